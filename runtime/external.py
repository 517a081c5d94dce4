"""ExternalThreadExecutor: jobs run by a thread the caller already has, when it pumps.

:class:`~kvtrio.runtime.executor.DedicatedThreadExecutor` starts its own thread. A
threaded server (mlx-lm's, whose generation thread makes every MLX call) already has the
one thread that must run the jobs, and that thread is busy with its own loop. This
executor lets that thread be the owner: trio tasks queue jobs with :meth:`run`, and the
owner runs them when it calls :meth:`pump` (between its own steps) or :meth:`wait` (while
it waits for a reply from the trio side, so a call that needs owner jobs cannot
deadlock).

Theory of operation:

1. One queue holds jobs (from the trio thread) and replies (from :meth:`post`); only the
   owner thread takes from it. Jobs run FIFO.
2. A job keeps the executor's rules: one whose caller is cancelled before it starts is
   skipped; a started job finishes, and its result is dropped if its caller left (the
   PENDING/STARTED/DONE/SKIPPED/ABANDONED table of the dedicated executor).
3. :meth:`pump` runs queued jobs until the queue is empty or ``budget`` seconds have
   passed (a job in progress finishes): the owner's own loop stays responsive.
4. :meth:`wait` runs jobs until the reply it waits for arrives (or ``timeout``).
   One owner thread waits for one reply at a time; a reply whose wait gave up
   (``abandoned``) is dropped when it arrives, any other stray one is an AssertionError.
5. ``on_queued`` (if set) is called, on the queuing thread, after a job is queued: a
   server whose owner sleeps on its own queue uses it to wake the owner up.
6. After :meth:`close`, :meth:`run` raises ClosedResourceError; jobs already queued
   still run when the owner pumps.
7. A job that pumps (a callback that calls back into the caller's code) runs nothing:
   :meth:`pump` inside a job returns 0, so jobs never nest and a reply is only ever
   taken by the :meth:`wait` it belongs to.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar, TypeVarTuple, Unpack

import attrs
import trio
from kvtrio.runtime.jobbook import ExecutorStatistics, JobBook, _Job

__all__ = ["ExternalThreadExecutor", "Reply"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@attrs.define(eq=False)
class Reply(Generic[T]):
    """A value (or error) handed to the owner thread through the job queue (rule 4)."""

    value: T | None = None
    error: BaseException | None = None
    arrived: bool = False
    abandoned: bool = False  # its wait gave up: it is dropped when it arrives

    def unwrap(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class ExternalThreadExecutor:
    """An executor whose jobs run on a thread that pumps them (see the module doc).

    The owner thread is the one that calls :meth:`bind` (by default, the one that made the
    executor).
    """

    def __init__(self, *, name: str = "external-owner") -> None:
        self.name = name
        self.on_queued: Callable[[], object] | None = None
        self._owner = threading.get_ident()
        self._queue: queue.SimpleQueue[_Job[Any] | Reply[Any]] = queue.SimpleQueue()
        self._jobs = JobBook()  # rule 2
        self._closed = False
        self._in_job = False

    # -- the owner thread --------------------------------------------------------------

    def bind(self) -> None:
        """Make the calling thread the owner (before it pumps)."""
        self._owner = threading.get_ident()

    def is_owner_thread(self) -> bool:
        return threading.get_ident() == self._owner

    def pending(self) -> bool:
        """Whether a job is queued (cheap; any thread)."""
        return not self._queue.empty()

    def pump(self, budget: float = 0.005) -> int:
        """Run queued jobs until none is left or ``budget`` seconds passed (rule 3);
        return how many ran (skipped ones do not count). Owner thread only."""
        self._check_owner()
        if self._in_job:
            return 0  # rule 7
        deadline = time.perf_counter() + budget
        ran = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return ran
            if isinstance(item, Reply):
                _check_stray(item)
                continue
            ran += self._run_job(item)
            del item
            if time.perf_counter() >= deadline:
                return ran

    def wait(self, reply: Reply[T], *, timeout: float | None = None) -> bool:
        """Run jobs until ``reply`` has arrived (True) or ``timeout`` passed (False).
        Owner thread only (rule 4)."""
        self._check_owner()
        if self._in_job:
            raise AssertionError("a job may not wait for the trio side (rule 7)")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # until the reply itself is taken off the queue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                return False
            if item is reply:
                return True
            if isinstance(item, Reply):
                _check_stray(item)
                continue
            self._run_job(item)
            del item

    def post(
        self, reply: Reply[Any], value: Any = None, error: BaseException | None = None
    ) -> None:
        """Deliver ``reply`` to the owner's :meth:`wait` (any thread)."""
        reply.value, reply.error, reply.arrived = value, error, True
        self._queue.put(reply)

    def _check_owner(self) -> None:
        if not self.is_owner_thread():
            raise AssertionError(f"executor {self.name!r}: only its owner thread may pump")

    def _run_job(self, job: _Job[Any]) -> bool:
        """Run ``job`` unless it was skipped; whether it ran."""
        self._in_job = True  # rule 7
        try:
            return self._jobs.execute(job)
        finally:
            self._in_job = False

    # -- the trio side -----------------------------------------------------------------

    def close(self) -> None:
        """Refuse new jobs (rule 6)."""
        self._closed = True

    async def run(self, fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        if self._closed:
            raise trio.ClosedResourceError(f"executor {self.name!r} is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        job = self._jobs.new(lambda: fn(*args))
        self._queue.put(job)
        if self.on_queued is not None:
            self.on_queued()
        return await self._jobs.wait(job)

    def statistics(self) -> ExecutorStatistics:
        return self._jobs.statistics()


def _check_stray(reply: Reply[Any]) -> None:
    if not reply.abandoned:
        raise AssertionError("a reply arrived that nobody waits for")
