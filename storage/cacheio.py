"""Cache I/O on the MLX side: mlx-lm cache objects <-> header plan + host tensors.

Everything here touches ``mlx.core`` and runs on the MLX owner thread only (docs/design.md
"Threads"); the CPU side (:mod:`~kvtrio.storage.writer`, :mod:`~kvtrio.storage.reader`)
works on the memoryviews and header records this module produces and consumes. Each
cache is encoded by its codec (:mod:`kvtrio.storage.codecs`; mlx-lm's in
:mod:`kvtrio.storage.mlxlm_codecs`); host memory is handled by
:mod:`kvtrio.storage.hostbuffers`.

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
   again on restore; :func:`~kvtrio.storage.structure.trim_caches` refuses to go below it,
   or to trim a cache that is not trimmable (a rotating cache that has wrapped).
4. Empty caches (no arrays yet) round-trip to empty caches of the same kind and fields.
5. ``restore`` trusts nothing beyond the validated header: per-kind fields are range
   checked and tensor shapes must agree with the offsets (CorruptCacheError otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from kvtrio.errors import CorruptCacheError, UnknownCacheKindError
from kvtrio.storage import (
    concat_codec,  # noqa: F401  (registers ConcatenateKVCache's)
    mlxlm_codecs,  # noqa: F401  (registers mlx-lm's codecs)
)
from kvtrio.storage.codecs import (
    MIN_REUSABLE_ATTR,
    TensorView,
    codec_for_cache,
    codec_for_kind,
    min_reusable_offset,
    view_tokens,
)
from kvtrio.storage.format import (
    DTYPE_SIZES,
    Attachment,
    CacheEntry,
    Header,
    TensorSlot,
    piece_nbytes,
    piece_ranges,
)
from kvtrio.storage.headerparse import nth_slot, slot_names
from kvtrio.storage.hostbuffers import NP_DTYPES, LoadBuffers, dtype_name, materialize_part
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions

__all__ = [
    "AttachmentData",
    "CacheSnapshot",
    "HostTensor",
    "Restored",
    "adopt",
    "assemble",
    "materialize",
    "materialize_pieces",
    "materialize_tensor",
    "piece_sizes",
    "restore",
    "restore_tensor",
    "snapshot",
]


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


# --------------------------------------------------------------------------- snapshot


def _slot_of(view: TensorView) -> TensorSlot:
    shape = tuple(int(d) for d in view.array.shape)
    dtype = dtype_name(view.array)
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
        tokens=tuple(map(int, tokens)),
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
    codec = codec_for_cache(cache)
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


def materialize_tensor(
    snap: CacheSnapshot,
    index: int,
    *,
    block_tokens: int | None = None,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> HostTensor:
    """Evaluate tensor ``index`` of ``snap`` (owner thread) into host byte segments.

    ``block_tokens=None``: one piece (single layout). Otherwise the pieces of
    :func:`~kvtrio.storage.format.piece_ranges` (block layout). Each piece is the
    evaluated view's own memory, described as contiguous segments (no copy), unless its
    strides are not an ordered non-overlapping layout (or ``options.zero_copy`` is off):
    then it is copied contiguous.
    """
    view = snap.views[index]
    slot = nth_slot(snap.header, index)
    pieces = range(len(_piece_views(view, slot, block_tokens)))
    segments, keepalive = materialize_pieces(
        snap, index, pieces, block_tokens=block_tokens, options=options, slot=slot
    )
    return HostTensor(segments=segments, keepalive=keepalive)


def _piece_views(view: TensorView, slot: TensorSlot, block_tokens: int | None) -> list[Any]:
    if block_tokens is None or view.token_axis is None:
        return [view.array]
    return [
        view_tokens(view.array, view.token_axis, stop, start)
        for start, stop in piece_ranges(slot, block_tokens)
    ]


def piece_sizes(snap: CacheSnapshot, *, block_tokens: int | None = None) -> list[list[int]]:
    """Bytes of each piece of each tensor of ``snap``, as :func:`materialize_tensor` cuts
    them (header arithmetic only: any thread)."""
    out: list[list[int]] = []
    for view, slot in zip(snap.views, snap.header.slots(), strict=True):
        if block_tokens is None or view.token_axis is None:
            out.append([slot.nbytes])
        else:
            out.append([piece_nbytes(slot, a, b) for a, b in piece_ranges(slot, block_tokens)])
    return out


def materialize_pieces(
    snap: CacheSnapshot,
    index: int,
    pieces: Sequence[int],
    *,
    block_tokens: int | None = None,
    options: IoOptions = DEFAULT_IO_OPTIONS,
    slot: TensorSlot | None = None,
) -> tuple[tuple[tuple[memoryview, ...], ...], tuple[Any, ...]]:
    """Pieces ``pieces`` of tensor ``index`` (owner thread), as :func:`materialize_tensor`
    makes them: their segments and the arrays that own them. One ``mx.eval`` evaluates
    them all (one wait for MLX's stream instead of one per piece)."""
    view = snap.views[index]
    slot = nth_slot(snap.header, index) if slot is None else slot
    every = _piece_views(view, slot, block_tokens)
    arrays = [every[i] for i in pieces]
    mx.eval(arrays)
    parts = [materialize_part(a, options=options) for a in arrays]
    return tuple(segs for segs, _ in parts), tuple(owner for _, owner in parts)


def materialize(
    snap: CacheSnapshot,
    *,
    block_tokens: int | None = None,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> list[HostTensor]:
    """Every tensor of ``snap`` (owner thread; for scripts, the actors step one by one)."""
    return [
        materialize_tensor(snap, i, block_tokens=block_tokens, options=options)
        for i in range(len(snap.views))
    ]


# --------------------------------------------------------------------------- restore


def restore_tensor(header: Header, index: int, pieces: Sequence[Any]) -> Any:
    """Build slot ``index``'s MLX array from its host pieces (owner thread; copies once)."""
    slot = nth_slot(header, index)
    block_tokens = header.block_tokens if header.layout == "blocks" else None
    ranges = piece_ranges(slot, block_tokens) if len(pieces) > 1 else [(0, 0)]
    if len(pieces) != len(ranges):
        raise ValueError(f"slot {index}: {len(pieces)} pieces, expected {len(ranges)}")
    np_dtype = NP_DTYPES[slot.dtype]
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
    except UnknownCacheKindError as exc:
        raise UnknownCacheKindError(f"{path}.{exc}") from None
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
