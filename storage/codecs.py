"""Cache codecs: mlx-lm cache objects <-> header entries + tensors. The MLX side of storage.

Everything here that touches ``mlx.core`` runs on the MLX owner thread only (DESIGN.md
"Threads"); the CPU side (:mod:`~kvtrio.storage.writer`, :mod:`~kvtrio.storage.reader`)
works on the memoryviews and header records this module produces and consumes.

Save (owner thread, in steps the owner can interleave with decoding)::

    snap = snapshot(caches, tokens, model_id=..., config_fingerprint=..., meta=...,
                    attachments=[AttachmentData(schema, metadata, arrays)])
    # O(1): snap.header is the plan (no bytes), snap.views are lazy MLX views.
    host = [materialize_tensor(snap, i, block_tokens=None) for i in range(snap.tensor_count)]
    # each call evals ONE tensor and returns HostTensor(segments=((memoryview, ...), ...)):
    # per piece, contiguous byte segments of the live buffer (zero-copy where possible).
    # then, on a worker thread (no MLX):
    write_single(path, snap.header, [h.segments[0] for h in host])      # or
    write_blocks(path, snap.header, [h.segments for h in host], store, block_tokens=256)
    # drop ``host`` (and ``snap``) afterwards: the memoryviews borrow MLX memory.

Load (zero-copy: the reader fills MLX-owned memory)::

    cf = read_header(path)                          # worker thread, validates everything
    bufs = allocate_load_buffers(cf.header)         # owner (or allocate_slot(i) per step)
    read_tensors(cf, bufs.buffers, store=..., verify=True)   # worker thread
    restored = adopt(cf.header, bufs)               # owner: caches + attachments

  or, from host buffers of your own (one MLX copy per tensor, holding the GIL)::

    arrays = [restore_tensor(cf.header, i, pieces) for i, pieces in enumerate(host)]
    restored = assemble(cf.header, arrays)

Theory of operation:

1. ``snapshot`` makes views only (slices of the live arrays); MLX arrays are immutable
   values, so a later ``update_and_fetch``/``__setitem__`` on the live cache rebinds the
   cache's attribute to a new array and cannot change a view (invariant 1).
2. KV tensors carry ``token_axis=2``: the block layout cuts them every ``block_tokens``
   tokens (token-block-major), so two caches sharing a prefix share those blocks.
3. Every cache's ``min_reusable_offset`` attribute (default 0) is stored per entry and set
   again on restore; :func:`trim_caches` refuses to go below it, or to trim a cache that is
   not trimmable (a rotating cache that has wrapped).
4. Empty caches (no arrays yet) round-trip to empty caches of the same kind and fields.
5. ``restore`` trusts nothing beyond the validated header: per-kind fields are range
   checked and tensor shapes must agree with the offsets (CorruptCacheError otherwise).

Codec protocol (:class:`CacheCodec`; register more with :func:`register_codec`, e.g. the
paged cache of :mod:`kvtrio.metal`):

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

import ctypes
import io
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, Protocol, cast

import attrs
import mlx.core as mx
import numpy as np
from kvtrio.errors import CacheMismatchError, CorruptCacheError
from kvtrio.storage.dtypes import DTYPES
from kvtrio.storage.fileops import byte_view
from kvtrio.storage.format import (
    DTYPE_SIZES,
    Attachment,
    CacheEntry,
    FieldValue,
    Header,
    TensorSlot,
    piece_ranges,
    slot_names,
)
from mlx_lm.models import cache as _mlx_cache_module

__all__ = [
    "MIN_REUSABLE_ATTR",
    "AttachmentData",
    "CacheCodec",
    "LoadBuffers",
    "CacheSnapshot",
    "CodecState",
    "HostTensor",
    "Restored",
    "TensorView",
    "adopt",
    "allocate_load_buffers",
    "allocate_slot",
    "assemble",
    "check_allocatable",
    "cache_structure",
    "codec_for_kind",
    "expect_shape",
    "field_int",
    "header_structure",
    "materialize",
    "materialize_tensor",
    "min_reusable_offset",
    "register_codec",
    "restore",
    "restore_tensor",
    "snapshot",
    "trim_caches",
]

# mlx-lm's cache classes are untyped; treat the module as Any.
mlx_cache: Any = _mlx_cache_module

_ALIGN = 4096  # allocate_slot's piece alignment, for O_DIRECT reads

#: The attribute holding a cache's minimum reusable offset (absent means 0).
MIN_REUSABLE_ATTR = "min_reusable_offset"

#: The MLX dtype and the numpy carrier of every dtype of the closed list.
_MX_DTYPES: dict[str, Any] = {d.name: getattr(mx, d.mlx_attr) for d in DTYPES}
_NP_DTYPES: dict[str, Any] = {d.name: getattr(np, d.numpy_attr) for d in DTYPES}
_DTYPE_NAMES: dict[Any, str] = {dtype: name for name, dtype in _MX_DTYPES.items()}


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


@attrs.frozen
class AttachmentData:
    """Extra arrays saved beside the caches: a schema name, string metadata, arrays."""

    schema: str
    metadata: Mapping[str, str]
    arrays: tuple[Any, ...]


@attrs.frozen
class CacheSnapshot:
    """A planned save: the header plan and one lazy view per slot (``header.slots()`` order)."""

    header: Header
    views: tuple[TensorView, ...]

    @property
    def tensor_count(self) -> int:
        return len(self.views)

    @property
    def nbytes(self) -> int:
        return self.header.nbytes


@attrs.frozen(eq=False)
class HostTensor:
    """One materialized tensor, and the arrays its host memory belongs to.

    ``segments[i]`` is piece ``i`` (one piece in the single layout, one per token block
    in the block layout) as an ordered list of C-contiguous byte memoryviews whose
    concatenation is the piece's bytes in C order. Where the snapshot's view allows it
    they point straight into the live (immutable) MLX buffer, one segment per run of
    leading indices, so nothing is copied; each segment's exporter also holds the array
    it reads, and ``keepalive`` holds them too until the caller drops the HostTensor.
    """

    segments: tuple[tuple[memoryview, ...], ...]
    keepalive: tuple[Any, ...]

    @property
    def pieces(self) -> tuple[memoryview, ...]:
        """Each piece as one contiguous memoryview: zero-copy for a one-segment piece,
        a joined copy otherwise (for tests and scripts; the save paths use ``segments``)."""
        return tuple(s[0] if len(s) == 1 else memoryview(b"".join(s)) for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for piece in self.segments for seg in piece)


@attrs.frozen(eq=False)
class Restored:
    """A loaded cache set."""

    header: Header
    tokens: tuple[int, ...]
    caches: list[Any]
    attachments: list[AttachmentData]


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


def codec_for_kind(kind: str) -> CacheCodec:
    """The codec of a header kind (CorruptCacheError for an unknown kind)."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise CorruptCacheError(f"kind: no codec for cache kind {kind!r:.60}") from None


def _codec_for_cache(cache: Any) -> CacheCodec:
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


def _dtype_name(array: Any) -> str:
    try:
        return _DTYPE_NAMES[array.dtype]
    except KeyError:
        raise TypeError(f"dtype {array.dtype} cannot be saved") from None


def _view_tokens(array: Any, axis: int, stop: int, start: int = 0) -> Any:
    index: tuple[slice, ...] = (slice(None),) * axis + (slice(start, stop),)
    return array[index]


def min_reusable_offset(cache: Any) -> int:
    """The cache's minimum reusable offset (0 when never set)."""
    value = getattr(cache, MIN_REUSABLE_ATTR, 0)
    return int(value) if isinstance(value, int) else 0


# --------------------------------------------------------------------------- mlx-lm codecs


def _kv_tensors(keys: Any, values: Any, tokens: int) -> tuple[TensorView, ...]:
    return (
        TensorView(_view_tokens(keys, 2, tokens), 2),
        TensorView(_view_tokens(values, 2, tokens), 2),
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
        cache._idx = field_int(entry, "idx", 0, stored)
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
        tensors = tuple(TensorView(_view_tokens(a, 2, n), 2) for a in (*cache.keys, *cache.values))
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


# --------------------------------------------------------------------------- snapshot


def _slot_of(view: TensorView) -> TensorSlot:
    shape = tuple(int(d) for d in view.array.shape)
    dtype = _dtype_name(view.array)
    nbytes = DTYPE_SIZES[dtype]
    for d in shape:
        nbytes *= d
    return TensorSlot(shape=shape, dtype=dtype, nbytes=nbytes, token_axis=view.token_axis)


def snapshot(
    caches: Sequence[Any],
    tokens: Sequence[int],
    *,
    model_id: str | None = None,
    config_fingerprint: str | None = None,
    meta: Mapping[str, str] | None = None,
    attachments: Sequence[AttachmentData] = (),
) -> CacheSnapshot:
    """Plan a save of ``caches`` (owner thread): header plan + lazy views, no bytes moved."""
    n_tokens = len(tokens)
    entries: list[CacheEntry] = []
    views: list[TensorView] = []
    for cache in caches:
        entries.append(_snapshot_top(cache, n_tokens, views))
    planned_attachments: list[Attachment] = []
    for attachment in attachments:
        att_views = [TensorView(a) for a in attachment.arrays]
        views.extend(att_views)
        planned_attachments.append(
            Attachment(
                schema=attachment.schema,
                metadata=dict(attachment.metadata),
                tensors=tuple(_slot_of(v) for v in att_views),
            )
        )
    header = Header(
        layout="single",
        tokens=tuple(int(t) for t in tokens),
        caches=tuple(entries),
        created_at=time.time(),
        model_id=model_id,
        config_fingerprint=config_fingerprint,
        attachments=tuple(planned_attachments),
        meta=dict(meta or {}),
    )
    return CacheSnapshot(header=header, views=tuple(views))


def _snapshot_top(cache: Any, n_tokens: int, views: list[TensorView]) -> CacheEntry:
    # Depth-first: an entry's own views, then its children's, matching Header.slots().
    codec = _codec_for_cache(cache)
    state = codec.snapshot(cache)
    own = list(state.tensors)
    views.extend(own)
    children = tuple(_snapshot_top(c, n_tokens, views) for c in state.children)
    offset = state.offset
    if offset is None:
        offset = max((c.offset for c in children), default=n_tokens)
    min_offset = min_reusable_offset(cache)
    if not 0 <= min_offset <= offset:
        raise ValueError(f"min_reusable_offset {min_offset} is outside [0, offset {offset}]")
    return CacheEntry(
        kind=codec.kind,
        offset=offset,
        min_reusable_offset=min_offset,
        trimmable=state.trimmable and all(c.trimmable for c in children),
        fields=dict(state.fields),
        tensors=tuple(_slot_of(v) for v in own),
        children=children,
    )


# --------------------------------------------------------------------------- materialize


def _host_view(array: Any) -> memoryview:
    view = memoryview(array)
    if not view.c_contiguous:
        raise AssertionError("materialized array is not C-contiguous")
    return byte_view(view)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_PyObject_GetBuffer = ctypes.pythonapi.PyObject_GetBuffer
_PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_PyObject_GetBuffer.restype = ctypes.c_int
_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None
_PYBUF_STRIDED_RO = 0x0010 | 0x0008  # PyBUF_STRIDES (includes ND); read-only


def _buffer_address(view: memoryview) -> int:
    """The address of ``view``'s first element (any strides; numpy cannot parse bfloat16)."""
    raw = _PyBuffer()
    if _PyObject_GetBuffer(view, ctypes.byref(raw), _PYBUF_STRIDED_RO) != 0:
        raise AssertionError("memoryview refused its own buffer")
    try:
        return int(raw.buf or 0)
    finally:
        _PyBuffer_Release(ctypes.byref(raw))


def _segment_plan(view: memoryview) -> tuple[int, list[int]] | None:
    """``(segment bytes, byte offsets)`` of ``view``'s C-order contiguous runs, or None
    when its strides are not a non-overlapping, ascending, row-major layout."""
    shape = list(view.shape or ())
    strides = list(view.strides or ())
    run = view.itemsize
    k = len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    if run < _MIN_SEGMENT:  # tiny runs (e.g. a strided last axis): one copy is cheaper
        return None
    lead = [(n, st) for n, st in zip(shape[:k], strides[:k], strict=True) if n != 1]
    inner = run
    for n, st in reversed(lead):
        if st < inner:  # negative, zero or overlapping: not a set of disjoint ordered runs
            return None
        inner = st * n
    if math.prod(n for n, _ in lead) > _MAX_SEGMENTS:
        return None
    offsets = [0]
    for n, st in lead:
        offsets = [o + i * st for o in offsets for i in range(n)]
    return run, offsets


def _zero_copy_segments(array: Any) -> tuple[memoryview, ...] | None:
    """``array``'s (evaluated) bytes as contiguous segments of its own buffer, or None."""
    view = memoryview(array)
    if view.c_contiguous:
        return (byte_view(view),)
    plan = _segment_plan(view)
    if plan is None:
        return None
    run, offsets = plan
    span = offsets[-1] + run
    flat_type = ctypes.c_ubyte * span
    flat = flat_type.from_address(_buffer_address(view))
    flat._kvtrio_owner = (array, view)  # type: ignore[attr-defined]  # lives as long as flat
    base = memoryview(flat).cast("B")
    # Merge runs that touch (e.g. a leading dim of size 1 already folded, or full rows).
    out: list[memoryview] = []
    start, stop = offsets[0], offsets[0] + run
    for off in offsets[1:]:
        if off == stop:
            stop += run
            continue
        out.append(base[start:stop])
        start, stop = off, off + run
    out.append(base[start:stop])
    return tuple(out)


def _materialize_part(array: Any) -> tuple[tuple[memoryview, ...], Any]:
    """Evaluate ``array``; its segments (zero-copy where its strides allow) and owner."""
    mx.eval(array)
    segments = _zero_copy_segments(array) if _ZERO_COPY else None
    if segments is not None:
        return segments, array
    dense = mx.contiguous(array)
    mx.eval(dense)
    return (_host_view(dense),), dense


_MIN_SEGMENT = 64
_MAX_SEGMENTS = 1 << 16

#: Whether materialize may hand out segments of the live buffer (off: always copy).
_ZERO_COPY = os.environ.get("KVTRIO_SAVE_COPY", "") != "1"


def materialize_tensor(
    snap: CacheSnapshot, index: int, *, block_tokens: int | None = None
) -> HostTensor:
    """Evaluate tensor ``index`` of ``snap`` (owner thread) into host byte segments.

    ``block_tokens=None``: one piece (single layout). Otherwise the pieces of
    :func:`~kvtrio.storage.format.piece_ranges` (block layout). Each piece is the
    evaluated view's own memory, described as contiguous segments (no copy), unless its
    strides are not an ordered non-overlapping layout: then it is copied contiguous.
    """
    view = snap.views[index]
    slot = _nth_slot(snap.header, index)
    if block_tokens is None or view.token_axis is None:
        arrays = [view.array]
    else:
        arrays = [
            _view_tokens(view.array, view.token_axis, stop, start)
            for start, stop in piece_ranges(slot, block_tokens)
        ]
    parts = [_materialize_part(a) for a in arrays]
    return HostTensor(
        segments=tuple(segs for segs, _ in parts), keepalive=tuple(owner for _, owner in parts)
    )


def _nth_slot(header: Header, index: int) -> TensorSlot:
    for i, slot in enumerate(header.slots()):
        if i == index:
            return slot
    raise IndexError(index)


def materialize(snap: CacheSnapshot, *, block_tokens: int | None = None) -> list[HostTensor]:
    """Every tensor of ``snap`` (owner thread; for scripts, the actors step one by one)."""
    return [materialize_tensor(snap, i, block_tokens=block_tokens) for i in range(len(snap.views))]


# --------------------------------------------------------------------------- restore


def restore_tensor(header: Header, index: int, pieces: Sequence[Any]) -> Any:
    """Build slot ``index``'s MLX array from its host pieces (owner thread; copies once)."""
    slot = _nth_slot(header, index)
    block_tokens = header.block_tokens if header.layout == "blocks" else None
    ranges = piece_ranges(slot, block_tokens) if len(pieces) > 1 else [(0, 0)]
    if len(pieces) != len(ranges):
        raise ValueError(f"slot {index}: {len(pieces)} pieces, expected {len(ranges)}")
    np_dtype = _NP_DTYPES[slot.dtype]
    arrays = []
    for piece, (start, stop) in zip(pieces, ranges, strict=True):
        shape = list(slot.shape)
        if len(pieces) > 1 and slot.token_axis is not None:
            shape[slot.token_axis] = stop - start
        host = np.frombuffer(piece, dtype=np_dtype).reshape(shape)
        array = mx.array(host)
        if slot.dtype == "bfloat16":
            array = array.view(mx.bfloat16)
        arrays.append(array)
    if len(arrays) == 1:
        out = arrays[0]
    else:
        out = mx.concatenate(arrays, axis=slot.token_axis or 0)
    mx.eval(out)
    return out


def _assemble_entry(entry: CacheEntry, it: Any, path: str) -> Any:
    arrays = [next(it) for _ in entry.tensors]
    children = [
        _assemble_entry(c, it, f"{path}.children[{k}]") for k, c in enumerate(entry.children)
    ]
    try:
        cache = codec_for_kind(entry.kind).restore(entry, arrays, children)
    except CorruptCacheError as exc:
        raise CorruptCacheError(f"{path}.{exc}") from None
    if entry.min_reusable_offset:
        setattr(cache, MIN_REUSABLE_ATTR, entry.min_reusable_offset)
    return cache


def assemble(header: Header, arrays: Sequence[Any]) -> Restored:
    """Build caches and attachments from restored arrays (owner thread; no copies)."""
    slots = list(header.slots())
    if len(arrays) != len(slots):
        raise ValueError(f"header has {len(slots)} slots, got {len(arrays)} arrays")
    for array, slot, name in zip(arrays, slots, slot_names(header), strict=True):
        if tuple(array.shape) != slot.shape:
            raise ValueError(f"{name}: array shape {array.shape} != slot shape {slot.shape}")
    # Pieces from allocate_slot are lazy views of their backing arrays: make them concrete.
    mx.eval(list(arrays))
    it = iter(arrays)
    caches = [_assemble_entry(e, it, f"caches[{i}]") for i, e in enumerate(header.caches)]
    attachments = [
        AttachmentData(a.schema, dict(a.metadata), tuple(next(it) for _ in a.tensors))
        for a in header.attachments
    ]
    return Restored(header=header, tokens=header.tokens, caches=caches, attachments=attachments)


def restore(header: Header, buffers: Sequence[Sequence[Any]]) -> Restored:
    """:func:`restore_tensor` for every slot, then :func:`assemble` (owner thread)."""
    arrays = [restore_tensor(header, i, pieces) for i, pieces in enumerate(buffers)]
    return assemble(header, arrays)


@attrs.frozen(eq=False)
class LoadBuffers:
    """MLX arrays allocated for a load, and writable byte views of them for the reader.

    ``buffers[i][j]`` views ``arrays[i][j]`` (slot ``i``, piece ``j``): the reader's
    ``readinto`` fills MLX memory directly, and :func:`adopt` turns the arrays into caches
    with no copy (block layout: one MLX concatenate per multi-piece tensor). Keep the
    views only until :func:`adopt` returns.
    """

    arrays: tuple[tuple[Any, ...], ...]
    buffers: tuple[tuple[memoryview, ...], ...]


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def check_allocatable(nbytes: int) -> None:
    """Raise MemoryError if ``nbytes`` exceeds the machine's physical memory.

    Allocating what a header claims is bounded by validation (single layout: the file's
    size; blocks: :func:`kvtrio.storage.reader.check_blocks`); this is the last guard,
    since MLX crashes the process (SIGSEGV) instead of raising when an allocation fails.
    """
    limit = _physical_memory()
    if limit is not None and nbytes > limit:
        raise MemoryError(f"loading needs {nbytes} bytes, more than the machine's {limit}")


def allocate_slot(header: Header, index: int) -> tuple[tuple[Any, ...], tuple[memoryview, ...]]:
    """Allocate (owner thread) MLX arrays for slot ``index``'s pieces, and byte views of them.

    Each piece is a view into a slightly larger evaluated uint8 array, placed so that its
    first byte is 4 KiB aligned: the reader can then fill it with O_DIRECT reads. The
    arrays are lazy views; :func:`adopt` evaluates them after the bytes are in. Sizes come
    from the validated header (single layout: bounded by the file size).
    """
    slot = _nth_slot(header, index)
    check_allocatable(slot.nbytes)
    block_tokens = header.block_tokens if header.layout == "blocks" else None
    arrays = []
    views = []
    for start, stop in piece_ranges(slot, block_tokens):
        shape = list(slot.shape)
        if block_tokens is not None and slot.token_axis is not None:
            shape[slot.token_axis] = stop - start
        nbytes = DTYPE_SIZES[slot.dtype]
        for d in shape:
            nbytes *= d
        if nbytes == 0:
            empty = mx.zeros(shape, dtype=_MX_DTYPES[slot.dtype])
            mx.eval(empty)
            arrays.append(empty)
            views.append(memoryview(bytearray()))
            continue
        backing = _untouched_uint8(nbytes + _ALIGN)
        raw = _writable_bytes(backing)
        skip = -int(np.frombuffer(raw, dtype=np.uint8).ctypes.data) % _ALIGN
        arrays.append(backing[skip : skip + nbytes].view(_MX_DTYPES[slot.dtype]).reshape(shape))
        views.append(raw[skip : skip + nbytes])
    return tuple(arrays), tuple(views)


class _UnfilledNpy(io.RawIOBase):
    """A ``.npy`` stream of ``n`` uint8 whose data reads leave the buffer as it is.

    ``mx.load`` allocates the array (malloc: fresh pages, not yet touched) and hands its
    buffer to ``readinto``; nothing is written, so the first touch of those pages is the
    reader's (which pre-faults them as huge pages, see :mod:`kvtrio.storage.memadvise`)
    instead of a zero fill at 4 KiB page-fault speed on the owner thread. The bytes are
    undefined until the reader has filled every one of them (it does, or it raises and
    the arrays are dropped).
    """

    name = "kvtrio-unfilled.npy"

    def __init__(self, n: int) -> None:
        super().__init__()
        text = f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({n},), }}"
        text += " " * (-(len(text) + 11) % 64) + "\n"
        self._head = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()
        self._size = len(self._head) + n
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._pos < len(self._head):
            n = min(len(view), len(self._head) - self._pos)
            view[:n] = self._head[self._pos : self._pos + n]
        else:
            n = min(len(view), self._size - self._pos)
        self._pos += n
        return n


#: On by default (KVTRIO_ALLOC_UNTOUCHED=0 turns it off): the owner thread no longer
#: faults load destinations in with a zero fill (the reader's copy does), which frees it
#: for the server's model steps and keeps the event loop's heartbeat p99 under 2 ms during
#: a tier load on the development VM (1.03-1.25 vs 1.51-2.81 ms); the zero fill, running
#: ahead of the reader threads, made loads 5-10% faster there (docs/benchmarks.md).
_ALLOC_UNTOUCHED = os.environ.get("KVTRIO_ALLOC_UNTOUCHED", "1") != "0"


def _untouched_uint8(nbytes: int) -> Any:
    """An evaluated uint8 array of ``nbytes`` for a load destination (owner thread).

    By default one whose pages MLX has not written (falling back to ``mx.zeros`` if this
    MLX does not load the stream as expected); with ``KVTRIO_ALLOC_UNTOUCHED=0``,
    ``mx.zeros``, which faults every page in here, ahead of the reader.
    """
    if _ALLOC_UNTOUCHED:
        try:
            loaded: Any = mx.load(cast(BinaryIO, _UnfilledNpy(nbytes)))
            mx.eval(loaded)
            if isinstance(loaded, mx.array) and loaded.shape == (nbytes,):
                if loaded.dtype == mx.uint8:
                    return loaded
        except Exception:
            pass
    array = mx.zeros((nbytes,), dtype=mx.uint8)
    mx.eval(array)
    return array


def _writable_bytes(array: Any) -> memoryview:
    view = memoryview(array)
    if view.readonly or not view.c_contiguous:
        raise AssertionError("MLX did not expose a writable contiguous buffer")
    return byte_view(view)


def allocate_load_buffers(header: Header) -> LoadBuffers:
    """:func:`allocate_slot` for every slot (owner thread)."""
    check_allocatable(header.nbytes)
    pairs = [allocate_slot(header, i) for i in range(sum(1 for _ in header.slots()))]
    return LoadBuffers(
        arrays=tuple(a for a, _ in pairs),
        buffers=tuple(b for _, b in pairs),
    )


def adopt(header: Header, loaded: LoadBuffers) -> Restored:
    """Build caches from arrays the reader filled (owner thread; no copy of tensor bytes)."""
    arrays = []
    for slot, pieces in zip(header.slots(), loaded.arrays, strict=True):
        if len(pieces) == 1:
            arrays.append(pieces[0])
        else:
            arrays.append(mx.concatenate(list(pieces), axis=slot.token_axis or 0))
    mx.eval(arrays)
    return assemble(header, arrays)


# --------------------------------------------------------------------------- structure, trim


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
