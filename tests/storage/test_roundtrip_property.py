"""Property: any KV-cache geometry, dtype, layout and block size round-trips bit-exact."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtrio.storage.format import Layout
from mlx_lm.models import cache as _mlx_cache_module

from .conftest import assert_same, logical_state

mlx_cache: Any = _mlx_cache_module

DTYPES = [mx.float16, mx.bfloat16, mx.float32, mx.int8, mx.uint32, mx.bool_]


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 3),
    steps=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    trim=st.integers(0, 60),
    head_dim=st.sampled_from([1, 8, 24]),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["single", "blocks"]),
    block_tokens=st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
def test_any_kv_geometry_round_trips(
    heads: int,
    steps: list[int],
    trim: int,
    head_dim: int,
    dtype: Any,
    layout: Layout,
    block_tokens: int,
    seed: int,
) -> None:
    key = mx.random.key(seed)
    cache = mlx_cache.KVCache()
    for n in steps:
        key, k1, k2 = mx.random.split(key, 3)
        k = (mx.random.normal((1, heads, n, head_dim), key=k1) * 50).astype(dtype)
        v = (mx.random.normal((1, heads, n, head_dim), key=k2) * 50).astype(dtype)
        cache.update_and_fetch(k, v)
    cache.trim(trim)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "c.kvt"
        kvtrio.save_cache(path, [], [cache], layout=layout, block_tokens=block_tokens)
        loaded = kvtrio.load_cache(path).caches[0]
    assert_same(logical_state(loaded), logical_state(cache))


@settings(max_examples=25, deadline=None)
@given(
    max_size=st.integers(4, 40),
    keep=st.integers(0, 4),
    steps=st.lists(st.integers(1, 50), min_size=1, max_size=6),
    trim=st.integers(0, 10),
    layout=st.sampled_from(["single", "blocks"]),
    block_tokens=st.integers(1, 16),
)
def test_any_rotating_history_round_trips_and_continues(
    max_size: int, keep: int, steps: list[int], trim: int, layout: Layout, block_tokens: int
) -> None:
    """Prefills and decodes in any order, wrapped or not, trimmed when allowed."""
    live = mlx_cache.RotatingKVCache(max_size=max_size, keep=min(keep, max_size - 1))
    for i, n in enumerate(steps):
        live.update_and_fetch(*kv_steps(n, i))
    if live.is_trimmable():
        live.trim(min(trim, live.offset))
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "r.kvt"
        kvtrio.save_cache(path, [], [live], layout=layout, block_tokens=block_tokens)
        loaded = kvtrio.load_cache(path)
    restored = loaded.caches[0]
    assert loaded.header.trimmable == bool(live.is_trimmable())
    assert_same(logical_state(restored), logical_state(live))
    for j in range(2):
        k, v = kv_steps(1, 100 + j)
        assert_same(list(restored.update_and_fetch(k, v)), list(live.update_and_fetch(k, v)))


def kv_steps(n: int, seed: int) -> tuple[Any, Any]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, 2, n, 8), key=k1), mx.random.normal((1, 2, n, 8), key=k2)
