"""Kept launches replayed through ``mx.compile`` (kvtrio.metal.launch, on the CPU).

A kept launch's second call traces its kernel calls once; later calls replay the trace
without calling the kernels from Python. A stand-in whose kernels are MLX operations can be
traced, so these tests see the replay; the numpy stand-in cannot (and does not say it can,
so it never sees a trace), and one that claims it can shows the fallback.
"""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import attrs
import mlx.core as mx
import pytest
from kvtrio.metal.attention import BatchPagedAttentionView, KernelTuning
from kvtrio.metal.launch import LaunchMode

from .emulated_backend import EmulatedBackend
from .test_batch_view import _batch

TUNING = KernelTuning(min_part_tokens=16, mma_blocks=64, mma_warps=1)
PLAIN = attrs.evolve(TUNING, compiled_launch=False)

pytestmark = pytest.mark.usefixtures("on_cpu")


class _Traceable:
    """Kernels made of MLX operations (not attention): outputs that depend on every input
    array, so a replay that dropped or reordered one would give another result."""

    NAME = "traceable"
    TENSOR_CORES = True
    FUSED_MERGE = False
    TRACEABLE = True

    def __init__(self) -> None:
        self.invoked: list[str] = []

    def partial_mma(self) -> Any:
        def run(*, inputs: list[mx.array], output_shapes: list[tuple[int, ...]],
                output_dtypes: list[mx.Dtype], **_: Any) -> list[mx.array]:
            self.invoked.append("partial")
            q, keys, values, table = inputs[:4]
            x = (q.astype(mx.float32).sum() * 3 + keys.astype(mx.float32)[0].sum()
                 - values.astype(mx.float32)[-1].sum() + table.sum())
            return [mx.broadcast_to(x, output_shapes[0]).astype(output_dtypes[0]),
                    mx.zeros(output_shapes[1], dtype=output_dtypes[1])]
        return run

    def merge(self) -> Any:
        def run(*, inputs: list[mx.array], output_shapes: list[tuple[int, ...]],
                output_dtypes: list[mx.Dtype], **_: Any) -> list[mx.array]:
            self.invoked.append("merge")
            partials, normal, table = inputs
            x = partials.mean() + normal.sum() + table[0]
            return [mx.broadcast_to(x, output_shapes[0]).astype(output_dtypes[0])]
        return run


def _view(seed: int) -> BatchPagedAttentionView:
    return _batch(random.Random(seed), [70, 5, 129], kv_heads=2, dim=64, dtype=mx.float16)


def _call(view: BatchPagedAttentionView, queries: mx.array, backend: Any,
          tuning: KernelTuning) -> mx.array:
    return view.attend_direct(queries, 0.125, None, backend, tuning)


def _fresh(view: BatchPagedAttentionView) -> BatchPagedAttentionView:
    return BatchPagedAttentionView(
        arrays=view.arrays, lengths=view.lengths, block_tables=view.block_tables,
        block_size=view.block_size, bits=view.bits, group_size=view.group_size,
        direct=view.direct)


def test_a_kept_launch_replays_its_trace_from_the_second_call_with_the_plain_result() -> None:
    view = _view(1)
    backend = _Traceable()
    for step in range(4):
        queries = mx.random.normal((3, 8, 1, 64)).astype(mx.float16)
        got = _call(view, queries, backend, TUNING)
        plain = _call(_fresh(view), queries, _Traceable(), PLAIN)
        assert mx.array_equal(got, plain).item(), step
    (launch,) = view._launches.values()
    assert launch.mode == LaunchMode.COMPILED
    # call 1 plain, call 2 traced; calls 3 and 4 never reach the Python kernels
    assert backend.invoked == ["partial", "merge"] * 2


def test_a_view_called_once_is_never_traced() -> None:
    view = _view(2)
    backend = _Traceable()
    _call(view, mx.random.normal((3, 8, 1, 64)).astype(mx.float16), backend, TUNING)
    (launch,) = view._launches.values()
    assert launch.mode == LaunchMode.PLAIN and backend.invoked == ["partial", "merge"]


def test_compiled_launch_off_calls_the_kernels_every_time() -> None:
    view = _view(3)
    backend = _Traceable()
    for _ in range(3):
        _call(view, mx.random.normal((3, 8, 1, 64)).astype(mx.float16), backend, PLAIN)
    (launch,) = view._launches.values()
    assert launch.mode == LaunchMode.PLAIN and backend.invoked == ["partial", "merge"] * 3
    assert KernelTuning().compiled_launch is True
    off = KernelTuning(compiled_launch=False)
    assert KernelTuning.parse(off.text()) == off
    assert KernelTuning.parse("4,4,4,1,1024,-1,8,264,1,1,4,0,0").compiled_launch is False


class _ClaimsTraceable(EmulatedBackend):
    TRACEABLE = True


def test_an_untraceable_launch_keeps_the_plain_calls_and_their_result() -> None:
    """The numpy stand-in reads its inputs' values, which a trace cannot: a backend that
    says it is traceable and is not falls back to plain calls once, for good, with the
    result of a launch that never tried."""
    view = _view(4)
    backend = _ClaimsTraceable()
    for step in range(3):
        queries = mx.random.normal((3, 8, 1, 64)).astype(mx.float16)
        got = _call(view, queries, backend, TUNING)
        assert mx.array_equal(got, _call(_fresh(view), queries, EmulatedBackend(),
                                         PLAIN)).item(), step
    (launch,) = view._launches.values()
    assert launch.mode == LaunchMode.UNTRACEABLE
    backend.calls.clear()
    _call(view, mx.random.normal((3, 8, 1, 64)).astype(mx.float16), backend, TUNING)
    assert backend.calls == ["partial_mma", "merge"]


def test_a_stand_in_that_is_not_traceable_is_never_traced() -> None:
    view = _view(6)
    backend = EmulatedBackend()
    for _ in range(3):
        _call(view, mx.random.normal((3, 8, 1, 64)).astype(mx.float16), backend, TUNING)
    (launch,) = view._launches.values()
    assert launch.mode == LaunchMode.PLAIN and backend.calls == ["partial_mma", "merge"] * 3


def test_a_kernel_error_still_reaches_the_caller() -> None:
    view = _view(5)
    broken = _ClaimsTraceable(broken=True)
    for _ in range(3):
        with pytest.raises(Exception, match="does not build"):
            _call(view, mx.random.normal((3, 8, 1, 64)).astype(mx.float16), broken, TUNING)


def test_a_dropped_compiled_launch_frees_its_view_arrays() -> None:
    """The replay holds the kernel calls, not the launch: dropping the view frees the launch
    (and the pool arrays it holds) with no cycle through MLX's compiled function."""
    view = _view(7)
    backend = _Traceable()
    for _ in range(3):
        _call(view, mx.random.normal((3, 8, 1, 64)).astype(mx.float16), backend, TUNING)
    (launch,) = view._launches.values()
    assert launch.mode == LaunchMode.COMPILED
    gone = weakref.ref(launch)
    gc.disable()  # freed by reference counting alone, not by a later cycle collection
    try:
        del view, launch
        assert gone() is None
    finally:
        gc.enable()
