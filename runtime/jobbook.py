"""The job lifecycle every thread executor shares: one record per job, one lock, counters.

:class:`~kvtrio.runtime.executor.DedicatedThreadExecutor` and
:class:`~kvtrio.runtime.external.ExternalThreadExecutor` differ in who runs a job (a thread
of their own, or a thread that pumps) but not in what a job is. A :class:`JobBook` holds
that once:

1. :meth:`JobBook.new` makes a PENDING job for the calling trio task and counts it queued.
2. :meth:`JobBook.execute` runs on the owner thread: PENDING -> STARTED under the lock (a
   job already SKIPPED is dropped), the call, then STARTED -> DONE with the result and a
   wake-up of the caller, or, if the caller left (ABANDONED), the result is released there.
3. :meth:`JobBook.wait` runs in the caller's trio task: it sleeps until woken, and a
   cancellation turns PENDING into SKIPPED (it never runs) or STARTED into ABANDONED (it
   finishes, nobody is told); a DONE job's wake-up is already on its way, so it is taken.
4. Whoever makes a transition under the lock decides alone what happens next: no result
   is delivered twice or to a task that left. The job's function is dropped before it
   runs, its result as it is handed over, so nothing outlives its job.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import trio

__all__ = ["ExecutorStatistics", "JobBook"]

T = TypeVar("T")


class _State(enum.Enum):
    PENDING = "pending"
    STARTED = "started"
    DONE = "done"
    SKIPPED = "skipped"
    ABANDONED = "abandoned"


@attrs.define(eq=False)
class _Job(Generic[T]):
    fn: Callable[[], T]
    task: trio.lowlevel.Task
    trio_token: trio.lowlevel.TrioToken
    state: _State = _State.PENDING
    value: T | None = None
    error: BaseException | None = None


@attrs.frozen
class ExecutorStatistics:
    """A snapshot of an executor's counters."""

    queued: int
    started: int
    completed: int
    skipped: int
    abandoned: int  # started jobs whose caller left before they returned
    thread_abandoned: bool = False  # close gave up waiting for the owner thread


def _released() -> Any:
    raise AssertionError("a job runs at most once")


class JobBook:
    """The lock and counters of one executor's jobs (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued = 0
        self._started = 0
        self._completed = 0
        self._skipped = 0
        self._abandoned = 0

    def new(self, fn: Callable[[], T]) -> _Job[T]:
        """A PENDING job calling ``fn`` for the current trio task (rule 1; trio thread)."""
        job: _Job[T] = _Job(
            fn=fn,
            task=trio.lowlevel.current_task(),
            trio_token=trio.lowlevel.current_trio_token(),
        )
        self._queued += 1
        return job

    def execute(self, job: _Job[Any]) -> bool:
        """Run ``job`` unless its caller already left; whether it ran (rule 2; owner
        thread)."""
        fn, job.fn = job.fn, _released  # the closure holds the job's arguments
        with self._lock:
            if job.state is not _State.PENDING:
                return False  # skipped: its caller left before we got here
            job.state = _State.STARTED
            self._started += 1
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn()
        except BaseException as exc:
            error = exc
        del fn
        with self._lock:
            self._completed += 1
            if job.state is _State.ABANDONED:
                return True  # nobody waits; the result is released here
            job.state = _State.DONE
            job.value = value
            job.error = error
        del value, error
        try:
            job.trio_token.run_sync_soon(trio.lowlevel.reschedule, job.task)
        except trio.RunFinishedError:
            pass  # the trio run ended while the job ran; nobody is left to wake
        return True

    async def wait(self, job: _Job[T]) -> T:
        """Sleep until ``job`` is done and return its result or raise its error (rule 3;
        the caller's trio task)."""

        def abort(_: object) -> trio.lowlevel.Abort:
            with self._lock:
                if job.state is _State.PENDING:
                    job.state = _State.SKIPPED
                    self._skipped += 1
                    return trio.lowlevel.Abort.SUCCEEDED
                if job.state is _State.STARTED:
                    job.state = _State.ABANDONED
                    self._abandoned += 1
                    return trio.lowlevel.Abort.SUCCEEDED
            # DONE: the wake-up is already on its way; take the result.
            return trio.lowlevel.Abort.FAILED

        await trio.lowlevel.wait_task_rescheduled(abort)
        value, error = job.value, job.error
        job.value = job.error = None  # rule 4: the record keeps nothing once handed over
        if error is not None:
            try:
                raise error
            finally:
                del error
        return value  # type: ignore[return-value]

    def statistics(self, *, thread_abandoned: bool = False) -> ExecutorStatistics:
        return ExecutorStatistics(
            queued=self._queued,
            started=self._started,
            completed=self._completed,
            skipped=self._skipped,
            abandoned=self._abandoned,
            thread_abandoned=thread_abandoned,
        )
