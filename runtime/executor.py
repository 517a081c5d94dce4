"""Executors: where a job runs when it must run on one particular thread.

An :class:`Executor` runs ``fn(*args)`` somewhere and hands the result back to the calling
trio task. :class:`DedicatedThreadExecutor` owns one long-lived OS thread (the MLX owner is
built on it: MLX streams are thread-local, so every MLX call must happen on one thread);
:class:`InlineExecutor` runs jobs on the calling trio thread, for deterministic tests.

Theory of operation (DedicatedThreadExecutor):

1. Jobs run one at a time, in the order ``run`` was called (FIFO): one queue, one thread.
2. A job whose caller is cancelled before the thread picks it up is skipped: it never runs.
3. A job that has started always finishes. If its caller was cancelled meanwhile, the caller
   leaves at once and the result (or exception) is released, never delivered.
4. Each job moves PENDING -> STARTED -> DONE, or PENDING -> SKIPPED, or STARTED -> ABANDONED,
   under one lock shared by the owner thread and the trio thread; whoever makes a transition
   decides alone what happens next, so no result is delivered twice or to a task that left.
5. Nothing outlives its job: the owner thread drops the job's function and arguments once
   it has run (or was skipped), and ``run`` clears the result from the job record as it
   hands it over, so a large result lives exactly as long as the caller keeps it.
6. A started job cannot be interrupted (Python has no way to stop a thread). ``close`` and
   ``aclose`` wait for the queued jobs to finish; given a ``timeout``, they stop waiting
   when it runs out, leave the owner thread running as a daemon thread (it does not keep
   the interpreter alive), log a warning and raise :class:`ExecutorCloseTimeout`. The
   thread then exits on its own once its current job (and any queued behind it) returns.

Rules 2-5 are the job lifecycle :mod:`kvtrio.runtime.jobbook` keeps for every thread
executor; this module adds the queue, the thread and rules 1 and 6.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, TypeVar, TypeVarTuple, Unpack

import trio
from kvtrio.errors import KvtrioError
from kvtrio.runtime.jobbook import ExecutorStatistics, JobBook, _Job

__all__ = [
    "DedicatedThreadExecutor",
    "Executor",
    "ExecutorCloseTimeout",
    "ExecutorStatistics",
    "InlineExecutor",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class Executor(Protocol):
    """Runs jobs on a fixed thread; ``run`` awaits the job's result."""

    async def run(self, fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        """Run ``fn(*args)`` on the executor's thread and return its result (or raise)."""
        ...

    def is_owner_thread(self) -> bool:
        """True when called from the thread the executor runs its jobs on."""
        ...


class ExecutorCloseTimeout(KvtrioError):
    """``close``/``aclose`` gave up waiting for a job that did not return; the owner thread
    was left running as a daemon thread (rule 6)."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(
            f"executor {name!r}: a job was still running {timeout:g}s after close; "
            "its thread was left running as a daemon thread"
        )


_CLOSE = object()  # queue sentinel: the owner thread exits after the jobs before it


class DedicatedThreadExecutor:
    """One long-lived OS thread running jobs FIFO (see the module's theory of operation).

    Use as ``async with DedicatedThreadExecutor(name="mlx-owner") as ex:``, or call
    :meth:`start` and :meth:`close` yourself. Jobs queued before ``close`` still run.
    ``close_timeout`` is the timeout leaving the ``async with`` block passes to
    :meth:`aclose` (None: wait as long as the jobs take).
    """

    def __init__(
        self,
        *,
        name: str = "kvtrio-executor",
        close_timeout: float | None = None,
        on_thread_exit: Callable[[], object] | None = None,
    ) -> None:
        self.name = name
        self.close_timeout = close_timeout
        # Runs on the owner thread after its last job, before the thread ends: libraries
        # with thread-local state (MLX streams) must release it there, not at process exit.
        self.on_thread_exit = on_thread_exit
        self._thread_abandoned = False
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._jobs = JobBook()  # rules 2-5
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the owner thread (idempotent until closed)."""
        if self._closed:
            raise trio.ClosedResourceError(f"executor {self.name!r} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def close(self, *, timeout: float | None = None) -> None:
        """Stop accepting jobs, let the queued ones run, and join the thread (blocking).

        With ``timeout`` (seconds), stop waiting when it runs out and raise
        :class:`ExecutorCloseTimeout`, leaving the thread running as a daemon (rule 6).
        """
        thread = self._begin_close()
        if thread is not None:
            thread.join(timeout)
            self._check_joined(thread, timeout)

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Like :meth:`close`, but waits for the thread from a worker thread (shielded from
        cancellation: the jobs cannot be interrupted; bound the wait with ``timeout``)."""
        thread = self._begin_close()
        if thread is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join, timeout)
            self._check_joined(thread, timeout)

    def _check_joined(self, thread: threading.Thread, timeout: float | None) -> None:
        if not thread.is_alive():
            return
        assert timeout is not None and thread.daemon
        self._thread_abandoned = True
        logger.warning(
            "executor %r: a job was still running %gs after close; "
            "leaving its thread running as a daemon thread",
            self.name,
            timeout,
        )
        raise ExecutorCloseTimeout(self.name, timeout)

    def _begin_close(self) -> threading.Thread | None:
        if self._closed:
            return None
        self._closed = True
        self._queue.put(_CLOSE)
        return self._thread

    async def __aenter__(self) -> DedicatedThreadExecutor:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose(timeout=self.close_timeout)

    # -- the trio side ---------------------------------------------------------------------

    def is_owner_thread(self) -> bool:
        thread = self._thread
        return thread is not None and thread.ident == threading.get_ident()

    async def run(self, fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        if self._closed or self._thread is None:
            state = "closed" if self._closed else "not started"
            raise trio.ClosedResourceError(f"executor {self.name!r} is {state}")
        await trio.lowlevel.checkpoint_if_cancelled()
        job = self._jobs.new(lambda: fn(*args))
        self._queue.put(job)
        return await self._jobs.wait(job)

    def statistics(self) -> ExecutorStatistics:
        return self._jobs.statistics(thread_abandoned=self._thread_abandoned)

    # -- the owner thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                self._thread_exit()
                return
            assert isinstance(item, _Job)
            self._jobs.execute(item)
            del item  # rule 5: do not hold the settled job until the next one arrives

    def _thread_exit(self) -> None:
        if self.on_thread_exit is None:
            return
        try:
            self.on_thread_exit()
        except Exception:
            logger.exception("executor %r: on_thread_exit failed", self.name)


class InlineExecutor:
    """Same interface as :class:`DedicatedThreadExecutor`, but runs jobs on the calling thread.

    For deterministic tests: jobs run synchronously inside ``run`` (after a cancellation
    check), so trio's autojump clock sees no hidden thread. The owner thread is the thread
    that created the executor, normally the trio thread.
    """

    def __init__(self, *, name: str = "inline") -> None:
        self.name = name
        self._owner = threading.get_ident()
        self._started = 0
        self._skipped = 0

    def start(self) -> None:
        """Nothing to start; present for interface parity."""

    def close(self, *, timeout: float | None = None) -> None:
        """Nothing to close; present for interface parity."""

    async def aclose(self, *, timeout: float | None = None) -> None:
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> InlineExecutor:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def is_owner_thread(self) -> bool:
        return threading.get_ident() == self._owner

    async def run(self, fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            self._skipped += 1
            raise
        self._started += 1
        result = fn(*args)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(
            queued=self._started + self._skipped,
            started=self._started,
            completed=self._started,
            skipped=self._skipped,
            abandoned=0,
        )
