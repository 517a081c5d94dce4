"""Readers: a cache file or manifest -> a validated header, then bytes into caller buffers.

CPU only (no trio, no MLX); run on worker threads. Two steps, so the caller can allocate
host buffers (on any thread) between them:

1. :func:`read_header` opens the file, checks the preamble and the header hash, and
   parses and validates every header field (see :mod:`kvtrio.storage.format`) before
   anything in it is used. It returns a :class:`CacheFile`.
2. :func:`read_tensors` fills ``buffers[i][j]`` (slot ``i`` of ``header.slots()``, piece
   ``j`` of :func:`~kvtrio.storage.format.piece_ranges`; the single layout has one piece
   per slot) with ``readinto``-style reads and, when ``verify`` is true (the default),
   checks every tensor's xxh3-64 (single) or every block (blocks) before returning: a
   block against the xxh3-64 its manifest records (format version 2 on) when the store
   is written by its own process alone, else against its sha256 name (a shared store,
   whose blocks other clients write; a version-1 manifest, which records no xxh3).
   :func:`allocate_buffers` makes suitable zero-filled buffers.

docs/design.md invariant 4: a reader never returns bytes it has not checked against the header's
hashes
when asked to verify, and never trusts a header field it has not bounds-checked. Every
validation failure is a CorruptCacheError naming the field; a missing block is a
CacheMissError (a clean miss). ``cancel()`` is polled at every tensor, chunk and block
boundary (between batches of blocks: at most :data:`BLOCK_BATCH_BYTES` per round trip
for stores that declare ``supports_batched_reads``, such as Redis, and
:data:`SMALL_BATCH_BYTES` for the others); when it returns True,
:class:`~kvtrio.errors.OperationCancelled` is raised.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import xxhash
from kvtrio.errors import CacheMissError, CorruptCacheError, OperationCancelled
from kvtrio.storage.blockstore import BlockStore, CorruptBlockError
from kvtrio.storage.fileops import (
    O_NOFOLLOW,
    O_NONBLOCK,
    OS_FILE_OPS,
    FileOps,
    Piece,
    Scatter,
    byte_view,
    pread_full,
)
from kvtrio.storage.format import (
    PREAMBLE,
    BlockRef,
    Header,
    TensorSlot,
    piece_nbytes,
    piece_ranges,
)
from kvtrio.storage.hashpool import HashBatch, HashPool
from kvtrio.storage.headerparse import parse_header, parse_preamble, slot_names
from kvtrio.storage.manifeststore import ManifestStore
from kvtrio.storage.memadvise import PrefaultAhead, prefault
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.rootfd import NotRegularFileError

__all__ = [
    "BLOCK_BATCH_BYTES",
    "SMALL_BATCH_BYTES",
    "CacheFile",
    "allocate_buffers",
    "check_blocks",
    "piece_sizes",
    "read_header",
    "read_manifest",
    "read_tensors",
]

_CHUNK = 8 * 1024 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
# IoOptions measured on the development VM and left off by default there (neither moved
# the cold load; both cost CPU on two shared cores, see docs/benchmarks.md), for machines
# with CPU to spare: ``load_hash_thread`` verifies each chunk on a helper thread while the
# next is read; ``prefault_ahead`` pre-faults destinations ahead of the reads
# (kvtrio.storage.memadvise; ``prefault_huge`` for huge pages). Buffered reads by
# default: the kernel's readahead keeps the device busy while the destination's pages
# are faulted in and the bytes hashed, where O_DIRECT into fresh memory (``load_direct``)
# left the device idle during each read's page faults (measured: 1.40 vs 1.05 GB/s per
# 512 MiB on the development VM). ``willneed`` asks for each tensor's whole range up
# front (POSIX_FADV_WILLNEED) instead of relying on sequential readahead: +5% median
# here but a wider spread.
_SUB = 1024 * 1024
_BEHIND = 2

# Block-layout reads from a store that declares ``supports_batched_reads`` go this many
# bytes per call (one pipelined round trip on Redis): enough to amortize the round trip, bounded so
# cancellation is polled often and the store buffers little.
BLOCK_BATCH_BYTES = 16 * 1024 * 1024
# Any other store gets up to this many bytes per ``read_many_into`` call (the local store
# opens its directory once per call, not once per block; cancellation is polled between
# calls, and the batch is still in cache when its blocks are hashed).
SMALL_BATCH_BYTES = 1024 * 1024

Cancel = Callable[[], bool] | None


@attrs.frozen
class CacheFile:
    """A validated cache file or manifest: its header and where its tensor data starts."""

    path: str
    header: Header
    data_start: int
    file_size: int
    st_dev: int
    st_ino: int


def _check_cancel(cancel: Cancel) -> None:
    if cancel is not None and cancel():
        raise OperationCancelled("read cancelled at a step boundary")


def read_header(
    path: str, *, file_ops: FileOps = OS_FILE_OPS, follow_links: bool = True
) -> CacheFile:
    """Open ``path`` and return its checked header (raises CorruptCacheError, OSError).

    Only a regular file is read: anything else (a FIFO, which a plain open would wait on
    forever; a directory; a device) is CacheMissError, and so is a symbolic link when
    ``follow_links`` is false (the tier's files: nothing under its root is followed).
    """
    flags = os.O_RDONLY | O_NONBLOCK | (0 if follow_links else O_NOFOLLOW)
    try:
        fd = file_ops.open(path, flags)
    except NotRegularFileError:  # refused by a tier's rooted file operations
        raise CacheMissError(f"{path}: not a regular file") from None
    except OSError as exc:
        # Also a link on the way under a tier's root (its file operations follow none).
        if exc.errno == errno.ELOOP:
            raise CacheMissError(f"{path}: a symbolic link, not followed") from None
        raise
    try:
        info = file_ops.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CacheMissError(f"{path}: not a regular file")
        size = info.st_size
        raw = bytearray(min(PREAMBLE.size, size))
        pread_full(file_ops, fd, memoryview(raw), 0)
        preamble = parse_preamble(bytes(raw), size)
        body = bytearray(preamble.header_len)  # <= file size, checked by parse_preamble
        got = pread_full(file_ops, fd, memoryview(body), PREAMBLE.size)
        if got != preamble.header_len:
            raise CorruptCacheError(f"header: short read ({got} of {preamble.header_len} bytes)")
        header = parse_header(bytes(body), preamble, size)
    finally:
        file_ops.close(fd)
    return CacheFile(
        path=os.path.abspath(path),
        header=header,
        data_start=preamble.data_start,
        file_size=size,
        st_dev=info.st_dev,
        st_ino=info.st_ino,
    )


def read_manifest(manifests: ManifestStore, name: str) -> CacheFile:
    """Get manifest ``name`` from ``manifests`` and return its checked header.

    FileNotFoundError when the store has no such manifest (as for a missing file);
    CorruptCacheError when its bytes fail the checks or it is not a block-layout
    manifest (a store holds no tensor data, so nothing else can be read from one).
    """
    data = manifests.get(name)
    if data is None:
        raise FileNotFoundError(errno.ENOENT, "no such manifest", name)
    preamble = parse_preamble(data[: PREAMBLE.size], len(data))
    body = data[PREAMBLE.size : PREAMBLE.size + preamble.header_len]
    header = parse_header(body, preamble, len(data))
    if header.layout != "blocks":
        raise CorruptCacheError(f"manifest {name}: layout is {header.layout!r}, not 'blocks'")
    return CacheFile(
        path=name,
        header=header,
        data_start=preamble.data_start,
        file_size=len(data),
        st_dev=0,
        st_ino=0,
    )


def check_blocks(header: Header, store: BlockStore) -> None:
    """Before allocating for a block-layout load: every block is present (CacheMissError).

    A store that declares ``supports_sizes`` (it tells a block's size without reading
    it: one round trip on Redis, a stat for
    :class:`~kvtrio.storage.blockstore.LocalBlockStore`) also has each size checked
    against the manifest (CorruptCacheError), so a crafted manifest cannot make the
    caller allocate more than the store holds.
    """
    names = list(slot_names(header))
    slot_refs = [slot.blocks or () for slot in header.slots()]
    # One batch for the whole entry (a local store looks through one descriptor), then
    # the checks slot by slot, as before.
    every = [ref.sha256 for refs in slot_refs for ref in refs]
    sizes = iter(store.stored_sizes(every) if store.supports_sizes and every else ())
    present = iter(() if store.supports_sizes else store.has_many(every))
    for refs, name in zip(slot_refs, names, strict=True):
        if store.supports_sizes:
            stored = [next(sizes) for _ in refs]
            for ref, size in zip(refs, stored, strict=True):
                if size is not None and size != ref.nbytes:
                    raise CorruptCacheError(
                        f"block {ref.sha256}: stored size {size} != expected {ref.nbytes}"
                    )
            here = [size is not None for size in stored]
        else:
            here = [next(present) for _ in refs]
        for j, (ref, ok) in enumerate(zip(refs, here, strict=True)):
            if not ok:
                raise CacheMissError(f"{name}.blocks[{j}]: block {ref.sha256} is missing")


def piece_sizes(header: Header) -> list[list[int]]:
    """Byte sizes of the buffers :func:`read_tensors` expects: per slot, per piece."""
    return [_slot_piece_sizes(header, slot) for slot in header.slots()]


def _slot_piece_sizes(header: Header, slot: TensorSlot) -> list[int]:
    if header.layout == "single":
        return [slot.nbytes]
    return [piece_nbytes(slot, a, b) for a, b in piece_ranges(slot, header.block_tokens)]


def allocate_buffers(header: Header) -> list[list[bytearray]]:
    """Zero-filled host buffers shaped for :func:`read_tensors` (lazily backed by the OS)."""
    return [[bytearray(n) for n in sizes] for sizes in piece_sizes(header)]


def _flat(buffer: memoryview, name: str, expected: int) -> memoryview:
    view = byte_view(buffer)
    if view.readonly:
        raise ValueError(f"{name}: buffer is read-only")
    if len(view) != expected:
        raise ValueError(f"{name}: buffer has {len(view)} bytes, needs {expected}")
    return view


def _flat_piece(piece: Piece, name: str, expected: int) -> Piece:
    """A caller's destination as flat writable bytes of ``expected`` length in all."""
    if not isinstance(piece, Scatter):
        return _flat(memoryview(piece), name, expected)
    parts = tuple(_flat(part, name, part.nbytes) for part in piece.parts)
    if sum(len(part) for part in parts) != expected:
        raise ValueError(f"{name}: buffer has {piece.nbytes} bytes, needs {expected}")
    return Scatter(parts)


def _digest_hex(piece: Piece, digest: Any) -> str:
    """``digest`` (a fresh hashlib or xxhash object) over ``piece``'s bytes, in order."""
    for part in piece.parts if isinstance(piece, Scatter) else (piece,):
        digest.update(part)
    hexed: str = digest.hexdigest()
    return hexed


def _xxh3_hex(piece: Piece) -> str:
    return _digest_hex(piece, xxhash.xxh3_64())


def _sha256_hex(piece: Piece) -> str:
    return _digest_hex(piece, hashlib.sha256())


def read_tensors(
    cache_file: CacheFile,
    buffers: Sequence[Sequence[Piece]],
    *,
    indices: Sequence[int] | None = None,
    store: BlockStore | None = None,
    verify: bool = True,
    cancel: Cancel = None,
    file_ops: FileOps = OS_FILE_OPS,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> None:
    """Fill ``buffers`` with the tensor bytes, verifying hashes when ``verify`` is true.

    ``buffers[k]`` receives slot ``indices[k]`` (default: every slot, in order), so
    callers may read a few tensors per call (one per step, or several threads at once).
    Single layout: reads the file of ``cache_file`` (which must still be the same file,
    same size). Block layout: reads each block from ``store`` (required), re-hashing it
    when ``verify`` (against the manifest's xxh3 for a store its process alone writes,
    else against its sha256 name: module docstring); a missing block raises
    CacheMissError. A block's destination may be a
    :class:`~kvtrio.storage.fileops.Scatter` (its runs of a tensor of several kv heads),
    filled and hashed in order.
    ``options`` choose how (direct I/O, drop-behind, helper threads), never what is read
    or checked.
    """
    header = cache_file.header
    all_slots = list(header.slots())
    all_names = list(slot_names(header))
    chosen = list(range(len(all_slots))) if indices is None else list(indices)
    if len(buffers) != len(chosen):
        raise ValueError(f"{len(chosen)} slots to read, got {len(buffers)} buffer lists")
    slots, names, views = [], [], []
    for index, got in zip(chosen, buffers, strict=True):
        if not 0 <= index < len(all_slots):
            raise IndexError(f"slot {index} out of range")
        # Only the chosen slots' piece sizes: callers read a slot or a step per call, and
        # a long cache in the block layout has hundreds of pieces per slot.
        name, want = all_names[index], _slot_piece_sizes(header, all_slots[index])
        if len(got) != len(want):
            raise ValueError(f"{name}: {len(got)} buffers, needs {len(want)}")
        slots.append(all_slots[index])
        names.append(name)
        views.append([_flat_piece(b, name, n) for b, n in zip(got, want, strict=True)])
    if header.layout == "single":
        if any(isinstance(v, Scatter) for pieces in views for v in pieces):
            raise ValueError("a single-layout file is read into whole buffers, not scattered")
        plain = [[v for v in pieces if isinstance(v, memoryview)] for pieces in views]
        _read_single(cache_file, slots, names, plain, verify, cancel, file_ops, options)
    else:
        if store is None:
            raise ValueError("the blocks layout needs a block store")
        _read_blocks(slots, names, views, store, verify, cancel, options)


def _open_checked(cache_file: CacheFile, flags: int, file_ops: FileOps) -> int:
    fd = file_ops.open(cache_file.path, flags)
    try:
        info = file_ops.fstat(fd)
        if (info.st_dev, info.st_ino, info.st_size) != (
            cache_file.st_dev,
            cache_file.st_ino,
            cache_file.file_size,
        ):
            raise CorruptCacheError("file: replaced or resized since its header was read")
    except BaseException:
        file_ops.close(fd)
        raise
    return fd


def _open_direct(cache_file: CacheFile, file_ops: FileOps) -> int | None:
    if not _O_DIRECT:
        return None
    try:
        return _open_checked(cache_file, os.O_RDONLY | _O_DIRECT, file_ops)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # no O_DIRECT on this filesystem
            return None
        raise


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _read_single(
    cache_file: CacheFile,
    slots: list[TensorSlot],
    names: list[str],
    views: list[list[memoryview]],
    verify: bool,
    cancel: Cancel,
    file_ops: FileOps,
    options: IoOptions,
) -> None:
    # Buffered reads by default (see IoOptions.load_direct): readahead keeps the device
    # busy while the destination is faulted in and hashed, and chunks read are dropped
    # behind. With ``load_direct``, buffers whose address is 4 KiB aligned (made so by
    # hostbuffers.allocate_slot) are filled with O_DIRECT reads; the unaligned tail of each
    # tensor, and any unaligned buffer, goes through the page cache either way.
    fd = _open_checked(cache_file, os.O_RDONLY, file_ops)
    dfd: int | None = None
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, cache_file.data_start, 0, os.POSIX_FADV_SEQUENTIAL)
        if options.load_direct and any(_direct_bulk(v) for (v,) in views):
            dfd = _open_direct(cache_file, file_ops)
        if options.willneed and dfd is None and hasattr(os, "posix_fadvise"):
            _advise_willneed(fd, cache_file, slots, views)
        # Optionally (``prefault_ahead``, ``load_hash_thread``): fresh destinations pre-faulted
        # chunk by chunk on a helper thread ahead of the reads, and each chunk read hashed
        # on another while the next read is in flight.
        chunks = [
            view[start : start + _CHUNK]
            for (view,) in views
            for start in range(0, len(view), _CHUNK)
        ]
        # One helper thread: a tensor's chunks are hashed in order.
        hashing = verify and options.load_hash_thread and len(chunks) > 1
        ahead_views = chunks if options.prefaults_ahead else []
        with (
            HashPool(1 if hashing else 0, name="kvtrio-verify") as hash_pool,
            hash_pool.batch() as hashes,
            PrefaultAhead(ahead_views, huge=options.prefault_huge) as ahead,
        ):
            # Buffered reads drop what they have read a few chunks back from the page
            # cache, as the streaming writer does (a cold load does not leave the file
            # cached).
            behind = options.drop_behind and dfd is None
            read = _SingleRead(
                cache_file,
                fd,
                dfd,
                file_ops,
                verify,
                cancel,
                hashes,
                prefault_ahead=bool(ahead_views),
                drop_behind=file_ops.drop_behind if behind else None,
            )
            for slot, name, (view,) in zip(slots, names, views, strict=True):
                _check_cancel(cancel)
                read.tensor(slot, name, view, chunks, ahead)
    finally:
        file_ops.close(fd)
        if dfd is not None:
            file_ops.close(dfd)


def _direct_bulk(view: memoryview) -> int:
    """How many leading bytes of ``view`` an O_DIRECT read may fill (0: none, unaligned)."""
    if _address(view) % _DIRECT_ALIGN != 0:
        return 0
    return len(view) - len(view) % _DIRECT_ALIGN


def _advise_willneed(
    fd: int, cache_file: CacheFile, slots: list[TensorSlot], views: list[list[memoryview]]
) -> None:
    """Ask for each tensor's whole range up front (``IoOptions.willneed``)."""
    for slot, (view,) in zip(slots, views, strict=True):
        if len(view):
            where = cache_file.data_start + (slot.off or 0)
            os.posix_fadvise(fd, where, len(view), os.POSIX_FADV_WILLNEED)


@attrs.define
class _SingleRead:
    """One single-layout read in progress: the open descriptors and what each read does.

    Tensors are read in order, chunk by chunk (:data:`_CHUNK`): chunk ``next_chunk`` of
    the caller's list is the next one to fill. ``dfd`` (O_DIRECT) fills each aligned
    tensor's aligned bulk; ``fd`` (buffered) the rest, in :data:`_SUB` pieces. ``hashes``
    (a batch on a one-thread pool, or inline) takes each chunk's hash update when it runs
    on a helper; inline, chunks are hashed piece by piece as they arrive.
    """

    cache_file: CacheFile
    fd: int
    dfd: int | None
    file_ops: FileOps
    verify: bool
    cancel: Cancel
    hashes: HashBatch
    prefault_ahead: bool = False
    drop_behind: Callable[[int, int, int], None] | None = None
    behind: deque[tuple[int, int]] = attrs.field(factory=deque)
    next_chunk: int = 0

    def tensor(
        self,
        slot: TensorSlot,
        name: str,
        view: memoryview,
        chunks: list[memoryview],
        ahead: PrefaultAhead,
    ) -> None:
        """Fill ``view`` with tensor ``name``'s bytes and check them against its xxh3."""
        base = self.cache_file.data_start + (slot.off or 0)
        bulk = _direct_bulk(view) if self.dfd is not None else 0
        hasher = xxhash.xxh3_64()
        threaded = self.verify and not self.hashes.inline
        inline = hasher if self.verify and not threaded else None
        for start in range(0, len(view), _CHUNK):
            _check_cancel(self.cancel)
            chunk = chunks[self.next_chunk]
            if self.prefault_ahead:
                ahead.ready(self.next_chunk)
            self.next_chunk += 1
            direct_part = max(0, min(len(chunk), bulk - start))
            if self._fill(chunk, base + start, direct_part, inline) != len(chunk):
                raise CorruptCacheError(f"{name}: file truncated inside the tensor")
            if threaded:
                self.hashes.submit(hasher.update, chunk)
            self._read_done(base + start, len(chunk))
        self.hashes.wait()
        if self.verify and hasher.hexdigest() != slot.xxh3:
            raise CorruptCacheError(f"{name}.xxh3: tensor bytes do not match their hash")

    def _fill(
        self, chunk: memoryview, offset: int, direct_part: int, hasher: xxhash.xxh3_64 | None
    ) -> int:
        """Read ``chunk`` from ``offset`` (its first ``direct_part`` bytes with O_DIRECT),
        feeding ``hasher`` as bytes arrive; the number of bytes read (short: truncated)."""
        got = 0
        if direct_part:
            assert self.dfd is not None
            got = pread_full(self.file_ops, self.dfd, chunk[:direct_part], offset)
        if hasher is not None and got:
            hasher.update(chunk[:got])
        if got != direct_part:
            return got
        # Buffered: 1 MiB pieces, each hashed right after the kernel copied it (still in
        # cache), while readahead keeps the device busy.
        while got < len(chunk):
            piece = chunk[got : got + _SUB]
            n = pread_full(self.file_ops, self.fd, piece, offset + got)
            if hasher is not None:
                hasher.update(piece[:n])
            got += n
            if n < len(piece):
                break
        return got

    def _read_done(self, offset: int, length: int) -> None:
        """Drop the page cache :data:`_BEHIND` chunks back (buffered reads only)."""
        if self.drop_behind is None:
            return
        self.behind.append((offset, length))
        while len(self.behind) > _BEHIND:
            self.drop_behind(self.fd, *self.behind.popleft())


def _read_blocks(
    slots: list[TensorSlot],
    names: list[str],
    views: list[list[Piece]],
    store: BlockStore,
    verify: bool,
    cancel: Cancel,
    options: IoOptions,
) -> None:
    # Every block to read, in order, checked against the header before any I/O.
    wanted: list[tuple[str, BlockRef, Piece]] = []  # (label, reference, buffer)
    for slot, name, pieces in zip(slots, names, views, strict=True):
        refs = slot.blocks or ()
        if len(refs) != len(pieces):
            raise CorruptCacheError(
                f"{name}.blocks: {len(refs)} blocks, the tensor has {len(pieces)} token blocks"
            )
        for j, (ref, piece) in enumerate(zip(refs, pieces, strict=True)):
            if ref.nbytes != piece.nbytes:
                raise CorruptCacheError(
                    f"{name}.blocks[{j}].bytes: {ref.nbytes}, the token block has {piece.nbytes}"
                )
            wanted.append((f"{name}.blocks[{j}]", ref, piece))
    # A store that declares batched reads (RedisBlockStore: one pipelined round trip per
    # batch) gets up to BLOCK_BATCH_BYTES per call; the others SMALL_BATCH_BYTES.
    batched = store.supports_batched_reads
    # A store that declares verified reads (RedisBlockStore: each block re-hashed while
    # the bytes are cache-hot and the next replies are still on the wire) verifies for us.
    # Scattered destinations (a tier allocates them only for a store that declares
    # scatter reads) go to read_many_scattered_into, and the store's own verification is
    # for whole buffers alone.
    scattered = any(isinstance(piece, Scatter) for _, _, piece in wanted)
    store_verifies = verify and store.supports_verified_reads and not scattered
    # docs/design.md invariant 4: every block is checked before the load returns; by the
    # xxh3-64 its manifest records only where no other client writes the store
    # (BlockStore.written_by_others), else by its sha256 name.
    by_xxh3 = verify and not store.written_by_others
    for batch in _block_batches([piece.nbytes for _, _, piece in wanted], batched):
        _check_cancel(cancel)
        items = [wanted[i] for i in batch]
        if options.prefaults_ahead:
            for _, _, piece in items:
                for part in piece.parts if isinstance(piece, Scatter) else (piece,):
                    prefault(part, huge=options.prefault_huge)
        pairs = [(ref.sha256, piece) for _, ref, piece in items]
        whole = [(sha, piece) for sha, piece in pairs if isinstance(piece, memoryview)]
        if scattered:
            found = store.read_many_scattered_into(pairs)
        elif store_verifies:
            try:
                found = store.read_many_verified_into(whole)
            except CorruptBlockError as exc:
                named = _name_block_field(exc, items)
                if named is None:
                    raise
                raise named from exc
        else:
            found = store.read_many_into(whole)
        for (label, ref, piece), ok in zip(items, found, strict=True):
            if not ok:
                raise CacheMissError(f"{label}: block {ref.sha256} is missing")
            if not verify or store_verifies:
                continue
            if by_xxh3 and ref.xxh3 is not None:
                if _xxh3_hex(piece) != ref.xxh3:
                    raise CorruptCacheError(f"{label}.xxh3: block content does not match its hash")
            elif _sha256_hex(piece) != ref.sha256:
                raise CorruptCacheError(f"{label}.sha256: block content does not hash to its name")


def _name_block_field(
    exc: CorruptBlockError, items: Sequence[tuple[str, BlockRef, Piece]]
) -> CorruptCacheError | None:
    """The store's error about block ``<sha256>`` restated with the header field it fills
    (``caches[i].tensors[j].blocks[k]``), as the reader's own checks name fields."""
    for label, ref, _ in items:
        if ref.sha256 == exc.name:
            return CorruptCacheError(f"{label}.{exc.field}: {exc.detail}")
    return None


def _block_batches(sizes: Sequence[int], batched: bool) -> Iterator[range]:
    """Index ranges of about BLOCK_BATCH_BYTES (SMALL_BATCH_BYTES when not ``batched``),
    at least one block each."""
    limit = BLOCK_BATCH_BYTES if batched else SMALL_BATCH_BYTES
    start = 0
    while start < len(sizes):
        end = start + 1
        total = sizes[start]
        while end < len(sizes) and total + sizes[end] <= limit:
            total += sizes[end]
            end += 1
        yield range(start, end)
        start = end
