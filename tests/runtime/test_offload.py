"""ThreadOffload and InlineOffload: the token is passed, and a running job is never abandoned."""

from __future__ import annotations

import threading
import time

import pytest
import trio
from kvtrio.errors import OperationCancelled
from kvtrio.runtime.offload import CancelToken, InlineOffload, Offload, ThreadOffload

WAIT = 10.0  # seconds; only reached if the code under test is broken


def test_cancel_token_is_a_should_stop_predicate() -> None:
    """The token works as Callable[[], bool] and check() raises OperationCancelled once set."""
    token = CancelToken()
    assert (token(), token.cancelled) == (False, False)
    token.check()
    token.cancel()
    assert (token(), token.cancelled) == (True, True)
    with pytest.raises(OperationCancelled, match=r"^operation cancelled at a step boundary$"):
        token.check()


async def test_job_gets_token_and_args_and_runs_on_a_worker_thread() -> None:
    offload: Offload = ThreadOffload(2)

    def job(token: CancelToken, a: int, b: int) -> tuple[int, bool, int]:
        return a + b, token.cancelled, threading.get_ident()

    total, cancelled, thread = await offload.run(job, 2, 3)
    assert (total, cancelled) == (5, False)
    assert thread != threading.get_ident()


async def test_cancellation_sets_token_and_waits_for_the_thread() -> None:
    """docs/design.md invariant 6: on cancellation the worker thread is told to stop and waited
    for, never
    abandoned; the caller then sees the trio cancellation."""
    started = threading.Event()
    returned = threading.Event()

    def job(token: CancelToken) -> None:
        started.set()
        try:
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                token.check()  # a step boundary
                time.sleep(0.001)
        finally:
            time.sleep(0.05)  # cleanup after the boundary (removing a tmp file, say)
            returned.set()

    offload = ThreadOffload(1)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel_once_started() -> None:
                await trio.to_thread.run_sync(started.wait, WAIT)
                scope.cancel()

            nursery.start_soon(cancel_once_started)
            await offload.run(job)
    assert scope.cancelled_caught
    assert returned.is_set()  # the thread had finished its cleanup before run() returned
    assert offload.statistics().running == 0
    assert offload.statistics().cancel_requests == 1


async def test_job_ignoring_token_still_finishes_and_other_errors_win() -> None:
    """A job that ends with a real error after cancellation reports that error, not Cancelled."""
    started = threading.Event()

    def job(token: CancelToken) -> None:
        started.set()
        while not token():
            time.sleep(0.001)
        raise OSError("disk full while stopping")

    offload = ThreadOffload(1)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel_once_started() -> None:
                await trio.to_thread.run_sync(started.wait, WAIT)
                scope.cancel()

            nursery.start_soon(cancel_once_started)
            with pytest.raises(OSError, match=r"^disk full while stopping$"):
                await offload.run(job)


async def test_limiter_bounds_concurrent_jobs() -> None:
    """At most `limit` jobs run at once."""
    lock = threading.Lock()
    running = 0
    peak = 0

    def job(token: CancelToken) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)
        with lock:
            running -= 1

    offload = ThreadOffload(trio.CapacityLimiter(2))
    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(offload.run, job)
    assert peak <= 2
    assert offload.statistics().completed == 6


async def test_inline_offload_runs_on_trio_thread_and_reports_job_cancellation() -> None:
    """InlineOffload: same interface, deterministic; a pre-cancelled token drives the job's
    own OperationCancelled path."""
    offload = InlineOffload()
    assert await offload.run(lambda token, x: (x, threading.get_ident()), 7) == (
        7,
        threading.get_ident(),
    )

    def cancelled_token() -> CancelToken:
        token = CancelToken()
        token.cancel()
        return token

    offload.token_factory = cancelled_token
    with pytest.raises(OperationCancelled):
        await offload.run(lambda token: token.check())
