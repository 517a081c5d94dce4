"""The paged cache through the storage layer: bit-exact round trips, shared blocks on disk."""

from __future__ import annotations

import os
from pathlib import Path

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.metal import BlockPool, PagedKVCache, make_paged_cache, restore_into
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.format import Layout

KV_HEADS = 2
HEAD_DIM = 32
BLOCK = 4


def _filled(pool: BlockPool, tokens: int, seed: int) -> PagedKVCache:
    mx.random.seed(seed)
    cache = make_paged_cache(pool)
    keys = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM))
    values = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM))
    cache.update_and_fetch(keys, values)
    return cache


def _equal(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    assert isinstance(a, mx.array) and isinstance(b, mx.array)
    return a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("layout", ["single", "blocks"])
@pytest.mark.parametrize("bits", [None, 4])
def test_round_trip_is_bit_exact_and_restores_the_block_table(
    tmp_path: Path, layout: Layout, bits: int | None
) -> None:
    pool = BlockPool(32, KV_HEADS, BLOCK, HEAD_DIM, dtype=mx.float16, bits=bits, group_size=32)
    _filled(pool, 9, seed=1)  # another sequence, so this one's blocks are not 0..n
    cache = _filled(pool, 14, seed=2)
    path = tmp_path / "paged.kvt"
    kvtrio.save_cache(path, list(range(14)), [cache], layout=layout, block_tokens=BLOCK)
    loaded = kvtrio.load_cache(path).caches[0]
    assert type(loaded) is type(cache)
    assert loaded.offset == 14
    assert loaded.block_table == cache.block_table
    assert _equal(loaded.state, cache.state)
    assert loaded.pool.statistics().used_blocks == len(cache.block_table)


def test_empty_cache_round_trips(tmp_path: Path) -> None:
    pool = BlockPool(4, KV_HEADS, BLOCK, HEAD_DIM)
    path = tmp_path / "empty.kvt"
    kvtrio.save_cache(path, [], [make_paged_cache(pool)])
    loaded = kvtrio.load_cache(path).caches[0]
    assert loaded.empty()
    assert loaded.block_table == []


def test_shared_prefix_blocks_are_stored_once(tmp_path: Path) -> None:
    """Two forked sequences saved with block_tokens == block size: the prefix's physical
    blocks become the same stored blocks, and loading both into one pool shares them again."""
    pool = BlockPool(64, KV_HEADS, BLOCK, HEAD_DIM, dtype=mx.float16)
    first = _filled(pool, 12, seed=3)
    second = first.fork()
    tail = mx.random.normal((1, KV_HEADS, 6, HEAD_DIM))
    first.update_and_fetch(tail, tail * 5)
    second.update_and_fetch(tail * 2, tail * 3)
    store = LocalBlockStore(str(tmp_path / "blocks"))
    for name, cache in (("a.kvt", first), ("b.kvt", second)):
        kvtrio.save_cache(
            tmp_path / name, list(range(18)), [cache], layout="blocks", store=store,
            block_tokens=BLOCK,
        )
    stored = len(os.listdir(tmp_path / "blocks"))
    # Per sequence: 5 blocks x 2 tensors; the 3 shared prefix blocks are stored once.
    assert stored == 2 * (5 + 5 - 3)
    target = BlockPool(64, KV_HEADS, BLOCK, HEAD_DIM, dtype=mx.float16)
    with restore_into(target):
        a = kvtrio.load_cache(tmp_path / "a.kvt", store=store).caches[0]
        b = kvtrio.load_cache(tmp_path / "b.kvt", store=store).caches[0]
    assert _equal(a.state, first.state)
    assert _equal(b.state, second.state)
    stats = target.statistics()
    assert stats.used_blocks == 5 + 5 - 3
    assert stats.shared_blocks == 3


def test_restore_shares_only_blocks_with_the_same_contents(tmp_path: Path) -> None:
    """Regression: equal block numbers from another pool, or a block rewritten after a trim,
    must not be shared on restore (they hold other tokens)."""
    one = BlockPool(8, KV_HEADS, BLOCK, HEAD_DIM, dtype=mx.float16)
    two = BlockPool(8, KV_HEADS, BLOCK, HEAD_DIM, dtype=mx.float16)
    a = _filled(one, 8, seed=5)
    b = _filled(two, 8, seed=6)
    assert a.block_table == b.block_table
    kvtrio.save_cache(tmp_path / "a.kvt", list(range(8)), [a])
    kvtrio.save_cache(tmp_path / "b.kvt", list(range(8)), [b])
    a.trim(2)
    rewrite = mx.random.normal((1, KV_HEADS, 2, HEAD_DIM))
    a.update_and_fetch(rewrite, rewrite)
    kvtrio.save_cache(tmp_path / "a2.kvt", list(range(8)), [a])
    target = BlockPool(16, KV_HEADS, BLOCK, HEAD_DIM, dtype=mx.float16)
    with restore_into(target):
        loaded = [kvtrio.load_cache(tmp_path / n).caches[0] for n in ("a.kvt", "b.kvt", "a2.kvt")]
    assert _equal(loaded[1].state, b.state)
    assert _equal(loaded[2].state, a.state)
    assert target.statistics().shared_blocks == 1  # only a's untouched first block
