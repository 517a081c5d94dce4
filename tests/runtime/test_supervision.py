"""Supervision: escalate by default, restart within an intensity limit, exact backoff."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
import trio.testing
from kvtrio.errors import ActorCrashed, ShuttingDown
from kvtrio.runtime.actor import ActorRef, ActorState
from kvtrio.runtime.supervision import Restart, RestartTracker
from kvtrio.runtime.system import ActorSystem
from kvtrio.runtime.testing import Trace
from kvtrio.tests.runtime.helpers import Add, Counter, Crash, Get, Hold, Msg

NO_BACKOFF: dict[str, Any] = {"backoff_initial": 0.0, "jitter": 0.0}


def _crash_of(group: BaseExceptionGroup[BaseException]) -> ActorCrashed:
    crashes = group.subgroup(ActorCrashed)
    assert crashes is not None and len(crashes.exceptions) == 1
    crash = crashes.exceptions[0]
    assert isinstance(crash, ActorCrashed)
    return crash


async def test_crash_escalates_by_default_like_a_nursery() -> None:
    """Escalate: the crash cancels the system and surfaces as ActorCrashed with its cause;
    an ask queued behind the crashing message fails with ActorCrashed instead of hanging."""
    outcome: list[BaseException] = []
    release = trio.Event()
    with pytest.raises(BaseExceptionGroup) as info:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter(), name="fragile")
            ref.tell_nowait(Hold(release))
            ref.tell_nowait(Crash("disk on fire"))

            async def queued_ask() -> None:
                try:
                    await ref.ask(Get)
                except ActorCrashed as exc:
                    outcome.append(exc)

            system._nursery.start_soon(queued_ask)  # type: ignore[union-attr]
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            await trio.sleep_forever()
    crash = _crash_of(info.value)
    assert str(crash) == "actor 'fragile' crashed"
    assert isinstance(crash.__cause__, ValueError)
    assert str(crash.__cause__) == "disk on fire"
    assert outcome == [crash]
    stats = ref.statistics()
    assert (stats.failures, stats.dropped, stats.state) == (1, 1, ActorState.STOPPED)
    with pytest.raises(ShuttingDown, match=r"^actor 'fragile' refused a message: shutting down$"):
        await ref.tell(Add(1))


async def test_restart_keeps_the_mailbox_and_fails_only_the_crashing_ask() -> None:
    """Restart: the crashed message's asker gets ActorCrashed; queued messages survive."""
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, name="c", supervision=Restart(**NO_BACKOFF))
        ref.tell_nowait(Add(5))
        ref.tell_nowait(Crash())
        ref.tell_nowait(Add(7))
        assert await ref.ask(Get) == 7  # a fresh instance (factory) after the restart
        stats = ref.statistics()
        assert (stats.failures, stats.restarts, stats.processed) == (1, 1, 3)


async def test_crash_beyond_the_restart_intensity_escalates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Restart intensity: with max_restarts=2 within 10 s, the 3rd crash inside the window
    escalates."""
    with pytest.raises(BaseExceptionGroup) as info:
        async with ActorSystem() as system:
            policy = Restart(max_restarts=2, within=10.0, **NO_BACKOFF)
            ref = await system.spawn(Counter, name="c", supervision=policy)
            for _ in range(3):
                await trio.sleep(1.0)
                await ref.tell(Crash())
            await trio.sleep_forever()
    assert _crash_of(info.value).actor == "c"
    stats = ref.statistics()
    assert (stats.failures, stats.restarts) == (3, 2)
    assert trio.current_time() == 3.0


async def test_crashes_spread_wider_than_the_window_keep_restarting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Restart intensity: crashes more than `within` apart never add up to an escalation."""
    async with ActorSystem() as system:
        policy = Restart(max_restarts=2, within=10.0, **NO_BACKOFF)
        ref: ActorRef[Msg] = await system.spawn(Counter, name="c", supervision=policy)
        for _ in range(6):
            await ref.tell(Crash())
            await trio.sleep(5.01)  # at most 2 crashes in any 10 s window
        stats = ref.statistics()
        assert (stats.failures, stats.restarts) == (6, 6)


async def test_backoff_delays_are_exact_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Backoff, docs/design.md invariant 7: restarts wait initial * factor**k (capped), measured on
    trio's
    clock, so the delays are exact under MockClock."""
    trace = Trace()
    policy = Restart(
        max_restarts=10, within=100.0, backoff_initial=1.0, backoff_factor=2.0,
        backoff_max=5.0, jitter=0.0,
    )
    async with ActorSystem(trace=trace) as system:
        ref = await system.spawn(Counter, name="c", supervision=policy)
        for _ in range(4):
            ref.tell_nowait(Crash())
        assert await ref.ask(Get) == 0
    crashed = [e.at for e in trace.select(actor="c", event="crashed")]
    restarted = [e.at for e in trace.select(actor="c", event="restarted")]
    delays = [r - c for c, r in zip(crashed, restarted, strict=True)]
    assert delays == [min(5.0, 1.0 * 2.0**k) for k in range(4)]
    assert crashed[0] == 0.0


async def test_backoff_jitter_is_seeded_and_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Jitter: each delay lies within +-jitter of the base and is reproducible from the seed."""
    policy = Restart(max_restarts=10, within=100.0, backoff_initial=1.0, jitter=0.5)
    expected_rng = random.Random(7)
    expected = [policy.backoff(k, expected_rng) for k in range(3)]
    trace = Trace()
    async with ActorSystem(trace=trace, seed=7) as system:
        ref = await system.spawn(Counter, name="c", supervision=policy)
        for _ in range(3):
            ref.tell_nowait(Crash())
        await ref.ask(Get)
    crashed = [e.at for e in trace.select(event="crashed")]
    restarted = [e.at for e in trace.select(event="restarted")]
    delays = [r - c for c, r in zip(crashed, restarted, strict=True)]
    assert delays == pytest.approx(expected)
    for k, delay in enumerate(delays):
        assert 0.5 * 2.0**k <= delay <= 1.5 * 2.0**k


def test_restart_tracker_forgets_crashes_older_than_the_window() -> None:
    tracker = RestartTracker(Restart(max_restarts=1, within=10.0, jitter=0.0), random.Random(0))
    assert tracker.on_crash(0.0) == 0.1
    assert tracker.on_crash(5.0) is None  # 2nd crash within 10 s: escalate
    assert tracker.on_crash(10.5) == 0.1  # the crash at 0.0 left the window
