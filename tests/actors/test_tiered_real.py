"""TieredPromptCache over the real ColdTier, with the tiny mlx-lm model: bit-exact hits
from RAM and from disk, restart, shared-prefix dedup and the disk budget on real files."""

from __future__ import annotations

import copy
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import (
    Tier,
    TieredPromptCache,
    WritePolicy,
    open_tiered_cache,
)
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill
from mlx_lm.models.cache import trim_prompt_cache

from .test_ledger_real import _disk_bytes

BLOCK = 64


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=5)


def _key(tiny: TinyModel) -> ModelKey:
    return ModelKey(tiny.model_id, tiny.fingerprint)


@asynccontextmanager
async def _open(
    directory: Path,
    tiny: TinyModel,
    owner: MlxOwner,
    *,
    hot_budget: int = 1 << 30,
    cold_budget: int = 1 << 40,
    policy: WritePolicy = WritePolicy.WRITE_BACK,
) -> AsyncIterator[TieredPromptCache]:
    async with open_tiered_cache(
        directory,
        _key(tiny),
        owner=owner,
        hot_budget=hot_budget,
        cold_budget=cold_budget,
        policy=policy,
        block_size=BLOCK,
    ) as cache:
        yield cache


def _prompt(seed: int, n: int, prefix: list[int] | None = None) -> list[int]:
    import random

    rng = random.Random(seed)
    out = list(prefix or [])
    return out + [rng.randrange(512) for _ in range(n - len(out))]


async def test_hits_from_ram_and_disk_are_bit_exact_and_survive_restart(
    tmp_path: Path, tiny: TinyModel
) -> None:
    prompt = _prompt(1, 200)
    follow = [*prompt, 7, 8, 9]
    async with MlxOwner.inline() as owner:
        live = make_caches(tiny)
        prefill(tiny, live, prompt)
        reference = prefill(tiny, copy.deepcopy(live), follow[len(prompt) :])
        async with _open(tmp_path, tiny, owner) as cache:
            await cache.insert(prompt, live)
            hot = await cache.fetch_nearest(follow)
            assert hot.tier is Tier.HOT and hot.caches is not None
            assert mx.array_equal(prefill(tiny, hot.caches, hot.remaining), reference)
        async with _open(tmp_path, tiny, owner) as cache:
            cold = await cache.fetch_nearest(follow)
            assert cold.tier is Tier.COLD and cold.caches is not None
            assert cold.remaining == (7, 8, 9)
            assert mx.array_equal(prefill(tiny, cold.caches, cold.remaining), reference)
            assert cache.statistics().bytes_read > 0
        other = ModelKey(tiny.model_id, "another-fingerprint")
        async with open_tiered_cache(
            tmp_path, other, owner=owner, hot_budget=1 << 30, cold_budget=1 << 40
        ) as cache:
            assert (await cache.fetch_nearest(follow)).caches is None


async def test_an_entry_found_at_open_is_prefetched_at_the_bytes_it_holds(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """After a restart, a prefetch counts the entry's tensor bytes as the store holds them
    (the catalogue's block sizes), the bytes its load reads, and the cold tier's eviction
    values found entries at this model's bytes per token measured from them: both used the
    estimate of 128 KiB a token, so kvtrio_cold_prefetch_bytes_total was ~128x too large
    for the tiny model and the prefetch cap and the eviction judged by that estimate."""
    prompt = _prompt(3, 200)
    async with MlxOwner.inline() as owner:
        live = make_caches(tiny)
        prefill(tiny, live, prompt)
        async with _open(tmp_path, tiny, owner) as cache:
            await cache.insert(prompt, live)
        async with _open(tmp_path, tiny, owner) as cache:
            valued = cache.cold_policy.statistics().nbytes
            assert cache.prefetch(prompt)
            assert cache.statistics().prefetch_bytes < 200 * 128 * 1024
            got = await cache.fetch_nearest(prompt)
            assert got.tier is Tier.COLD and got.caches is not None
            stats = cache.statistics()
            assert stats.prefetches == 1 and stats.bytes_read > 0
            assert stats.prefetch_used_bytes == stats.bytes_read
            assert stats.bytes_read == sum(int(c.nbytes) for c in got.caches)
            assert valued == stats.bytes_read // 200 * 200


async def test_shared_prefixes_are_stored_once(tmp_path: Path, tiny: TinyModel) -> None:
    system = _prompt(2, 2 * BLOCK)
    async with MlxOwner.inline() as owner:
        async with _open(tmp_path, tiny, owner, policy=WritePolicy.WRITE_THROUGH) as cache:
            for seed in (3, 4, 5):
                tokens = _prompt(seed, 3 * BLOCK + 10, system)
                caches = make_caches(tiny)
                prefill(tiny, caches, tokens)
                await cache.insert(tokens, caches)
            await cache.wait_writes_settled()
            stats = cache.statistics()
        assert stats.bytes_deduplicated > 0
        assert stats.bytes_written + stats.bytes_deduplicated > stats.bytes_written
        assert stats.cold_bytes == _disk_bytes(tmp_path / "caches") + _disk_bytes(
            tmp_path / "blocks"
        )


async def test_disk_budget_holds_on_real_files(tmp_path: Path, tiny: TinyModel) -> None:
    """The cold tier's bytes on disk exceed the budget by at most the newest entry."""
    entries: list[tuple[list[int], Any]] = []
    async with MlxOwner.inline() as owner:
        for seed in range(6):
            tokens = _prompt(10 + seed, 150)
            caches = make_caches(tiny)
            prefill(tiny, caches, tokens)
            entries.append((tokens, caches))
        one = 150 * 2 * 2 * 64 * 4 + 16384  # tokens x layers x (k, v) x head_dim x f32 + header
        budget = 3 * one
        async with _open(tmp_path, tiny, owner, hot_budget=0, cold_budget=budget) as cache:
            for tokens, caches in entries:
                await cache.insert(tokens, caches)
                await cache.wait_writes_settled()
                on_disk = _disk_bytes(tmp_path)
                assert on_disk <= budget + one
                assert cache.statistics().cold_bytes == on_disk
            assert cache.statistics().cold_evictions > 0
        assert len(os.listdir(tmp_path / "caches")) < len(entries)


async def test_open_sweeps_blocks_no_manifest_names(tmp_path: Path, tiny: TinyModel) -> None:
    """A crash between storing blocks and publishing the manifest leaves orphans: the
    next open deletes them, so the disk figure is what is really there. (The process
    dies here by an exception out of the block: the catalogue is then not marked clean,
    as after a real crash, and the open lists the block directory.)"""

    class Crash(Exception):
        pass

    async with MlxOwner.inline() as owner:
        crashed = False
        try:
            async with _open(tmp_path, tiny, owner, policy=WritePolicy.WRITE_THROUGH) as cache:
                tokens = _prompt(20, 100)
                caches = make_caches(tiny)
                prefill(tiny, caches, tokens)
                await cache.insert(tokens, caches)
                await cache.wait_writes_settled()
                raise Crash
        except* Crash:
            crashed = True
        assert crashed
        orphan = tmp_path / "blocks" / ("ab" * 32)
        orphan.write_bytes(b"x" * 1000)
        async with _open(tmp_path, tiny, owner) as cache:
            assert not orphan.exists()
            assert cache.statistics().cold_bytes == _disk_bytes(tmp_path)
            assert cache.statistics().cold_entries == 1


async def test_every_mlx_call_of_the_tiered_cache_runs_on_the_owner(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """docs/design.md invariant 8, for the tiered cache: with a dedicated owner thread, a hot
    hit, a write-back and a cold hit make no MLX call anywhere else."""
    from kvtrio.actors.testing import mlx_thread_guard

    prompt = _prompt(30, 120)
    async with MlxOwner.dedicated() as owner:
        with mlx_thread_guard(owner.is_owner_thread) as guard:
            live = await owner.run(make_caches, tiny)
            await owner.run(prefill, tiny, live, prompt)
            async with _open(tmp_path, tiny, owner, hot_budget=0) as cache:
                await cache.insert(prompt, live)
                other = await owner.run(make_caches, tiny)
                await owner.run(prefill, tiny, other, _prompt(31, 50))
                await cache.insert(_prompt(31, 50), other)  # evicts the first: write-back
                await cache.wait_writes_settled()
                cold = await cache.fetch_nearest([*prompt, 5])
                assert cold.tier is Tier.COLD
            assert guard.calls > 0
            assert guard.violations == []


@pytest.mark.parametrize("seed", range(2))
async def test_random_operations_on_real_files(tmp_path: Path, tiny: TinyModel, seed: int) -> None:
    """Inserts with shared prefixes and conversations, lookups and restarts over the real
    ColdTier (blocks layout, shared blocks): the disk total always matches the directory,
    every hit is bit-exact, and `kvtrio verify` finds nothing wrong."""
    import random

    from kvtrio.storage.blockstore import LocalBlockStore
    from kvtrio.storage.maintenance import verify_tree

    rng = random.Random(seed)
    base = [rng.randrange(2, 500) for _ in range(3 * BLOCK)]
    saved: dict[tuple[int, ...], Any] = {}
    history: dict[str, list[int]] = {}
    async with MlxOwner.inline() as owner:
        for _restart in range(2):
            async with _open(
                tmp_path, tiny, owner, hot_budget=200_000, cold_budget=600_000
            ) as cache:
                for _ in range(12):
                    conv = rng.choice(["a", "b", None])
                    if conv in history and rng.random() < 0.6:
                        tokens = history[str(conv)] + [rng.randrange(2, 500) for _ in range(9)]
                    else:
                        tokens = [*base[: rng.randrange(BLOCK, 3 * BLOCK)], 7]
                    if conv is not None:
                        history[conv] = tokens
                    caches = make_caches(tiny)
                    prefill(tiny, caches, tokens)
                    saved[tuple(tokens)] = copy.deepcopy(caches)
                    await cache.insert(tokens, caches, conversation=conv)
                    query = [*base[: rng.randrange(BLOCK, 3 * BLOCK)], 9, 9]
                    found = await cache.fetch_nearest(query)
                    if found.caches is not None and found.match is not None:
                        live = copy.deepcopy(saved[found.match.entry.tokens])
                        trim_prompt_cache(live, found.match.trim)
                        rest = list(found.remaining)
                        assert mx.array_equal(
                            prefill(tiny, found.caches, rest), prefill(tiny, live, rest)
                        )
                    await cache.wait_writes_settled()
                    assert cache.statistics().cold_bytes == _disk_bytes(tmp_path)
        report = verify_tree(str(tmp_path / "caches"), LocalBlockStore(str(tmp_path / "blocks")))
        assert report.ok and report.files_ok > 0
