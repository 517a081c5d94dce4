"""Builders of every mlx-lm cache kind with random contents, shared by the storage tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as _mlx_cache_module

# mlx-lm's cache classes are untyped.
mlx_cache: Any = _mlx_cache_module

B, H, D = 1, 2, 64


def kv(n: int, dtype: Any = mx.float16, seed: int = 0) -> tuple[Any, Any]:
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return (
        mx.random.normal((B, H, n, D), key=k1).astype(dtype),
        mx.random.normal((B, H, n, D), key=k2).astype(dtype),
    )


def fill(cache: Any, steps: list[int], seed: int = 0) -> Any:
    for i, n in enumerate(steps):
        cache.update_and_fetch(*kv(n, seed=seed * 100 + i))
    return cache


def make_kv(steps: list[int] | None = None, dtype: Any = mx.float16) -> Any:
    cache = mlx_cache.KVCache()
    for i, n in enumerate(steps if steps is not None else [300, 1, 1]):
        cache.update_and_fetch(*kv(n, dtype=dtype, seed=i))
    return cache


def make_rotating(wrapped: bool) -> Any:
    cache = mlx_cache.RotatingKVCache(max_size=128, keep=4)
    return fill(cache, [200, 1, 1, 1] if wrapped else [40, 1, 1])


def make_quantized() -> Any:
    return fill(mlx_cache.QuantizedKVCache(group_size=32, bits=4), [70, 1])


def make_chunked() -> Any:
    cache = fill(mlx_cache.ChunkedKVCache(chunk_size=64), [50, 30])
    cache.maybe_trim_front()
    return fill(cache, [1])


def make_arrays() -> Any:
    cache = mlx_cache.ArraysCache(3)
    cache[0] = mx.random.normal((B, 3, 16))
    cache[2] = mx.random.normal((B, 4, 8, 8)).astype(mx.bfloat16)
    return cache


def make_trimmed_to_zero() -> Any:
    """Arrays allocated but holding no token: zero-size tensors on disk."""
    cache = make_kv([5])
    cache.trim(5)
    return cache


def make_list() -> Any:
    return mlx_cache.CacheList(make_kv([20]), make_arrays())


#: name -> builder of a non-empty cache of that kind
BUILDERS: dict[str, Callable[[], Any]] = {
    "kv": make_kv,
    "kv_bf16": lambda: make_kv([33], dtype=mx.bfloat16),
    "kv_f32": lambda: make_kv([7], dtype=mx.float32),
    "kv_trimmed_to_zero": make_trimmed_to_zero,
    "rotating": lambda: make_rotating(False),
    "rotating_wrapped": lambda: make_rotating(True),
    "quantized": make_quantized,
    "chunked": make_chunked,
    "arrays": make_arrays,
    "list": make_list,
}

#: name -> builder of an empty cache of that kind
EMPTY_BUILDERS: dict[str, Callable[[], Any]] = {
    "kv": mlx_cache.KVCache,
    "rotating": lambda: mlx_cache.RotatingKVCache(max_size=64, keep=2),
    "quantized": lambda: mlx_cache.QuantizedKVCache(group_size=32, bits=8),
    "chunked": lambda: mlx_cache.ChunkedKVCache(chunk_size=32),
    "arrays": lambda: mlx_cache.ArraysCache(2),
    "list": lambda: mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.ArraysCache(1)),
}


def logical_state(cache: Any) -> list[Any]:
    """Everything that defines a cache's behaviour, as arrays and scalars."""
    name = type(cache).__name__
    if name == "CacheList":
        return [name, *(logical_state(c) for c in cache.caches)]
    if name == "ArraysCache":
        return [name, cache.cache, cache.left_padding, cache.lengths]
    if cache.keys is None:
        return [name, None, cache.offset]
    if name == "QuantizedKVCache":
        n = cache.offset
        return [
            name,
            n,
            cache.group_size,
            cache.bits,
            *(a[..., :n, :] for a in (*cache.keys, *cache.values)),
        ]
    if name == "RotatingKVCache":
        n = min(cache.offset, cache.keys.shape[2])
        return [
            name,
            cache.offset,
            cache._idx,
            cache.keep,
            cache.max_size,
            cache.keys[..., :n, :],
            cache.values[..., :n, :],
        ]
    if name == "ChunkedKVCache":
        n = cache.offset - cache.start_position
        return [
            name,
            cache.offset,
            cache.start_position,
            cache.chunk_size,
            cache.keys[..., :n, :],
            cache.values[..., :n, :],
        ]
    n = cache.offset
    return [name, n, cache.keys[..., :n, :], cache.values[..., :n, :]]


def assert_same(a: Any, b: Any) -> None:
    """Bit-exact equality of nested logical states (arrays compared with dtype)."""
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), (a, b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, mx.array):
        assert isinstance(b, mx.array)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert mx.array_equal(a, b).item()
    else:
        assert a == b, (a, b)


@pytest.fixture
def cache_dir(tmp_path: Any) -> Any:
    return tmp_path


def tokens_for(caches: list[Any]) -> list[int]:
    """A token list as long as the caches hold (save_cache refuses any other count)."""
    from kvtrio.storage.cacheio import snapshot

    entries = snapshot(caches, []).header.caches
    return list(range(entries[0].offset if entries else 0))
