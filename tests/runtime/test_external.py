"""ExternalThreadExecutor: jobs run on the thread that pumps them, with the executor rules."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio
from kvtrio.runtime.external import ExternalThreadExecutor, Reply


def _owner_thread(ex: ExternalThreadExecutor, body: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        ex.bind()
        body()

    thread = threading.Thread(target=run, name="owner")
    thread.start()
    return thread


async def test_jobs_run_on_the_pumping_thread_in_order() -> None:
    ex = ExternalThreadExecutor()
    stop = threading.Event()
    ran_on: list[str] = []

    def owner() -> None:
        while not stop.is_set():
            ex.pump(0.01)
            time.sleep(0.001)

    def job(i: int) -> int:
        ran_on.append(threading.current_thread().name)
        return i

    thread = _owner_thread(ex, owner)
    try:
        results = [await ex.run(job, i) for i in range(5)]
    finally:
        stop.set()
        thread.join()
    assert results == [0, 1, 2, 3, 4] and ran_on == ["owner"] * 5
    assert ex.statistics().completed == 5


async def test_a_job_cancelled_before_the_owner_pumps_never_runs() -> None:
    ex = ExternalThreadExecutor()
    ran: list[int] = []
    with trio.move_on_after(0.05):
        await ex.run(ran.append, 1)  # nobody pumps
    ex.bind()
    assert ex.pump() == 0 and ran == [] and ex.statistics().skipped == 1


async def test_wait_runs_jobs_until_its_reply_arrives() -> None:
    ex = ExternalThreadExecutor()
    reply: Reply[str] = Reply()
    done = threading.Event()
    got: list[Any] = []

    def owner() -> None:
        got.append(ex.wait(reply, timeout=10))
        got.append(reply.unwrap())
        done.set()

    thread = _owner_thread(ex, owner)
    assert await ex.run(lambda: threading.current_thread().name) == "owner"
    ex.post(reply, "answer")
    await trio.to_thread.run_sync(thread.join)
    assert got == [True, "answer"]


def test_a_job_that_pumps_runs_nothing_and_an_abandoned_reply_is_dropped() -> None:
    ex = ExternalThreadExecutor()
    late: Reply[int] = Reply()
    assert not ex.wait(late, timeout=0.01)
    late.abandoned = True
    ex.post(late, 1)  # arrives after its wait gave up: dropped by the next pump
    nested: list[int] = []

    async def main() -> None:
        await ex.run(lambda: nested.append(ex.pump()))

    thread = threading.Thread(target=trio.run, args=(main,))
    thread.start()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        ex.pump(0.01)
        time.sleep(0.001)
    thread.join()
    assert nested == [0]


def test_only_the_owner_thread_may_pump() -> None:
    ex = ExternalThreadExecutor()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            ex.pump()
        except AssertionError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert [str(e) for e in errors] == ["executor 'external-owner': only its owner thread may pump"]


def test_a_stray_reply_is_an_error() -> None:
    ex = ExternalThreadExecutor()
    ex.post(Reply(), 1)
    with pytest.raises(AssertionError, match=r"^a reply arrived that nobody waits for$"):
        ex.pump()
