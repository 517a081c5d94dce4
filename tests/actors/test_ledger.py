"""The cold ledger of TieredPromptCache over a fake store: reservations before writes,
one eviction loop, the pending write-backs' byte cap, and a full volume (ENOSPC).

Guards docs/design.md invariants 11, 12 and 14.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import TieredPromptCache

from .fakes import BYTES_PER_TOKEN, FakeColdStore, fake_caches

MODEL = ModelKey("tiny", "fp-1")
LAYERS = 2
TOKENS = 30
ENTRY = TOKENS * BYTES_PER_TOKEN * LAYERS


@asynccontextmanager
async def _open(store: FakeColdStore, **options: Any) -> AsyncIterator[TieredPromptCache]:
    options.setdefault("hot_budget", 0)
    options.setdefault("cold_budget", 20 * ENTRY)
    async with (
        MlxOwner.inline() as owner,
        TieredPromptCache.open(owner, store, MODEL, block_size=4, **options) as cache,
    ):
        yield cache


def _tokens(i: int) -> list[int]:
    return [i // 1000 + 1, i % 1000, *range(TOKENS - 2)]


@pytest.mark.parametrize("paced", [False, True])
async def test_a_burst_never_exceeds_the_budget_by_more_than_one_entry(
    tmp_path: Path, paced: bool
) -> None:
    """2,000 write-back inserts, unpaced (nobody waits for the disk) or paced: the disk
    never holds more than the budget plus one entry, and once the writes settle the
    cache keeps at least 90% of the entries that fit (no over-eviction)."""
    store = FakeColdStore(tmp_path, MODEL)
    budget = 20 * ENTRY
    async with _open(store, cold_budget=budget, pending_budget=10**12) as cache:
        for i in range(2000):
            await cache.insert(_tokens(i), fake_caches(TOKENS))
            if paced:
                await cache.wait_writes_settled()
        await cache.wait_writes_settled()
        stats = cache.statistics()
        cache.check()
    assert store.peak <= budget + ENTRY
    fit = budget // ENTRY
    assert len(store.disk) >= 0.9 * fit
    assert stats.cold_entries == len(store.disk) and stats.cold_bytes == store.disk_bytes
    assert stats.cold_reserved == 0 and stats.pending_writes == 0


async def test_pending_write_backs_are_capped_by_bytes_dropping_the_oldest(
    tmp_path: Path,
) -> None:
    """With the disk stalled, a burst queues at most the cap (plus the newest entry) of
    write-backs; the oldest are dropped and counted, and the newest reach the disk."""
    store = FakeColdStore(tmp_path, MODEL, store_gate=trio.Event())
    cap = 5 * ENTRY
    async with _open(store, cold_budget=10**12, pending_budget=cap) as cache:
        for i in range(40):
            await cache.insert(_tokens(i), fake_caches(TOKENS))
            stats = cache.statistics()
            assert stats.pending_bytes <= cap + ENTRY
        stats = cache.statistics()
        assert stats.pending_dropped > 0 and stats.drops == stats.pending_dropped
        assert store.store_gate is not None
        store.store_gate.set()
        await cache.wait_writes_settled()
        cache.check()
        final = cache.statistics()
    kept = {info.tokens[:2] for info, _ in store.disk.values()}
    # The first was in flight when the disk stalled; the next oldest were dropped.
    assert (1, 38) in kept and (1, 0) in kept and (1, 1) not in kept
    assert final.pending_dropped + len(store.disk) == 40  # the hot one was flushed at close
    assert final.pending_bytes == 0


async def test_a_full_volume_evicts_and_retries_instead_of_freezing(tmp_path: Path) -> None:
    """The volume fills before the budget does: each write that meets ENOSPC evicts the
    least recently used entry and is retried, so writes keep landing."""
    store = FakeColdStore(tmp_path, MODEL, capacity=8 * ENTRY)
    async with _open(store, cold_budget=10**12, min_free_bytes=0) as cache:
        for i in range(30):
            await cache.insert(_tokens(i), fake_caches(TOKENS))
            await cache.wait_writes_settled()
        stats = cache.statistics()
        cache.check()
    assert stats.no_space_retries > 0 and stats.cold_evictions > 0
    assert store.disk_bytes <= 8 * ENTRY and len(store.disk) >= 7
    assert stats.drops == 0  # every retried write landed
    newest = max(store.disk.values(), key=lambda item: item[0].mtime)[0]
    assert newest.tokens[:2] == (1, 29)  # the last insert, flushed at close, landed too


async def test_a_failed_write_releases_its_reservation_at_once(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL, fail_stores=True)
    async with _open(store) as cache:
        for i in range(5):
            await cache.insert(_tokens(i), fake_caches(TOKENS))
        await cache.wait_writes_settled()
        stats = cache.statistics()
        cache.check()
    assert stats.drops == 4 and stats.cold_reserved == 0 and stats.cold_bytes == 0


async def test_the_free_space_floor_defaults_to_a_share_of_the_volume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """min_free_bytes unset: 5% of the volume stays free, so a nearly full disk evicts."""
    import shutil
    from collections import namedtuple

    from kvtrio.actors.tiered import DEFAULT_MIN_FREE_SHARE

    assert DEFAULT_MIN_FREE_SHARE > 0
    usage = namedtuple("usage", "total used free")
    total = 1000 * ENTRY
    volume = {"free": total // 2}  # free space before the cache's own bytes
    store = FakeColdStore(tmp_path, MODEL)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda _p: usage(total, 0, volume["free"] - store.disk_bytes)
    )
    async with _open(store, cold_budget=10**12) as cache:
        for i in range(6):
            await cache.insert(_tokens(i), fake_caches(TOKENS))
        await cache.wait_writes_settled()
        assert len(store.disk) == 5 and cache.statistics().cold_evictions == 0
        # The cache's 5 entries bring the volume down to its floor: no room is left.
        volume["free"] = int(total * DEFAULT_MIN_FREE_SHARE) + 5 * ENTRY
        await cache.insert(_tokens(100), fake_caches(TOKENS))
        await cache.wait_writes_settled()
        assert cache.statistics().cold_evictions >= 1
        assert len(store.disk) == 5  # one in, one out
