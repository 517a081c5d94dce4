"""PagedKVCache: one sequence's KV cache stored as a block table over a shared BlockPool.

It speaks mlx-lm's cache protocol (``update_and_fetch``, ``offset``, ``trim``,
``is_trimmable``, ``make_mask``, ``state``, ``nbytes``, ``empty``), so an mlx-lm model runs
with it unchanged. ``update_and_fetch`` returns the keys and values gathered by block table
(the reference path: mlx-lm's attention then runs on them and the logits are bit-exact with
``KVCache``). The quantized variant carries ``bits`` and ``group_size`` like mlx-lm's
``QuantizedKVCache``, so mlx-lm dispatches to its quantized attention on the gathered triples.
The direct decode kernel reads the blocks in place through :meth:`PagedKVCache.attention_view`
(see :mod:`kvtrio.metal.attention`). MLX evaluates lazily: when the direct path is taken, the
gathered copies returned by ``update_and_fetch`` are never computed.

Sequences that share a prompt prefix share its blocks: :meth:`fork` retains every block, and
the first append into a shared, partially filled last block copies it first (copy-on-write).

:class:`BatchPagedKVCache` decodes B such sequences of one pool together (mlx-lm's batched
cache protocol: per-sequence ``offset`` array, left-padded gathered keys with a padding mask);
its attention view serves the whole batch with one direct-kernel launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from kvtrio.metal.attention import BatchPagedAttentionView, PagedAttentionView
from kvtrio.metal.pool import BlockPool
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import create_attention_mask

__all__ = [
    "BatchPagedKVCache",
    "PagedKVCache",
    "QuantizedBatchPagedKVCache",
    "QuantizedPagedKVCache",
    "make_paged_cache",
]

KVPair = tuple[Any, Any]


class PagedKVCache:
    """A sequence's KV cache in ``pool``: ``block_table[i]`` holds tokens
    ``[i * block_size, (i + 1) * block_size)``."""

    def __init__(self, pool: BlockPool, *, direct: bool = True) -> None:
        self.pool = pool
        self.block_table: list[int] = []
        self.offset = 0
        # Whether attention may read blocks in place (False: always gather, the reference).
        self.direct = direct

    # -- sequence lifetime --------------------------------------------------------------------

    def fork(self) -> PagedKVCache:
        """A new sequence sharing this one's blocks (a shared prompt prefix, stored once)."""
        child = type(self)(self.pool, direct=self.direct)
        for block in self.block_table:
            self.pool.retain(block)
        child.block_table = list(self.block_table)
        child.offset = self.offset
        return child

    def release(self) -> None:
        """Retire the sequence: give its blocks back (shared ones stay with their other owners)."""
        for block in self.block_table:
            self.pool.release(block)
        self.block_table = []
        self.offset = 0

    # -- writing ------------------------------------------------------------------------------

    def _reserve(self, tokens: int) -> None:
        """Make blocks for ``tokens`` more tokens writable, copying a shared partial block."""
        size = self.pool.block_size
        if self.offset % size and self.pool.refcount(self.block_table[-1]) > 1:
            shared = self.block_table[-1]
            self.block_table[-1] = self.pool.copy_block(shared)
            self.pool.release(shared)
        needed = -(-(self.offset + tokens) // size)
        while len(self.block_table) < needed:
            self.block_table.append(self.pool.allocate())

    def _append(self, count: int) -> tuple[list[int], list[int]]:
        """Reserve ``count`` more tokens; their (block, slot) places, in token order."""
        self._reserve(count)
        size = self.pool.block_size
        positions = range(self.offset, self.offset + count)
        self.offset += count
        return [self.block_table[p // size] for p in positions], [p % size for p in positions]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> KVPair:
        """Append ``[1, kv_heads, n, dim]`` keys and values; return the whole sequence's."""
        blocks, slots = self._append(keys.shape[2])
        self.pool.write(blocks, slots, keys, values)
        return self.keys_and_values()

    def keys_and_values(self) -> KVPair:
        """The sequence's keys and values gathered in token order (quantized: triples)."""
        return self.attention_view().gather()

    # -- reading ------------------------------------------------------------------------------

    def attention_view(self) -> PagedAttentionView:
        """An immutable view of the current tokens: later appends or release do not change it."""
        return PagedAttentionView.capture(self.pool, self.block_table, self.offset, self.direct)

    # -- mlx-lm protocol ----------------------------------------------------------------------

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (at most all); whole blocks past the end are released."""
        n = min(self.offset, n)
        self.offset -= n
        keep = -(-self.offset // self.pool.block_size)
        for block in self.block_table[keep:]:
            self.pool.release(block)
        del self.block_table[keep:]
        if self.offset % self.pool.block_size and self.pool.refcount(self.block_table[-1]) == 1:
            self.pool.renew(self.block_table[-1])
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the pool blocks this sequence references (shared ones counted in full)."""
        return len(self.block_table) * self.pool.block_nbytes

    @property
    def state(self) -> KVPair:
        """The sequence's keys and values in token order, like ``KVCache.state`` (no slack)."""
        return self.keys_and_values()

    @state.setter
    def state(self, value: KVPair) -> None:
        self.release()
        keys, values = value
        self._set_state(keys, values)

    def _set_state(self, keys: Any, values: Any) -> None:
        if keys.shape[2]:
            self.update_and_fetch(keys, values)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return ()

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        del value


class QuantizedPagedKVCache(PagedKVCache):
    """A paged cache over a quantized pool; ``bits``/``group_size`` steer mlx-lm's attention."""

    @property
    def bits(self) -> int:
        assert self.pool.bits is not None
        return self.pool.bits

    @property
    def group_size(self) -> int:
        return self.pool.group_size

    def _set_state(self, keys: Any, values: Any) -> None:
        if keys[0].shape[2]:
            blocks, slots = self._append(keys[0].shape[2])
            self.pool.write_quantized(blocks, slots, tuple(keys), tuple(values))


def make_paged_cache(pool: BlockPool, *, direct: bool = True) -> PagedKVCache:
    """A new empty sequence over ``pool``: quantized pools get a :class:`QuantizedPagedKVCache`."""
    if pool.quantized:
        return QuantizedPagedKVCache(pool, direct=direct)
    return PagedKVCache(pool, direct=direct)


def _left_pad(array: mx.array, width: int) -> mx.array:
    """``[1, heads, length, d]`` padded with zeros on the left of the token axis to ``width``."""
    missing = width - array.shape[2]
    if missing == 0:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (missing, 0), (0, 0)])


class BatchPagedKVCache:
    """B sequences of one pool decoded together, each with its own block table and length.

    The mlx-lm side of it: ``update_and_fetch`` takes ``[B, kv_heads, n, dim]`` and appends n
    tokens to every sequence (one pool write for the batch); it returns the sequences'
    keys and values gathered and left-padded to the longest, and ``make_mask`` the matching
    padding-and-causal mask, as mlx-lm's ``BatchKVCache`` does, so a model runs on it
    unchanged (the reference path). ``offset`` is the per-sequence array mlx-lm's RoPE takes.
    Through :func:`kvtrio.metal.scaled_dot_product_attention` the model's attention reads the
    blocks in place instead, all sequences in one launch on a GPU, and the gathered copies are
    never computed. A sliding-window mask is not supported.
    """

    def __init__(self, caches: Sequence[PagedKVCache]) -> None:
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        pools = {id(c.pool) for c in caches}
        if len(pools) != 1:
            raise ValueError("every sequence of a batch must live in the same pool")
        self.pool = caches[0].pool
        self.caches = list(caches)

    @staticmethod
    def of(caches: Sequence[PagedKVCache]) -> BatchPagedKVCache:
        """The batch of ``caches``: a :class:`QuantizedBatchPagedKVCache` for a quantized
        pool (whose ``bits`` steer mlx-lm to its quantized attention)."""
        if caches and caches[0].pool.quantized:
            return QuantizedBatchPagedKVCache(caches)
        return BatchPagedKVCache(caches)

    @classmethod
    def empty_batch(cls, pool: BlockPool, batch: int, *, direct: bool = True) -> BatchPagedKVCache:
        """``batch`` new empty sequences over ``pool``."""
        return cls.of([make_paged_cache(pool, direct=direct) for _ in range(batch)])

    # -- batch membership (mlx-lm's filter / extend) -------------------------------------------

    def filter(self, batch_indices: Sequence[int]) -> list[PagedKVCache]:
        """Keep the sequences at ``batch_indices`` (in that order); return the others, still
        holding their blocks (save them, or ``release()`` them)."""
        keep = [int(i) for i in batch_indices]
        if not keep:
            raise ValueError("a batch needs at least one sequence")
        dropped = [c for i, c in enumerate(self.caches) if i not in set(keep)]
        self.caches = [self.caches[i] for i in keep]
        return dropped

    def extend(self, other: BatchPagedKVCache | Sequence[PagedKVCache]) -> None:
        """Add sequences of the same pool at the end of the batch."""
        more = other.caches if isinstance(other, BatchPagedKVCache) else list(other)
        if any(c.pool is not self.pool for c in more):
            raise ValueError("every sequence of a batch must live in the same pool")
        self.caches.extend(more)

    def release(self) -> None:
        """Retire every sequence of the batch (their blocks go back to the pool)."""
        for cache in self.caches:
            cache.release()

    # -- writing ------------------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        return [c.offset for c in self.caches]

    @property
    def offset(self) -> mx.array:
        """Per-sequence token counts ``[B]`` (mlx-lm's RoPE takes an array offset)."""
        return mx.array(self.lengths, dtype=mx.int32)

    def update_and_fetch(self, keys: Any, values: Any) -> KVPair:
        """Append ``[B, kv_heads, n, dim]`` keys and values (token i of row b to sequence b);
        return every sequence's keys and values, left-padded to the longest."""
        batch, heads, n, width = keys.shape
        if batch != len(self.caches):
            raise ValueError(f"expected {len(self.caches)} rows of keys, got {keys.shape}")
        blocks: list[int] = []
        slots: list[int] = []
        for cache in self.caches:
            b, s = cache._append(n)
            blocks += b
            slots += s
        # Tokens in (sequence, position) order, as the block and slot lists are.
        flat_k = keys.transpose(1, 0, 2, 3).reshape(1, heads, batch * n, width)
        flat_v = values.transpose(1, 0, 2, 3).reshape(1, heads, batch * n, values.shape[3])
        self.pool.write(blocks, slots, flat_k, flat_v)
        return self.keys_and_values()

    def keys_and_values(self) -> KVPair:
        """Keys and values ``[B, kv_heads, longest, dim]``, each sequence left-padded with
        zeros (quantized pools: triples)."""
        width = max(self.lengths)
        gathered = [c.keys_and_values() for c in self.caches]
        if self.pool.bits is None:
            return (
                mx.concatenate([_left_pad(k, width) for k, _ in gathered], axis=0),
                mx.concatenate([_left_pad(v, width) for _, v in gathered], axis=0),
            )
        keys = tuple(mx.concatenate([_left_pad(k[i], width) for k, _ in gathered], axis=0)
                     for i in range(3))
        values = tuple(mx.concatenate([_left_pad(v[i], width) for _, v in gathered], axis=0)
                       for i in range(3))
        return keys, values

    # -- reading ------------------------------------------------------------------------------

    def attention_view(self) -> BatchPagedAttentionView:
        """An immutable view of every sequence's current tokens (one kernel launch for all)."""
        return BatchPagedAttentionView.capture(
            self.pool,
            [c.block_table for c in self.caches],
            self.lengths,
            all(c.direct for c in self.caches),
        )

    # -- mlx-lm protocol ----------------------------------------------------------------------

    def size(self) -> int:
        return max(self.lengths)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens of every sequence (at most the shortest's length)."""
        n = min(n, *self.lengths)
        for cache in self.caches:
            cache.trim(n)
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        """The mask of the N queries about to be appended over the left-padded keys that
        ``update_and_fetch`` returns: causal, and blind to each sequence's padding."""
        del return_array  # always an array: the padding differs per sequence
        if window_size is not None:
            raise ValueError("a paged batch has no sliding-window mask")
        longest = max(self.lengths)
        padding = mx.array([longest - x for x in self.lengths], dtype=mx.int32)
        return create_causal_mask(N, offset=longest, left_padding=padding)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool blocks the batch references (a shared block counted once)."""
        blocks = {b for c in self.caches for b in c.block_table}
        return len(blocks) * self.pool.block_nbytes


class QuantizedBatchPagedKVCache(BatchPagedKVCache):
    """A batch over a quantized pool; ``bits``/``group_size`` steer mlx-lm's attention."""

    @property
    def bits(self) -> int:
        assert self.pool.bits is not None
        return self.pool.bits

    @property
    def group_size(self) -> int:
        return self.pool.group_size
