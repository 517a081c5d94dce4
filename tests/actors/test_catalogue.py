"""The cold tier's catalogue under the tiered cache (real ColdTier, tiny mlx-lm model): a
clean reopen reads it alone; a deleted, truncated or corrupted catalogue, or one that
disagrees with the manifests, is rebuilt with nothing lost; the cold LRU's order
survives a restart.

Guards docs/design.md invariant 15.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.coldrecords import block_names
from kvtrio.actors.coldstore import ColdTierStore, OpenReport
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import Tier, TieredPromptCache, WritePolicy, open_tiered_cache
from kvtrio.storage.catalogue import CATALOGUE_NAME
from kvtrio.storage.manifeststore import PINS_NAME
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill

BLOCK = 64


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=5)


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


@asynccontextmanager
async def _open(
    directory: Path, tiny: TinyModel, owner: MlxOwner, **kw: Any
) -> AsyncIterator[TieredPromptCache]:
    kw.setdefault("hot_budget", 1 << 30)
    kw.setdefault("cold_budget", 1 << 40)
    async with open_tiered_cache(
        directory,
        ModelKey(tiny.model_id, tiny.fingerprint),
        owner=owner,
        policy=WritePolicy.WRITE_THROUGH,
        block_size=BLOCK,
        min_free_bytes=0,
        **kw,
    ) as cache:
        yield cache


def _report(cache: TieredPromptCache) -> OpenReport:
    assert isinstance(cache.cold, ColdTierStore) and cache.cold.opening is not None
    return cache.cold.opening


async def _fill(directory: Path, tiny: TinyModel, owner: MlxOwner, seeds: range) -> int:
    async with _open(directory, tiny, owner) as cache:
        for seed in seeds:
            tokens = _prompt(seed)
            caches = make_caches(tiny)
            prefill(tiny, caches, tokens)
            await cache.insert(tokens, caches)
        await cache.wait_writes_settled()
        return cache.statistics().cold_bytes


async def _all_hit_cold(directory: Path, tiny: TinyModel, owner: MlxOwner, seeds: range) -> None:
    async with _open(directory, tiny, owner) as cache:
        assert cache.statistics().cold_entries == len(seeds)
        for seed in seeds:
            found = await cache.fetch_nearest([*_prompt(seed), 1])
            assert found.tier is Tier.COLD and found.remaining == (1,)


async def test_a_clean_reopen_reads_the_catalogue_alone(tmp_path: Path, tiny: TinyModel) -> None:
    async with MlxOwner.inline() as owner:
        used = await _fill(tmp_path, tiny, owner, range(3))
        async with _open(tmp_path, tiny, owner) as cache:
            report = _report(cache)
            assert report.clean and report.parsed == 0 and not report.rebuilt
            assert cache.statistics().cold_bytes == used
            assert cache.statistics().cold_entries == 3


@pytest.mark.parametrize("damage", ["deleted", "truncated", "corrupted"])
async def test_a_damaged_catalogue_is_rebuilt_with_nothing_lost(
    tmp_path: Path, tiny: TinyModel, damage: str
) -> None:
    async with MlxOwner.inline() as owner:
        used = await _fill(tmp_path, tiny, owner, range(3))
        path = tmp_path / CATALOGUE_NAME
        data = path.read_bytes()
        if damage == "deleted":
            path.unlink()
        elif damage == "truncated":
            path.write_bytes(data[: len(data) // 3])
        else:
            middle = len(data) // 2
            path.write_bytes(data[:100] + bytes(random.Random(1).randbytes(middle)) + data[-50:])
        async with _open(tmp_path, tiny, owner) as cache:
            report = _report(cache)
            assert not report.clean and report.parsed == 3
            assert cache.statistics().cold_bytes == used
        async with _open(tmp_path, tiny, owner) as cache:
            assert _report(cache).clean  # rebuilt once, trusted again
        await _all_hit_cold(tmp_path, tiny, owner, range(3))


@pytest.mark.parametrize(
    "damage",
    [
        "min_offset = 1000",
        "conversations = '[1]'",
        "tokens = zeroblob(6)",
        # Regression: open packs each row's manifest bytes as a u64 (coldstore
        # _entry_record); a negative one failed the open with struct.error, no rebuild.
        "file_bytes = -1",
    ],
)
async def test_a_catalogue_row_of_the_wrong_shape_is_rebuilt_with_nothing_lost(
    tmp_path: Path, tiny: TinyModel, damage: str
) -> None:
    """A row the catalogue's bulk check refuses (a field no manifest could give: an
    offset past its tokens, a conversation that is not a string, tokens that are not
    whole u32 values) makes the open rebuild from the manifests, as a corrupt file does,
    instead of failing or indexing it."""
    import sqlite3

    async with MlxOwner.inline() as owner:
        used = await _fill(tmp_path, tiny, owner, range(3))
        db = sqlite3.connect(tmp_path / CATALOGUE_NAME)
        db.execute(f"UPDATE entries SET {damage} WHERE rowid = 2")
        db.commit()
        db.close()
        async with _open(tmp_path, tiny, owner) as cache:
            report = _report(cache)
            assert report.rebuilt and report.parsed == 3
            assert cache.statistics().cold_bytes == used
        await _all_hit_cold(tmp_path, tiny, owner, range(3))


async def test_listing_keeps_exactly_the_valid_keys(tmp_path: Path) -> None:
    """The tier's listing checks names a batch at a time (one regex call per batch of
    keys): a bad name anywhere in a batch drops that name alone."""
    from kvtrio.actors.tier import ColdTier

    async with ColdTier.open(tmp_path, inline=True) as tier:
        good = [f"k{i:05d}" for i in range(2500)] + ["a" * 150, "A.b_c-d"]
        bad = ["-lead", "a b", "a" * 151, "\u00e9t\u00e9", ".hidden", "x\ny"]
        caches = tmp_path / "caches"
        for name in good + bad:
            try:
                (caches / f"{name}.kvc").write_bytes(b"")
            except OSError:
                continue
        (caches / "k00007.kvc.kvtrio-tmp").write_bytes(b"")
        assert sorted(tier.list_keys()) == sorted(good)


async def test_a_catalogue_that_disagrees_with_the_manifests_is_reconciled(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """A manifest gone behind its back drops its row; a manifest it lacks is read."""
    async with MlxOwner.inline() as owner:
        other = tmp_path / "other"
        await _fill(other, tiny, owner, range(10, 11))
        await _fill(tmp_path, tiny, owner, range(2))
        manifests = sorted((tmp_path / "caches").iterdir())
        manifests[0].unlink()
        for manifest in (other / "caches").iterdir():
            shutil.copy(manifest, tmp_path / "caches" / manifest.name)
        for block in (other / "blocks").iterdir():
            shutil.copy(block, tmp_path / "blocks" / block.name)
        async with _open(tmp_path, tiny, owner) as cache:
            report = _report(cache)
            assert (report.dropped, report.parsed, report.clean) == (1, 1, False)
            assert cache.statistics().cold_entries == 2
            assert (await cache.fetch_nearest([*_prompt(10), 5])).tier is Tier.COLD


async def test_the_cold_lru_order_survives_a_restart(tmp_path: Path, tiny: TinyModel) -> None:
    """Entries 0, 1, 2 written in that order, then 0 used: after a restart a budget for
    three evicts 1 (the least recently used), not 0 (the oldest written)."""
    async with MlxOwner.inline() as owner:
        one = await _fill(tmp_path, tiny, owner, range(1)) + 8192
        await _fill(tmp_path, tiny, owner, range(1, 3))
        async with _open(tmp_path, tiny, owner) as cache:
            assert (await cache.fetch_nearest([*_prompt(0), 9])).tier is Tier.COLD
        async with _open(tmp_path, tiny, owner, cold_budget=4 * one) as cache:
            tokens = _prompt(3)
            caches = make_caches(tiny)
            prefill(tiny, caches, tokens)
            # Room for three entries and a half: the new entry's write (it reserves its
            # encoded size, about one entry) evicts exactly one.
            cache.cold_budget = 3 * one + one // 2
            await cache.insert(tokens, caches)
            await cache.wait_writes_settled()
            assert cache.statistics().cold_evictions == 1
            assert (await cache.fetch_nearest([*_prompt(0), 9])).tier is Tier.COLD
            assert (await cache.fetch_nearest([*_prompt(1), 9])).caches is None


@pytest.mark.parametrize("catalogue", ["kept", "deleted"])
async def test_a_pin_survives_a_restart_and_pressure(
    tmp_path: Path, tiny: TinyModel, catalogue: str
) -> None:
    """docs/design.md invariant 15 (nothing lost with the catalogue): a pinned entry is
    pinned again after a restart, whether the catalogue is kept or deleted (the manifest
    store's record of pins is the truth), and a budget too small for every entry evicts
    the others, never it; an unpin survives a restart too."""
    async with MlxOwner.inline() as owner:
        one = await _fill(tmp_path, tiny, owner, range(1)) + 8192
        await _fill(tmp_path, tiny, owner, range(1, 3))
        async with _open(tmp_path, tiny, owner, pin_limit=1 << 30) as cache:
            cache.pin(_prompt(0))
        assert (tmp_path / PINS_NAME).is_file()  # the tier's metadata, beside the catalogue
        if catalogue == "deleted":
            (tmp_path / CATALOGUE_NAME).unlink()
        async with _open(tmp_path, tiny, owner, pin_limit=1 << 30) as cache:
            assert _report(cache).rebuilt is False and _report(cache).clean is (catalogue == "kept")
            policy = cache.statistics().cold_policy
            assert policy is not None and policy.pinned_entries == 1
            cache.cold_budget = 2 * one
            for seed in range(3, 6):
                tokens = _prompt(seed)
                caches = make_caches(tiny)
                prefill(tiny, caches, tokens)
                await cache.insert(tokens, caches)
                await cache.wait_writes_settled()
            assert cache.statistics().cold_evictions >= 3  # 1, 2 and newer ones went
            assert (await cache.fetch_nearest([*_prompt(1), 9])).caches is None
            assert (await cache.fetch_nearest([*_prompt(0), 9])).tier is Tier.COLD
        async with _open(tmp_path, tiny, owner, pin_limit=1) as cache:  # too small now
            assert cache.statistics().pins_refused == 1
            cache.unpin(_prompt(0))
        async with _open(tmp_path, tiny, owner, pin_limit=1 << 30) as cache:
            policy = cache.statistics().cold_policy
            assert policy is not None and policy.pinned_entries == 0


async def test_block_counts_read_from_the_catalogue_match_the_manifests_and_free_blocks(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """The reference counts an open reads from the catalogue's block lists (digests kept
    as stored, named on removal) are those a rebuild from the manifests counts; removing
    entries deletes a shared block only with the last entry naming it."""
    shared = _prompt(99, BLOCK)
    async with MlxOwner.inline() as owner:
        async with _open(tmp_path, tiny, owner) as cache:
            for seed in range(3):  # one token block in common, then their own
                tokens = [*shared, *_prompt(seed, 80)]
                caches = make_caches(tiny)
                prefill(tiny, caches, tokens)
                await cache.insert(tokens, caches)
            await cache.wait_writes_settled()
        (tmp_path / CATALOGUE_NAME).unlink()
        async with _open(tmp_path, tiny, owner) as cache:
            assert _report(cache).parsed == 3  # from the manifests
            assert isinstance(cache.cold, ColdTierStore)
            parsed = dict(cache.cold._refs)
            named = {
                key: set(block_names(record)) for key, record in cache.cold._entry_blocks.items()
            }
        assert any(count == 3 for count in parsed.values())  # the shared block
        async with _open(tmp_path, tiny, owner) as cache:
            store = cache.cold
            assert isinstance(store, ColdTierStore) and _report(cache).clean
            assert store._refs == parsed
            assert sorted(store._entry_blocks) == sorted(named)
            for key in sorted(named):
                await store.remove(key)
                store.check()
                del named[key]
                left = set().union(*named.values())
                on_disk = {path.name for path in (tmp_path / "blocks").iterdir()}
                assert {name for name in on_disk if name in parsed} == left
                assert set(store._refs) == left
            assert not store._refs


async def test_the_store_and_the_index_share_one_key_str_per_entry(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """An open (from the catalogue, and a rebuild from the manifests) keeps one str per
    entry's key: the store's tables and the cache's records hold the same object, not two
    equal copies (one per catalogue query), which cost ~110 bytes per entry."""
    async with MlxOwner.inline() as owner:
        await _fill(tmp_path, tiny, owner, range(4))
        for rebuild in (False, True):
            if rebuild:
                (tmp_path / CATALOGUE_NAME).unlink()
            async with _open(tmp_path, tiny, owner) as cache:
                assert isinstance(cache.cold, ColdTierStore)
                assert _report(cache).parsed == (4 if rebuild else 0)
                stored = {key: key for key in cache.cold._entry_blocks}
                assert len(cache._records) == len(stored) == 4
                assert all(stored[key] is key for key in cache._records)


async def test_a_clean_open_takes_each_key_from_the_store_and_any_order_still_shares_it(
    tmp_path: Path, tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a clean open the scan's rows come in the order of the store's table of
    entries, so the cache takes each key from there (FoundRows.keys) and interns none; a
    rebuild interns every key; and keys handed over in another order (a catalogue put
    back in order by the open) are each interned instead, the records still sharing the
    store's strs and every entry indexed. Regression: each key was interned, a probe of a
    table of every key at random (about 45 ms of a 100,000-entry open)."""
    import sys
    from types import SimpleNamespace

    from kvtrio.actors import coldstore, tieredload

    interned: list[str] = []
    real_intern, real_next_rows = sys.intern, coldstore._next_rows

    def counting(key: str) -> str:
        interned.append(key)
        return real_intern(key)

    handed: dict[int, Any] = {}

    def reversed_keys(scan: Any, keys: Any) -> Any:
        if keys is not None:  # one iterator for the whole scan, in reverse
            keys = handed.setdefault(id(scan), iter(list(keys)[::-1]))
        return real_next_rows(scan, keys)

    async with MlxOwner.inline() as owner:
        await _fill(tmp_path, tiny, owner, range(4))
        monkeypatch.setattr(tieredload, "sys", SimpleNamespace(intern=counting))  # the cache's
        for order in ("clean", "rebuild", "reversed"):
            interned.clear()
            if order == "rebuild":
                (tmp_path / CATALOGUE_NAME).unlink()
            if order == "reversed":
                monkeypatch.setattr(coldstore, "_next_rows", reversed_keys)
            async with _open(tmp_path, tiny, owner) as cache:
                assert isinstance(cache.cold, ColdTierStore)
                stored = {key: key for key in cache.cold._entry_blocks}
                assert all(stored[key] is key for key in cache._records)
                assert len(cache._index) == len(cache._records) == 4
                cache.check()
            assert len(interned) == {"clean": 0, "rebuild": 4, "reversed": 4}[order], order


@pytest.fixture
def populated(tmp_path: Path) -> Path:
    from kvtrio.bench.scale import _populate

    _populate(tmp_path, POPULATED)
    return tmp_path


POPULATED = 600


async def test_an_indexed_entry_holds_three_objects_for_the_collector(populated: Path) -> None:
    """Each entry a clean open indexes holds three objects the cyclic collector tracks (its
    record, which is its own cold side; its prefix entry; the cold policy's slot): the
    objects a full collection traverses per entry, and most of an entry's memory.

    Regression: the record and its cold side were two objects (four per entry)."""
    import gc

    from kvtrio.bench.scale import BLOCK, _model_of

    n, tmp_path = POPULATED, populated
    model = _model_of(tmp_path)

    async def tracked_per_entry(owner: MlxOwner) -> float:
        gc.collect()
        before = len(gc.get_objects())
        async with open_tiered_cache(
            tmp_path, model, owner=owner, hot_budget=1 << 30, cold_budget=1 << 50,
            block_size=BLOCK, min_free_bytes=0,
        ) as cache:  # fmt: skip
            gc.collect()
            assert cache.statistics().cold_entries == n
            record = next(iter(cache._records.values()))
            assert record.cold is record
            return (len(gc.get_objects()) - before) / n

    async with MlxOwner.inline() as owner:
        await tracked_per_entry(owner)  # the rebuild: the catalogue is made
        per_entry = await tracked_per_entry(owner)
    # Three each, plus the open cache's own fixed objects (a few hundred: ~0.6 per entry
    # here); four each, as before, is 4.6.
    assert 3 <= per_entry < 4, per_entry


async def test_the_store_keeps_one_table_of_every_entry_and_counts_what_is_on_disk(
    populated: Path,
) -> None:
    """A clean open's store keeps one dict of every entry (its record: the manifest's
    bytes, then its block digests), not one per figure; the usage it derives from it is
    the bytes of the manifests and blocks on disk, and it names each entry's blocks as the
    manifest does. Regression: a second dict of every entry held its manifest's bytes
    (~75 bytes per entry at 100,000)."""
    import attrs
    from kvtrio.actors.coldrecords import file_bytes
    from kvtrio.bench.scale import BLOCK, _model_of

    model = _model_of(populated)
    async with MlxOwner.inline() as owner:
        for clean in (False, True):  # the rebuild, then a clean open of its catalogue
            async with open_tiered_cache(
                populated, model, owner=owner, hot_budget=1 << 30, cold_budget=1 << 50,
                block_size=BLOCK, min_free_bytes=0,
            ) as cache:  # fmt: skip
                store = cache.cold
                assert isinstance(store, ColdTierStore) and _report(cache).clean is clean
                store.check()
                tables = [
                    field.name
                    for field in attrs.fields(ColdTierStore)
                    if isinstance(value := getattr(store, field.name), dict)
                    and len(value) == POPULATED
                ]
                assert tables == ["_entry_blocks"]
                on_disk = sum(p.stat().st_size for p in (populated / "caches").iterdir())
                on_disk += sum(p.stat().st_size for p in (populated / "blocks").iterdir())
                assert await store.usage() == on_disk
                key, record = next(iter(store._entry_blocks.items()))
                assert file_bytes(record) == (populated / "caches" / f"{key}.kvc").stat().st_size
                assert set(block_names(record)) == {
                    p.name for p in (populated / "blocks").iterdir()
                }


async def test_entries_of_two_models_in_turn_each_keep_their_model(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """An open whose catalogue rows alternate between models (least recently used first:
    this model's, another's, this model's) gives each entry its own model (open compares a
    row's model with the row before's): the other model's entry never answers this
    model's lookup, and this model's entries do."""
    own = ModelKey(tiny.model_id, tiny.fingerprint)
    other = ModelKey(tiny.model_id, "another-fingerprint")
    prompts = [_prompt(seed) for seed in range(3)]
    async with MlxOwner.inline() as owner:
        for model, tokens in zip((own, other, own), prompts, strict=True):
            async with open_tiered_cache(
                tmp_path, model, owner=owner, policy=WritePolicy.WRITE_THROUGH,
                hot_budget=1 << 30, cold_budget=1 << 40, block_size=BLOCK, min_free_bytes=0,
            ) as cache:  # fmt: skip
                caches = make_caches(tiny)
                prefill(tiny, caches, tokens)
                await cache.insert(tokens, caches)
                await cache.wait_writes_settled()
        async with _open(tmp_path, tiny, owner) as cache:
            assert _report(cache).clean
            models = [record.entry.model for record in cache._records.values()]
            assert sorted(m.fingerprint for m in models) == sorted(
                [own.fingerprint, other.fingerprint, own.fingerprint]
            )
            assert cache._other_models == {other}
            found = [await cache.fetch_nearest([*tokens, 1]) for tokens in prompts]
            assert [f.tier for f in found] == [Tier.COLD, None, Tier.COLD]


def _set_version(manifest: Path, version: int) -> None:
    """Rewrite a manifest's preamble version (the header's hash does not cover it)."""
    import struct

    raw = bytearray(manifest.read_bytes())
    struct.pack_into("<I", raw, 8, version)
    manifest.write_bytes(bytes(raw))


async def test_an_entry_of_a_newer_format_is_kept_with_its_blocks(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """A rollback to an older kvtrio, or an older host on a shared directory's copy:
    entries a newer kvtrio wrote are not damaged. The open does not index one and sweeps
    no block (it cannot know which it names), ``kvtrio gc`` sweeps none either, and a
    load of an indexed entry rewritten so is a miss that leaves it; back under a kvtrio
    that reads it, the entry is whole. (docs/format.md, "Compatibility promise".)"""
    from kvtrio.storage.blockstore import LocalBlockStore
    from kvtrio.storage.maintenance import collect_garbage

    async with MlxOwner.inline() as owner:
        await _fill(tmp_path, tiny, owner, range(3))
        manifests = sorted((tmp_path / "caches").glob("*.kvc"))
        blocks = sorted(p.name for p in (tmp_path / "blocks").rglob("*") if p.is_file())
        assert len(manifests) == 3 and blocks
        newer = manifests[0]
        _set_version(newer, 99)
        (tmp_path / CATALOGUE_NAME).unlink()  # the open reads every manifest
        async with _open(tmp_path, tiny, owner) as cache:
            report = _report(cache)
            assert report.newer_format == 1 and report.orphans_swept == 0
            assert cache.statistics().cold_entries == 2
        assert sorted(p.name for p in (tmp_path / "blocks").rglob("*") if p.is_file()) == blocks
        gc = collect_garbage(
            str(tmp_path / "caches"), LocalBlockStore(str(tmp_path / "blocks")), grace_s=0.0,
            catalogue_dir=str(tmp_path),
        )  # fmt: skip
        assert gc.newer == (str(newer),) and gc.deleted_blocks == 0
        assert sorted(p.name for p in (tmp_path / "blocks").rglob("*") if p.is_file()) == blocks
        # An indexed entry rewritten by a newer kvtrio while this one runs: a miss, kept.
        _set_version(newer, 2)
        async with _open(tmp_path, tiny, owner) as cache:
            assert cache.statistics().cold_entries == 3
            other = manifests[1]
            _set_version(other, 99)
            misses = 0
            for seed in range(3):
                found = await cache.fetch_nearest([*_prompt(seed), 1])
                misses += found.tier is not Tier.COLD
            assert misses == 1
        assert other.exists() and newer.exists()
        _set_version(other, 2)
        (tmp_path / CATALOGUE_NAME).unlink()
        await _all_hit_cold(tmp_path, tiny, owner, range(3))
