"""The direct call's host side: what is kept between calls, and the fused merge's contract.

A view keeps, per call shape, everything of a direct call but its queries (kernels, template,
grid, output shapes, kernel table: ``BatchPagedAttentionView._launches``), so a repeated call
only hands new queries to the kept kernel calls. These run on the CPU against the numpy
stand-in of the kernels (tests/metal/emulated_backend.py); the GPU tests
(tests/metal/test_direct_gpu.py) hold the real kernels to the same contract.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from kvtrio.metal import kernels, kernels_cuda
from kvtrio.metal.attention import BatchPagedAttentionView, KernelTuning
from kvtrio.metal.cache import make_paged_cache
from kvtrio.metal.pool import BlockPool

from .emulated_backend import EmulatedBackend
from .test_batch_view import _batch, _relative_error

TUNING = KernelTuning(min_part_tokens=16, mma_blocks=64, mma_warps=1)
FUSED = KernelTuning(min_part_tokens=16, mma_blocks=64, mma_warps=1, fused_merge=True)


pytestmark = pytest.mark.usefixtures("on_cpu")


class _Counting(EmulatedBackend):
    """The stand-in, counting how often the host asks it for a kernel object."""

    def __init__(self) -> None:
        super().__init__("counting")
        self.asked = 0

    def partial_mma(self) -> Any:
        self.asked += 1
        return super().partial_mma()

    def partial_mma_fused(self) -> Any:
        self.asked += 1
        return super().partial_mma_fused()


def _direct(view: BatchPagedAttentionView, queries: mx.array, backend: Any,
            tuning: KernelTuning = TUNING, **kw: Any) -> mx.array:
    mask = "causal" if queries.shape[2] > 1 else None
    return view.attend_direct(queries, queries.shape[3] ** -0.5, mask, backend, tuning, **kw)


def _reference(view: BatchPagedAttentionView, queries: mx.array) -> mx.array:
    mask = "causal" if queries.shape[2] > 1 else None
    return view.attend_reference(queries, queries.shape[3] ** -0.5, mask, upcast=True)


def test_a_kept_launch_gives_the_uncached_result_for_new_queries() -> None:
    rng = random.Random(3)
    mx.random.seed(3)
    view = _batch(rng, [70, 5, 129], kv_heads=2, dim=64, dtype=mx.float16)
    backend = _Counting()
    for step in range(3):
        queries = mx.random.normal((3, 8, 2, 64)).astype(mx.float16)
        got = _direct(view, queries, backend)
        # the same call on a copy of the view with nothing kept
        fresh = BatchPagedAttentionView(
            arrays=view.arrays, lengths=view.lengths, block_tables=view.block_tables,
            block_size=view.block_size, bits=view.bits, group_size=view.group_size,
            direct=view.direct)
        uncached = _direct(fresh, queries, EmulatedBackend())
        assert mx.array_equal(got, uncached).item()
        assert _relative_error(got, _reference(view, queries)) < 2e-3
        assert len(view._launches) == 1 and backend.asked == 1, step  # built once


def test_each_call_shape_gets_its_own_launch() -> None:
    rng = random.Random(4)
    mx.random.seed(4)
    view = _batch(rng, [40, 90], kv_heads=1, dim=64, dtype=mx.float16)
    backend = _Counting()
    shapes = [(2, 4, 1, 64, mx.float16), (2, 4, 3, 64, mx.float16), (2, 8, 1, 64, mx.float16),
              (2, 4, 1, 64, mx.float32)]
    for *shape, dtype in shapes:
        queries = mx.random.normal(tuple(shape)).astype(dtype)
        got = _direct(view, queries, backend)
        assert got.shape == queries.shape and got.dtype == dtype
        assert _relative_error(got, _reference(view, queries)) < 2e-3
    _direct(view, mx.random.normal((2, 4, 1, 64)).astype(mx.float16), backend, FUSED)
    _direct(view, mx.random.normal((2, 4, 1, 64)).astype(mx.float16), backend,
            poison=float("nan"))
    assert len(view._launches) == len(shapes) + 2 and backend.asked == len(shapes) + 2


@pytest.mark.parametrize("change", ["length", "table", "dtype"])
def test_a_new_view_never_reuses_an_old_launch(change: str) -> None:
    """Views are immutable and keep their launches: after an append (new length), a fork's
    copy-on-write (new block table) or in another pool dtype, the new capture computes over
    its own tokens, not over what an earlier view's kept table or template said."""
    mx.random.seed(5)
    pool = BlockPool(64, 2, 16, 64, dtype=mx.float16)
    cache = make_paged_cache(pool)
    cache.update_and_fetch(mx.random.normal((1, 2, 40, 64)).astype(mx.float16),
                           mx.random.normal((1, 2, 40, 64)).astype(mx.float16))
    backend = EmulatedBackend()
    queries = mx.random.normal((1, 8, 1, 64)).astype(mx.float16)
    old = cache.attention_view().as_batch()
    before = _direct(old, queries, backend)
    if change == "length":
        cache.update_and_fetch(mx.random.normal((1, 2, 30, 64)).astype(mx.float16),
                               mx.random.normal((1, 2, 30, 64)).astype(mx.float16))
        new = cache.attention_view().as_batch()
        assert new.lengths == (70,)
    elif change == "table":
        fork = cache.fork()  # shares the blocks: the write below copies the last one
        cache.trim(1)
        cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)).astype(mx.float16),
                               mx.random.normal((1, 2, 1, 64)).astype(mx.float16))
        new = cache.attention_view().as_batch()
        assert new.lengths == old.lengths and new.block_tables != old.block_tables
        fork.release()
    else:
        other = BlockPool(64, 2, 16, 64, dtype=mx.float32)
        copy = make_paged_cache(other)
        keys, values = cache.keys_and_values()
        copy.update_and_fetch(keys.astype(mx.float32), values.astype(mx.float32))
        new = copy.attention_view().as_batch()
    got = _direct(new, queries, backend)
    assert _relative_error(got, _reference(new, queries)) < 2e-3
    assert _relative_error(before, _reference(old, queries)) < 2e-3
    if change != "dtype":
        assert not mx.allclose(got, before).item()


@pytest.mark.parametrize("seed", range(4))
def test_the_fused_merge_is_one_launch_with_the_two_launches_result(seed: int) -> None:
    rng = random.Random(seed)
    mx.random.seed(seed)
    batch = rng.randint(1, 5)
    lengths = [rng.randint(8, 300) for _ in range(batch)]
    n = rng.choice([1, 2, 8])
    dtype = rng.choice([mx.float16, mx.bfloat16])
    view = _batch(rng, lengths, kv_heads=2, dim=128, dtype=dtype)
    queries = mx.random.normal((batch, 2 * rng.choice([1, 4]), n, 128)).astype(dtype)
    backend = EmulatedBackend()
    two = _direct(view, queries, backend)
    assert backend.calls == ["partial_mma", "merge"]
    for poison in (None, float("nan")):
        backend.calls.clear()
        one = _direct(view, queries, backend, FUSED, poison=poison)
        assert backend.calls == ["partial_mma_fused"]
        assert mx.array_equal(one, two).item()


def test_the_fused_merge_is_off_by_default_and_cuda_only() -> None:
    assert KernelTuning().fused_merge is False
    assert kernels_cuda.FUSED_MERGE is True
    from kvtrio.metal import kernels_metal

    assert kernels_metal.FUSED_MERGE is False
    view = _batch(random.Random(1), [50], kv_heads=1, dim=64, dtype=mx.float16)
    queries = mx.random.normal((1, 4, 1, 64)).astype(mx.float16)
    assert view.uses_fused(FUSED, kernels_cuda)
    assert not view.uses_fused(FUSED, kernels_metal)
    assert not view.uses_fused(TUNING, kernels_cuda)
    scalar = KernelTuning(mma=False, fused_merge=True)
    assert not view.uses_fused(scalar, kernels_cuda)
    del queries
    on = KernelTuning(fused_merge=True)
    assert KernelTuning.parse(on.text()) == on
    assert KernelTuning.parse("4,4,4,1,1024,-1,8,264,1,1,4,1").fused_merge is True


def test_the_fused_body_renders_for_cuda_with_no_neutral_name_left() -> None:
    rendered = kernels_cuda.PARTIAL_MMA_FUSED_SOURCE
    assert rendered == kernels.render(kernels.PARTIAL_MMA_FUSED, "cuda")
    assert [n for n in kernels.NAMES if n in rendered] == []
    for helper in ("kvt_fence_device", "kvt_count"):
        assert f"{helper}(" in kernels_cuda.HEADER_MMA_FUSED
