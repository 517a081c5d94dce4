"""Actors and references: backpressure, ask/reply, timeouts and asker cancellation."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from kvtrio.errors import AskTimeout
from kvtrio.runtime.actor import Reply
from kvtrio.runtime.system import ActorSystem
from kvtrio.tests.runtime.helpers import Add, Counter, Get, Hold, Sleep


async def test_full_mailbox_blocks_the_sender_and_statistics_show_the_peak(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Backpressure: with the mailbox full, tell waits and tell_nowait raises WouldBlock;
    nothing is lost, and statistics report the depth, the peak and the waiting sender."""
    release = trio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="counter", mailbox_size=2)
        ref.tell_nowait(Hold(release))
        await trio.testing.wait_all_tasks_blocked()  # the handler now holds the first message
        ref.tell_nowait(Add(1))
        ref.tell_nowait(Add(2))
        with pytest.raises(trio.WouldBlock):
            ref.tell_nowait(Add(100))
        sent = trio.Event()

        async def blocked_sender() -> None:
            await ref.tell(Add(3))
            sent.set()

        system._nursery.start_soon(blocked_sender)  # type: ignore[union-attr]
        await trio.testing.wait_all_tasks_blocked()
        stats = ref.statistics()
        assert not sent.is_set()
        assert (stats.mailbox_depth, stats.peak_depth, stats.senders_waiting) == (2, 2, 1)
        release.set()
        await sent.wait()
        assert await ref.ask(Get) == 6
        stats = ref.statistics()
        assert (stats.processed, stats.peak_depth, stats.senders_waiting) == (5, 2, 0)


async def test_ask_returns_the_handlers_reply() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="counter")
        await ref.tell(Add(40))
        await ref.tell(Add(2))
        assert await ref.ask(Get) == 42
        assert await ref.ask(Get, timeout=1.0) == 42


async def test_ask_timeout_raises_and_the_late_reply_is_discarded_quietly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """AskTimeout fires exactly at the timeout; the reply sent later harms nobody."""
    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="slow")
        await ref.tell(Sleep(10.0))
        start = trio.current_time()
        with pytest.raises(AskTimeout, match=r"^ask to actor 'slow' timed out after 1.5s$"):
            await ref.ask(Get, timeout=1.5)
        assert trio.current_time() - start == 1.5
        await ref.tell(Add(1))
        assert await ref.ask(Get) == 1  # handled after the abandoned Get, in order
        stats = ref.statistics()
        assert (stats.processed, stats.failures) == (4, 0)


async def test_cancelled_asker_leaves_and_the_late_reply_is_discarded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Asker cancellation: the asker leaves at once; the actor's late reply is ignored."""
    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="slow")
        await ref.tell(Sleep(5.0))
        with trio.move_on_after(1.0) as scope:
            await ref.ask(Get)
        assert scope.cancelled_caught
        assert trio.current_time() == 1.0
        assert await ref.ask(Get) == 0
        assert ref.statistics().failures == 0


def test_reply_settles_once_and_ignores_an_abandoned_asker() -> None:
    """A second send is a bug (RuntimeError); send after the asker left is quiet."""
    reply: Reply[int] = Reply()
    reply.send(1)
    assert reply.settled
    with pytest.raises(RuntimeError, match=r"^reply already settled$"):
        reply.fail(ValueError("late"))

    async def abandon() -> Reply[int]:
        slot: Reply[int] = Reply()
        with trio.move_on_after(0):
            await slot.wait()
        return slot

    abandoned = trio.run(abandon)
    abandoned.send(2)
    abandoned.fail(ValueError("also ignored"))
    assert abandoned.settled
