"""TieredPromptCache.spill over a fake cold store: what a save costs the owner thread."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.tiered import TieredPromptCache

from .fakes import MODEL, FakeColdStore, entry_bytes, fake_caches, fake_tiered


async def test_a_spill_describes_and_plans_its_write_in_one_owner_job(tmp_path: Path) -> None:
    """Cold side rule 2: the spill's one owner job describes the caches and plans their
    write; the writer sizes the reservation from that plan off the owner, with no owner job
    (and no plan) of its own before the store."""
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0) as cache:
        assert isinstance(cache.owner, MlxOwner)
        executor = cache.owner.executor
        before = executor.statistics().started
        key = await cache.spill(list(range(8)), fake_caches(8))
        assert executor.statistics().started - before == 1
        await cache.wait_writes_settled()
        assert store.stored == [key] and store.plans == 1
        assert executor.statistics().started - before == 1  # the fake store runs none
        assert cache.statistics().cold_entries == 1


async def test_a_write_back_waits_while_the_server_is_busy_and_starts_once_it_is_not(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Cold side rule 5 (kvtrio.actors.writegate): while the server says it decodes, a
    spilled entry stays pending (queued, counted against the cap); it is written as soon
    as the server is idle."""
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0) as cache:
        cache.set_foreground(True, defer=10.0)
        key = await cache.spill(list(range(8)), fake_caches(8))
        await trio.sleep(5.0)
        assert store.stored == [] and cache.statistics().pending_writes == 1
        cache.set_foreground(False)
        await cache.wait_writes_settled()
        assert store.stored == [key] and trio.current_time() < 5.1


async def test_a_write_back_starts_after_the_defer_bound_whatever_the_server_does(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Cold side rule 5: a server that never idles still writes: a write-back waits at
    most ``defer`` seconds from when the writer first held it back."""
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0) as cache:
        cache.set_foreground(True, defer=2.0)
        start = trio.current_time()
        key = await cache.spill(list(range(8)), fake_caches(8))
        await trio.sleep(1.9)
        assert store.stored == []
        await cache.wait_writes_settled()
        assert store.stored == [key]
        assert 2.0 <= trio.current_time() - start < 2.1


async def test_write_backs_go_at_once_when_pending_bytes_reach_half_the_cap(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Cold side rules 1 and 5: waiting never brings the pending writes near their byte
    cap (which would shed them): at half of it the writer starts, busy server or not."""
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0, pending_budget=4 * entry_bytes(8)) as cache:
        cache.set_foreground(True, defer=60.0)
        first = await cache.spill(list(range(8)), fake_caches(8))
        await trio.sleep(1.0)
        assert store.stored == []
        second = await cache.spill(list(range(100, 108)), fake_caches(8))
        await trio.sleep(1.0)
        # Two entries reached half of the cap: the oldest went; one alone waits again.
        assert store.stored == [first] and cache.statistics().pending_writes == 1
        assert cache.statistics().pending_dropped == 0
        cache.set_foreground(False)
        await cache.wait_writes_settled()
        assert store.stored == [first, second] and trio.current_time() < 3


async def test_a_close_writes_every_held_back_entry_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Cold side rule 5, kvtrio serve's SIGTERM promise (nothing lost): a close does not
    wait for a busy server's deferral; every pending write-back is written."""
    store = FakeColdStore(tmp_path, MODEL)
    keys = []
    async with fake_tiered(store, hot_budget=0) as cache:
        cache.set_foreground(True, defer=60.0)
        for i in range(3):
            keys.append(await cache.spill([i * 100 + t for t in range(8)], fake_caches(8)))
        start = trio.current_time()
    assert store.stored == keys and trio.current_time() - start < 1.0


async def test_a_flushs_spills_are_not_shed_by_the_pending_byte_cap(tmp_path: Path) -> None:
    """Cold side rule 1 and kvtrio serve's SIGTERM promise: a close hands every RAM entry
    over at once (``spill(flush=True)``); the byte cap, there to bound what RAM evictions
    hold while serving, sheds none of them, as it sheds none of :meth:`flush`'s. With the
    disk stalled the writes pile up past the cap (the first one written, two waiting
    beside a cap of one and a half) and all reach the disk (before, the older of the two
    waiting was shed)."""
    store = FakeColdStore(tmp_path, MODEL, store_gate=trio.Event())
    async with fake_tiered(store, hot_budget=0, pending_budget=3 * entry_bytes(8) // 2) as cache:
        keys = [
            await cache.spill([i * 100 + t for t in range(8)], fake_caches(8), flush=True)
            for i in range(1, 4)
        ]
        stats = cache.statistics()
        assert stats.pending_dropped == 0 and stats.pending_bytes > stats.pending_budget
        assert store.store_gate is not None
        store.store_gate.set()
        await cache.wait_writes_settled()
    assert sorted(store.stored) == sorted(keys)


async def _stalled_with_one_queued(cache: TieredPromptCache) -> str:
    """One write in flight (stalled at the store) and one RAM eviction queued behind it,
    droppable: the key of the queued one."""
    await cache.spill(list(range(8)), fake_caches(8))
    await trio.testing.wait_all_tasks_blocked()
    queued = await cache.spill(list(range(500, 508)), fake_caches(8))
    assert cache.statistics().pending_writes == 1
    return queued


async def test_a_flush_re_handing_a_queued_eviction_makes_it_unsheddable(tmp_path: Path) -> None:
    """A flush's write is never shed (cold side rule 1), even one of an entry already
    queued as a RAM eviction (droppable): kvtrio serve's close hands over again an entry
    RAM evicted and took back (a system prompt's segment is inserted at every request
    that has it). The spill found it queued and left it droppable, so a later write-back
    past the pending byte cap shed it."""
    store = FakeColdStore(tmp_path, MODEL, store_gate=trio.Event())
    async with fake_tiered(store, hot_budget=0, pending_budget=3 * entry_bytes(8) // 2) as cache:
        queued = await _stalled_with_one_queued(cache)
        again = await cache.spill(list(range(500, 508)), fake_caches(8), flush=True)
        assert again == queued
        await cache.spill(list(range(600, 608)), fake_caches(8))  # past the cap
        assert cache.statistics().pending_dropped == 0
        assert store.store_gate is not None
        store.store_gate.set()
    assert queued in store.stored and len(store.stored) == 3


async def test_a_flushs_spills_shed_no_write_queued_before_them(tmp_path: Path) -> None:
    """The close hands every RAM entry over at once, past the pending byte cap (they are
    in RAM anyway): those writes shed nothing, not even a RAM eviction queued before
    them, which the tier had admitted (before, the close's spills shed it)."""
    store = FakeColdStore(tmp_path, MODEL, store_gate=trio.Event())
    async with fake_tiered(store, hot_budget=0, pending_budget=3 * entry_bytes(8) // 2) as cache:
        queued = await _stalled_with_one_queued(cache)
        for i in range(2):
            await cache.spill([700 + 10 * i + t for t in range(8)], fake_caches(8), flush=True)
        stats = cache.statistics()
        assert stats.pending_dropped == 0 and stats.pending_writes == 3
        assert store.store_gate is not None
        store.store_gate.set()
    assert queued in store.stored and len(store.stored) == 4
