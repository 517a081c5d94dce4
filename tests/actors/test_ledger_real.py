"""The cold ledger on real files (ColdTier, blocks layout, the tiny mlx-lm model): a write
that fails part-way (ENOSPC) leaves no uncounted bytes, a full volume recovers, and a
manifest whose blocks are absent counts only what exists."""

from __future__ import annotations

import errno
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.coldstore import ColdTierStore
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tier import ColdTier
from kvtrio.actors.tiered import TieredPromptCache, WritePolicy
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps, FileOps
from kvtrio.storage.format import PREAMBLE
from kvtrio.storage.headerparse import parse_header, parse_preamble
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill

BLOCK = 64


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=5)


def _disk_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory``, but for the tier's own metadata in its
    root (the lock file, the catalogue: ``.kvtrio-*``), which the cold budget leaves out."""
    return sum(
        p.stat().st_size
        for p in directory.rglob("*")
        if p.is_file() and not (p.parent == directory and p.name.startswith(".kvtrio-"))
    )


def _prompt(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


@asynccontextmanager
async def _open(
    directory: Path, tiny: TinyModel, owner: MlxOwner, file_ops: FileOps = OS_FILE_OPS, **kw: Any
) -> AsyncIterator[tuple[TieredPromptCache, ColdTierStore]]:
    async with ColdTier.open(
        directory, layout="blocks", block_tokens=BLOCK, owner=owner, file_ops=file_ops
    ) as tier:
        store = await ColdTierStore.create(tier)
        kw.setdefault("hot_budget", 1 << 30)
        kw.setdefault("cold_budget", 1 << 40)
        async with TieredPromptCache.open(
            owner,
            store,
            ModelKey(tiny.model_id, tiny.fingerprint),
            policy=WritePolicy.WRITE_THROUGH,
            block_size=BLOCK,
            min_free_bytes=0,
            **kw,
        ) as cache:
            yield cache, store


def _caches(tiny: TinyModel, tokens: list[int]) -> list[Any]:
    caches = make_caches(tiny)
    prefill(tiny, caches, tokens)
    return caches


class _Enospc:
    """A hook for FaultyFileOps: once armed, the ``after``-th write and (with ``once``
    False) every later one fails with ENOSPC."""

    def __init__(self) -> None:
        self.armed = False
        self.after = 0
        self.once = True
        self.failures = 0
        self._writes = 0

    def arm(self, *, after: int, once: bool) -> None:
        self.armed, self.after, self.once, self._writes = True, after, once, 0

    def __call__(self, op: str) -> None:
        if not self.armed or op != "write":
            return
        self._writes += 1
        if self._writes >= self.after:
            self.failures += 1
            if self.once:
                self.armed = False
            raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("once", [True, False])
async def test_a_write_failing_part_way_leaves_no_uncounted_bytes(
    tmp_path: Path, tiny: TinyModel, once: bool
) -> None:
    """ENOSPC in the middle of a write's blocks: the blocks it stored go at once, the
    ledger matches the directory, and the write is retried after an eviction (landing
    when the volume frees up, dropped when it stays full)."""
    hook = _Enospc()
    ops = FaultyFileOps(OS_FILE_OPS, hook)
    async with MlxOwner.inline() as owner, _open(tmp_path, tiny, owner, ops) as (cache, store):
        first = _prompt(1)
        await cache.insert(first, _caches(tiny, first))
        await cache.wait_writes_settled()
        hook.arm(after=3, once=once)
        second = _prompt(2)
        await cache.insert(second, _caches(tiny, second))
        await cache.wait_writes_settled()
        stats = cache.statistics()
        store.check()
        cache.check()
        assert hook.failures >= 1
        assert stats.cold_bytes == _disk_bytes(tmp_path)
        assert stats.no_space_retries == 1 and stats.cold_evictions == 1
        assert stats.cold_entries == (1 if once else 0)
        assert stats.drops == (0 if once else 1)
        hook.armed = False


async def test_a_manifest_with_absent_blocks_counts_nothing_and_evicts_nothing(
    tmp_path: Path, tiny: TinyModel
) -> None:
    async with MlxOwner.inline() as owner:
        prompts = [_prompt(seed) for seed in (10, 11, 12)]
        async with _open(tmp_path, tiny, owner) as (cache, _):
            for tokens in prompts[:2]:
                await cache.insert(tokens, _caches(tiny, tokens))
            await cache.wait_writes_settled()
            one = cache.statistics().cold_bytes // 2  # on disk: what a write reserves
        # The second entry's blocks vanish (an operator's rm, a bad disk): its manifest
        # stays and still declares them.
        manifests = sorted((tmp_path / "caches").iterdir())
        for manifest in manifests:
            data = manifest.read_bytes()
            preamble = parse_preamble(data[: PREAMBLE.size], len(data))
            body = data[PREAMBLE.size : PREAMBLE.size + preamble.header_len]
            header = parse_header(body, preamble, len(data))
            if list(header.tokens) == prompts[1]:
                for slot in header.slots():
                    for ref in slot.blocks or ():
                        (tmp_path / "blocks" / ref.sha256).unlink(missing_ok=True)
        # Room for the first entry and the new one's reservation, not for the absent blocks.
        budget = 2 * one + one // 2
        async with _open(tmp_path, tiny, owner, cold_budget=budget) as (cache, store):
            assert cache.statistics().cold_bytes == _disk_bytes(tmp_path)
            store.check()
            tokens = prompts[2]
            await cache.insert(tokens, _caches(tiny, tokens))
            await cache.wait_writes_settled()
            stats = cache.statistics()
            assert stats.cold_evictions == 0 and stats.cold_entries == 3
            assert stats.cold_bytes == _disk_bytes(tmp_path)


@pytest.mark.parametrize("paced", [True, False])
async def test_a_burst_at_a_budget_of_ten_entries_keeps_what_fits(
    tmp_path: Path, tiny: TinyModel, paced: bool
) -> None:
    """A write reserves its encoded size (manifest and blocks, from the caches' shapes
    and dtypes), not its RAM bytes (a KVCache's buffer is rounded up to 256 tokens, 2.7x
    these 96-token entries): with a budget of ten entries, a burst of distinct
    write-through inserts keeps at least 90% of the entries that fit, and the disk never
    holds more than the budget plus one entry."""
    async with MlxOwner.inline() as owner:
        async with _open(tmp_path / "probe", tiny, owner) as (cache, _):
            tokens = _prompt(100, 96)
            await cache.insert(tokens, _caches(tiny, tokens))
            await cache.wait_writes_settled()
        one = _disk_bytes(tmp_path / "probe")
        budget = 10 * one + one // 10
        peak = 0
        directory = tmp_path / "tier"
        async with _open(directory, tiny, owner, cold_budget=budget) as (cache, store):
            for seed in range(30):
                tokens = _prompt(200 + seed, 96)
                await cache.insert(tokens, _caches(tiny, tokens))
                if paced:
                    await cache.wait_writes_settled()
                peak = max(peak, _disk_bytes(directory))
            await cache.wait_writes_settled()
            peak = max(peak, _disk_bytes(directory))
            stats = cache.statistics()
            store.check()
            cache.check()
            assert stats.cold_bytes == _disk_bytes(directory)
        assert peak <= budget + one
        assert stats.cold_entries >= 0.9 * (budget // one)
