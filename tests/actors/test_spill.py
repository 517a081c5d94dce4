"""Spill: one test per rule of docs/design.md invariant 3 and the ticket / release contract
(invariant 2)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing
from kvtrio.actors.spill import (
    Spill,
    SpillActor,
    SpillOutcome,
    SpillQueue,
    SpillResult,
    SpillTicket,
)
from kvtrio.errors import ShuttingDown
from kvtrio.runtime.system import ActorSystem


@attrs.frozen
class Item:
    name: str
    nbytes: int = 10
    barrier: bool = False


@attrs.define
class Recorder:
    """A store that takes ``delay`` seconds of trio time per item and logs what it stored."""

    delay: float = 1.0
    fail: frozenset[str] = frozenset()
    stored: list[str] = attrs.field(factory=list)
    started: list[str] = attrs.field(factory=list)
    released: Counter[str] = attrs.field(factory=Counter)
    active: int = 0
    most_active: int = 0

    async def store(self, item: Item) -> None:
        self.started.append(item.name)
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await trio.sleep(self.delay)
        finally:
            self.active -= 1
        if item.name in self.fail:
            raise OSError(f"disk full storing {item.name}")
        self.stored.append(item.name)

    def release(self, item: Item) -> None:
        self.released[item.name] += 1


@asynccontextmanager
async def running(
    rec: Recorder, cap: float = 25, can_drop: Callable[[Item], bool] | None = None
) -> AsyncIterator[Spill[Item]]:
    spill: Spill[Item] = Spill(
        rec.store,
        rec.release,
        cap_bytes=cap,
        bytes_of=lambda item: item.nbytes,
        can_drop=can_drop or (lambda item: not item.barrier),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(spill.run)
        yield spill
        spill.close()
    assert spill.statistics().pending_items == 0


def released_once(rec: Recorder, names: list[str]) -> None:
    assert rec.released == Counter(names), "Invariant 2: every item released exactly once"


async def test_soft_cap_admits_the_newest_item_alone(autojump_clock: trio.abc.Clock) -> None:
    """Invariant 3: queued bytes exceed the cap only by the newest item alone."""
    rec = Recorder()
    async with running(rec, cap=25) as spill:
        small = spill.submit_nowait(Item("small", 10))
        big = spill.submit_nowait(Item("big", 100))
        stats = spill.statistics()
        # The store task has not started `small` yet, so it is not in flight: it is shed.
        assert small.outcome is SpillOutcome.DROPPED
        assert stats.pending_bytes == 100 and stats.pending_items == 1
        assert (await big.wait()).outcome is SpillOutcome.WRITTEN
    assert rec.stored == ["big"]
    released_once(rec, ["small", "big"])


async def test_in_flight_item_is_never_dropped(autojump_clock: trio.abc.Clock) -> None:
    """Invariant 3: shedding skips the in-flight item and drops the oldest queued one."""
    rec = Recorder()
    async with running(rec, cap=25) as spill:
        first = spill.submit_nowait(Item("first"))
        await trio.sleep(0.5)  # the store task has `first` in flight now
        assert rec.started == ["first"]
        second = spill.submit_nowait(Item("second"))
        third = spill.submit_nowait(Item("third"))
        assert second.outcome is SpillOutcome.DROPPED
        assert first.outcome is None and third.outcome is None
        assert (await first.wait()).outcome is SpillOutcome.WRITTEN
        assert (await third.wait()).outcome is SpillOutcome.WRITTEN
    assert rec.stored == ["first", "third"]
    released_once(rec, ["first", "second", "third"])


async def test_barriers_survive_shedding(autojump_clock: trio.abc.Clock) -> None:
    """Invariant 3: an item whose can_drop is false is never shed; the next droppable one is."""
    rec = Recorder()
    async with running(rec, cap=25) as spill:
        barrier = spill.submit_nowait(Item("barrier", 10, barrier=True))
        plain = spill.submit_nowait(Item("plain", 10))
        newest = spill.submit_nowait(Item("newest", 10))
        assert barrier.outcome is None
        assert plain.outcome is SpillOutcome.DROPPED
        assert newest.outcome is None
        over = spill.submit_nowait(Item("over", 50))
        # Only barriers and the newest remain: the soft cap admits `over`, sheds `newest`.
        assert newest.outcome is SpillOutcome.DROPPED
        assert spill.statistics().pending_bytes == 60
        await spill.drain()
        assert over.outcome is SpillOutcome.WRITTEN
    assert rec.stored == ["barrier", "over"]
    released_once(rec, ["barrier", "plain", "newest", "over"])


async def test_cancel_where_spares_the_in_flight_item(autojump_clock: trio.abc.Clock) -> None:
    """cancel_where cancels matching queued items but never the one being stored."""
    rec = Recorder()
    async with running(rec, cap=1000) as spill:
        a1 = spill.submit_nowait(Item("a1"))
        await trio.sleep(0.5)
        a2 = spill.submit_nowait(Item("a2"))
        b1 = spill.submit_nowait(Item("b1"))
        assert spill.cancel_where(lambda t: t.item.name.startswith("a")) == 1
        assert a2.outcome is SpillOutcome.CANCELLED
        assert a1.outcome is None
        await spill.drain()
        assert [a1.result, b1.result] == [SpillResult(SpillOutcome.WRITTEN)] * 2
    assert rec.stored == ["a1", "b1"]
    released_once(rec, ["a1", "a2", "b1"])


async def test_drain_settles_everything_enqueued_so_far(autojump_clock: trio.abc.Clock) -> None:
    """drain() returns once each earlier item settled, not waiting for later submissions."""
    rec = Recorder(delay=1.0)
    async with running(rec, cap=1000) as spill:
        early = [spill.submit_nowait(Item(f"e{i}")) for i in range(3)]
        drained_at: list[float] = []

        async def drain_then_note() -> None:
            await spill.drain()
            drained_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_then_note)
            await trio.sleep(0.1)
            late = spill.submit_nowait(Item("late"))
        assert all(t.outcome is SpillOutcome.WRITTEN for t in early)
        assert late.outcome is None
        assert drained_at[0] == pytest.approx(trio.current_time())
        await late.wait()
    assert rec.stored == ["e0", "e1", "e2", "late"]


async def test_stores_run_strictly_in_enqueue_order(autojump_clock: trio.abc.Clock) -> None:
    """Invariant 3: items are stored one at a time, in enqueue order."""
    rec = Recorder(delay=0.25)
    names = [f"i{n}" for n in range(8)]
    async with running(rec, cap=10_000) as spill:
        for name in names:
            spill.submit_nowait(Item(name))
            await trio.sleep(0.1)
        await spill.drain()
    assert rec.stored == names
    assert rec.most_active == 1


async def test_a_failed_store_is_followed_by_successful_ones(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A store that raises settles FAILED(error); the queue goes on with the next items."""
    rec = Recorder(fail=frozenset({"bad"}))
    async with running(rec, cap=1000) as spill:
        tickets = [spill.submit_nowait(Item(n)) for n in ("ok1", "bad", "ok2")]
        await spill.drain()
    results = [t.result for t in tickets]
    assert results[0] == SpillResult(SpillOutcome.WRITTEN)
    assert results[1] is not None and results[1].outcome is SpillOutcome.FAILED
    assert isinstance(results[1].error, OSError)
    assert str(results[1].error) == "disk full storing bad"
    assert results[2] == SpillResult(SpillOutcome.WRITTEN)
    stats = spill.statistics()
    assert (stats.written, stats.failed, stats.dropped, stats.cancelled) == (2, 1, 0, 0)
    released_once(rec, ["ok1", "bad", "ok2"])


async def test_newer_checkpoint_supersedes_queued_ones_of_its_key(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Supersession cancels the older queued checkpoints of the same key, not the in-flight one."""
    rec = Recorder()
    async with running(rec, cap=1000) as spill:
        c1 = spill.submit_nowait(Item("c1"), key="conv", supersede=True)
        await trio.sleep(0.5)
        c2 = spill.submit_nowait(Item("c2"), key="conv", supersede=True)
        other = spill.submit_nowait(Item("other"), key="elsewhere", supersede=True)
        c3 = spill.submit_nowait(Item("c3"), key="conv", supersede=True)
        assert c2.outcome is SpillOutcome.CANCELLED
        await spill.drain()
        assert [c1.outcome, other.outcome, c3.outcome] == [SpillOutcome.WRITTEN] * 3
    assert rec.stored == ["c1", "other", "c3"]
    released_once(rec, ["c1", "c2", "other", "c3"])


async def test_statistics_track_high_water_and_outcomes(autojump_clock: trio.abc.Clock) -> None:
    rec = Recorder()
    async with running(rec, cap=30) as spill:
        for n in range(5):
            spill.submit_nowait(Item(f"s{n}", 10))
        mid = spill.statistics()
        assert mid.pending_bytes == 30 and mid.high_water_bytes == 40
        await spill.drain()
    stats = spill.statistics()
    assert (stats.pending_bytes, stats.pending_items, stats.in_flight) == (0, 0, False)
    assert stats.written + stats.dropped == 5 and stats.dropped == 2
    assert stats.high_water_bytes == 40


async def test_closed_spill_refuses_and_releases_new_items(autojump_clock: trio.abc.Clock) -> None:
    rec = Recorder()
    async with running(rec) as spill:
        spill.close()
        with pytest.raises(ShuttingDown, match=r"^spill queue is closed$"):
            spill.submit_nowait(Item("late"))
    released_once(rec, ["late"])


async def test_cancelling_the_spill_settles_and_releases_everything(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Invariant 2: shutdown by cancellation settles the in-flight and queued items CANCELLED."""
    rec = Recorder(delay=10)
    spill: Spill[Item] = Spill(rec.store, rec.release, cap_bytes=1000)
    with trio.move_on_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(spill.run)
            tickets = [spill.submit_nowait(Item(n)) for n in ("x", "y")]
    assert [t.outcome for t in tickets] == [SpillOutcome.CANCELLED] * 2
    assert rec.stored == []
    released_once(rec, ["x", "y"])


async def test_abort_cancels_the_store_in_flight(autojump_clock: trio.abc.Clock) -> None:
    rec = Recorder(delay=10)
    async with running(rec, cap=1000) as spill:
        first = spill.submit_nowait(Item("first"))
        second = spill.submit_nowait(Item("second"))
        await trio.sleep(1)
        spill.abort()
        assert (await first.wait()).outcome is SpillOutcome.CANCELLED
        assert second.outcome is SpillOutcome.CANCELLED
    assert trio.current_time() == pytest.approx(1)
    released_once(rec, ["first", "second"])


def test_queue_state_machine_without_a_loop() -> None:
    """The pure queue: start_next/finish drive it; finishing a non-in-flight item is an error."""
    released: list[str] = []
    queue: SpillQueue[str] = SpillQueue(20, released.append)
    a = queue.enqueue("a", nbytes=10)
    b = queue.enqueue("b", nbytes=10)
    assert queue.start_next() is a and queue.start_next() is None
    with pytest.raises(RuntimeError, match=r"^finish\(\) of an item that is not in flight$"):
        queue.finish(b, SpillResult(SpillOutcome.WRITTEN))
    c = queue.enqueue("c", nbytes=10)
    assert b.outcome is SpillOutcome.DROPPED  # `a` is in flight, so `b` is the oldest victim
    queue.finish(a, SpillResult(SpillOutcome.WRITTEN))
    assert queue.pending() == [c]
    assert released == ["b", "a"]
    tickets: list[SpillTicket[str]] = queue.pending()
    assert tickets[0].seq == 2


async def test_spill_actor_stores_and_drains_under_an_actor_system(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The system's phased shutdown drains the spill actor: every queued item is stored."""
    rec = Recorder()
    spill: Spill[Item] = Spill(rec.store, rec.release, cap_bytes=1000)
    async with ActorSystem(grace=60) as system:
        spill.attach(await system.spawn(SpillActor(spill), name="spill", mailbox_size=1))
        tickets = [spill.submit_nowait(Item(f"a{i}")) for i in range(4)]
        await trio.sleep(1.5)
        assert rec.stored == ["a0"]
    spill.stop()
    assert [t.outcome for t in tickets] == [SpillOutcome.WRITTEN] * 4
    assert rec.stored == ["a0", "a1", "a2", "a3"]
    released_once(rec, ["a0", "a1", "a2", "a3"])


async def test_spill_actor_cancelled_at_the_deadline_releases_the_rest(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Invariant 2: a shutdown deadline cancels the store in flight; stop() settles and
    releases every item left."""
    rec = Recorder(delay=10)
    spill: Spill[Item] = Spill(rec.store, rec.release, cap_bytes=1000)
    async with ActorSystem(grace=5) as system:
        spill.attach(await system.spawn(SpillActor(spill), name="spill", mailbox_size=1))
        tickets = [spill.submit_nowait(Item(f"b{i}")) for i in range(3)]
    assert trio.current_time() == pytest.approx(5)
    spill.stop()
    assert [t.outcome for t in tickets] == [SpillOutcome.CANCELLED] * 3
    assert rec.stored == []
    released_once(rec, ["b0", "b1", "b2"])
    with pytest.raises(ShuttingDown, match=r"^spill queue is closed$"):
        spill.submit_nowait(Item("late"))


async def test_a_submission_the_stopped_actor_cannot_take_is_settled_by_stop(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Invariant 2: an item queued after the spill actor stopped is not lost in limbo:
    stop() cancels and releases it."""
    rec = Recorder()
    spill: Spill[Item] = Spill(rec.store, rec.release, cap_bytes=1000)
    async with ActorSystem(grace=5) as system:
        spill.attach(await system.spawn(SpillActor(spill), name="spill", mailbox_size=1))
        await system.shutdown()
        orphan = spill.submit_nowait(Item("orphan"))
        assert orphan.outcome is None
    spill.stop()
    assert orphan.outcome is SpillOutcome.CANCELLED
    released_once(rec, ["orphan"])
