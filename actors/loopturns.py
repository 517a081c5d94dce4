"""Turns of the event loop during a long worker-thread job (docs/design.md invariant 16).

A worker thread that alternates Python work with short system calls (a rebuild reading
100,000 manifests: stat, open, read, close, then a parse, each a few tens of
microseconds) can keep the event loop from the GIL for tens or hundreds of milliseconds,
although it never holds the GIL for long in one piece. CPython's GIL hands over on
request only: a thread waiting for it asks the holder to drop it after the switch
interval (5 ms) of waiting, but every release of the GIL (each system call) wakes the
waiter and restarts its wait; the waiter, woken on another CPU, finds the GIL taken
again by the worker, which never left its CPU, and starts a new 5 ms wait. So the loop
can wait through hundreds of releases without once asking for the GIL (the convoy
effect; measured with ``perf sched timehist`` in docs/bench/scale.md, twelfth session:
136 wake-ups of the loop thread in one 15 ms stall, each running 2 microseconds). A
worker doing pure Python work, with no system call, does not do this: the waiter's
request comes after 5 ms.

:class:`LoopTurns` hands the GIL over for certain: at most every :data:`TURN_PERIOD_S`
of work, the worker calls :func:`trio.from_thread.run_sync` with nothing to do and blocks
until the event loop has run it, so the loop, which runs every task that is due in the
same turn, waits for the GIL at most about one period behind such a worker. A turn costs
the worker a round trip through the loop (tens of microseconds).
"""

from __future__ import annotations

import time

import attrs
import trio

__all__ = ["TURN_PERIOD_S", "LoopTurns"]

#: Worker time between two turns of the event loop (the GIL's own switch interval).
TURN_PERIOD_S = 0.005


def _nothing() -> None:
    return None


@attrs.define
class LoopTurns:
    """Offered by a worker thread between short steps of a long job (:meth:`offer`): the
    event loop takes a turn whenever ``period_s`` has passed since the last one.

    Made for a job that :func:`trio.to_thread.run_sync` runs: the worker reaches the loop
    through the thread's own link to it. The first turn is due one period after it is
    made."""

    period_s: float = attrs.field(factory=lambda: TURN_PERIOD_S)  # the module's, when made
    turns: int = attrs.field(default=0, init=False)  # turns taken (reports, tests)
    _due: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._due = time.perf_counter() + self.period_s

    def offer(self) -> None:
        """Worker thread: let the event loop take a turn if one is due (no-op otherwise).
        Call it between steps of the job, each much shorter than the period."""
        if time.perf_counter() < self._due:
            return
        trio.from_thread.run_sync(_nothing)
        self.turns += 1
        self._due = time.perf_counter() + self.period_s
