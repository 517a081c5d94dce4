"""Lifecycle and phased shutdown: start order, drain, reverse stop order, the deadline."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from kvtrio.errors import ActorCrashed, ActorStopped, ShuttingDown
from kvtrio.runtime.actor import ActorState
from kvtrio.runtime.system import ActorSystem
from kvtrio.runtime.testing import Trace
from kvtrio.tests.runtime.helpers import Add, Counter, Forward, Get, Sleep


async def test_spawn_starts_actors_in_order_and_shutdown_stops_them_in_reverse(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Graceful shutdown: every accepted message is handled (drain), actors stop in reverse
    start order, and a message after the stop gets ShuttingDown."""
    log: list[str] = []
    trace = Trace()
    async with ActorSystem(trace=trace) as system:
        refs = [await system.spawn(Counter(log), name=name) for name in ("a", "b", "c")]
        assert log == ["start a", "start b", "start c"]
        for ref in refs:
            for n in range(5):
                ref.tell_nowait(Sleep(0.1))
                ref.tell_nowait(Add(n))
        await system.shutdown(grace=60.0)
        assert log[3:] == ["stop c", "stop b", "stop a"]
        for ref in refs:
            stats = ref.statistics()
            assert (stats.processed, stats.dropped, stats.state) == (10, 0, ActorState.STOPPED)
        with pytest.raises(ShuttingDown, match=r"^actor 'a' refused a message: shutting down$"):
            await refs[0].tell(Add(1))
        with pytest.raises(ShuttingDown):
            await system.spawn(Counter(), name="late")
    handled = [e.actor for e in trace.handled()]
    assert sorted(handled) == ["a"] * 10 + ["b"] * 10 + ["c"] * 10
    assert trio.current_time() == pytest.approx(0.5)  # the actors drained side by side


async def test_intake_stops_for_outsiders_but_actors_may_still_talk_while_draining(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Stop intake: outside senders get ShuttingDown at once, blocked ones included, while
    a draining actor can still tell an actor that stops after it."""
    async with ActorSystem() as system:
        first = await system.spawn(Counter(), name="first", mailbox_size=4)
        second = await system.spawn(Counter(peer=first), name="second", mailbox_size=1)
        second.tell_nowait(Sleep(1.0))
        second.tell_nowait(Forward(7))
        refused: list[BaseException] = []

        async def blocked_outsider() -> None:
            try:
                await second.tell(Add(1))  # the mailbox is full: waits
            except ShuttingDown as exc:
                refused.append(exc)

        system._nursery.start_soon(blocked_outsider)  # type: ignore[union-attr]
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(system.shutdown)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(ShuttingDown):
                first.tell_nowait(Add(100))
        assert len(refused) == 1
        assert first.statistics().processed == 1  # the Forward from "second" got through
        assert second.statistics().processed == 2


async def test_stuck_actor_is_cancelled_at_the_deadline_and_not_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Deadline (docs/design.md invariant 7: trio's clock): a handler that never finishes is
    cancelled
    exactly at `grace`, not before; the message queued behind it is counted as dropped and
    its asker gets ShuttingDown."""
    stuck = Counter()
    async with ActorSystem() as system:
        ref = await system.spawn(stuck, name="stuck")
        ref.tell_nowait(Sleep(math.inf))
        outcome: list[BaseException] = []

        async def queued_ask() -> None:
            try:
                await ref.ask(Get)
            except ShuttingDown as exc:
                outcome.append(exc)

        system._nursery.start_soon(queued_ask)  # type: ignore[union-attr]
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1.0)
        await system.shutdown(grace=5.0)
        assert stuck.cancelled_at == 6.0
        assert trio.current_time() == 6.0
        await trio.testing.wait_all_tasks_blocked()  # let the asker see its error
        assert [str(e) for e in outcome] == [
            "actor 'stuck' was cancelled before handling the message"
        ]
        stats = ref.statistics()
        assert (stats.processed, stats.dropped) == (0, 2)


async def test_stopped_actor_refuses_messages_with_actor_stopped() -> None:
    """A tell or ask to an actor that stopped raises ActorStopped; nothing is dropped."""
    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="done")
        await ref.tell(Add(3))
        await system.stop(ref)
        assert ref.statistics().processed == 1
        with pytest.raises(ActorStopped, match=r"^actor 'done' is stopped$"):
            await ref.tell(Add(1))
        with pytest.raises(ActorStopped):
            ref.tell_nowait(Add(1))
        with pytest.raises(ActorStopped):
            await ref.ask(Get)


async def test_leaving_the_block_drains_and_cancel_skips_the_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Leaving `async with` normally drains like shutdown(); cancel() stops at once."""
    async with ActorSystem(grace=30.0) as system:
        ref = await system.spawn(Counter(), name="c")
        for _ in range(3):
            ref.tell_nowait(Sleep(1.0))
    assert ref.statistics().processed == 3
    assert trio.current_time() == 3.0

    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="c")
        for _ in range(3):
            ref.tell_nowait(Sleep(1.0))
        await trio.testing.wait_all_tasks_blocked()
        system.cancel()
        await system.wait_stopped()
    stats = ref.statistics()
    assert (stats.processed, stats.dropped) == (0, 3)
    assert trio.current_time() == 3.0


class _FailsToStart(Counter):
    async def on_start(self) -> None:
        raise OSError("no disk")


async def test_spawn_raises_actor_crashed_when_the_first_on_start_fails() -> None:
    """A failing on_start surfaces at spawn (with its cause), not later as a silent stop."""
    async with ActorSystem() as system:
        with pytest.raises(ActorCrashed, match=r"^actor 'bad' crashed$") as info:
            await system.spawn(_FailsToStart(), name="bad")
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(ActorStopped):
            await system.lookup("bad").tell(Add(1))
        ok = await system.spawn(Counter(), name="ok")  # the system itself is unharmed
        assert await ok.ask(Get) == 0


class _Quitter(Counter):
    async def handle(self, msg: object) -> None:
        await super().handle(msg)  # type: ignore[arg-type]
        if isinstance(msg, Add) and msg.n < 0:
            self.system.request_shutdown(grace=10.0)


async def test_an_actor_can_request_shutdown_of_its_own_system(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """request_shutdown from a handler drains the system (awaiting shutdown there would
    wait on the handler itself)."""
    async with ActorSystem() as system:
        worker = await system.spawn(Counter(), name="worker")
        quitter = await system.spawn(_Quitter(), name="quitter")
        worker.tell_nowait(Sleep(3.0))
        worker.tell_nowait(Add(1))
        quitter.tell_nowait(Add(-1))
        await system.wait_stopped()
        assert trio.current_time() == 3.0
        assert worker.statistics().processed == 2
        assert system.statistics().shutting_down


async def test_stop_timeout_cancels_one_stuck_actor_and_the_rest_still_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Per-actor phase deadline: a stuck actor with stop_timeout=1 is cancelled after 1 s of
    its own drain, and the actor started before it still gets to drain completely."""
    stuck = Counter()
    async with ActorSystem() as system:
        steady = await system.spawn(Counter(), name="steady")
        blocked = await system.spawn(stuck, name="stuck", stop_timeout=1.0)
        blocked.tell_nowait(Sleep(math.inf))
        for _ in range(3):
            steady.tell_nowait(Sleep(1.0))
        await trio.testing.wait_all_tasks_blocked()
        await system.shutdown(grace=30.0)
        assert stuck.cancelled_at == 1.0
        assert steady.statistics().processed == 3
        assert trio.current_time() == 3.0
