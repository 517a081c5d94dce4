"""The codec registry and protocol: how one kind of cache maps to a header entry + tensors.

A codec turns one mlx-lm cache object into a header entry (its kind, offset, JSON-able
fields) and lazy tensor views, and back. The save and load flows that drive the codecs
are in :mod:`kvtrio.storage.cacheio`; the codecs of mlx-lm's caches in
:mod:`kvtrio.storage.mlxlm_codecs` (registered when :mod:`~kvtrio.storage.cacheio` is
imported); the paged cache's in :mod:`kvtrio.metal.codec`.

Codec protocol (:class:`CacheCodec`; register more with :func:`register_codec`):

- ``kind``: the header's ``kind`` string (unique); ``cache_types``: the exact Python types
  it encodes (exact ``type(cache) in cache_types``, so subclasses need their own codec).
- ``structure_fields``: the ``fields`` keys that describe a model's cache structure
  (compared by ``load_cache(expect=...)`` against an empty cache from the model).
- ``snapshot(cache) -> CodecState``: offset (None: the number of saved tokens),
  trimmable, JSON-able ``fields``, lazy ``TensorView``s and nested ``children`` caches.
  Views only: no eval, no copies.
- ``restore(entry, arrays, children) -> cache``: build the cache from the entry's fields and
  its arrays (in ``tensors`` order); validate with :func:`field_int` / :func:`expect_shape`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
from kvtrio.errors import CorruptCacheError, UnknownCacheKindError
from kvtrio.storage.format import CacheEntry, FieldValue, Header

__all__ = [
    "MIN_REUSABLE_ATTR",
    "CacheCodec",
    "CodecState",
    "TensorView",
    "check_kinds",
    "codec_for_cache",
    "codec_for_kind",
    "expect_shape",
    "field_int",
    "min_reusable_offset",
    "register_codec",
    "unregister_codec",
    "view_tokens",
]

#: The attribute holding a cache's minimum reusable offset (absent means 0).
MIN_REUSABLE_ATTR = "min_reusable_offset"


@attrs.frozen
class TensorView:
    """A lazy MLX view to save, and the axis the block layout cuts it along (or None)."""

    array: Any
    token_axis: int | None = None


@attrs.frozen
class CodecState:
    """What a codec's ``snapshot`` returns for one cache."""

    offset: int | None
    trimmable: bool
    fields: Mapping[str, FieldValue]
    tensors: tuple[TensorView, ...]
    children: tuple[Any, ...] = ()


class CacheCodec(Protocol):
    """Encodes one kind of cache; see the module docstring for the contract."""

    @property
    def kind(self) -> str: ...

    @property
    def cache_types(self) -> tuple[type, ...]: ...

    @property
    def structure_fields(self) -> tuple[str, ...]: ...

    def snapshot(self, cache: Any) -> CodecState: ...

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any: ...


# --------------------------------------------------------------------------- registry

_BY_KIND: dict[str, CacheCodec] = {}
_BY_TYPE: dict[type, CacheCodec] = {}


def register_codec(codec: CacheCodec, *, replace: bool = False) -> None:
    """Make ``codec`` encode its ``cache_types`` and decode its ``kind``."""
    if not replace and codec.kind in _BY_KIND:
        raise ValueError(f"a codec for kind {codec.kind!r} is already registered")
    _BY_KIND[codec.kind] = codec
    for t in codec.cache_types:
        _BY_TYPE[t] = codec


def unregister_codec(codec: CacheCodec) -> None:
    """Undo :func:`register_codec` of ``codec`` (a test's toy codec, a plugin unloaded):
    its kind and cache types no longer resolve. KeyError if it is not the codec
    registered for its kind."""
    if _BY_KIND.get(codec.kind) is not codec:
        raise KeyError(f"codec for kind {codec.kind!r} is not registered")
    del _BY_KIND[codec.kind]
    for t in [t for t, registered in _BY_TYPE.items() if registered is codec]:
        del _BY_TYPE[t]


def codec_for_kind(kind: str) -> CacheCodec:
    """The codec of a header kind (UnknownCacheKindError for a kind with none: a file of
    a newer writer or of an unregistered plugin is not corrupt)."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise UnknownCacheKindError(f"kind: no codec for cache kind {kind!r:.60}") from None


def check_kinds(header: Header) -> None:
    """Before a load reads a byte of tensor data: every entry's kind has a codec
    (UnknownCacheKindError naming the first that has none)."""

    def walk(entry: CacheEntry, path: str) -> None:
        if entry.kind not in _BY_KIND:
            raise UnknownCacheKindError(f"{path}.kind: no codec for cache kind {entry.kind!r:.60}")
        for k, child in enumerate(entry.children):
            walk(child, f"{path}.children[{k}]")

    for i, entry in enumerate(header.caches):
        walk(entry, f"caches[{i}]")


def codec_for_cache(cache: Any) -> CacheCodec:
    """The codec of a live cache's exact type (TypeError for a type without one)."""
    try:
        return _BY_TYPE[type(cache)]
    except KeyError:
        raise TypeError(f"no kvtrio codec for cache type {type(cache).__name__}") from None


# --------------------------------------------------------------------------- helpers


def field_int(entry: CacheEntry, name: str, lo: int, hi: int) -> int:
    """Field ``name`` of ``entry`` as an int in ``[lo, hi]`` (CorruptCacheError otherwise)."""
    value = entry.fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CorruptCacheError(f"fields.{name}: {value!r:.40} is not an integer in [{lo}, {hi}]")
    return value


def expect_shape(array: Any, shape: Sequence[int | None], what: str) -> None:
    """Require ``array.shape`` to match ``shape`` (None matches any size)."""
    got = tuple(array.shape)
    fits = len(got) == len(shape) and all(
        s is None or s == g for s, g in zip(shape, got, strict=True)
    )
    if not fits:
        raise CorruptCacheError(f"{what}: shape {list(got)} does not fit {list(shape)}")


def view_tokens(array: Any, axis: int, stop: int, start: int = 0) -> Any:
    """``array[..., start:stop]`` along ``axis`` (a lazy view)."""
    index: tuple[slice, ...] = (slice(None),) * axis + (slice(start, stop),)
    return array[index]


def min_reusable_offset(cache: Any) -> int:
    """The cache's minimum reusable offset (0 when never set)."""
    value = getattr(cache, MIN_REUSABLE_ATTR, 0)
    return int(value) if isinstance(value, int) else 0
