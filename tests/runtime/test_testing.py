"""The public test kit: Trace timestamps, FaultPlan counting, run_scenario determinism."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing
from kvtrio.runtime.offload import CancelToken
from kvtrio.runtime.testing import FaultPlan, Scenario, Trace, run_scenario
from kvtrio.tests.runtime.helpers import Add, Counter, Get, Sleep


async def test_trace_records_actor_message_type_and_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    trace = Trace()
    async with Scenario(clock=autojump_clock, trace=trace).system() as system:
        ref = await system.spawn(Counter(), name="c")
        await ref.tell(Sleep(2.5))
        await ref.tell(Add(1))
        assert await ref.ask(Get) == 1
    assert [(e.actor, e.message_type, e.at) for e in trace.handled()] == [
        ("c", "Sleep", 0.0),
        ("c", "Add", 2.5),
        ("c", "Get", 2.5),
    ]
    assert trace.format().splitlines()[1] == "t=2.500 c handled Add"


def test_fault_plan_fails_the_nth_call_only() -> None:
    """The plan counts every call and raises only on the planned one(s)."""
    plan = FaultPlan().fail("fsync", on_call=2, error=OSError(5, "EIO")).fail(
        "rename", on_call=1, times=2
    )
    plan("fsync")
    with pytest.raises(OSError, match=r"^\[Errno 5\] EIO$"):
        plan("fsync")
    plan("fsync")
    for _ in range(2):
        with pytest.raises(OSError, match=r"^\[Errno 5\] injected fault: rename$"):
            plan("rename")
    plan("rename")
    assert (plan.calls("fsync"), plan.calls("rename"), plan.calls("write")) == (3, 3, 0)


def test_fault_plan_delays_sync_calls_with_time_sleep() -> None:
    plan = FaultPlan().delay("write", on_call=1, seconds=0.02)
    start = time.monotonic()
    plan("write")
    assert time.monotonic() - start >= 0.02


async def test_fault_plan_is_usable_from_a_worker_thread_job() -> None:
    """Storage code calls plan(op) from worker threads, knowing nothing of the runtime."""
    from kvtrio.runtime.offload import ThreadOffload

    plan = FaultPlan().fail("read", on_call=2)

    def job(token: CancelToken) -> int:
        for _ in range(3):
            plan("read")
        return 0

    with pytest.raises(OSError, match=r"^\[Errno 5\] injected fault: read$"):
        await ThreadOffload(1).run(job)
    assert plan.calls("read") == 2


async def test_fault_plan_async_delay_is_exact_on_the_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    plan = FaultPlan().delay("flush", on_call=2, seconds=3.0)
    await plan.async_call("flush")
    assert trio.current_time() == 0.0
    await plan.async_call("flush")
    assert trio.current_time() == 3.0


def test_run_scenario_is_deterministic_and_uses_inline_executors() -> None:
    """Two runs of one scenario give the same trace, timestamps included, in no wall time."""

    async def scenario(kit: Scenario) -> tuple[list[tuple[str, str, float]], float]:
        assert await kit.executor.run(lambda: kit.executor.is_owner_thread())
        assert await kit.offload.run(lambda token, x: x * 2, 21) == 42
        async with kit.system(grace=600.0) as system:
            refs = [await system.spawn(Counter(), name=f"c{i}") for i in range(3)]
            async with trio.open_nursery() as nursery:
                for i, ref in enumerate(refs):
                    nursery.start_soon(ref.tell, Sleep(60.0 * (3 - i)))
        return [(e.actor, e.event, e.at) for e in kit.trace.events], trio.current_time()

    start = time.monotonic()
    first = run_scenario(scenario)
    assert first == run_scenario(scenario)
    assert time.monotonic() - start < 5.0
    events, finished_at = first
    assert sorted(events) == [(f"c{i}", "handled", 0.0) for i in range(3)]
    assert finished_at == 180.0  # the longest Sleep, drained on leaving the block
