"""The codec of mlx-lm's ConcatenateKVCache, registered on import (by cacheio).

A ConcatenateKVCache holds keys/values ``[B, H, T, D]`` grown by concatenation, with no
step padding; ``trim`` lowers ``offset`` only. Saved: the first ``offset`` tokens (a
trimmed cache is stored trimmed); restored with ``offset`` equal to the stored tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtrio.errors import CorruptCacheError
from kvtrio.storage.codecs import CodecState, TensorView, expect_shape, register_codec, view_tokens
from kvtrio.storage.format import CacheEntry
from mlx_lm.models import cache as _mlx_cache_module

__all__ = ["ConcatenateKVCacheCodec"]

mlx_cache: Any = _mlx_cache_module


class ConcatenateKVCacheCodec:
    """mlx-lm ``ConcatenateKVCache``: keys/values ``[B, H, offset, D]``."""

    kind = "concatenate"
    cache_types: tuple[type, ...] = (mlx_cache.ConcatenateKVCache,)
    structure_fields: tuple[str, ...] = ()

    def snapshot(self, cache: Any) -> CodecState:
        if cache.keys is None:
            return CodecState(0, True, {}, ())
        tensors = (
            TensorView(view_tokens(cache.keys, 2, cache.offset), 2),
            TensorView(view_tokens(cache.values, 2, cache.offset), 2),
        )
        return CodecState(cache.offset, True, {}, tensors)

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        cache = mlx_cache.ConcatenateKVCache()
        if not arrays and not entry.offset:
            return cache
        if len(arrays) != 2:
            raise CorruptCacheError(
                f"tensors: a {entry.kind} cache has 2 tensors, got {len(arrays)}"
            )
        keys, values = arrays
        expect_shape(keys, (None, None, entry.offset, None), "tensors[0]")
        expect_shape(values, (keys.shape[0], keys.shape[1], entry.offset, None), "tensors[1]")
        cache.keys, cache.values, cache.offset = keys, values, entry.offset
        return cache


register_codec(ConcatenateKVCacheCodec())
