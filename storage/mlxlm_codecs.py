"""The codecs of mlx-lm's caches (KVCache, RotatingKVCache, QuantizedKVCache,
ChunkedKVCache, ArraysCache, CacheList), registered on import.

KV tensors carry ``token_axis=2`` (theory of operation rule 2 of
:mod:`kvtrio.storage.cacheio`); empty caches (no arrays yet) round-trip to empty caches of
the same kind and fields (rule 4); ``restore`` range checks every per-kind field and
requires tensor shapes to agree with the offsets, raising CorruptCacheError (rule 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtrio.errors import CorruptCacheError
from kvtrio.storage.codecs import (
    CodecState,
    TensorView,
    expect_shape,
    field_int,
    register_codec,
    view_tokens,
)
from kvtrio.storage.format import CacheEntry, FieldValue
from mlx_lm.models import cache as _mlx_cache_module

__all__ = [
    "ArraysCacheCodec",
    "CacheListCodec",
    "ChunkedKVCacheCodec",
    "KVCacheCodec",
    "QuantizedKVCacheCodec",
    "RotatingKVCacheCodec",
]

# mlx-lm's cache classes are untyped; treat the module as Any.
mlx_cache: Any = _mlx_cache_module


def _kv_tensors(keys: Any, values: Any, tokens: int) -> tuple[TensorView, ...]:
    return (
        TensorView(view_tokens(keys, 2, tokens), 2),
        TensorView(view_tokens(values, 2, tokens), 2),
    )


def _check_kv(entry: CacheEntry, arrays: Sequence[Any], tokens: int) -> tuple[Any, Any]:
    if len(arrays) != 2:
        raise CorruptCacheError(f"tensors: a {entry.kind} cache has 2 tensors, got {len(arrays)}")
    keys, values = arrays
    expect_shape(keys, (None, None, tokens, None), "tensors[0]")
    expect_shape(values, (keys.shape[0], keys.shape[1], tokens, None), "tensors[1]")
    return keys, values


class KVCacheCodec:
    """mlx-lm ``KVCache``: keys/values ``[B, H, offset, D]``."""

    kind = "kv"
    cache_types: tuple[type, ...] = (mlx_cache.KVCache,)
    structure_fields: tuple[str, ...] = ()

    def snapshot(self, cache: Any) -> CodecState:
        if cache.keys is None:
            return CodecState(0, True, {}, ())
        return CodecState(
            cache.offset, True, {}, _kv_tensors(cache.keys, cache.values, cache.offset)
        )

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        cache = mlx_cache.KVCache()
        if arrays or entry.offset:
            cache.keys, cache.values = _check_kv(entry, arrays, entry.offset)
            cache.offset = entry.offset
        return cache


class RotatingKVCacheCodec:
    """mlx-lm ``RotatingKVCache`` (ring buffer); not trimmable once it has wrapped."""

    kind = "rotating"
    cache_types: tuple[type, ...] = (mlx_cache.RotatingKVCache,)
    structure_fields: tuple[str, ...] = ("keep", "max_size")

    def snapshot(self, cache: Any) -> CodecState:
        fields: dict[str, FieldValue] = {"keep": cache.keep, "max_size": cache.max_size}
        if cache.keys is None:
            return CodecState(0, True, {**fields, "idx": cache._idx}, ())
        # Before it fills, the buffer may be longer than what it holds: save what it holds.
        stored = min(cache.offset, cache.keys.shape[2])
        fields["idx"] = cache._idx
        return CodecState(
            cache.offset,
            bool(cache.is_trimmable()),
            fields,
            _kv_tensors(cache.keys, cache.values, stored),
        )

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        max_size = field_int(entry, "max_size", 1, 1 << 24)
        keep = field_int(entry, "keep", 0, max_size)
        cache = mlx_cache.RotatingKVCache(max_size=max_size, keep=keep)
        if not arrays and entry.offset == 0:
            cache._idx = field_int(entry, "idx", 0, 0)
            return cache
        if len(arrays) != 2 or arrays[0].ndim != 4:
            raise CorruptCacheError("tensors: a rotating cache has 2 tensors [B, H, T, D]")
        stored = arrays[0].shape[2]
        if stored > entry.offset:
            raise CorruptCacheError(f"tensors[0]: holds {stored} tokens, offset is {entry.offset}")
        cache.keys, cache.values = _check_kv(entry, arrays, stored)
        cache.offset = entry.offset
        # keep == max_size is mlx-lm's degenerate ring: once full, every write lands past
        # the buffer (an empty slice) while _idx still advances, so _idx runs past what is
        # stored, up to the offset. Any other ring keeps _idx within what it stores.
        idx_max = entry.offset if keep == max_size else stored
        cache._idx = field_int(entry, "idx", 0, idx_max)
        return cache


class QuantizedKVCacheCodec:
    """mlx-lm ``QuantizedKVCache``: keys and values are (packed, scales, biases) triples."""

    kind = "quantized"
    cache_types: tuple[type, ...] = (mlx_cache.QuantizedKVCache,)
    structure_fields: tuple[str, ...] = ("group_size", "bits")

    def snapshot(self, cache: Any) -> CodecState:
        fields: dict[str, FieldValue] = {"group_size": cache.group_size, "bits": cache.bits}
        if cache.keys is None:
            return CodecState(0, True, fields, ())
        n = cache.offset
        tensors = tuple(TensorView(view_tokens(a, 2, n), 2) for a in (*cache.keys, *cache.values))
        return CodecState(n, True, fields, tensors)

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        group_size = field_int(entry, "group_size", 1, 1 << 16)
        bits = field_int(entry, "bits", 1, 32)
        cache = mlx_cache.QuantizedKVCache(group_size=group_size, bits=bits)
        if not arrays and entry.offset == 0:
            return cache
        if len(arrays) != 6:
            raise CorruptCacheError(f"tensors: a quantized cache has 6 tensors, got {len(arrays)}")
        for i, a in enumerate(arrays):
            expect_shape(a, (None, None, entry.offset, None), f"tensors[{i}]")
        cache.keys = tuple(arrays[:3])
        cache.values = tuple(arrays[3:])
        cache.offset = entry.offset
        return cache


class ChunkedKVCacheCodec:
    """mlx-lm ``ChunkedKVCache``: holds tokens ``[start_position, offset)``."""

    kind = "chunked"
    cache_types: tuple[type, ...] = (mlx_cache.ChunkedKVCache,)
    structure_fields: tuple[str, ...] = ("chunk_size",)

    def snapshot(self, cache: Any) -> CodecState:
        fields: dict[str, FieldValue] = {
            "chunk_size": cache.chunk_size,
            "start_position": cache.start_position,
        }
        if cache.keys is None:
            return CodecState(cache.offset, True, fields, ())
        held = cache.offset - cache.start_position
        return CodecState(cache.offset, True, fields, _kv_tensors(cache.keys, cache.values, held))

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        cache = mlx_cache.ChunkedKVCache(field_int(entry, "chunk_size", 1, 1 << 24))
        cache.start_position = field_int(entry, "start_position", 0, entry.offset)
        cache.offset = entry.offset
        if arrays:
            held = entry.offset - cache.start_position
            cache.keys, cache.values = _check_kv(entry, arrays, held)
        elif entry.offset:
            raise CorruptCacheError("tensors: a non-empty chunked cache needs 2 tensors")
        return cache


class ArraysCacheCodec:
    """mlx-lm ``ArraysCache`` (SSM / linear-attention state); never trimmable."""

    kind = "arrays"
    cache_types: tuple[type, ...] = (mlx_cache.ArraysCache,)
    structure_fields: tuple[str, ...] = ("size",)

    def snapshot(self, cache: Any) -> CodecState:
        present = tuple(a is not None for a in cache.cache)
        tensors = [TensorView(a) for a in cache.cache if a is not None]
        extras = (cache.left_padding, cache.lengths)
        for extra in extras:
            if extra is not None:
                tensors.append(TensorView(extra))
        fields: dict[str, FieldValue] = {
            "size": len(cache.cache),
            "present": present,
            "left_padding": extras[0] is not None,
            "lengths": extras[1] is not None,
        }
        return CodecState(None, False, fields, tuple(tensors))

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        size = field_int(entry, "size", 0, 1 << 16)
        present = entry.fields.get("present")
        if (
            not isinstance(present, tuple)
            or len(present) != size
            or not all(isinstance(p, bool) for p in present)
        ):
            raise CorruptCacheError(f"fields.present: expected {size} booleans")
        flags = []
        for name in ("left_padding", "lengths"):
            flag = entry.fields.get(name)
            if not isinstance(flag, bool):
                raise CorruptCacheError(f"fields.{name}: expected a boolean")
            flags.append(flag)
        want = sum(bool(p) for p in present) + sum(flags)
        if len(arrays) != want:
            raise CorruptCacheError(f"tensors: expected {want} tensors, got {len(arrays)}")
        it = iter(arrays)
        cache = mlx_cache.ArraysCache(size)
        cache.cache = [next(it) if p else None for p in present]
        cache.left_padding = next(it) if flags[0] else None
        cache.lengths = next(it) if flags[1] else None
        return cache


class CacheListCodec:
    """mlx-lm ``CacheList``: nested caches, each encoded by its own codec."""

    kind = "list"
    cache_types: tuple[type, ...] = (mlx_cache.CacheList,)
    structure_fields: tuple[str, ...] = ()

    def snapshot(self, cache: Any) -> CodecState:
        children = tuple(cache.caches)
        return CodecState(None, True, {}, (), children)

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        if arrays:
            raise CorruptCacheError("tensors: a cache list holds no tensors of its own")
        return mlx_cache.CacheList(*children)


for _codec in (
    KVCacheCodec(),
    RotatingKVCacheCodec(),
    QuantizedKVCacheCodec(),
    ChunkedKVCacheCodec(),
    ArraysCacheCodec(),
    CacheListCodec(),
):
    register_codec(_codec)
