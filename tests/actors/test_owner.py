"""MlxOwner: MLX work runs on the owner thread only, and the guard catches any that does not."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.testing import mlx_thread_guard


def _library_eval(value: int) -> tuple[int, str]:
    """Stands in for kvtrio code: builds and evaluates an array, reports the thread."""
    import mlx.core as mx

    arr = mx.array([value, value])
    mx.eval(arr)
    total: Any = arr.sum().item()
    return int(total), threading.current_thread().name


async def test_dedicated_owner_runs_jobs_on_its_own_thread() -> None:
    """docs/design.md invariant 8: the owner's jobs, and their MLX calls, run on its thread."""
    async with MlxOwner.dedicated(name="mlx-owner-test") as owner:
        with mlx_thread_guard(owner.is_owner_thread) as guard:
            total, thread = await owner.run(_library_eval, 21)
        assert not owner.is_owner_thread()
    assert (total, thread) == (42, "mlx-owner-test")
    assert guard.violations == [] and guard.calls >= 2


async def test_guard_fails_an_mlx_call_from_a_worker_thread() -> None:
    """The guard of docs/design.md invariant 8 fails a call made on a worker thread."""
    async with MlxOwner.dedicated() as owner:
        with mlx_thread_guard(owner.is_owner_thread) as guard:
            with pytest.raises(AssertionError, match=r"^MLX call off the owner thread: mx\.array"):
                await trio.to_thread.run_sync(_library_eval, 1)
    assert guard.violations and guard.violations[0].startswith("mx.array on thread ")


async def test_owner_jobs_run_in_fifo_order() -> None:
    """Jobs run one at a time in call order, so model steps and snapshots never race."""
    order: list[int] = []
    async with MlxOwner.dedicated() as owner, trio.open_nursery() as nursery:
        for n in range(6):
            nursery.start_soon(owner.run, order.append, n)
            await trio.sleep(0.001)
    assert order == list(range(6))


async def test_inline_owner_runs_on_the_trio_thread(autojump_clock: trio.abc.Clock) -> None:
    async with MlxOwner.inline() as owner:
        with mlx_thread_guard(owner.is_owner_thread) as guard:
            total, thread = await owner.run(_library_eval, 2)
    assert (total, thread) == (4, threading.current_thread().name)
    assert guard.violations == []
