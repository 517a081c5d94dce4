"""Paged attention: the reference path and the direct split-K decode kernel, with dispatch.

An attention view is captured from a sequence (:meth:`PagedKVCache.attention_view`): the pool
tensors as they are now, the block table and the length. It is immutable: later appends,
copy-on-write or retiring the sequence replace the pool's arrays and never touch the ones
the view holds.

``attend`` picks a path per call:

- direct (the split-K kernel reading blocks in place) on a GPU (CUDA or Metal) for at most
  :data:`DIRECT_MAX_QUERIES` queries without an array mask, when the shapes fit the kernel;
- the reference path otherwise (always on the CPU): gather the blocks in token order, then
  ``mx.fast.scaled_dot_product_attention`` (mlx-lm's quantized attention for quantized pools),
  which is exactly what mlx-lm computes on a ``KVCache``/``QuantizedKVCache``.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
from mlx_lm.models import base as mlx_base

if TYPE_CHECKING:
    from kvtrio.metal.pool import BlockPool

__all__ = [
    "DEFAULT_TUNING",
    "DIRECT_MAX_QUERIES",
    "KernelTuning",
    "PagedAttentionView",
    "direct_backend",
    "scaled_dot_product_attention",
    "use_paged_attention",
]

DIRECT_MAX_QUERIES = 8
# Partitions the merge kernel accepts (its shared weights); longer contexts get longer parts.
_MAX_PARTS = 1024


@attrs.frozen
class KernelTuning:
    """Launch shape of the direct kernel (``kvtrio bench attention --sweep`` compares them)."""

    # The scalar kernel (float32 and quantized pools, or any pool with mma=False):
    warps: int = 4  # warps per thread block
    rows: int = 4  # query rows (GQA group x queries) a block serves; more take more blocks
    unroll: int = 4  # tokens each lane keeps in flight per step (2 when a block has > 4 rows)
    pipeline: bool = True  # load the next step's keys and values before using this step's
    target_blocks: int = 1024  # thread blocks to aim for: a few per multiprocessor
    min_part_tokens: int = 128
    # The tensor-core kernel (float16/bfloat16 pools; 8 query rows per block and 16 tokens
    # per warp step): whether to use it (None: where the backend has tensor cores, i.e. CUDA;
    # Metal's version emulates them), its warps per block and thread blocks to aim for.
    mma: bool | None = None
    mma_warps: int = 8
    mma_blocks: int = 264  # 2 per multiprocessor of an H200 (from the sweep)

    @classmethod
    def parse(cls, text: str) -> KernelTuning:
        """``warps,rows,unroll,pipeline,blocks[,mma[,mma_warps,mma_blocks]]`` (pipeline 0 or 1;
        mma 0, 1 or -1 for the backend's default); fields left out keep their defaults."""
        fields = [int(x) for x in text.split(",")]
        if len(fields) not in (5, 6, 8):
            raise ValueError(f"expected 5, 6 or 8 comma-separated integers, got {text!r}")
        tuning = cls(
            warps=fields[0], rows=fields[1], unroll=fields[2], pipeline=bool(fields[3]),
            target_blocks=fields[4],
        )
        if len(fields) > 5:
            tuning = attrs.evolve(tuning, mma=None if fields[5] < 0 else bool(fields[5]))
        if len(fields) > 6:
            tuning = attrs.evolve(tuning, mma_warps=fields[6], mma_blocks=fields[7])
        return tuning

    def text(self) -> str:
        """The ``--tuning`` argument that parses back to this shape."""
        fields = [self.warps, self.rows, self.unroll, int(self.pipeline), self.target_blocks,
                  -1 if self.mma is None else int(self.mma), self.mma_warps, self.mma_blocks]
        return ",".join(str(x) for x in fields)


DEFAULT_TUNING = KernelTuning()
_LOG2E = 1.4426950408889634


def direct_backend() -> ModuleType | None:
    """The kernel module for the default device (CUDA or Metal), or None on the CPU."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.cuda.is_available():
        from kvtrio.metal import kernels_cuda

        return kernels_cuda
    if mx.metal.is_available():
        from kvtrio.metal import kernels_metal

        return kernels_metal
    return None


@attrs.frozen
class PagedAttentionView:
    """One sequence's keys and values at capture time, read through its block table."""

    arrays: tuple[mx.array, ...]  # keys, values (+ key scales, biases, value scales, biases)
    table: mx.array  # int32 [length, block numbers...]: the kernel's one argument array
    length: int
    block_size: int
    bits: int | None
    group_size: int
    direct: bool

    @classmethod
    def capture(
        cls, pool: BlockPool, block_table: Sequence[int], length: int, direct: bool = True
    ) -> PagedAttentionView:
        # stop_gradient gives new array objects sharing the buffers (no copy): the pool's
        # later writes rebind its own attributes, so these keep today's contents.
        return cls(
            arrays=tuple(mx.stop_gradient(a) for a in pool.arrays()),
            table=mx.array([length, *block_table], dtype=mx.int32),
            length=length,
            block_size=pool.block_size,
            bits=pool.bits,
            group_size=pool.group_size,
            direct=direct,
        )

    @property
    def kv_heads(self) -> int:
        return int(self.arrays[0].shape[1])

    def _gather(self, array: mx.array) -> mx.array:
        heads, width = array.shape[1], array.shape[3]
        if self.length == 0:
            return mx.zeros((1, heads, 0, width), dtype=array.dtype)
        picked = mx.take(array, self.table[1:], axis=0)
        flat = picked.transpose(1, 0, 2, 3).reshape(heads, -1, width)
        return flat[None, :, : self.length, :]

    def gather(self) -> tuple[Any, Any]:
        """Keys and values in token order, ``[1, kv_heads, length, dim]`` (quantized: triples)."""
        parts = [self._gather(a) for a in self.arrays]
        if self.bits is None:
            return parts[0], parts[1]
        return (parts[0], parts[2], parts[3]), (parts[1], parts[4], parts[5])

    # -- attention ----------------------------------------------------------------------------

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of ``queries`` ``[1, q_heads, n, dim]`` over the view's tokens."""
        backend = direct_backend()
        if backend is not None and self.uses_direct(queries, mask):
            return self.attend_direct(queries, scale, mask, backend)
        return self.attend_reference(queries, scale, mask)

    def attend_reference(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Gather, then the attention mlx-lm runs on a contiguous cache (bit-exact with it)."""
        keys, values = self.gather()
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
        batch, q_heads, n, dim = queries.shape
        keys = self.arrays[0]
        k_dim = keys.shape[3] * (32 // self.bits if self.bits else 1)
        v_dim = self.arrays[1].shape[3] * (32 // self.bits if self.bits else 1)
        return (
            self.direct
            and self.length > 0
            and batch == 1
            and 1 <= n <= DIRECT_MAX_QUERIES
            and (mask is None or isinstance(mask, str))
            and q_heads % self.kv_heads == 0
            and dim == k_dim == v_dim
            and dim in (64, 128)  # the head dims tested on hardware
            and (self.bits is None or (self.bits in (4, 8) and self.group_size % 8 == 0))
            and self.arrays[-1].dtype in (mx.float16, mx.bfloat16, mx.float32)
        )

    def attend_direct(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        backend: ModuleType,
        tuning: KernelTuning = DEFAULT_TUNING,
    ) -> mx.array:
        """The split-K kernel: partial softmax per partition, then a log-sum-exp merge."""
        _, q_heads, n, dim = queries.shape
        kv_heads = self.kv_heads
        rows = (q_heads // kv_heads) * n
        scale_bits = struct.unpack("<i", struct.pack("<f", scale * _LOG2E))[0]
        causal = n > 1 and mask is not None
        if self.uses_mma(tuning, backend):
            # Tensor cores: blocks of 8 query rows (one mma tile), 16-token tiles per warp.
            warps = tuning.mma_warps
            chunks = -(-rows // 8)
            part = self._part_tokens(kv_heads * chunks, warps * 16, tuning.mma_blocks, tuning)
            parts = -(-self.length // part)
            kernel = backend.partial_mma()
            template: list[tuple[str, Any]] = [
                ("HK", kv_heads), ("G", q_heads // kv_heads), ("N", n), ("D", dim),
                ("BS", self.block_size), ("WARPS", warps), ("CAUSAL", causal),
                ("SCALE_BITS", scale_bits),
            ]
        else:
            warps = tuning.warps
            rows_per_block = min(rows, tuning.rows)
            chunks = -(-rows // rows_per_block)
            unroll = tuning.unroll if rows_per_block <= 4 else min(tuning.unroll, 2)
            per_step = warps * (32 // (dim // 8)) * unroll
            part = self._part_tokens(kv_heads * chunks, per_step, tuning.target_blocks, tuning)
            parts = -(-self.length // part)
            kernel = backend.partial(self.bits is not None)
            template = [
                ("HQ", q_heads), ("HK", kv_heads), ("G", q_heads // kv_heads), ("N", n),
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
        inputs = [queries, self.arrays[0], self.arrays[1], self.table]
        partial_out, normal = kernel(
            inputs=inputs + list(self.arrays[2:]),
            template=template,
            grid=(32 * warps * parts, kv_heads * chunks, 1),
            threadgroup=(32 * warps, 1, 1),
            output_shapes=[(q_heads * n, parts, dim), (q_heads * n, parts, 2)],
            output_dtypes=[mx.float32, mx.float32],
        )
        split = 1024 // dim  # threads of a merge block that share one output element
        (out,) = backend.merge()(
            inputs=[partial_out, normal],
            template=[("D", dim), ("J", split), ("MAX_PARTS", _MAX_PARTS), ("OutT", queries.dtype)],
            grid=(dim, split * q_heads * n, 1),
            threadgroup=(dim, split, 1),
            output_shapes=[(1, q_heads, n, dim)],
            output_dtypes=[queries.dtype],
        )
        result: mx.array = out
        return result

    def uses_mma(self, tuning: KernelTuning, backend: ModuleType) -> bool:
        """Whether the direct kernel runs on tensor cores (float16/bfloat16 pools)."""
        wanted = tuning.mma if tuning.mma is not None else bool(backend.TENSOR_CORES)
        return (
            wanted
            and self.bits is None
            and self.arrays[0].dtype in (mx.float16, mx.bfloat16)
            and self.arrays[0].shape[3] % 32 == 0
        )

    def _part_tokens(
        self, row_blocks: int, per_step: int, target_blocks: int, tuning: KernelTuning
    ) -> int:
        """Tokens per partition: enough partitions to fill the GPU, whole block steps each."""
        wanted = max(1, target_blocks // row_blocks)
        tokens = max(
            -(-self.length // wanted), -(-self.length // _MAX_PARTS), tuning.min_part_tokens
        )
        return -(-tokens // per_step) * per_step


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

    For a paged cache the gathered ``keys``/``values`` the model passes are ignored (MLX never
    computes them) and the cache's attention view is used instead.
    """
    attention_view = getattr(cache, "attention_view", None)
    if attention_view is None or sinks is not None:
        out: mx.array = mlx_base.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
        return out
    view: PagedAttentionView = attention_view()
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
