"""A load binds content to its key (issue 15, item 2).

On the landed code a cache file replaced by another valid one (B's file copied over
A's) gave an EXACT cold hit on A's tokens holding B's keys and values: nothing checked
that what was read under key K still held K's tokens. Now that is a counted drop and a
miss. The Redis twin (A's manifest value overwritten with B's) is in
tests/redis/test_redis_boundary.py.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import TieredPromptCache, WritePolicy, open_tiered_cache
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=5)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


async def insert_two_cold(
    cache: TieredPromptCache, tiny: TinyModel, owner: MlxOwner
) -> tuple[tuple[str, list[int]], tuple[str, list[int]]]:
    """Entries A and B, both written and A no longer in RAM (the hot budget keeps one)."""
    out = []
    for seed in (1, 2):
        tokens = _prompt(seed, 80)
        caches = await owner.run(make_caches, tiny)
        await owner.run(prefill, tiny, caches, tokens)
        out.append((await cache.insert(tokens, caches), tokens))
    await cache.wait_writes_settled()
    assert cache.statistics().hot_entries == 1
    return out[0], out[1]


def options(tiny: TinyModel, owner: MlxOwner) -> dict[str, object]:
    return {
        "owner": owner,
        "hot_budget": 1,
        "cold_budget": 1 << 40,
        "policy": WritePolicy.WRITE_THROUGH,
        "block_size": 16,
    }


Entry = tuple[str, list[int]]


@asynccontextmanager
async def _two_cold(
    directory: Path, tiny: TinyModel
) -> AsyncIterator[tuple[TieredPromptCache, Entry, Entry]]:
    """A write-through cache on ``directory`` with entries A and B (insert_two_cold)."""
    model = ModelKey(tiny.model_id, tiny.fingerprint)
    async with (
        MlxOwner.inline() as owner,
        open_tiered_cache(directory, model, **options(tiny, owner)) as cache,  # type: ignore[arg-type]
    ):
        a, b = await insert_two_cold(cache, tiny, owner)
        yield cache, a, b


async def test_a_file_replaced_by_another_entrys_is_a_drop_not_a_hit(
    tmp_path: Path, tiny: TinyModel
) -> None:
    async with _two_cold(tmp_path, tiny) as (cache, (key_a, tokens_a), (key_b, _)):
        caches_dir = tmp_path / "caches"
        shutil.copyfile(caches_dir / f"{key_b}.kvc", caches_dir / f"{key_a}.kvc")
        fetched = await cache.fetch_nearest(tokens_a)
        assert fetched.caches is None and fetched.remaining == tuple(tokens_a)
        stats = cache.statistics()
        assert (stats.hits_cold, stats.drops) == (0, 1)


# -- containment (issue 15, item 4): the disk failing is a miss, never a request failure


async def test_eio_while_loading_a_cold_entry_is_a_counted_miss(
    tmp_path: Path, tiny: TinyModel
) -> None:
    import errno

    from kvtrio.actors.tier import ColdTier
    from kvtrio.actors.tiered import ColdTierStore
    from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps

    armed = {"on": False}

    def eio_on_read(op: str) -> None:
        if armed["on"] and op == "read":
            raise OSError(errno.EIO, "injected EIO")

    model = ModelKey(tiny.model_id, tiny.fingerprint)
    faulty = FaultyFileOps(OS_FILE_OPS, eio_on_read)
    async with (
        MlxOwner.inline() as owner,
        ColdTier.open(
            tmp_path, layout="blocks", block_tokens=16, owner=owner, file_ops=faulty
        ) as tier,
    ):
        store = await ColdTierStore.create(tier)
        opts = options(tiny, owner)
        opts.pop("owner")
        async with TieredPromptCache.open(owner, store, model, **opts) as cache:  # type: ignore[arg-type]
            (_, tokens_a), (_, tokens_b) = await insert_two_cold(cache, tiny, owner)
            armed["on"] = True
            fetched = await cache.fetch_nearest(tokens_a)
            assert fetched.caches is None
            stats = cache.statistics()
            assert (stats.cold_errors, stats.drops, stats.misses) == (1, 1, 1)
            armed["on"] = False
            assert (await cache.fetch_nearest(tokens_b)).caches is not None  # still serving
        assert any((tmp_path / "caches").iterdir())  # forgotten, not deleted


async def test_a_block_replaced_by_a_directory_does_not_kill_the_cache(
    tmp_path: Path, tiny: TinyModel
) -> None:
    async with _two_cold(tmp_path, tiny) as (cache, (_, tokens_a), _):
        for block in (tmp_path / "blocks").iterdir():
            block.unlink()
            block.mkdir()  # every block of A (and B) is now a directory
        fetched = await cache.fetch_nearest(tokens_a)  # a miss; the entry is removed
        assert fetched.caches is None
        await cache.wait_writes_settled()  # the background removal ran, and survived
        assert cache.statistics().drops >= 1
        assert (await cache.fetch_nearest(tokens_a)).caches is None


async def test_an_entry_of_an_unknown_kind_is_a_miss_and_is_not_deleted(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """A newer writer's kind is not corruption: the tier deletes only proven corruption."""
    import json

    from kvtrio.storage.format import PREAMBLE, encode_preamble

    async with _two_cold(tmp_path, tiny) as (cache, (key_a, tokens_a), _):
        path = tmp_path / "caches" / f"{key_a}.kvc"
        raw = path.read_bytes()
        _, _, header_len, _ = PREAMBLE.unpack_from(raw)
        doc = json.loads(raw[PREAMBLE.size : PREAMBLE.size + header_len])
        doc["caches"][0]["kind"] = "kv-from-the-future"
        body = json.dumps(doc).encode()
        path.write_bytes(encode_preamble(body) + body)
        fetched = await cache.fetch_nearest(tokens_a)
        assert fetched.caches is None
        await cache.wait_writes_settled()
        assert cache.statistics().drops == 1
    assert path.exists()
