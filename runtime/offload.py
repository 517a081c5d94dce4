"""Thread offload: run a blocking job on a worker thread without ever abandoning it.

``await offload.run(fn, *args)`` calls ``fn(token, *args)`` on a worker thread, where
``token`` is a :class:`CancelToken` the job checks between steps (at every tensor or block
boundary). Theory of operation:

1. At most ``limit`` jobs run at once (a trio CapacityLimiter); a caller cancelled while
   waiting for a slot never starts its job.
2. When the calling task is cancelled while the job runs, the token is set and the caller
   keeps waiting - shielded - until the thread returns. A worker thread holding borrowed
   buffers is never abandoned (docs/design.md invariant 6).
3. Then the cancellation is re-raised. A job that ended with ``OperationCancelled`` (it saw
   the token) is reported as the trio cancellation; any other error it raised wins.

:class:`InlineOffload` has the same interface and runs the job on the trio thread, for
deterministic tests (trio's autojump clock ignores worker threads).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, TypeVarTuple, Unpack

import attrs
import trio
from kvtrio.errors import OperationCancelled

__all__ = ["CancelToken", "InlineOffload", "Offload", "OffloadStatistics", "ThreadOffload"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class CancelToken:
    """A flag a blocking job polls between steps; set by the offload on trio cancellation.

    ``token()`` is the same as ``token.cancelled``, so the token can be passed wherever a
    ``Callable[[], bool]`` "should stop" predicate is expected.
    """

    __slots__ = ("_cancelled",)

    def __init__(self) -> None:
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Ask the job to stop at its next step boundary (idempotent, thread-safe)."""
        self._cancelled = True

    def check(self) -> None:
        """Raise :class:`~kvtrio.errors.OperationCancelled` if cancellation was requested."""
        if self._cancelled:
            raise OperationCancelled("operation cancelled at a step boundary")

    def __call__(self) -> bool:
        return self._cancelled

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self._cancelled})"


class Offload(Protocol):
    """Runs ``fn(token, *args)`` off the trio thread and returns its result."""

    async def run(self, fn: Callable[[CancelToken, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run the job; on cancellation set the token, wait for it, then re-raise."""
        ...


@attrs.frozen
class OffloadStatistics:
    """A snapshot of an offload's counters."""

    running: int
    completed: int
    cancel_requests: int


@attrs.define(eq=False)
class _Slot:
    """The result box one worker thread fills in; identity-hashed, so it can borrow a limiter."""

    value: Any = None
    error: BaseException | None = None


class ThreadOffload:
    """Runs blocking jobs on trio's worker threads, at most ``limit`` at once."""

    def __init__(self, limit: int | trio.CapacityLimiter = 4) -> None:
        self.limiter = limit if isinstance(limit, trio.CapacityLimiter) else trio.CapacityLimiter(
            limit
        )
        self._running = 0
        self._completed = 0
        self._cancel_requests = 0

    async def run(self, fn: Callable[[CancelToken, Unpack[Ts]], T], *args: *Ts) -> T:
        token = CancelToken()
        slot = _Slot()
        await self.limiter.acquire_on_behalf_of(slot)  # rule 1: cancellable, nothing started
        try:
            task = trio.lowlevel.current_task()
            trio_token = trio.lowlevel.current_trio_token()
            context = contextvars.copy_context()

            def job() -> None:
                try:
                    slot.value = context.run(fn, token, *args)
                except BaseException as exc:
                    slot.error = exc

            def deliver(_: object) -> None:
                # The caller always waits for this (rule 2), so the run cannot have finished.
                trio_token.run_sync_soon(trio.lowlevel.reschedule, task)

            def abort(_: object) -> trio.lowlevel.Abort:
                if not token.cancelled:
                    self._cancel_requests += 1
                token.cancel()
                return trio.lowlevel.Abort.FAILED  # keep waiting for the thread: rule 2

            self._running += 1
            trio.lowlevel.start_thread_soon(job, deliver)
            try:
                await trio.lowlevel.wait_task_rescheduled(abort)
            finally:
                self._running -= 1
                self._completed += 1
        finally:
            self.limiter.release_on_behalf_of(slot)
        result: T = await _settle(token, slot)
        return result

    def statistics(self) -> OffloadStatistics:
        return OffloadStatistics(
            running=self._running,
            completed=self._completed,
            cancel_requests=self._cancel_requests,
        )


async def _settle(token: CancelToken, slot: _Slot) -> Any:
    """Rule 3: turn a finished job into its result, its error, or the pending cancellation."""
    error, slot.error = slot.error, None
    if token.cancelled and (error is None or isinstance(error, OperationCancelled)):
        # The scope that set the token is still cancelled, so this checkpoint raises Cancelled.
        await trio.lowlevel.checkpoint()
    if error is not None:
        raise error
    return slot.value


class InlineOffload:
    """Same interface as :class:`ThreadOffload`, but runs the job on the trio thread.

    The job runs synchronously, so it cannot be interrupted mid-way; a caller already
    cancelled when it calls ``run`` never starts the job. A test may set ``token_factory``
    (e.g. to return an already-cancelled token) to drive a job's own cancellation path.
    """

    def __init__(self) -> None:
        self._completed = 0
        self.token_factory: Callable[[], CancelToken] = CancelToken

    async def run(self, fn: Callable[[CancelToken, Unpack[Ts]], T], *args: *Ts) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        token = self.token_factory()
        try:
            result = fn(token, *args)
        finally:
            self._completed += 1
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    def statistics(self) -> OffloadStatistics:
        return OffloadStatistics(
            running=0, completed=self._completed, cancel_requests=0
        )
