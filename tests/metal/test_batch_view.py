"""The batch view over one BlockPool and its dispatch, on the CPU.

- The per-sequence reference path (gather + sdpa per sequence) is the batch's reference.
- The direct path's host side (kernel table, work items across the batch, grid, output
  layouts, the batched merge) runs against :mod:`tests.metal.emulated_backend`, which
  computes what the kernels promise; the real kernels are checked against the same
  reference on a GPU (tests/metal/test_direct_gpu.py).
- BatchPagedKVCache runs an mlx-lm llama's batched decode step: its logits equal each
  sequence decoded alone.
- Dispatch: the CPU takes the reference; Metal is opt-in; an unmeasured backend runs the
  self-check once and falls back to the reference with one warning when it fails.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import attrs
import mlx.core as mx
import pytest
from kvtrio.metal import attention
from kvtrio.metal.attention import (
    BatchPagedAttentionView,
    KernelTuning,
    PagedAttentionView,
    direct_backend,
    self_check,
)
from kvtrio.metal.cache import BatchPagedKVCache, PagedKVCache, make_paged_cache
from kvtrio.metal.pool import BlockPool
from mlx_lm.models import llama

from .emulated_backend import EmulatedBackend

BLOCK = 16


pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no backend checked and Metal not allowed."""
    monkeypatch.setattr(attention, "_checked", {})
    monkeypatch.setattr(attention, "_allow_unmeasured", False)


def _batch(
    rng: random.Random, lengths: list[int], kv_heads: int, dim: int, dtype: mx.Dtype,
    bits: int | None = None,
) -> BatchPagedAttentionView:
    """A pool holding ``lengths`` random sequences in shuffled blocks (plus spare blocks)."""
    counts = [-(-x // BLOCK) for x in lengths]
    pool = BlockPool(sum(counts) + 5, kv_heads, BLOCK, dim, dtype=dtype, bits=bits,
                     group_size=32)
    order = [pool.allocate() for _ in range(sum(counts) + 5)]
    rng.shuffle(order)
    tables, at = [], 0
    for length, count in zip(lengths, counts, strict=True):
        table = order[at: at + count]
        at += count
        positions = range(length)
        pool.write([table[p // BLOCK] for p in positions], [p % BLOCK for p in positions],
                   mx.random.normal((1, kv_heads, length, dim)).astype(dtype),
                   mx.random.normal((1, kv_heads, length, dim)).astype(dtype))
        tables.append(table)
    return BatchPagedAttentionView.capture(pool, tables, lengths)


def _relative_error(got: mx.array, want: mx.array) -> float:
    got32 = got.astype(mx.float32)
    assert not mx.isnan(got32).any().item()
    return float(mx.linalg.norm((got32 - want).reshape(-1)) / mx.linalg.norm(want.reshape(-1)))


# -- the reference path -----------------------------------------------------------------------


def test_batch_reference_is_each_sequence_alone() -> None:
    rng = random.Random(1)
    view = _batch(rng, [5, 40, 17], kv_heads=2, dim=32, dtype=mx.float32)
    queries = mx.random.normal((3, 8, 1, 32))
    got = view.attend_reference(queries, 0.2)
    assert got.shape == (3, 8, 1, 32)
    for b in range(3):
        keys, values = view.sequence(b).gather()
        assert keys.shape == (1, 2, view.lengths[b], 32)
        want = mx.fast.scaled_dot_product_attention(queries[b: b + 1], keys, values, scale=0.2)
        assert mx.array_equal(got[b: b + 1], want).item()


def test_batch_reference_quantized_and_causal() -> None:
    rng = random.Random(2)
    view = _batch(rng, [33, 7], kv_heads=1, dim=64, dtype=mx.float16, bits=8)
    queries = mx.random.normal((2, 4, 3, 64)).astype(mx.float16)
    got = view.attend_reference(queries, 0.125, "causal")
    for b in range(2):
        want = view.sequence(b).attend_reference(queries[b: b + 1], 0.125, "causal")
        assert mx.array_equal(got[b: b + 1], want).item()
    exact = view.attend_reference(queries, 0.125, "causal", upcast=True)
    assert exact.dtype == mx.float32
    assert _relative_error(got, exact) < 2e-2


def test_capture_rejects_short_tables_and_trims_long_ones() -> None:
    pool = BlockPool(8, 1, BLOCK, 32, dtype=mx.float32)
    with pytest.raises(ValueError, match="cannot hold"):
        BatchPagedAttentionView.capture(pool, [[0]], [17])
    view = BatchPagedAttentionView.capture(pool, [[0, 1, 2], [3]], [17, 0])
    assert view.block_tables == ((0, 1), ())
    queries = mx.zeros((2, 2, 1, 32))
    assert not view.uses_direct(queries, None)  # an empty sequence takes the reference
    wide = BlockPool(8, 1, BLOCK, 64, dtype=mx.float32)
    view = BatchPagedAttentionView.capture(wide, [[0, 1, 2], [3]], [17, 3])
    assert view.uses_direct(mx.zeros((2, 2, 3, 64)), "causal")
    assert not view.uses_direct(mx.zeros((2, 2, 4, 64)), "causal")  # 4 queries, 3 tokens


# -- the kernel table -------------------------------------------------------------------------


def test_kernel_table_layout() -> None:
    pool = BlockPool(16, 1, BLOCK, 32, dtype=mx.float32)
    view = BatchPagedAttentionView.capture(pool, [[4, 5, 6], [9]], [40, 3])
    listed = view.kernel_table(32).tolist()
    assert isinstance(listed, list)
    table = [int(x) for x in listed]  # type: ignore[arg-type]
    # [P, B, W, (length, blocks_at, first_item) x B, item -> sequence x W, blocks...]
    assert table[:3] == [32, 2, 3]
    assert table[3:9] == [40, 12, 0, 3, 15, 2]
    assert table[9:12] == [0, 0, 1]
    assert table[12:] == [4, 5, 6, 9]
    assert view.kernel_table(32) is view.kernel_table(32)  # built once per item size


def test_part_tokens_fill_the_gpu_and_respect_the_merge_limit() -> None:
    pool = BlockPool(2, 1, BLOCK, 32, dtype=mx.float32)
    tuning = KernelTuning()
    short = BatchPagedAttentionView.capture(pool, [[0]] * 4, [10] * 4)
    assert short.part_tokens(8, 128, 264, tuning) == 128  # at least min_part_tokens
    long = BatchPagedAttentionView.capture(pool, [[0]], [0])
    long = attrs.evolve(long, lengths=(2_000_000,), block_tables=((0,) * 125_000,))
    part = long.part_tokens(8, 128, 264, tuning)
    assert part % 128 == 0 and -(-2_000_000 // part) <= 1024
    mixed = attrs.evolve(long, lengths=(1000, 30000, 5000), block_tables=((0,),) * 3)
    part = mixed.part_tokens(8, 128, 264 * 4, tuning)
    items = sum(-(-x // part) for x in mixed.lengths)
    assert 8 * items >= 264  # the batch's items fill at least one wave of blocks


# -- the direct path's host side, against the emulated kernels ----------------------------------

TUNINGS = [
    KernelTuning(min_part_tokens=16, mma_blocks=64, mma_warps=1),
    KernelTuning(min_part_tokens=16, mma_blocks=64, mma_warps=2, mma_tiles=2, batch_waves=1),
    KernelTuning(mma=False, min_part_tokens=16, target_blocks=64, warps=2),
    KernelTuning(mma=False, rows=2, unroll=2, min_part_tokens=16, target_blocks=16),
    KernelTuning(min_part_tokens=16, mma_blocks=64, mma_warps=1, fused_merge=True),
]


@pytest.mark.parametrize("seed", range(6))
def test_emulated_direct_matches_per_sequence_reference(seed: int) -> None:
    """Random batches: B 1..6, lengths 1..300 (shuffled blocks), GQA 1/4/8, n 1..8."""
    rng = random.Random(seed)
    mx.random.seed(seed)
    batch = rng.randint(1, 6)
    lengths = [rng.randint(1, 300) for _ in range(batch)]
    kv_heads = rng.choice([1, 2])
    ratio = rng.choice([1, 4, 8])
    n = rng.choice([1, 1, 2, 5, 8])
    dim = rng.choice([64, 128])
    dtype, bits = rng.choice([(mx.float16, None), (mx.float32, None), (mx.float16, 4)])
    view = _batch(rng, lengths, kv_heads, dim, dtype, bits)
    queries = mx.random.normal((batch, kv_heads * ratio, n, dim)).astype(dtype)
    mask = "causal" if n > 1 else None
    assert view.uses_direct(queries, mask)
    want = view.attend_reference(queries, dim**-0.5, mask, upcast=True)
    backend = EmulatedBackend()
    for tuning in TUNINGS:
        got = view.attend_direct(queries, dim**-0.5, mask, backend, tuning)  # type: ignore[arg-type]
        assert got.shape == queries.shape and got.dtype == queries.dtype
        assert _relative_error(got, want) < (1e-5 if dtype == mx.float32 else 2e-3)
    if bits is not None:
        assert set(backend.calls) == {"partial_q", "merge"}
    elif dtype == mx.float16:  # tensor cores, then the scalar tunings, then fused
        assert set(backend.calls) == {"partial_mma", "partial", "merge", "partial_mma_fused"}
    else:
        assert set(backend.calls) == {"partial", "merge"}


def test_single_view_direct_is_a_batch_of_one() -> None:
    rng = random.Random(9)
    batch = _batch(rng, [77], kv_heads=2, dim=64, dtype=mx.float32)
    single = batch.sequence(0)
    assert isinstance(single, PagedAttentionView) and single.as_batch().lengths == (77,)
    queries = mx.random.normal((1, 8, 1, 64))
    backend = EmulatedBackend()
    got = single.attend_direct(queries, 0.125, None, backend)  # type: ignore[arg-type]
    want = single.attend_reference(queries, 0.125)
    assert _relative_error(got, want) < 1e-5


# -- BatchPagedKVCache through an mlx-lm llama -----------------------------------------------


def _model() -> Any:
    mx.random.seed(7)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
        head_dim=32,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


PROMPTS = [[3, 17, 42, 8, 99], [5, 61, 23, 77, 12, 4, 56, 31, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9],
           [44]]


def _prefilled(model: Any, pools: list[BlockPool]) -> list[list[PagedKVCache]]:
    """Per sequence, per layer: a paged cache holding that sequence's prompt."""
    sequences = []
    for prompt in PROMPTS:
        caches = [make_paged_cache(p) for p in pools]
        mx.eval(model(mx.array([prompt]), cache=caches))
        sequences.append(caches)
    return sequences


@pytest.mark.parametrize("drop_in", [False, True])
def test_batched_decode_step_equals_each_sequence_alone(drop_in: bool) -> None:
    model = _model()
    pools = [BlockPool(64, 2, 4, 32, dtype=mx.float32) for _ in range(2)]
    sequences = _prefilled(model, pools)
    step = mx.array([[11], [12], [13]])
    alone = []
    for b, caches in enumerate(sequences):
        forks = [c.fork() for c in caches]
        alone.append(model(step[b: b + 1], cache=forks)[0, -1])
    batch = [BatchPagedKVCache.of([seq[layer] for seq in sequences]) for layer in range(2)]
    assert batch[0].offset.tolist() == [len(p) for p in PROMPTS]
    if drop_in:
        with attention.use_paged_attention(llama):
            logits = model(step, cache=batch)
    else:
        logits = model(step, cache=batch)
    assert batch[0].lengths == [len(p) + 1 for p in PROMPTS]
    for b in range(3):
        assert mx.allclose(logits[b, -1], alone[b], atol=1e-4).item()


def test_batch_cache_membership_trim_and_bytes() -> None:
    pool = BlockPool(32, 1, 4, 32, dtype=mx.float32)
    batch = BatchPagedKVCache.empty_batch(pool, 3)
    batch.update_and_fetch(mx.random.normal((3, 1, 6, 32)), mx.random.normal((3, 1, 6, 32)))
    assert batch.lengths == [6, 6, 6] and batch.nbytes == 6 * pool.block_nbytes
    keys, _ = batch.update_and_fetch(mx.random.normal((3, 1, 1, 32)),
                                     mx.random.normal((3, 1, 1, 32)))
    assert keys.shape == (3, 1, 7, 32)
    dropped = batch.filter([2, 0])
    assert len(dropped) == 1 and dropped[0].offset == 7 and len(batch.caches) == 2
    dropped[0].release()
    other = PagedKVCache(pool)
    other.update_and_fetch(mx.random.normal((1, 1, 2, 32)), mx.random.normal((1, 1, 2, 32)))
    batch.extend([other])
    assert batch.lengths == [7, 7, 2]
    keys, _ = batch.keys_and_values()
    assert keys.shape == (3, 1, 7, 32)
    assert mx.array_equal(keys[2, :, 5:], other.keys_and_values()[0][0]).item()
    assert not mx.any(keys[2, :, :5]).item()  # left padding
    mask = batch.make_mask(1)
    assert mask.shape == (3, 1, 1, 8) and mask[2, 0, 0].tolist() == [False] * 5 + [True] * 3
    assert batch.trim(3) == 2 and batch.lengths == [5, 5, 0]
    with pytest.raises(ValueError, match="same pool"):
        batch.extend([PagedKVCache(BlockPool(4, 1, 4, 32))])
    batch.release()
    assert pool.statistics().used_blocks == 0


# -- dispatch and the self-check --------------------------------------------------------------


def test_cpu_takes_the_reference_and_metal_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    assert direct_backend() is None  # the CPU
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert direct_backend() is None  # Metal kernels have not run on Apple hardware
    attention.allow_unmeasured_direct()
    backend = direct_backend()
    assert backend is not None and backend.__name__ == "kvtrio.metal.kernels_metal"
    attention.allow_unmeasured_direct(False)
    assert direct_backend() is None


def _use(monkeypatch: pytest.MonkeyPatch, backend: EmulatedBackend) -> None:
    monkeypatch.setattr(attention, "direct_backend", lambda: backend)


def test_measured_backend_is_used_without_a_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = EmulatedBackend("cuda")
    _use(monkeypatch, backend)
    view = _batch(random.Random(3), [20, 9], kv_heads=1, dim=64, dtype=mx.float32)
    view.attend(mx.random.normal((2, 4, 1, 64)), 0.125)
    assert backend.calls == ["partial_mma", "merge"] or backend.calls == ["partial", "merge"]


def test_unmeasured_backend_self_checks_once_then_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = EmulatedBackend("apple")
    _use(monkeypatch, backend)
    view = _batch(random.Random(4), [20, 9], kv_heads=1, dim=64, dtype=mx.float32)
    queries = mx.random.normal((2, 4, 1, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = view.attend(queries, 0.125)
        checks = len(backend.calls)
        assert checks > 2  # the self-check's cases ran first
        view.attend(queries, 0.125)
    assert len(backend.calls) == checks + 2  # then one partial + one merge per call
    assert _relative_error(got, view.attend_reference(queries, 0.125)) < 1e-5


@pytest.mark.parametrize("fault", ["wrong", "broken"])
def test_failed_self_check_warns_once_and_keeps_the_reference(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    backend = EmulatedBackend("apple", wrong=fault == "wrong", broken=fault == "broken")
    _use(monkeypatch, backend)
    view = _batch(random.Random(5), [20], kv_heads=1, dim=64, dtype=mx.float32)
    queries = mx.random.normal((1, 4, 1, 64))
    with pytest.warns(RuntimeWarning, match="failed its self-check") as caught:
        got = view.attend(queries, 0.125)
    assert len(caught) == 1
    assert mx.array_equal(got, view.attend_reference(queries, 0.125)).item()
    calls = len(backend.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        view.sequence(0).attend(queries, 0.125)  # no second check, no second warning
    assert len(backend.calls) == calls


def test_self_check_passes_on_the_emulated_kernels() -> None:
    assert self_check(EmulatedBackend("x"))  # type: ignore[arg-type]
