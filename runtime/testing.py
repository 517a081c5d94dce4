"""A test kit for users' own deterministic concurrency tests (public API).

- :class:`Trace` records what every actor did - (actor, event, message type, virtual time)
  - when passed as ``ActorSystem(trace=...)``. Under trio's ``MockClock`` the timestamps
  are exact, so a test can assert *when* something happened, not only *that* it did.
- :class:`FaultPlan` makes the Nth call of a named operation fail or stall. It is a plain
  callable, ``plan("fsync")``, safe to call from worker threads, so code that knows nothing
  of kvtrio's runtime can take it as a hook (kvtrio's ``FaultyFileOps`` does). Actors use
  ``await plan.async_call("op")``, whose delays run on trio's clock.
- :func:`run_scenario` runs an async scenario under ``MockClock(autojump_threshold=0)`` with
  inline executor and offload, so nothing hides in a thread the clock cannot see.

Example::

    from kvtrio.runtime.testing import FaultPlan, Trace, run_scenario

    async def scenario(kit):
        async with kit.system() as system:
            ref = await system.spawn(MyActor(), name="store")
            await ref.tell(Put("k", b"v"))
        return kit.trace.handled("store")

    assert [e.message_type for e in run_scenario(scenario)] == ["Put"]
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio
import trio.testing
from kvtrio.runtime.executor import InlineExecutor
from kvtrio.runtime.offload import InlineOffload
from kvtrio.runtime.system import ActorSystem

__all__ = ["Fault", "FaultPlan", "Scenario", "Trace", "TraceEvent", "run_scenario"]

T = TypeVar("T")


@attrs.frozen
class TraceEvent:
    """One thing an actor did: ``event`` is handled, crashed, escalated, restarted, dropped,
    or stop_failed / stop_timed_out (an ``on_stop`` after a crash or cancel raised / ran out).

    ``at`` is ``trio.current_time()`` when it happened; for "handled", when the handler
    started on the message."""

    actor: str
    event: str
    message_type: str
    at: float
    message: object = attrs.field(eq=False, repr=False)


@attrs.define
class Trace:
    """An in-memory, ordered record of actor events with trio-clock timestamps."""

    events: list[TraceEvent] = attrs.field(factory=list)

    def record(self, actor: str, event: str, message: object) -> None:
        """Called by the system for each event (the :class:`~kvtrio.runtime.system.Tracer`
        protocol); the timestamp is ``trio.current_time()``."""
        message_type = "-" if message is None else type(message).__name__
        self.events.append(TraceEvent(actor, event, message_type, trio.current_time(), message))

    def select(self, *, actor: str | None = None, event: str | None = None) -> list[TraceEvent]:
        """The events matching every given filter, in order."""
        return [
            e
            for e in self.events
            if (actor is None or e.actor == actor) and (event is None or e.event == event)
        ]

    def handled(self, actor: str | None = None) -> list[TraceEvent]:
        """The messages handled (by ``actor``, or by any actor), in order."""
        return self.select(actor=actor, event="handled")

    def format(self) -> str:
        """One line per event: ``t=0.500 store handled Put``."""
        return "\n".join(
            f"t={e.at:.3f} {e.actor} {e.event} {e.message_type}" for e in self.events
        )


@attrs.frozen
class Fault:
    """What happens on the planned calls of one operation: raise ``error`` or sleep ``delay``."""

    op: str
    first_call: int
    times: int
    error: BaseException | Callable[[], BaseException] | None
    delay: float

    def applies(self, call: int) -> bool:
        return self.first_call <= call < self.first_call + self.times

    def make_error(self) -> BaseException | None:
        if self.error is None or isinstance(self.error, BaseException):
            return self.error
        return self.error()


class FaultPlan:
    """Fail or delay the Nth call (1-based) of named operations.

    ``plan.fail("fsync", on_call=2, error=OSError(5, "EIO"))`` makes the second fsync raise;
    ``plan.delay("write", on_call=1, seconds=0.2)`` stalls the first write. ``times`` repeats
    a fault over consecutive calls. Each call counts, faulty or not; ``plan.calls(op)``
    tells how many happened. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._calls: dict[str, int] = {}

    def fail(
        self,
        op: str,
        *,
        on_call: int = 1,
        error: BaseException | Callable[[], BaseException] | None = None,
        times: int = 1,
    ) -> FaultPlan:
        """Plan ``error`` (default ``OSError(5, "injected fault: <op>")``) for the call."""
        planned = error if error is not None else (lambda: OSError(5, f"injected fault: {op}"))
        return self._add(Fault(op, on_call, times, planned, 0.0))

    def delay(self, op: str, *, on_call: int = 1, seconds: float, times: int = 1) -> FaultPlan:
        """Plan a stall of ``seconds`` for the call (time.sleep, or trio.sleep in async_call)."""
        return self._add(Fault(op, on_call, times, None, seconds))

    def _add(self, fault: Fault) -> FaultPlan:
        if fault.first_call < 1 or fault.times < 1:
            raise ValueError("on_call and times start at 1")
        with self._lock:
            self._faults.append(fault)
        return self

    def calls(self, op: str) -> int:
        """How many times ``op`` was called so far."""
        with self._lock:
            return self._calls.get(op, 0)

    def _next(self, op: str) -> list[Fault]:
        with self._lock:
            call = self._calls.get(op, 0) + 1
            self._calls[op] = call
            return [f for f in self._faults if f.op == op and f.applies(call)]

    def __call__(self, op: str) -> None:
        """Count a call of ``op``; sleep and/or raise as planned (sync code, any thread)."""
        for fault in self._next(op):
            if fault.delay:
                time.sleep(fault.delay)
            error = fault.make_error()
            if error is not None:
                raise error

    async def async_call(self, op: str) -> None:
        """Like calling the plan, but delays are ``trio.sleep`` (exact under MockClock)."""
        faults = self._next(op)
        await trio.lowlevel.checkpoint()
        for fault in faults:
            if fault.delay:
                await trio.sleep(fault.delay)
            error = fault.make_error()
            if error is not None:
                raise error


@attrs.define
class Scenario:
    """What :func:`run_scenario` hands the scenario: a shared trace, inline executor and
    offload, the mock clock, and a factory for actor systems wired to them."""

    clock: trio.testing.MockClock
    trace: Trace = attrs.field(factory=Trace)
    executor: InlineExecutor = attrs.field(factory=InlineExecutor)
    offload: InlineOffload = attrs.field(factory=InlineOffload)
    seed: int = 0

    def system(self, **options: Any) -> ActorSystem:
        """An ActorSystem tracing into ``self.trace`` with a seeded jitter source."""
        options.setdefault("trace", self.trace)
        options.setdefault("seed", self.seed)
        return ActorSystem(**options)


def run_scenario(scenario: Callable[[Scenario], Awaitable[T]], *, seed: int = 0) -> T:
    """Run ``await scenario(kit)`` in a fresh trio run under ``MockClock(autojump_threshold=0)``
    and return its result. Time advances only when every task is blocked, so sleeps and
    timeouts take no wall time and their order is exact. ``seed`` also seeds the order in
    which trio runs tasks that are ready at the same moment, so a run is repeatable."""
    _seed_trio_scheduler(seed)
    clock = trio.testing.MockClock(autojump_threshold=0)
    kit = Scenario(clock=clock, seed=seed)

    async def main() -> T:
        return await scenario(kit)

    return trio.run(main, clock=clock)


def _seed_trio_scheduler(seed: int) -> None:
    """Seed trio's scheduling shuffle (a private Random that trio itself registers with
    hypothesis for the same purpose); skipped quietly if a trio release renames it."""
    scheduler_random = getattr(trio._core._run, "_r", None)
    if isinstance(scheduler_random, random.Random):
        scheduler_random.seed(seed)
