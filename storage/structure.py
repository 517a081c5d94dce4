"""Cache structure (kinds, structural fields, nesting) and trimming live caches.

:func:`header_structure` and :func:`cache_structure` give comparable descriptions of a
saved header and of a model's (possibly empty) caches, for ``load_cache(expect=...)``.
:func:`trim_caches` keeps theory of operation rule 3 of :mod:`kvtrio.storage.cacheio`:
it never trims a cache below its ``min_reusable_offset``, nor one that is not trimmable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtrio.errors import CacheMismatchError
from kvtrio.storage.cacheio import snapshot
from kvtrio.storage.codecs import codec_for_kind, min_reusable_offset
from kvtrio.storage.format import CacheEntry, Header
from mlx_lm.models import cache as _mlx_cache_module

__all__ = ["cache_structure", "header_structure", "trim_caches"]

# mlx-lm's cache classes are untyped; treat the module as Any.
mlx_cache: Any = _mlx_cache_module


def _entry_structure(entry: CacheEntry) -> tuple[Any, ...]:
    codec = codec_for_kind(entry.kind)
    fields = tuple((k, entry.fields.get(k)) for k in codec.structure_fields)
    return (entry.kind, fields, tuple(_entry_structure(c) for c in entry.children))


def header_structure(header: Header) -> tuple[Any, ...]:
    """The cache structure a header describes: kinds, structural fields, nesting."""
    return tuple(_entry_structure(e) for e in header.caches)


def cache_structure(caches: Sequence[Any]) -> tuple[Any, ...]:
    """The structure of live (possibly empty) caches, comparable to :func:`header_structure`."""
    return header_structure(snapshot(caches, ()).header)


def _trim_floor_check(cache: Any, n: int, path: str) -> None:
    if not cache.is_trimmable():
        raise CacheMismatchError(f"{path}: {type(cache).__name__} is not trimmable")
    floor = min_reusable_offset(cache)
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int) and offset - n < floor:
        raise CacheMismatchError(
            f"{path}: trimming {n} of {offset} tokens goes below the minimum "
            f"reusable offset {floor}"
        )
    for k, child in enumerate(
        getattr(cache, "caches", ()) if type(cache) is mlx_cache.CacheList else ()
    ):
        _trim_floor_check(child, n, f"{path}.caches[{k}]")


def trim_caches(caches: Sequence[Any], n: int) -> int:
    """Trim ``n`` tokens from every cache, never below a minimum reusable offset.

    Raises CacheMismatchError (trimming nothing) when a cache is not trimmable (a wrapped
    rotating cache, an SSM state) or the new length would fall below any cache's minimum
    reusable offset. Returns ``n``.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if n == 0:
        return 0
    for i, cache in enumerate(caches):
        _trim_floor_check(cache, n, f"caches[{i}]")
    for cache in caches:
        cache.trim(n)
    return n
