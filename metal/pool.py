"""BlockPool: one store of fixed-size KV blocks shared by many sequences.

Theory of operation:

1. Keys and values live in arrays shaped ``[num_blocks, kv_heads, block_size, head_dim]``
   (quantized: packed ``uint32`` words plus per-group scales and biases, each with the same
   three leading axes). A physical block holds ``block_size`` consecutive tokens of one
   sequence for every kv head.
2. A block is free, or owned by one or more sequences. ``refcount`` counts the owners; a
   block shared by a forked prefix is written only after copy-on-write (:meth:`copy_block`),
   which the cache does when it appends into a shared, partially filled block.
3. Every write replaces the pool arrays by new MLX arrays; it never mutates an array object
   that someone else may hold. An attention view or snapshot that captured the arrays earlier
   therefore keeps seeing the old contents (MLX copies only if such a holder is alive, and
   updates in place otherwise).
4. The allocator hands out the lowest free block first, so layouts are deterministic.
5. ``epoch(block)`` changes whenever a block's written slots may change meaning (it is
   allocated again, or trimmed back while unshared): ``(pool_id, block, epoch)`` of a full
   block names fixed contents, which lets a restore share blocks again safely.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Sequence

import attrs
import mlx.core as mx
from kvtrio.errors import KvtrioError

__all__ = ["BlockPool", "BlockPoolExhausted", "PoolStatistics"]


class BlockPoolExhausted(KvtrioError):
    """The block pool has no free block left: retire a sequence or use a larger pool."""


@attrs.frozen
class PoolStatistics:
    """A snapshot of a block pool's occupancy (``BlockPool.statistics()``)."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    shared_blocks: int
    nbytes: int


def _row_index(
    blocks: mx.array, slots: mx.array, kv_heads: int, block_size: int
) -> mx.array:
    """Flat row numbers ``[tokens * kv_heads]`` of (block, head, slot) in a pool viewed 2-D."""
    heads = mx.arange(kv_heads, dtype=mx.int32)
    rows = (blocks[:, None] * kv_heads + heads[None, :]) * block_size + slots[:, None]
    return rows.reshape(-1)


def _scatter_rows(pool: mx.array, rows: mx.array, update: mx.array) -> mx.array:
    """``pool`` with rows replaced by ``update`` ``[1, kv_heads, tokens, width]``; a new array."""
    width = pool.shape[-1]
    flat = pool.reshape(-1, width)
    flat[rows] = update[0].transpose(1, 0, 2).reshape(-1, width)
    return flat.reshape(pool.shape)


@attrs.define
class BlockPool:
    """Fixed-size KV blocks with a free list, reference counts and copy-on-write.

    ``bits`` selects affine quantization (``mx.quantize`` with ``group_size``); ``None``
    stores ``dtype`` values as they come.
    """

    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    v_head_dim: int = attrs.field(default=-1)
    dtype: mx.Dtype = mx.float16
    bits: int | None = None
    group_size: int = 64
    keys: mx.array = attrs.field(init=False)
    values: mx.array = attrs.field(init=False)
    key_scales: mx.array | None = attrs.field(init=False, default=None)
    key_biases: mx.array | None = attrs.field(init=False, default=None)
    value_scales: mx.array | None = attrs.field(init=False, default=None)
    value_biases: mx.array | None = attrs.field(init=False, default=None)
    pool_id: str = attrs.field(init=False, factory=lambda: uuid.uuid4().hex)
    _refcounts: list[int] = attrs.field(init=False, factory=list)
    _epochs: list[int] = attrs.field(init=False, factory=list)
    _free: list[int] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        if self.v_head_dim < 0:
            self.v_head_dim = self.head_dim
        for name in ("num_blocks", "kv_heads", "block_size", "head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        lead = (self.num_blocks, self.kv_heads, self.block_size)
        if self.bits is None:
            self.keys = mx.zeros((*lead, self.head_dim), dtype=self.dtype)
            self.values = mx.zeros((*lead, self.v_head_dim), dtype=self.dtype)
        else:
            for dim in (self.head_dim, self.v_head_dim):
                if dim % self.group_size or (dim * self.bits) % 32:
                    raise ValueError("head dims must be multiples of group_size and 32 / bits")
            self.keys, self.key_scales, self.key_biases = self._quantized_zeros(self.head_dim)
            self.values, self.value_scales, self.value_biases = self._quantized_zeros(
                self.v_head_dim
            )
        self._refcounts = [0] * self.num_blocks
        self._epochs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks))
        mx.eval(self.arrays())

    def _quantized_zeros(self, dim: int) -> tuple[mx.array, mx.array, mx.array]:
        assert self.bits is not None
        lead = (self.num_blocks, self.kv_heads, self.block_size)
        packed = mx.zeros((*lead, dim * self.bits // 32), dtype=mx.uint32)
        scales = mx.zeros((*lead, dim // self.group_size), dtype=self.dtype)
        return packed, scales, mx.zeros_like(scales)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def arrays(self) -> list[mx.array]:
        """The pool tensors in a fixed order: keys, values, then the four quantization ones."""
        extra = [self.key_scales, self.key_biases, self.value_scales, self.value_biases]
        return [self.keys, self.values, *(a for a in extra if a is not None)]

    @property
    def block_nbytes(self) -> int:
        """Bytes one physical block occupies across all pool tensors."""
        return sum(a.nbytes for a in self.arrays()) // self.num_blocks

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self) -> int:
        """Take the lowest free block with refcount 1; raises BlockPoolExhausted when none."""
        if not self._free:
            raise BlockPoolExhausted(f"all {self.num_blocks} blocks are in use")
        block = heapq.heappop(self._free)
        self._refcounts[block] = 1
        self._epochs[block] += 1
        return block

    def claim(self, block: int) -> None:
        """Take one particular free block (restoring a saved block table exactly)."""
        if not 0 <= block < self.num_blocks or self._refcounts[block] != 0:
            raise ValueError(f"block {block} is not a free block of this pool")
        self._free.remove(block)
        heapq.heapify(self._free)
        self._refcounts[block] = 1
        self._epochs[block] += 1

    def retain(self, block: int) -> None:
        """Add an owner to a block in use (a forked sequence sharing a prefix)."""
        if self._refcounts[block] <= 0:
            raise ValueError(f"block {block} is free")
        self._refcounts[block] += 1

    def release(self, block: int) -> None:
        """Drop one owner; the block returns to the free list when the last owner goes."""
        if self._refcounts[block] <= 0:
            raise ValueError(f"block {block} is already free")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            heapq.heappush(self._free, block)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def epoch(self, block: int) -> int:
        return self._epochs[block]

    def renew(self, block: int) -> None:
        """Mark a block's slots as about to be rewritten (a sequence trimmed back into it)."""
        self._epochs[block] += 1

    def copy_block(self, source: int) -> int:
        """Copy-on-write: a fresh block holding ``source``'s contents (caller releases source)."""
        target = self.allocate()
        span = self.kv_heads * self.block_size
        for name in self._array_names():
            array: mx.array = getattr(self, name)
            flat = array.reshape(-1, array.shape[-1])
            contents = flat[source * span : (source + 1) * span]
            flat[target * span : (target + 1) * span] = contents
            setattr(self, name, flat.reshape(array.shape))
        return target

    def _array_names(self) -> list[str]:
        names = ["keys", "values"]
        if self.bits is not None:
            names += ["key_scales", "key_biases", "value_scales", "value_biases"]
        return names

    # -- contents -----------------------------------------------------------------------------

    def write(
        self, blocks: Sequence[int], slots: Sequence[int], keys: mx.array, values: mx.array
    ) -> None:
        """Store token ``i`` of ``keys``/``values`` ``[1, kv_heads, tokens, dim]`` at
        (``blocks[i]``, ``slots[i]``)."""
        if keys.shape[0] != 1 or keys.shape[1] != self.kv_heads:
            raise ValueError(f"expected keys [1, {self.kv_heads}, tokens, dim], got {keys.shape}")
        rows = _row_index(
            mx.array(list(blocks), dtype=mx.int32),
            mx.array(list(slots), dtype=mx.int32),
            self.kv_heads,
            self.block_size,
        )
        if self.bits is None:
            self.keys = _scatter_rows(self.keys, rows, keys.astype(self.dtype))
            self.values = _scatter_rows(self.values, rows, values.astype(self.dtype))
            return
        self._write_rows(rows, self._quantize(keys), self._quantize(values))

    def _quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        packed, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return packed, scales, biases

    def write_quantized(
        self,
        blocks: Sequence[int],
        slots: Sequence[int],
        keys: tuple[mx.array, mx.array, mx.array],
        values: tuple[mx.array, mx.array, mx.array],
    ) -> None:
        """Store already-quantized (packed, scales, biases) triples, as :meth:`write` does."""
        if self.bits is None:
            raise ValueError("the pool is not quantized")
        rows = _row_index(
            mx.array(list(blocks), dtype=mx.int32),
            mx.array(list(slots), dtype=mx.int32),
            self.kv_heads,
            self.block_size,
        )
        self._write_rows(rows, keys, values)

    def _write_rows(
        self,
        rows: mx.array,
        keys: tuple[mx.array, mx.array, mx.array] | list[mx.array],
        values: tuple[mx.array, mx.array, mx.array] | list[mx.array],
    ) -> None:
        names = ["keys", "key_scales", "key_biases", "values", "value_scales", "value_biases"]
        for name, update in zip(names, [*keys, *values], strict=True):
            setattr(self, name, _scatter_rows(getattr(self, name), rows, update))

    def statistics(self) -> PoolStatistics:
        used = sum(1 for c in self._refcounts if c > 0)
        return PoolStatistics(
            num_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=len(self._free),
            shared_blocks=sum(1 for c in self._refcounts if c > 1),
            nbytes=sum(a.nbytes for a in self.arrays()),
        )
