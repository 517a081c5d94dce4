"""DedicatedThreadExecutor and InlineExecutor: FIFO, skip-if-cancelled, release-if-abandoned.

These run a real OS thread, so they coordinate with threading.Events, not the mock clock.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import trio
import trio.testing
from kvtrio.runtime.executor import (
    DedicatedThreadExecutor,
    Executor,
    ExecutorCloseTimeout,
    InlineExecutor,
)

WAIT = 10.0  # seconds; only reached if the code under test is broken


async def _gate_owner(ex: DedicatedThreadExecutor, nursery: trio.Nursery) -> threading.Event:
    """Occupy the owner thread until the returned event is set."""
    entered = threading.Event()
    gate = threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(WAIT)

    nursery.start_soon(ex.run, hold)
    await trio.to_thread.run_sync(entered.wait, WAIT)
    return gate


async def test_jobs_run_in_fifo_order_on_one_thread() -> None:
    """Rule 1: jobs run one at a time, in the order run() was called, on the owner thread."""
    order: list[int] = []
    threads: set[int] = set()

    def job(i: int) -> None:
        threads.add(threading.get_ident())
        order.append(i)

    async with DedicatedThreadExecutor(name="fifo") as ex, trio.open_nursery() as nursery:
        gate = await _gate_owner(ex, nursery)
        for i in range(20):
            nursery.start_soon(ex.run, job, i)
            await trio.testing.wait_all_tasks_blocked()  # job i is queued before job i+1
        gate.set()
    assert order == list(range(20))
    assert threads == {ex._thread.ident if ex._thread else -1}
    assert threading.get_ident() not in threads


async def test_job_cancelled_before_start_is_skipped() -> None:
    """Rule 2: a job whose caller is cancelled while it is still queued never runs."""
    ran: list[str] = []
    async with DedicatedThreadExecutor(name="skip") as ex:
        async with trio.open_nursery() as nursery:
            gate = await _gate_owner(ex, nursery)
            with trio.CancelScope() as scope:
                nursery.start_soon(lambda: ex.run(ran.append, "too late"))
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
                await ex.run(ran.append, "unreachable")
            nursery.cancel_scope.cancel()  # cancels the queued "too late" job's caller
            gate.set()
        await ex.run(ran.append, "after")
    assert ran == ["after"]
    assert ex.statistics().skipped >= 1


class _Result:
    pass


async def test_started_job_finishes_and_result_is_released_when_caller_leaves() -> None:
    """Rule 3: a cancelled caller leaves at once; the started job still finishes, and its
    result is dropped (not kept alive) because nobody waits for it."""
    started = threading.Event()
    gate = threading.Event()
    finished = threading.Event()
    refs: list[weakref.ref[_Result]] = []

    def slow() -> _Result:
        started.set()
        gate.wait(WAIT)
        result = _Result()
        refs.append(weakref.ref(result))
        finished.set()
        return result

    async with DedicatedThreadExecutor(name="abandon") as ex:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_once_started() -> None:
                    await trio.to_thread.run_sync(started.wait, WAIT)
                    scope.cancel()

                nursery.start_soon(cancel_once_started)
                await ex.run(slow)
        assert scope.cancelled_caught
        assert not finished.is_set()  # the caller did not wait for the job
        gate.set()
        await ex.run(lambda: None)  # FIFO: slow() has returned once this one ran
    assert finished.is_set()
    gc.collect()
    assert refs and refs[0]() is None
    stats = ex.statistics()
    assert (stats.abandoned, stats.completed) == (1, 2)


async def test_errors_propagate_and_owner_thread_is_known() -> None:
    """A job's exception reaches its caller; is_owner_thread is true only inside jobs."""

    def boom() -> None:
        raise ValueError("boom")

    async with DedicatedThreadExecutor(name="owner") as ex:
        with pytest.raises(ValueError, match=r"^boom$"):
            await ex.run(boom)
        assert await ex.run(ex.is_owner_thread) is True
        assert ex.is_owner_thread() is False
        assert await ex.run(pow, 2, 10) == 1024


async def test_run_after_close_raises_closed_resource_error() -> None:
    """A closed executor refuses jobs instead of queueing them forever."""
    ex = DedicatedThreadExecutor(name="closed")
    ex.start()
    await ex.aclose()
    with pytest.raises(trio.ClosedResourceError, match=r"^executor 'closed' is closed$"):
        await ex.run(lambda: None)


async def test_inline_executor_runs_on_the_calling_thread_and_skips_when_cancelled() -> None:
    """InlineExecutor: same interface, runs on the trio thread; a cancelled caller skips."""
    ex: Executor = InlineExecutor()
    ran: list[int] = []
    assert await ex.run(threading.get_ident) == threading.get_ident()
    assert ex.is_owner_thread()
    with trio.CancelScope() as scope:
        scope.cancel()
        await ex.run(ran.append, 1)
    assert ran == []


class _Payload:
    pass


async def test_result_and_arguments_are_released_once_delivered() -> None:
    """Rule 5: once ``run`` returned and the caller dropped the result, neither the result
    nor the job's arguments stay alive in the executor (no waiting for the next job)."""

    def make(arg: _Payload) -> _Result:
        return _Result()

    async with DedicatedThreadExecutor(name="release") as ex:
        arg = _Payload()
        arg_ref = weakref.ref(arg)
        result = await ex.run(make, arg)
        result_ref = weakref.ref(result)
        del result, arg
        gc.collect()
        assert result_ref() is None
        assert arg_ref() is None
        assert ex.statistics().completed == 1


async def test_failed_job_arguments_are_released_once_delivered() -> None:
    """Rule 5: a job that raised keeps neither its arguments nor its error alive."""

    class _Boom(Exception):
        pass

    def fail(arg: _Payload) -> None:
        raise _Boom("boom")

    async with DedicatedThreadExecutor(name="release-error") as ex:
        arg = _Payload()
        arg_ref = weakref.ref(arg)
        with pytest.raises(_Boom, match=r"^boom$") as info:
            await ex.run(fail, arg)
        error_ref = weakref.ref(info.value)
        del arg, info
        gc.collect()
        assert arg_ref() is None
        assert error_ref() is None


async def test_aclose_timeout_gives_up_on_a_job_that_never_returns() -> None:
    """Rule 6: a started job cannot be interrupted; aclose(timeout=...) stops waiting,
    leaves the owner thread running as a daemon and raises ExecutorCloseTimeout. The
    thread exits on its own once the job returns."""
    entered = threading.Event()
    release = threading.Event()

    def stuck() -> None:
        entered.set()
        release.wait(WAIT)

    ex = DedicatedThreadExecutor(name="stuck")
    ex.start()
    thread = ex._thread
    assert thread is not None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.run, stuck)
            await trio.to_thread.run_sync(entered.wait, WAIT)
            with pytest.raises(
                ExecutorCloseTimeout,
                match=r"^executor 'stuck': a job was still running 0\.2s after close; "
                r"its thread was left running as a daemon thread$",
            ):
                await ex.aclose(timeout=0.2)
            assert thread.is_alive() and thread.daemon
            assert ex.statistics().thread_abandoned
            release.set()  # the job returns; its caller gets the result
    finally:
        release.set()
    await trio.to_thread.run_sync(thread.join, WAIT)
    assert not thread.is_alive()
    await ex.aclose(timeout=0.2)  # already closed: returns at once


def test_sync_close_timeout_and_async_with_close_timeout() -> None:
    """Rule 6 for close(timeout=...) and for ``async with`` given ``close_timeout``; a
    close that is in time returns normally and abandons nothing."""
    release = threading.Event()
    entered = threading.Event()

    def stuck() -> None:
        entered.set()
        release.wait(WAIT)

    async def main() -> None:
        ex = DedicatedThreadExecutor(name="sync-stuck")
        ex.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.run, stuck)
            await trio.to_thread.run_sync(entered.wait, WAIT)
            with pytest.raises(ExecutorCloseTimeout, match=r"^executor 'sync-stuck': "):
                ex.close(timeout=0.1)
            release.set()
        assert ex.statistics().thread_abandoned

        entered.clear()
        release.clear()
        with pytest.raises(ExecutorCloseTimeout, match=r"^executor 'with-stuck': ") as info:
            async with (
                DedicatedThreadExecutor(name="with-stuck", close_timeout=0.1) as ex2,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(ex2.run, stuck)
                await trio.to_thread.run_sync(entered.wait, WAIT)
                nursery.cancel_scope.cancel()  # the caller leaves; the job keeps running
        assert info.value.timeout == 0.1
        release.set()

        async with DedicatedThreadExecutor(name="prompt", close_timeout=5.0) as ex3:
            assert await ex3.run(int, "7") == 7
        assert not ex3.statistics().thread_abandoned

    try:
        trio.run(main)
    finally:
        release.set()
