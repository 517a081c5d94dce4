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
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from kvtrio.metal.attention import PagedAttentionView
from kvtrio.metal.pool import BlockPool
from mlx_lm.models.cache import create_attention_mask

__all__ = ["PagedKVCache", "QuantizedPagedKVCache", "make_paged_cache"]

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
