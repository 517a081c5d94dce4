"""Paged attention: the reference path and the direct split-K decode kernel, with dispatch.

An attention view is captured from one sequence (:meth:`PagedKVCache.attention_view`) or a
batch of sequences of one pool (:meth:`BatchPagedKVCache.attention_view`): the pool tensors as
they are now, the block tables and the lengths. A view is immutable: later appends,
copy-on-write or retiring a sequence replace the pool's arrays and never touch the ones the
view holds.

``attend`` picks a path per call:

- direct (the split-K kernel reading blocks in place, one launch for the whole batch) on a
  GPU for at most :data:`DIRECT_MAX_QUERIES` queries per sequence without an array mask, when
  the shapes fit the kernel (:func:`direct_backend` says which GPUs: CUDA always; Metal only
  after :func:`allow_unmeasured_direct`, and a backend not yet measured on hardware passes a
  self-check against the reference path on first use, or the process keeps the reference);
- the reference path otherwise (always on the CPU): per sequence, gather the blocks in token
  order, then ``mx.fast.scaled_dot_product_attention`` (mlx-lm's quantized attention for
  quantized pools), which is exactly what mlx-lm computes on a ``KVCache``/``QuantizedKVCache``.
"""

from __future__ import annotations

import contextlib
import struct
import warnings
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np
from kvtrio.metal.launch import Launch
from kvtrio.metal.tuning import DEFAULT_TUNING, KernelTuning
from mlx_lm.models import base as mlx_base

if TYPE_CHECKING:
    from kvtrio.metal.pool import BlockPool

__all__ = [
    "DEFAULT_TUNING",
    "DIRECT_MAX_QUERIES",
    "MEASURED_BACKENDS",
    "BatchPagedAttentionView",
    "KernelTuning",
    "PagedAttentionView",
    "allow_unmeasured_direct",
    "direct_backend",
    "scaled_dot_product_attention",
    "self_check",
    "use_paged_attention",
]

DIRECT_MAX_QUERIES = 8
# Partitions of one sequence the merge kernel accepts (its shared weights); longer contexts
# get longer parts.
_MAX_PARTS = 1024
# Backends whose direct kernels ran and passed tests/metal/test_direct_gpu.py on hardware
# (CUDA: an NVIDIA H200). Any other backend is used only after it passes :func:`self_check`.
MEASURED_BACKENDS = frozenset({"cuda"})


_LOG2E = 1.4426950408889634

# -- which backend, and whether to trust it ------------------------------------------------

_allow_unmeasured = False
_checked: dict[str, bool] = {}


def allow_unmeasured_direct(enabled: bool = True) -> None:
    """Let :func:`direct_backend` pick backends not in :data:`MEASURED_BACKENDS` (Metal).

    Off by default, since the Metal kernels have not run on Apple hardware. When on, the
    first direct call per process and backend runs :func:`self_check`; a failure warns once
    and keeps the reference path for the rest of the process.
    """
    global _allow_unmeasured
    _allow_unmeasured = enabled


def direct_backend() -> ModuleType | None:
    """The kernel module for the default device, or None (the CPU; Metal unless allowed)."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.cuda.is_available():
        from kvtrio.metal import kernels_cuda

        return kernels_cuda
    if mx.metal.is_available() and _allow_unmeasured:
        from kvtrio.metal import kernels_metal

        return kernels_metal
    return None


def _trusted(backend: ModuleType) -> bool:
    """Whether ``backend``'s direct kernels may serve calls (self-checked once if unmeasured)."""
    name = str(backend.NAME)
    if name in MEASURED_BACKENDS:
        return True
    if name not in _checked:
        _checked[name] = self_check(backend)
    return _checked[name]


# Relative-error bounds of the self-check against the float32 reference (see
# tests/metal/test_direct_gpu.py for where they come from).
_CHECK_TOLERANCE = {mx.float16: 4e-3, mx.float32: 1e-3}
# (kv heads, GQA ratio, head dim, lengths of the batch, queries per sequence, pool dtype)
_CHECK_CASES = [
    (2, 4, 64, (37,), 1, mx.float16),
    (1, 8, 128, (300,), 1, mx.float32),
    (2, 2, 128, (70, 5, 129), 3, mx.float16),
    (1, 4, 64, (17, 200), 1, mx.float32),
]


def self_check(backend: ModuleType, tuning: KernelTuning | None = None) -> bool:
    """Run ``backend``'s direct kernels against the reference path on small random inputs
    (a few shapes and batches, float16 and float32); True when every case agrees within
    ``_CHECK_TOLERANCE``. A failure or an error (a kernel that does not compile) warns once,
    naming the case, and returns False."""
    from kvtrio.metal.pool import BlockPool

    name = str(backend.NAME)
    for kv_heads, ratio, dim, lengths, n, dtype in _CHECK_CASES:
        case = f"kv_heads={kv_heads} ratio={ratio} dim={dim} lengths={lengths} n={n} {dtype}"
        try:
            block_size = 16
            pool = BlockPool(sum(-(-x // block_size) for x in lengths) + 2, kv_heads,
                             block_size, dim, dtype=dtype)
            tables = []
            for length in lengths:
                table = [pool.allocate() for _ in range(-(-length // block_size))]
                positions = range(length)
                pool.write(
                    [table[p // block_size] for p in positions],
                    [p % block_size for p in positions],
                    mx.random.normal((1, kv_heads, length, dim)).astype(dtype),
                    mx.random.normal((1, kv_heads, length, dim)).astype(dtype),
                )
                tables.append(table)
            view = BatchPagedAttentionView.capture(pool, tables, lengths)
            queries = mx.random.normal((len(lengths), kv_heads * ratio, n, dim)).astype(dtype)
            mask = "causal" if n > 1 else None
            got = view.attend_direct(queries, dim**-0.5, mask, backend, tuning or DEFAULT_TUNING)
            want = view.attend_reference(queries.astype(mx.float32), dim**-0.5, mask,
                                         upcast=True)
            mx.eval(got, want)
            got32 = got.astype(mx.float32)
            error = float(mx.linalg.norm((got32 - want).reshape(-1))
                          / mx.linalg.norm(want.reshape(-1)))
            if not error <= _CHECK_TOLERANCE[dtype]:  # NaN fails too
                raise _SelfCheckMismatch(f"relative error {error:.2e}")
        except Exception as exc:  # a kernel that fails to build or run falls back too
            warnings.warn(
                f"kvtrio: the direct paged-attention kernel on {name} failed its self-check "
                f"({case}: {type(exc).__name__}: {exc}); this process uses the reference path",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
    return True


class _SelfCheckMismatch(Exception):
    """The direct kernel's output differs from the reference path's (self-check only)."""


# -- views ---------------------------------------------------------------------------------


def _gather(array: mx.array, blocks: mx.array, length: int) -> mx.array:
    """One sequence's rows of a pool tensor in token order, ``[1, heads, length, width]``."""
    heads, width = array.shape[1], array.shape[3]
    if length == 0:
        return mx.zeros((1, heads, 0, width), dtype=array.dtype)
    picked = mx.take(array, blocks, axis=0)
    flat = picked.transpose(1, 0, 2, 3).reshape(heads, -1, width)
    return flat[None, :, :length, :]


@attrs.frozen
class BatchPagedAttentionView:
    """B sequences of one pool at capture time, each read through its own block table.

    The direct kernel serves the whole batch in one launch (plus one merge launch): the
    sequences' partitions ("work items") are cut to one size and scheduled together, so
    short and long sequences fill the GPU at once. Costs on the host: capture copies the
    block tables once (O(total blocks)); each launch shape's kernel table is built once per
    view and kept.
    """

    arrays: tuple[mx.array, ...]  # keys, values (+ key scales, biases, value scales, biases)
    lengths: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    block_size: int
    bits: int | None
    group_size: int
    direct: bool
    _kernel_tables: dict[int, mx.array] = attrs.field(factory=dict, eq=False, repr=False)
    _launches: dict[tuple[Any, ...], Launch] = attrs.field(factory=dict, eq=False, repr=False)
    # Every block number of the tables, concatenated, when capture already made them an array
    _flat: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def capture(
        cls,
        pool: BlockPool,
        block_tables: Sequence[Sequence[int]],
        lengths: Sequence[int],
        direct: bool = True,
    ) -> BatchPagedAttentionView:
        if len(block_tables) != len(lengths):
            raise ValueError("one block table per sequence")
        tables = []
        for table, length in zip(block_tables, lengths, strict=True):
            needed = -(-length // pool.block_size)
            if length < 0 or len(table) < needed:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {length}")
            tables.append(tuple(table[:needed]))
        # stop_gradient gives new array objects sharing the buffers (no copy): the pool's
        # later writes rebind its own attributes, so these keep today's contents.
        return cls(
            arrays=tuple(mx.stop_gradient(a) for a in pool.arrays()),
            lengths=tuple(lengths),
            block_tables=tuple(tables),
            block_size=pool.block_size,
            bits=pool.bits,
            group_size=pool.group_size,
            direct=direct,
        )

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def kv_heads(self) -> int:
        return int(self.arrays[0].shape[1])

    def sequence(self, index: int) -> PagedAttentionView:
        """Sequence ``index`` alone, as a one-sequence view of the same arrays."""
        return PagedAttentionView(
            arrays=self.arrays,
            blocks=mx.array(self.block_tables[index], dtype=mx.int32),
            block_table=self.block_tables[index],
            length=self.lengths[index],
            block_size=self.block_size,
            bits=self.bits,
            group_size=self.group_size,
            direct=self.direct,
        )

    # -- attention ----------------------------------------------------------------------------

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of ``queries`` ``[B, q_heads, n, dim]``, sequence b over its own tokens
        (``mask`` None, or ``"causal"`` for the n queries being the last n tokens)."""
        backend = direct_backend()
        if backend is not None and self.uses_direct(queries, mask) and _trusted(backend):
            return self.attend_direct(queries, scale, mask, backend)
        return self.attend_reference(queries, scale, mask)

    def attend_reference(
        self, queries: mx.array, scale: float, mask: Any = None, *, upcast: bool = False
    ) -> mx.array:
        """Per sequence: gather, then the attention mlx-lm runs on a contiguous cache (with
        ``upcast``, on float32 keys and values, dequantized first: the accuracy reference)."""
        if queries.shape[0] != self.batch:
            raise ValueError(f"expected {self.batch} query rows, got {queries.shape}")
        outs = [
            self.sequence(b).attend_reference(queries[b : b + 1], scale, mask, upcast=upcast)
            for b in range(self.batch)
        ]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def uses_direct(self, queries: mx.array, mask: Any) -> bool:
        """Whether the direct kernel serves these shapes (device aside)."""
        batch, q_heads, n, dim = queries.shape
        per_word = 32 // self.bits if self.bits else 1
        k_dim = self.arrays[0].shape[3] * per_word
        v_dim = self.arrays[1].shape[3] * per_word
        return (
            self.direct
            and batch == self.batch >= 1
            and 1 <= n <= DIRECT_MAX_QUERIES
            # n queries are the sequence's last n tokens: a shorter sequence leaves some
            # query rows nothing to see (the reference path decides what that means)
            and min(self.lengths) >= n
            and (mask is None or isinstance(mask, str))
            and q_heads % self.kv_heads == 0
            and dim == k_dim == v_dim
            and dim in (64, 128)  # the head dims tested on hardware
            and (self.bits is None or (self.bits in (4, 8) and self.group_size % 8 == 0))
            and self.arrays[-1].dtype in (mx.float16, mx.bfloat16, mx.float32)
        )

    def uses_mma(self, tuning: KernelTuning, backend: ModuleType) -> bool:
        """Whether the direct kernel runs on tensor cores (float16/bfloat16 pools)."""
        wanted = tuning.mma if tuning.mma is not None else bool(backend.TENSOR_CORES)
        return (
            wanted
            and self.bits is None
            and self.arrays[0].dtype in (mx.float16, mx.bfloat16)
            and self.arrays[0].shape[3] % 32 == 0
        )

    def part_tokens(self, row_blocks: int, per_step: int, target_blocks: int,
                    tuning: KernelTuning) -> int:
        """Tokens per work item: enough items over the whole batch to give about
        ``target_blocks`` thread blocks, at most ``_MAX_PARTS`` items per sequence, whole
        kernel steps each."""
        wanted = max(1, target_blocks // row_blocks)
        tokens = max(
            -(-sum(self.lengths) // wanted),
            -(-max(self.lengths) // _MAX_PARTS),
            tuning.min_part_tokens,
        )
        return -(-tokens // per_step) * per_step

    def kernel_table(self, part: int) -> mx.array:
        """The kernel's table for items of ``part`` tokens (kvtrio.metal.kernels, point 1)."""
        table = self._kernel_tables.get(part)
        if table is None:
            lengths = np.array(self.lengths, dtype=np.int64)
            parts = -(-lengths // part)
            batch, items = len(lengths), int(parts.sum())
            counts = np.array([len(t) for t in self.block_tables], dtype=np.int64)
            blocks_at = 3 + 3 * batch + items + np.concatenate([[0], np.cumsum(counts)[:-1]])
            first = np.concatenate([[0], np.cumsum(parts)[:-1]])
            flat = self._flat if self._flat is not None else np.concatenate(
                [np.array(t, dtype=np.int64) for t in self.block_tables])
            host = np.concatenate([
                np.array([part, batch, items]),
                np.stack([lengths, blocks_at, first], axis=1).reshape(-1),
                np.repeat(np.arange(batch), parts),
                flat,
            ])
            table = mx.array(host.astype(np.int32))
            self._kernel_tables[part] = table
        return table

    def uses_fused(self, tuning: KernelTuning, backend: ModuleType) -> bool:
        """Whether the tensor-core kernel merges in its own launch (KernelTuning.fused_merge,
        on a backend that has the fused kernel)."""
        return tuning.fused_merge and getattr(backend, "FUSED_MERGE", False) is True and \
            self.uses_mma(tuning, backend)

    def attend_direct(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        backend: ModuleType,
        tuning: KernelTuning = DEFAULT_TUNING,
        *,
        poison: float | None = None,
    ) -> mx.array:
        """The split-K kernel over the whole batch: partial softmax per work item, then a
        log-sum-exp merge per sequence (``poison`` pre-fills every output, for tests that
        check each element is written).

        Everything of a call but its queries (kernels, template, grid, output shapes, the
        kernel table) is built once per view and call shape and kept (:class:`Launch`); a
        later call with the same shapes only hands the queries to the kept kernel calls, and
        from the second call on replays them through ``mx.compile``
        (``KernelTuning.compiled_launch``)."""
        key = (queries.shape, queries.dtype, scale, mask is not None, tuning, backend,
               None if poison is None else _float_bits(poison))
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launch(tuple(queries.shape), queries.dtype, scale, mask, backend,
                                  tuning, poison)
            self._launches[key] = launch
        return launch.run(queries)

    def _launch(self, shape: tuple[int, ...], dtype: mx.Dtype, scale: float, mask: Any,
                backend: ModuleType, tuning: KernelTuning, poison: float | None) -> Launch:
        """The kernel calls of :meth:`attend_direct` for one call shape, built."""
        _, q_heads, n, dim = shape
        kv_heads = self.kv_heads
        rows = (q_heads // kv_heads) * n
        scale_bits = _float_bits(scale * _LOG2E)
        causal = n > 1 and mask is not None
        waves = tuning.batch_waves if self.batch > 1 else 1
        if self.uses_mma(tuning, backend):
            # Tensor cores: blocks of 8 query rows (one mma tile), 16-token tiles per warp.
            warps = tuning.mma_warps
            chunks = -(-rows // 8)
            part = self.part_tokens(kv_heads * chunks, warps * 16 * tuning.mma_tiles,
                                    tuning.mma_blocks * waves, tuning)
            fused = self.uses_fused(tuning, backend)
            kernel = backend.partial_mma_fused() if fused else backend.partial_mma()
            template: list[tuple[str, Any]] = [
                ("HK", kv_heads), ("G", q_heads // kv_heads), ("N", n), ("D", dim),
                ("BS", self.block_size), ("WARPS", warps), ("TILES", tuning.mma_tiles),
                ("WIDE_L2", tuning.mma_wide_l2), ("CAUSAL", causal),
                ("SCALE_BITS", scale_bits),
            ]
        else:
            fused = False
            warps = tuning.warps
            rows_per_block = min(rows, tuning.rows)
            chunks = -(-rows // rows_per_block)
            unroll = tuning.unroll if rows_per_block <= 4 else min(tuning.unroll, 2)
            per_step = warps * (32 // (dim // 8)) * unroll
            part = self.part_tokens(kv_heads * chunks, per_step, tuning.target_blocks * waves,
                                    tuning)
            kernel = backend.partial(self.bits is not None)
            template = [
                ("HK", kv_heads), ("G", q_heads // kv_heads), ("N", n),
                ("D", dim), ("BS", self.block_size), ("RC", rows_per_block),
                ("WARPS", warps), ("U", unroll), ("PIPE", tuning.pipeline),
                ("CAUSAL", causal), ("SCALE_BITS", scale_bits),
            ]
            if self.bits is None:
                template.append(("T", self.arrays[0].dtype))
            else:
                template += [
                    ("BITS", self.bits), ("GS", self.group_size), ("T", self.arrays[2].dtype)
                ]
        table = self.kernel_table(part)
        # Kernel calls MLX can trace (the real backends' say so; a stand-in may not).
        compiled = tuning.compiled_launch and getattr(backend, "TRACEABLE", False) is True
        items = sum(-(-length // part) for length in self.lengths)
        hqn = q_heads * n
        grid = (32 * warps * items, kv_heads * chunks, 1)
        tail = (self.arrays[0], self.arrays[1], table, *self.arrays[2:])
        if fused:
            # One launch: the result, and a scratch of counters, partials and normalizers, all
            # filled with the init value the counters count up from (kernels, point 7).
            init = 0.0 if poison is None else poison
            counters = -(-(self.batch * kv_heads * chunks) // 4) * 4
            return Launch(
                partial=kernel,
                partial_kw={
                    "template": [*template, ("OutT", dtype), ("INIT_BITS", _float_bits(init))],
                    "grid": grid, "threadgroup": (32 * warps, 1, 1),
                    "output_shapes": [(self.batch, q_heads, n, dim),
                                      (counters + hqn * items * (dim + 2),)],
                    "output_dtypes": [dtype, mx.float32],
                    "init_value": init,
                },
                tail=tail, merge=None, merge_kw={},
                compiled=compiled,
            )
        split = 1024 // dim  # threads of a merge block that share one output element
        return Launch(
            partial=kernel,
            partial_kw={
                "template": template, "grid": grid, "threadgroup": (32 * warps, 1, 1),
                "output_shapes": [(hqn, items, dim), (hqn, items, 2)],
                "output_dtypes": [mx.float32, mx.float32], "init_value": poison,
            },
            tail=tail,
            merge=backend.merge(),
            merge_kw={
                "template": [("D", dim), ("J", split), ("MAX_PARTS", _MAX_PARTS), ("HQN", hqn),
                             ("OutT", dtype)],
                "grid": (dim, split * self.batch * hqn, 1), "threadgroup": (dim, split, 1),
                "output_shapes": [(self.batch, q_heads, n, dim)], "output_dtypes": [dtype],
                "init_value": poison,
            },
            compiled=compiled,
        )


def _float_bits(x: float) -> int:
    """The bits of ``x`` as a float32, as a signed int (a kernel's template constant)."""
    bits: int = struct.unpack("<i", struct.pack("<f", x))[0]
    return bits


@attrs.frozen
class PagedAttentionView:
    """One sequence's keys and values at capture time, read through its block table."""

    arrays: tuple[mx.array, ...]  # keys, values (+ key scales, biases, value scales, biases)
    blocks: mx.array  # int32 block numbers (the gather's index)
    block_table: tuple[int, ...]
    length: int
    block_size: int
    bits: int | None
    group_size: int
    direct: bool
    _batch: list[BatchPagedAttentionView] = attrs.field(factory=list, eq=False, repr=False)
    _host_table: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def capture(
        cls, pool: BlockPool, block_table: Sequence[int], length: int, direct: bool = True
    ) -> PagedAttentionView:
        table = tuple(block_table[: -(-length // pool.block_size)])
        # One conversion of the Python ints serves the gather's index and the kernel table
        # (each conversion of a 128k-token table costs hundreds of microseconds).
        host = np.array(table, dtype=np.int32)
        return cls(
            arrays=tuple(mx.stop_gradient(a) for a in pool.arrays()),
            blocks=mx.array(host),
            host_table=host,
            block_table=table,
            length=length,
            block_size=pool.block_size,
            bits=pool.bits,
            group_size=pool.group_size,
            direct=direct,
        )

    @property
    def kv_heads(self) -> int:
        return int(self.arrays[0].shape[1])

    def as_batch(self) -> BatchPagedAttentionView:
        """This sequence as a batch of one (the direct kernel's form), made once."""
        if not self._batch:
            self._batch.append(BatchPagedAttentionView(
                arrays=self.arrays, lengths=(self.length,), block_tables=(self.block_table,),
                block_size=self.block_size, bits=self.bits, group_size=self.group_size,
                direct=self.direct, flat=self._host_table,
            ))
        return self._batch[0]

    def gather(self) -> tuple[Any, Any]:
        """Keys and values in token order, ``[1, kv_heads, length, dim]`` (quantized: triples)."""
        parts = [_gather(a, self.blocks, self.length) for a in self.arrays]
        if self.bits is None:
            return parts[0], parts[1]
        return (parts[0], parts[2], parts[3]), (parts[1], parts[4], parts[5])

    # -- attention ----------------------------------------------------------------------------

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of ``queries`` ``[1, q_heads, n, dim]`` over the view's tokens."""
        backend = direct_backend()
        if backend is not None and self.uses_direct(queries, mask) and _trusted(backend):
            return self.attend_direct(queries, scale, mask, backend)
        return self.attend_reference(queries, scale, mask)

    def attend_reference(
        self, queries: mx.array, scale: float, mask: Any = None, *, upcast: bool = False
    ) -> mx.array:
        """Gather, then the attention mlx-lm runs on a contiguous cache (bit-exact with it);
        with ``upcast``, sdpa on float32 keys and values (dequantized first) instead."""
        keys, values = self.gather()
        if upcast:
            if self.bits is not None:
                keys = mx.dequantize(keys[0], keys[1], keys[2], group_size=self.group_size,
                                     bits=self.bits)
                values = mx.dequantize(values[0], values[1], values[2],
                                       group_size=self.group_size, bits=self.bits)
            return mx.fast.scaled_dot_product_attention(
                queries.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
                scale=scale, mask=mask,
            )
        if self.bits is None:
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask
            )
        out: mx.array = mlx_base.quantized_scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask,
            group_size=self.group_size, bits=self.bits,
        )
        return out

    def uses_direct(self, queries: mx.array, mask: Any) -> bool:
        """Whether the direct kernel serves these shapes (device aside)."""
        return queries.shape[0] == 1 and self.as_batch().uses_direct(queries, mask)

    def uses_mma(self, tuning: KernelTuning, backend: ModuleType) -> bool:
        """Whether the direct kernel runs on tensor cores (float16/bfloat16 pools)."""
        return self.as_batch().uses_mma(tuning, backend)

    def attend_direct(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        backend: ModuleType,
        tuning: KernelTuning = DEFAULT_TUNING,
        *,
        poison: float | None = None,
    ) -> mx.array:
        """The split-K kernel: partial softmax per partition, then a log-sum-exp merge."""
        return self.as_batch().attend_direct(queries, scale, mask, backend, tuning,
                                             poison=poison)


def scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for mlx-lm's ``scaled_dot_product_attention`` that reads paged caches in place.

    For a paged cache (one sequence, or a :class:`BatchPagedKVCache`) the gathered
    ``keys``/``values`` the model passes are ignored (MLX never computes them) and the
    cache's attention view is used instead.
    """
    attention_view = getattr(cache, "attention_view", None)
    if attention_view is None or sinks is not None:
        out: mx.array = mlx_base.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
        return out
    view: PagedAttentionView | BatchPagedAttentionView = attention_view()
    if isinstance(view, BatchPagedAttentionView):
        # The batch cache's mask only hides the left padding of its gathered keys; the view
        # knows each sequence's length, so attention is causal over each one's own tokens.
        return view.attend(queries, scale, "causal" if queries.shape[2] > 1 else None)
    return view.attend(queries, scale, mask)


@contextlib.contextmanager
def use_paged_attention(*modules: ModuleType) -> Iterator[None]:
    """Route the attention of mlx-lm model modules (e.g. ``mlx_lm.models.llama``) through
    :func:`scaled_dot_product_attention` while the block runs."""
    name = "scaled_dot_product_attention"
    saved = [(m, getattr(m, name)) for m in modules]
    try:
        for module in modules:
            setattr(module, name, scaled_dot_product_attention)
        yield
    finally:
        for module, original in saved:
            setattr(module, name, original)
