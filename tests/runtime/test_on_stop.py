"""on_stop runs once per started instance on every stop path: drain, crash before a restart,
escalation, and cancellation at the shutdown deadline; off the drain path it is shielded but
bounded by ``on_stop_timeout``, so a hanging on_stop cannot hang shutdown."""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import pytest
import trio
import trio.testing
from kvtrio.errors import ActorCrashed
from kvtrio.runtime.actor import Actor
from kvtrio.runtime.supervision import Restart
from kvtrio.runtime.system import ActorSystem
from kvtrio.runtime.testing import Trace
from kvtrio.tests.runtime.helpers import Crash, Sleep


@attrs.frozen
class Ping:
    pass


Msg = Crash | Sleep | Ping


class Lifecycle(Actor[Msg]):
    """Logs ``(event, instance, virtual time)``; on_stop may sleep (it awaits) or raise."""

    def __init__(
        self,
        log: list[tuple[str, int, float]],
        instance: int = 0,
        stop_sleep: float = 0.0,
        stop_error: bool = False,
        start_error: bool = False,
    ) -> None:
        self.log = log
        self.instance = instance
        self.stop_sleep = stop_sleep
        self.stop_error = stop_error
        self.start_error = start_error

    def _note(self, event: str) -> None:
        self.log.append((event, self.instance, trio.current_time()))

    async def on_start(self) -> None:
        self._note("start")
        if self.start_error:
            raise RuntimeError("on_start failed")

    async def on_stop(self) -> None:
        self._note("stop")
        if self.stop_sleep:
            await trio.sleep(self.stop_sleep)
            self._note("stopped")
        if self.stop_error:
            raise RuntimeError("on_stop failed")

    async def handle(self, msg: Msg) -> None:
        match msg:
            case Crash(why):
                raise ValueError(why)
            case Sleep(seconds):
                await trio.sleep(seconds)
            case Ping():
                self._note("ping")


def _factory(log: list[tuple[str, int, float]]) -> Callable[[], Lifecycle]:
    """A fresh, numbered instance per (re)start."""
    count = iter(range(1000))
    return lambda: Lifecycle(log, next(count))


async def test_on_stop_runs_after_a_crash_before_the_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Crash + restart: the crashed instance's on_stop runs at the crash, before the
    backoff; the fresh instance starts after the backoff and stops after the drain."""
    log: list[tuple[str, int, float]] = []
    policy = Restart(max_restarts=3, within=10.0, backoff_initial=0.5, jitter=0.0)
    async with ActorSystem() as system:
        ref = await system.spawn(_factory(log), name="flaky", supervision=policy)
        await trio.sleep(1.0)
        await ref.tell(Crash())
        await ref.tell(Ping())
        await trio.testing.wait_all_tasks_blocked()
    assert log == [
        ("start", 0, 0.0),
        ("stop", 0, 1.0),
        ("start", 1, 1.5),
        ("ping", 1, 1.5),
        ("stop", 1, 1.5),
    ]
    assert ref.statistics().restarts == 1


async def test_on_stop_runs_when_a_crash_escalates_and_for_the_cancelled_sibling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Escalate: the crashed actor's on_stop runs, and so does the on_stop of the sibling
    the escalation cancels mid-handler."""
    log: list[tuple[str, int, float]] = []
    with pytest.raises(BaseExceptionGroup) as info:
        async with ActorSystem() as system:
            sibling = await system.spawn(Lifecycle(log, 0), name="sibling")
            fragile = await system.spawn(Lifecycle(log, 1), name="fragile")
            await sibling.tell(Sleep(math.inf))
            await trio.sleep(2.0)
            await fragile.tell(Crash("disk on fire"))
            await trio.sleep(math.inf)
    assert info.value.subgroup(ActorCrashed) is not None
    assert sorted(log) == [
        ("start", 0, 0.0),
        ("start", 1, 0.0),
        ("stop", 0, 2.0),
        ("stop", 1, 2.0),
    ]


async def test_on_stop_runs_when_cancelled_at_the_shutdown_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Deadline cancel: a stuck actor is cancelled at ``grace`` and its on_stop still runs
    (shielded), once."""
    log: list[tuple[str, int, float]] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Lifecycle(log), name="stuck")
        await ref.tell(Sleep(math.inf))
        await system.shutdown(grace=3.0)
    assert log == [("start", 0, 0.0), ("stop", 0, 3.0)]


async def test_a_hanging_on_stop_is_bounded_by_on_stop_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Bound: an on_stop that hangs after a deadline cancel is itself cancelled after
    ``on_stop_timeout`` seconds, so shutdown ends at grace + on_stop_timeout; traced."""
    log: list[tuple[str, int, float]] = []
    trace = Trace()
    async with ActorSystem(on_stop_timeout=2.0, trace=trace) as system:
        ref = await system.spawn(Lifecycle(log, stop_sleep=math.inf), name="stuck")
        await ref.tell(Sleep(math.inf))
        await system.shutdown(grace=3.0)
        assert trio.current_time() == 5.0
    assert log == [("start", 0, 0.0), ("stop", 0, 3.0)]
    assert [e.event for e in trace.select(actor="stuck")][-1] == "stop_timed_out"


async def test_a_failing_on_stop_after_a_crash_is_traced_and_the_restart_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An on_stop that raises after a crash does not change the supervision decision: the
    error is traced as ``stop_failed`` and the actor restarts."""
    log: list[tuple[str, int, float]] = []
    trace = Trace()
    policy = Restart(max_restarts=1, within=10.0, backoff_initial=0.0, jitter=0.0)
    async with ActorSystem(trace=trace) as system:
        instances = iter([Lifecycle(log, 0, stop_error=True), Lifecycle(log, 1)])
        ref = await system.spawn(lambda: next(instances), name="flaky", supervision=policy)
        await ref.tell(Crash())
        await ref.tell(Ping())
        await trio.testing.wait_all_tasks_blocked()
        assert ref.statistics().restarts == 1
        events = [e.event for e in trace.select(actor="flaky")]
        assert events[:3] == ["handled", "crashed", "stop_failed"]
        await system.stop(ref)
    assert [entry[:2] for entry in log] == [
        ("start", 0),
        ("stop", 0),
        ("start", 1),
        ("ping", 1),
        ("stop", 1),
    ]


async def test_on_stop_does_not_run_when_on_start_failed() -> None:
    """Pairing: on_stop runs only for instances whose on_start returned."""
    log: list[tuple[str, int, float]] = []
    async with ActorSystem() as system:
        with pytest.raises(ActorCrashed, match=r"^actor 'broken' crashed$"):
            await system.spawn(Lifecycle(log, start_error=True), name="broken")
    assert [entry[0] for entry in log] == ["start"]
