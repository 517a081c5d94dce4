"""The storage codec of :class:`~kvtrio.metal.cache.PagedKVCache` (header kind ``"paged"``).

Theory of operation:

1. Only the blocks a sequence uses persist: a snapshot saves its tokens ``[0, offset)``
   gathered by block table in token order, ``[1, kv_heads, offset, width]`` per pool tensor
   (keys, values, and for quantized pools their scales and biases), cut by the storage
   block layout along the token axis. Saved with ``block_tokens`` equal to the pool's block
   size, each stored block is the content of one physical block, named by its sha256, so
   sequences sharing a prompt prefix share those files on disk.
2. The snapshot is an immutable view (docs/design.md invariant 1): it reads the pool arrays
captured at
   snapshot time; later appends, copy-on-write or release rebind the pool's arrays.
3. The header fields keep the pool geometry, the block table, the pool's id and each
   block's epoch. On load the table is restored: into a private pool (the saved physical
   block numbers, exactly), or, inside ``with restore_into(pool):``, into a live shared
   pool, where the full blocks that loads in the block shared when saved (same pool id,
   block and epoch: the same fixed contents) are shared again (reference counted,
   copy-on-write on append). Partial blocks are always restored into fresh blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import mlx.core as mx
from kvtrio.errors import CorruptCacheError
from kvtrio.metal.attention import PagedAttentionView
from kvtrio.metal.cache import PagedKVCache, QuantizedPagedKVCache, make_paged_cache
from kvtrio.metal.pool import BlockPool
from kvtrio.storage.codecs import CodecState, TensorView, expect_shape, field_int, register_codec
from kvtrio.storage.format import CacheEntry, FieldValue
from kvtrio.storage.hostbuffers import MX_DTYPES

__all__ = ["PagedKVCacheCodec", "restore_into"]

_DTYPES = {name: MX_DTYPES[name] for name in ("float16", "bfloat16", "float32")}
_MAX_BLOCKS = 1 << 24
_MAX_DIM = 1 << 16


@attrs.define
class _RestoreTarget:
    pool: BlockPool
    # (saved pool id, block, epoch) of a full block -> its block in ``pool``
    placed: dict[tuple[str, int, int], int] = attrs.field(factory=dict)


_TARGET: contextvars.ContextVar[_RestoreTarget | None] = contextvars.ContextVar(
    "kvtrio_paged_restore_target", default=None
)


@contextlib.contextmanager
def restore_into(pool: BlockPool) -> Iterator[None]:
    """Load paged caches into ``pool`` (instead of private pools) while the block runs."""
    token = _TARGET.set(_RestoreTarget(pool))
    try:
        yield
    finally:
        _TARGET.reset(token)


def _dtype_name(dtype: mx.Dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise TypeError(f"paged pools of dtype {dtype} cannot be saved")


class PagedKVCacheCodec:
    """Header kind ``"paged"``: a sequence of a paged cache, saved by its used blocks."""

    kind = "paged"
    cache_types: tuple[type, ...] = (PagedKVCache, QuantizedPagedKVCache)
    structure_fields: tuple[str, ...] = (
        "kv_heads", "head_dim", "v_head_dim", "dtype", "bits", "group_size",
    )

    def snapshot(self, cache: Any) -> CodecState:
        pool: BlockPool = cache.pool
        fields: dict[str, FieldValue] = {
            "kv_heads": pool.kv_heads,
            "head_dim": pool.head_dim,
            "v_head_dim": pool.v_head_dim,
            "dtype": _dtype_name(pool.dtype),
            "bits": pool.bits,
            "group_size": pool.group_size,
            "block_size": pool.block_size,
            "block_table": tuple(cache.block_table),
            "block_epochs": tuple(pool.epoch(b) for b in cache.block_table),
            "pool_id": pool.pool_id,
            "direct": bool(cache.direct),
        }
        view: PagedAttentionView = cache.attention_view()
        tensors = tuple(TensorView(t, 2) for t in _token_major(view)) if cache.offset else ()
        return CodecState(cache.offset, True, fields, tensors)

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        kv_heads = field_int(entry, "kv_heads", 1, _MAX_DIM)
        head_dim = field_int(entry, "head_dim", 1, _MAX_DIM)
        v_head_dim = field_int(entry, "v_head_dim", 1, _MAX_DIM)
        block_size = field_int(entry, "block_size", 1, _MAX_DIM)
        group_size = field_int(entry, "group_size", 1, _MAX_DIM)
        dtype = _DTYPES.get(str(entry.fields.get("dtype")))
        if dtype is None:
            raise CorruptCacheError("fields.dtype: not a paged pool dtype")
        bits = entry.fields.get("bits")
        if bits is not None and (isinstance(bits, bool) or bits not in (2, 3, 4, 5, 6, 8)):
            raise CorruptCacheError("fields.bits: not a quantization width")
        table = _block_table(entry, "block_table", -(-entry.offset // block_size))
        epochs = _block_table(entry, "block_epochs", len(table), 1 << 62)
        pool_id = str(entry.fields.get("pool_id"))
        direct = entry.fields.get("direct") is not False
        expected = 6 if bits is not None else 2
        if entry.offset and len(arrays) != expected:
            raise CorruptCacheError(f"tensors: a paged cache has {expected} tensors")
        target = _TARGET.get()
        if target is None:
            pool = BlockPool(
                max(table, default=0) + 1, kv_heads, block_size, head_dim, v_head_dim,
                dtype=dtype, bits=bits if isinstance(bits, int) else None, group_size=group_size,
            )
            target = _RestoreTarget(pool)
            private = True
        else:
            pool = target.pool
            private = False
            if (pool.kv_heads, pool.head_dim, pool.v_head_dim, pool.block_size, pool.bits) != (
                kv_heads, head_dim, v_head_dim, block_size, bits
            ):
                raise CorruptCacheError("fields: the paged cache does not fit the target pool")
        cache = make_paged_cache(pool, direct=direct)
        if not entry.offset:
            return cache
        _check_arrays(arrays, pool, entry.offset)
        positions: list[int] = []
        blocks: list[int] = []
        full_blocks = entry.offset // block_size
        for index, saved in enumerate(table):
            key = (pool_id, saved, epochs[index])
            if index < full_blocks and key in target.placed:
                pool.retain(target.placed[key])
                cache.block_table.append(target.placed[key])
                continue
            if private:
                pool.claim(saved)
                block = saved
            else:
                block = pool.allocate()
            if index < full_blocks:
                target.placed[key] = block
            cache.block_table.append(block)
            span = range(index * block_size, min((index + 1) * block_size, entry.offset))
            positions.extend(span)
            blocks.extend([block] * len(span))
        cache.offset = entry.offset
        if positions:
            take = mx.array(positions, dtype=mx.int32)
            picked = [mx.take(a, take, axis=2) for a in arrays]
            slots = [p % block_size for p in positions]
            if bits is None:
                pool.write(blocks, slots, picked[0], picked[1])
            else:
                pool.write_quantized(
                    blocks, slots, (picked[0], picked[2], picked[3]),
                    (picked[1], picked[4], picked[5]),
                )
            mx.eval(pool.arrays())
        return cache


def _token_major(view: PagedAttentionView) -> list[mx.array]:
    """The view's pool tensors gathered in token order (pool-array order)."""
    keys, values = view.gather()
    if view.bits is None:
        return [keys, values]
    return [keys[0], values[0], keys[1], keys[2], values[1], values[2]]


def _block_table(entry: CacheEntry, name: str, count: int, limit: int = _MAX_BLOCKS) -> list[int]:
    raw = entry.fields.get(name)
    if not isinstance(raw, tuple) or len(raw) != count:
        raise CorruptCacheError(f"fields.{name}: expected {count} block numbers")
    table: list[int] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise CorruptCacheError(f"fields.{name}: not a block number")
        table.append(value)
    return table


def _check_arrays(arrays: Sequence[Any], pool: BlockPool, tokens: int) -> None:
    for index, (array, like) in enumerate(zip(arrays, pool.arrays(), strict=True)):
        expect_shape(array, (1, pool.kv_heads, tokens, like.shape[3]), f"tensors[{index}]")
        if array.dtype != like.dtype:
            raise CorruptCacheError(f"tensors[{index}]: dtype does not fit the pool")


register_codec(PagedKVCacheCodec())
