"""DedicatedThreadExecutor(on_thread_exit=...): runs once, on the owner thread, after the
last job (thread-local state such as MLX streams must be released there)."""

from __future__ import annotations

import logging
import threading

import pytest
from kvtrio.runtime.executor import DedicatedThreadExecutor


async def test_on_thread_exit_runs_once_on_the_owner_thread_after_the_last_job() -> None:
    events: list[tuple[str, int]] = []

    def job() -> None:
        events.append(("job", threading.get_ident()))

    def on_exit() -> None:
        events.append(("exit", threading.get_ident()))

    async with DedicatedThreadExecutor(name="hook", on_thread_exit=on_exit) as ex:
        await ex.run(job)
        await ex.run(job)
        assert [kind for kind, _ in events] == ["job", "job"]
    assert [kind for kind, _ in events] == ["job", "job", "exit"]
    assert len({ident for _, ident in events}) == 1
    assert events[0][1] != threading.get_ident()


async def test_a_failing_on_thread_exit_is_logged_and_close_still_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def on_exit() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="kvtrio.runtime.executor"):
        async with DedicatedThreadExecutor(name="hook-fails", on_thread_exit=on_exit) as ex:
            assert await ex.run(lambda: 7) == 7
    assert "executor 'hook-fails': on_thread_exit failed" in caplog.text
    assert "RuntimeError: boom" in caplog.text
