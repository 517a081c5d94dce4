"""Host buffers: MLX arrays <-> memoryviews, without copies where the layout allows.

Owner thread only (everything here touches ``mlx.core``). Two directions:

- Save: :func:`materialize_part` evaluates an array and hands out its bytes as
  C-contiguous segments of the live (immutable) MLX buffer: for a strided view, one
  segment per run of leading indices, found with ``PyObject_GetBuffer`` through ctypes
  (numpy cannot parse bfloat16); else one contiguous copy (always, without
  ``IoOptions.zero_copy``).
- Load: :func:`allocate_slot` / :func:`allocate_load_buffers` allocate MLX arrays whose
  writable byte views the reader fills in place (4 KiB aligned, for O_DIRECT), by default
  without a zero fill (:class:`_UnfilledNpy`; ``IoOptions.alloc_untouched``);
  :func:`kvtrio.storage.cacheio.adopt`
  then turns them into caches without copying.

The MLX and numpy dtypes of the closed list derive from :mod:`kvtrio.storage.dtypes`.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
from collections.abc import Sequence
from typing import Any, BinaryIO, cast

import attrs
import mlx.core as mx
import numpy as np
from kvtrio.storage.dtypes import DTYPES
from kvtrio.storage.fileops import Piece, Scatter, byte_view
from kvtrio.storage.format import DTYPE_SIZES, Header, TensorSlot, piece_ranges
from kvtrio.storage.headerparse import nth_slot
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions

__all__ = [
    "MX_DTYPES",
    "NP_DTYPES",
    "LoadBuffers",
    "allocate_load_buffers",
    "allocate_slot",
    "allocate_slots",
    "check_allocatable",
    "dtype_name",
    "materialize_part",
]

_ALIGN = 4096  # allocate_slot's piece alignment, for O_DIRECT reads

#: The MLX dtype and the numpy carrier (the element type its bytes are read as) of each dtype.
MX_DTYPES: dict[str, Any] = {d.name: getattr(mx, d.mlx_attr) for d in DTYPES}
NP_DTYPES: dict[str, Any] = {d.name: getattr(np, d.numpy_attr) for d in DTYPES}
_DTYPE_NAMES: dict[Any, str] = {dtype: name for name, dtype in MX_DTYPES.items()}


def dtype_name(array: Any) -> str:
    """The header name of ``array``'s dtype (TypeError for one outside the closed list)."""
    try:
        return _DTYPE_NAMES[array.dtype]
    except KeyError:
        raise TypeError(f"dtype {array.dtype} cannot be saved") from None


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


def materialize_part(
    array: Any, *, options: IoOptions = DEFAULT_IO_OPTIONS
) -> tuple[tuple[memoryview, ...], Any]:
    """Evaluate ``array``; its segments (zero-copy where its strides allow, and
    ``options.zero_copy``) and owner."""
    mx.eval(array)
    segments = _zero_copy_segments(array) if options.zero_copy else None
    if segments is not None:
        return segments, array
    dense = mx.contiguous(array)
    mx.eval(dense)
    return (_host_view(dense),), dense


_MIN_SEGMENT = 64
_MAX_SEGMENTS = 1 << 16


@attrs.frozen(eq=False)
class LoadBuffers:
    """MLX arrays allocated for a load, and writable byte views of them for the reader.

    ``buffers[i][j]`` views ``arrays[i][j]`` (slot ``i``, piece ``j``), or, when slot
    ``i`` has one array for several pieces (consecutive blocks, :func:`allocate_slot`),
    piece ``j``'s bytes of ``arrays[i][0]``: the reader's ``readinto`` fills MLX memory
    directly, and :func:`adopt` turns the arrays into caches with no copy (block layout:
    one MLX concatenate per tensor of several arrays). Keep the views only until
    :func:`adopt` returns. A tier's load joins each step once it is read
    (``ColdTier._read_pipelined``): ``arrays[i]`` is then slot ``i``'s joined tensor
    alone, and ``buffers[i]`` the views of the pieces it was joined from.
    """

    arrays: tuple[tuple[Any, ...], ...]
    buffers: tuple[tuple[Piece, ...], ...]


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


def allocate_slots(
    header: Header,
    indices: Sequence[int],
    *,
    options: IoOptions = DEFAULT_IO_OPTIONS,
    scatter: bool = False,
) -> list[tuple[tuple[Any, ...], tuple[Piece, ...]]]:
    """:func:`allocate_slot` for each of ``indices`` (a load's step), every tensor carved
    from one backing (:class:`_Arena`): one allocation per step instead of one per tensor.
    An allocation costs about 0.15 ms of the owner's time whatever its size, so a step of
    several small tensors (the served bench's 4 of 1 MB, or 20 of SmolLM2's 1.5 MB) spent
    more on allocating than on anything else the owner does for a load.

    ``scatter`` (a block store that reads into runs): a block-layout tensor of several
    kv heads is one array, each piece a :class:`~kvtrio.storage.fileops.Scatter` of its
    runs of it (:func:`_allocate_scattered`), so nothing is joined after the read.
    """
    takes = [_backing_takes(header, index, scatter) for index in indices]
    total = sum(_aligned(n) for slot_takes in takes for n in slot_takes)
    check_allocatable(total)
    arena = _Arena(total, options)
    out: list[tuple[tuple[Any, ...], tuple[Piece, ...]]] = []
    for index in indices:
        slot = nth_slot(header, index)
        if scatter and _strided(header, slot):
            assert slot.token_axis is not None
            ranges = piece_ranges(slot, header.block_tokens)
            out.append(_allocate_scattered(slot.shape, slot.dtype, slot.token_axis, ranges, arena))
        else:
            out.append(allocate_slot(header, index, options=options, arena=arena))
    return out


def _strided(header: Header, slot: TensorSlot) -> bool:
    """Whether ``slot`` is a block-layout tensor of several pieces that are not
    consecutive bytes of it (several kv heads), and of some bytes."""
    return (
        header.layout == "blocks"
        and slot.token_axis is not None
        and slot.nbytes > 0
        and len(piece_ranges(slot, header.block_tokens)) > 1
        and not _pieces_contiguous(slot.shape, slot.token_axis)
    )


def allocate_slot(
    header: Header,
    index: int,
    *,
    options: IoOptions = DEFAULT_IO_OPTIONS,
    arena: _Arena | None = None,
) -> tuple[tuple[Any, ...], tuple[memoryview, ...]]:
    """Allocate (owner thread) MLX arrays for slot ``index``'s pieces, and byte views of them.

    Each piece is a view into a slightly larger evaluated uint8 array, placed so that its
    first byte is 4 KiB aligned: the reader can then fill it with O_DIRECT reads. A
    block-layout tensor whose pieces are consecutive bytes of it (every axis before the
    token axis of length 1) gets one array and one backing, with a view per piece
    (:func:`_allocate_contiguous`): nothing is joined after the read. Any other
    block-layout tensor gets one backing too, with an array per piece
    (:func:`_allocate_blockwise`), joined after the read (not so with
    :func:`allocate_slots`' ``scatter``). The arrays are lazy views;
    :func:`adopt` evaluates them after the bytes are in. Sizes come from the validated
    header (single layout: bounded by the file size). Without a fill unless
    ``options.alloc_untouched`` is off (:func:`_untouched_uint8`). With ``arena``, every
    backing is a part of it (:func:`allocate_slots`), sized by :func:`_backing_takes`.
    """
    slot = nth_slot(header, index)
    check_allocatable(slot.nbytes)
    if arena is None:
        arena = _Arena(sum(_aligned(n) for n in _backing_takes(header, index, False)), options)
    block_tokens = header.block_tokens if header.layout == "blocks" else None
    ranges = piece_ranges(slot, block_tokens)
    if len(ranges) > 1 and slot.token_axis is not None:
        if _pieces_contiguous(slot.shape, slot.token_axis):
            return _allocate_contiguous(slot.shape, slot.dtype, slot.token_axis, ranges, arena)
        if slot.nbytes:
            return _allocate_blockwise(slot.shape, slot.dtype, slot.token_axis, ranges, arena)
    arrays = []
    views = []
    for shape, nbytes in _piece_shapes(slot, block_tokens, ranges):
        if nbytes == 0:
            empty = mx.zeros(shape, dtype=MX_DTYPES[slot.dtype])
            mx.eval(empty)
            arrays.append(empty)
            views.append(memoryview(bytearray()))
            continue
        backing, raw, skip = arena.take(nbytes)
        arrays.append(backing[skip : skip + nbytes].view(MX_DTYPES[slot.dtype]).reshape(shape))
        views.append(raw[skip : skip + nbytes])
    return tuple(arrays), tuple(views)


def _piece_shapes(
    slot: TensorSlot, block_tokens: int | None, ranges: list[tuple[int, int]]
) -> list[tuple[list[int], int]]:
    """Each piece's shape and bytes when every piece is an array of its own."""
    out = []
    for start, stop in ranges:
        shape = list(slot.shape)
        if block_tokens is not None and slot.token_axis is not None:
            shape[slot.token_axis] = stop - start
        out.append((shape, DTYPE_SIZES[slot.dtype] * math.prod(shape)))
    return out


def _backing_takes(header: Header, index: int, scatter: bool) -> list[int]:
    """The bytes :func:`allocate_slot` takes from its arena for slot ``index``, in order."""
    slot = nth_slot(header, index)
    block_tokens = header.block_tokens if header.layout == "blocks" else None
    ranges = piece_ranges(slot, block_tokens)
    if len(ranges) > 1 and slot.token_axis is not None:
        if _pieces_contiguous(slot.shape, slot.token_axis) or (scatter and _strided(header, slot)):
            return [slot.nbytes]
        if slot.nbytes:
            return [_blockwise_layout(slot.shape, slot.dtype, slot.token_axis, ranges)[2]]
    return [n for _, n in _piece_shapes(slot, block_tokens, ranges) if n]


def _aligned(nbytes: int) -> int:
    return nbytes + -nbytes % _ALIGN


class _Arena:
    """One evaluated MLX uint8 backing, handed out front to back in parts that each start
    at a 4 KiB boundary (for O_DIRECT reads): the backing of one tensor, or of every
    tensor of a load's step (:func:`allocate_slots`)."""

    def __init__(self, nbytes: int, options: IoOptions) -> None:
        self.nbytes = nbytes
        self.options = options
        self.backing: Any = None  # allocated at the first take: a slot of no bytes takes none
        self.raw = memoryview(b"")
        self.next = self.end = 0

    def take(self, nbytes: int) -> tuple[Any, memoryview, int]:
        """``(backing, its writable memory, offset)`` of the next ``nbytes``."""
        if self.backing is None:
            self.backing, self.raw, self.next = _aligned_backing(self.nbytes, self.options)
            self.end = self.next + self.nbytes
        at = self.next
        if at + nbytes > self.end:
            raise AssertionError(f"arena overrun: {nbytes} bytes at {at} of {self.end}")
        self.next = at + _aligned(nbytes)
        return self.backing, self.raw, at


def _aligned_backing(nbytes: int, options: IoOptions) -> tuple[Any, memoryview, int]:
    """An MLX uint8 backing of ``nbytes`` plus 4 KiB, its writable memory, and the skip
    to its first 4 KiB-aligned byte (where the tensor's bytes start)."""
    backing = _untouched_uint8(nbytes + _ALIGN, options.alloc_untouched)
    raw = _writable_bytes(backing)
    skip = -int(np.frombuffer(raw, dtype=np.uint8).ctypes.data) % _ALIGN
    return backing, raw, skip


def _pieces_contiguous(shape: tuple[int, ...], token_axis: int | None) -> bool:
    """Whether a block-layout tensor's token pieces are consecutive byte ranges of the
    whole tensor (every axis before its token axis has length 1: mlx-lm's caches of one
    sequence and one kv head, or any tensor split on its first axis)."""
    return token_axis is not None and math.prod(shape[:token_axis]) == 1


def _allocate_contiguous(
    shape: tuple[int, ...],
    dtype: str,
    token_axis: int,
    ranges: list[tuple[int, int]],
    arena: _Arena,
) -> tuple[tuple[Any, ...], tuple[memoryview, ...]]:
    """:func:`allocate_slot` for a tensor whose pieces are consecutive.

    One evaluated backing for the whole tensor, one MLX array of it (so nothing is
    joined after the read), and one writable view per piece into that backing, in piece
    order: the reader fills each piece in place. The backing's first byte is 4 KiB
    aligned; a piece's is too when the pieces before it are whole multiples of 4 KiB
    (others are read buffered, as any unaligned destination)."""
    nbytes = DTYPE_SIZES[dtype] * math.prod(shape)
    per_token = nbytes // shape[token_axis]  # > 0 tokens: a tensor of several pieces
    backing, raw, skip = arena.take(nbytes)
    array = backing[skip : skip + nbytes].view(MX_DTYPES[dtype]).reshape(list(shape))
    views = tuple(raw[skip + start * per_token : skip + stop * per_token] for start, stop in ranges)
    return (array,), views


def _allocate_blockwise(
    shape: tuple[int, ...],
    dtype: str,
    token_axis: int,
    ranges: list[tuple[int, int]],
    arena: _Arena,
) -> tuple[tuple[Any, ...], tuple[memoryview, ...]]:
    """:func:`allocate_slot` for a tensor whose pieces are not consecutive (several kv
    heads: each token block holds a run of every head).

    One backing for every piece, each piece at the next 4 KiB boundary after the one
    before, and one MLX array per piece viewing it (:func:`adopt` joins them): one
    allocation per tensor instead of one per token block. An allocation costs about
    0.1 ms on the owner thread whatever its size, so a 4k-token entry of 30 layers in
    256-token blocks (1,020 pieces) spent about 0.1-0.2 s of the generation thread's time
    allocating (docs/benchmarks.md, "a 94 MB cold load, part by part")."""
    sizes, offsets, total = _blockwise_layout(shape, dtype, token_axis, ranges)
    backing, raw, skip = arena.take(total)
    arrays = []
    views = []
    for (start, stop), size, offset in zip(ranges, sizes, offsets, strict=True):
        piece_shape = list(shape)
        piece_shape[token_axis] = stop - start
        at = skip + offset
        arrays.append(backing[at : at + size].view(MX_DTYPES[dtype]).reshape(piece_shape))
        views.append(raw[at : at + size])
    return tuple(arrays), tuple(views)


def _allocate_scattered(
    shape: tuple[int, ...],
    dtype: str,
    token_axis: int,
    ranges: list[tuple[int, int]],
    arena: _Arena,
) -> tuple[tuple[Any, ...], tuple[Piece, ...]]:
    """:func:`allocate_slot` for a tensor whose pieces are not consecutive, read by a
    store that scatters: one array of the whole tensor, and each token block's
    destination its runs of it, one per leading index (kv head), in the order the block
    holds them (token-block-major: every head's tokens of the block, head after head).

    The reader fills and hashes the runs in place (one ``preadv`` a block), so the
    tensor needs no join: no second copy of its bytes and no second set of fresh pages
    (docs/benchmarks.md, "a 94 MB cold load, part by part": the joins were 57-73 ms)."""
    nbytes = DTYPE_SIZES[dtype] * math.prod(shape)
    lead = math.prod(shape[:token_axis])
    per_token = nbytes // (lead * shape[token_axis])  # one leading index's token, in bytes
    row = per_token * shape[token_axis]
    backing, raw, skip = arena.take(nbytes)
    array = backing[skip : skip + nbytes].view(MX_DTYPES[dtype]).reshape(list(shape))
    pieces = tuple(
        Scatter(
            tuple(
                raw[skip + i * row + start * per_token : skip + i * row + stop * per_token]
                for i in range(lead)
            )
        )
        for start, stop in ranges
    )
    return (array,), pieces


def _blockwise_layout(
    shape: tuple[int, ...], dtype: str, token_axis: int, ranges: list[tuple[int, int]]
) -> tuple[list[int], list[int], int]:
    """Each piece's bytes and offset in a blockwise backing (each at the next 4 KiB
    boundary after the one before), and the backing's bytes."""
    per_token = DTYPE_SIZES[dtype] * math.prod(shape) // shape[token_axis]
    sizes = [(stop - start) * per_token for start, stop in ranges]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + _aligned(size))
    return sizes, offsets, offsets[-1] + sizes[-1]


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


def _untouched_uint8(nbytes: int, untouched: bool) -> Any:
    """An evaluated uint8 array of ``nbytes`` for a load destination (owner thread).

    ``untouched`` (the default, ``IoOptions.alloc_untouched``): one whose pages MLX has not
    written (falling back to ``mx.zeros`` if this MLX does not load the stream as
    expected). The owner thread then no longer faults load destinations in with a zero
    fill (the reader's copy does), which frees it for the server's model steps and keeps
    the event loop's heartbeat p99 under 2 ms during a tier load on the development VM
    (1.03-1.25 vs 1.51-2.81 ms). Otherwise ``mx.zeros``, which faults every page in here,
    ahead of the reader: that made loads 5-10% faster there (docs/benchmarks.md).
    """
    if untouched:
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


def allocate_load_buffers(
    header: Header, *, options: IoOptions = DEFAULT_IO_OPTIONS
) -> LoadBuffers:
    """:func:`allocate_slot` for every slot (owner thread)."""
    check_allocatable(header.nbytes)
    count = sum(1 for _ in header.slots())
    pairs = [allocate_slot(header, i, options=options) for i in range(count)]
    return LoadBuffers(
        arrays=tuple(a for a, _ in pairs),
        buffers=tuple(b for _, b in pairs),
    )
