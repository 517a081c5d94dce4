"""Property: any KV-cache geometry, dtype, layout and block size round-trips bit-exact."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as _mlx_cache_module

from .conftest import assert_same, logical_state

mlx_cache: Any = _mlx_cache_module

DTYPES = [mx.float16, mx.bfloat16, mx.float32, mx.int8, mx.uint32, mx.bool_]


@settings(max_examples=40, deadline=None)
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
    layout: str,
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
