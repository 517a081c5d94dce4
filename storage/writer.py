"""Durable writers: host memoryviews -> a published cache file or manifest. CPU only.

No trio, no MLX: these run on worker threads over immutable host bytes (the MLX owner
produced them with :func:`kvtrio.storage.cacheio.materialize_tensor`).

- :func:`write_single` writes the single-file layout. ``tensors[i]`` is the bytes of the
  i-th slot of ``header.slots()`` (exactly ``slot.nbytes``): one C-contiguous buffer, or
  a :data:`Segmented` list of contiguous segments whose concatenation is those bytes
  (what :func:`~kvtrio.storage.cacheio.materialize_tensor` hands out: segments of the
  live MLX buffer, so a save copies nothing before the write).
- :func:`write_blocks` writes the block layout: ``pieces[i]`` are the i-th slot's pieces
  (each a buffer or segments) as :func:`kvtrio.storage.format.piece_ranges` cuts them
  (KV tensors token-block-major, so a shared prefix is shared blocks). Blocks go to
  ``store`` and are durable before the manifest naming them is published, as a file or
  through a :class:`~kvtrio.storage.manifeststore.ManifestStore` (``put``).

Theory of operation (docs/design.md invariants 4, 5 and 6):

1. Bytes go to a tmp file created O_EXCL, mode 0600, in the target's own directory
   (so the rename cannot cross filesystems), named ``.<name>.<random>.kvtrio-tmp``.
2. Tensor bytes are hashed (xxh3-64) as they are written; the header's fixed-width hash
   fields are patched in place afterwards, so the header's length never changes. By
   default the data goes out as buffered writes straight from the sources (no copy in
   user space), with writeback started chunk by chunk and written chunks dropped from
   the page cache, while a helper thread hashes; ``direct=True`` (or
   ``IoOptions.save_direct``) uses O_DIRECT through aligned bounce buffers instead. Both
   make the same file (each tensor's tail zero-padded to 4 KiB).
3. Write what you can read: the header is run through the reader's own validation
   (:func:`~kvtrio.storage.writable.check_writable`) before a byte is written, so a save
   never publishes a file its reader refuses (InvalidInputError, CacheMismatchError).
4. Publication is fsync(file) -> rename(tmp, final) -> fsync(dir) (F_FULLFSYNC on macOS);
   a final name never names a partial file. The result returns only after all three; if
   the directory fsync fails, the final name is removed again before the error propagates
   (a save that failed leaves nothing behind it).
5. ``cancel()`` is polled at every tensor, chunk and block boundary. When it returns True
   the tmp file is removed and :class:`~kvtrio.errors.OperationCancelled` is raised; on
   any other error the tmp file is removed too and the error propagates.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import attrs
import numpy as np
import xxhash
from kvtrio.errors import CorruptCacheError, OperationCancelled
from kvtrio.storage.blockstore import BlockStore
from kvtrio.storage.fileops import (
    OS_FILE_OPS,
    TMP_SUFFIX,
    FileOps,
    byte_view,
    pwrite_full,
)
from kvtrio.storage.format import (
    FORMAT_VERSION,
    BlockRef,
    Header,
    TensorSlot,
    align_up,
    encode_file_prefix,
    encode_header,
    encode_preamble,
    piece_nbytes,
    piece_ranges,
    place_single,
)
from kvtrio.storage.hashpool import HashPool
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.writable import check_writable

if TYPE_CHECKING:
    from kvtrio.storage.manifeststore import ManifestStore

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "TMP_SUFFIX",
    "IndexKeysOf",
    "Segmented",
    "WriteResult",
    "as_bytes",
    "publish_bytes",
    "tmp_path_for",
    "write_blocks",
    "write_single",
]

DEFAULT_BLOCK_TOKENS = 256
_CHUNK = 8 * 1024 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
# Hash-and-write (or gather-and-hash) piece size: fits in L2, so the second pass over a
# piece (the kernel's copy, or the hash of the bounce buffer) reads it from cache.
_SUB = 1024 * 1024
# Buffered writes: chunks whose writeback may be in flight before the oldest is waited
# for and dropped from the page cache.
_BEHIND = 4
# Buffered streaming writes by default (measured faster than O_DIRECT through bounce
# buffers on the development VM: no copy in user space, see docs/benchmarks.md);
# IoOptions.save_direct makes O_DIRECT the default again (macOS has no O_DIRECT).

Cancel = Callable[[], bool] | None
#: The prefix-index keys of a manifest about to be published (its placed header).
IndexKeysOf = Callable[[Header], Sequence[str]]

#: One tensor's (or block's) bytes: a C-contiguous buffer, or ordered contiguous segments.
Segmented = memoryview | Sequence[memoryview]


def _segments(data: Segmented) -> list[memoryview]:
    """``data`` as flat byte views, empty segments dropped (no copy)."""
    if isinstance(data, memoryview):
        views = [as_bytes(data)]
    else:
        views = [as_bytes(seg) for seg in data]
    return [v for v in views if len(v)]


def _chunks(segments: Sequence[memoryview], size: int) -> list[tuple[int, list[memoryview]]]:
    """Cut the concatenation of ``segments`` into ``size``-byte chunks (the last may be
    short): ``(offset, the segment slices that make it)`` each, no copy."""
    out: list[tuple[int, list[memoryview]]] = []
    parts: list[memoryview] = []
    fill = 0
    pos = 0
    for seg in segments:
        start = 0
        while start < len(seg):
            take = min(size - fill, len(seg) - start)
            parts.append(seg[start : start + take])
            fill += take
            start += take
            if fill == size:
                out.append((pos, parts))
                pos += fill
                parts, fill = [], 0
    if parts:
        out.append((pos, parts))
    return out


@attrs.frozen
class WriteResult:
    """What was published: the placed header, where, and the byte counts."""

    path: str
    header: Header
    file_bytes: int  # size of the published file (cache file or manifest)
    new_block_bytes: int = 0  # block layout: bytes newly stored (dedup skipped the rest)


def as_bytes(buffer: memoryview) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (no copy)."""
    return byte_view(buffer)


def tmp_path_for(path: str) -> str:
    """A fresh tmp name beside ``path`` (GC removes such debris after a crash)."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.{secrets.token_hex(8)}{TMP_SUFFIX}")


def _check_cancel(cancel: Cancel) -> None:
    if cancel is not None and cancel():
        raise OperationCancelled("write cancelled at a step boundary")


class _TmpFile:
    """An O_EXCL tmp file that is either published or removed."""

    def __init__(self, path: str, ops: FileOps, *, direct: bool = False) -> None:
        self.final = os.path.abspath(path)
        self.tmp = tmp_path_for(self.final)
        self.ops = ops
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.direct = direct and _O_DIRECT != 0
        if self.direct:
            try:
                self.fd: int | None = ops.open(self.tmp, flags | _O_DIRECT, 0o600)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT
                    raise
                self.direct = False
        self.fd = ops.open(self.tmp, flags, 0o600)

    def publish(self) -> None:
        assert self.fd is not None
        self.ops.fsync(self.fd)
        fd, self.fd = self.fd, None
        self.ops.close(fd)
        self.ops.rename(self.tmp, self.final)
        self.tmp = ""
        try:
            self.ops.fsync_dir(os.path.dirname(self.final))
        except BaseException:
            # Not durable, so not acknowledged: a failed save leaves no final name.
            try:
                self.ops.unlink(self.final)
            except OSError:
                pass
            raise

    def discard(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                self.ops.close(fd)
            except OSError:
                pass
        if self.tmp:
            tmp, self.tmp = self.tmp, ""
            try:
                self.ops.unlink(tmp)
            except OSError:
                pass


def publish_bytes(path: str, data: bytes, *, file_ops: FileOps = OS_FILE_OPS) -> None:
    """Durably publish small ``data`` at ``path`` (tmp, fsync, rename, fsync dir)."""
    tmp = _TmpFile(path, file_ops)
    try:
        assert tmp.fd is not None
        pwrite_full(file_ops, tmp.fd, memoryview(data), 0)
        tmp.publish()
    except BaseException:
        tmp.discard()
        raise


class _BufferedWrites:
    """Buffered writes streamed straight from the sources: no copy in user space.

    Each chunk is hashed and written in L2-sized pieces (the kernel's copy into the page
    cache then reads the piece from cache, not memory), its writeback is started at once
    (``write_behind``), and a chunk :data:`_BEHIND` chunks back is waited for and dropped
    from the page cache (``drop_behind``): the device stays busy, and the page cache
    pages are recycled instead of a whole cache's worth of fresh ones being faulted in.
    A ``FileOps`` whose hints do nothing makes the same writes plain buffered writes. Each
    tensor's tail is zero-padded to 4 KiB, as the O_DIRECT path does, so
    both paths make the same file.
    """

    def __init__(self, ops: FileOps, fd: int, *, hash_thread: bool = True) -> None:
        self.ops = ops
        self.fd = fd
        self.behind: deque[tuple[int, int]] = deque()
        # xxh3 runs on this helper thread (xxhash releases the GIL above 64 KiB) while
        # the caller's thread writes: the hash and the kernel's copy overlap. One thread:
        # a tensor's chunks are hashed in order.
        self.hash_pool = HashPool(1 if hash_thread else 0)

    def _written(self, offset: int, length: int) -> None:
        if not length:
            return
        self.ops.write_behind(self.fd, offset, length)
        self.behind.append((offset, length))
        while len(self.behind) > _BEHIND:
            self.ops.drop_behind(self.fd, *self.behind.popleft())

    def write(self, data: memoryview, offset: int) -> None:
        pwrite_full(self.ops, self.fd, data, offset)

    def write_hashed(self, segments: Sequence[memoryview], offset: int, cancel: Cancel) -> str:
        hasher = xxhash.xxh3_64()
        chunks = _chunks(segments, _CHUNK)
        with self.hash_pool.batch() as batch:
            # One chunk: hashed piece by piece beside its writes, while each is in cache.
            hashed = len(chunks) > 1 and not batch.inline
            if hashed:
                for _, parts in chunks:
                    batch.submit(_update, hasher, parts)
            self._write_chunks(chunks, offset, cancel, None if hashed else hasher)
        return hasher.hexdigest()

    def _write_chunks(
        self,
        chunks: Sequence[tuple[int, list[memoryview]]],
        offset: int,
        cancel: Cancel,
        hasher: xxhash.xxh3_64 | None,
    ) -> None:
        """Write one tensor's ``chunks`` from ``offset``, feeding ``hasher`` (if any) each
        piece before it is written."""
        for index, (start, parts) in enumerate(chunks):
            _check_cancel(cancel)
            where = offset + start
            for part in parts:
                for at in range(0, len(part), _SUB):
                    piece = part[at : at + _SUB]
                    if hasher is not None:
                        hasher.update(piece)
                    pwrite_full(self.ops, self.fd, piece, where)
                    where += len(piece)
            if index == len(chunks) - 1:
                # The tensor's tail is zero-padded to 4 KiB BEFORE its writeback starts:
                # writeback then never sees a partly written page, and no later write
                # re-dirties a page under writeback (which made the drop-behind wait for
                # a second, synchronous write of that page per tensor: strided caches,
                # whose tensors end mid-page, saved at ~60% of the aligned speed).
                pad = align_up(where, _DIRECT_ALIGN) - where
                if pad:
                    pwrite_full(self.ops, self.fd, memoryview(bytes(pad)), where)
                    where += pad
            self._written(offset + start, where - offset - start)

    def drain(self) -> None:
        """Nothing in flight: the file's pages are written back by fsync."""
        self.behind.clear()

    def close(self) -> None:
        """Let the hash thread go (each tensor's batch already waited for its jobs)."""
        self.hash_pool.close()
        self.behind.clear()


def _update(hasher: xxhash.xxh3_64, parts: Sequence[memoryview]) -> None:
    for part in parts:
        hasher.update(part)


def _address(buffer: memoryview) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def _pwrite_or_bounce(ops: FileOps, fd: int, data: memoryview, offset: int) -> None:
    """O_DIRECT from ``data``; if this address is refused, through a one-off aligned copy."""
    try:
        pwrite_full(ops, fd, data, offset)
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    view = memoryview(mmap.mmap(-1, len(data)))  # freed with the view (never closed under it)
    ctypes.memmove(_address(view), _address(data), len(data))
    pwrite_full(ops, fd, view, offset)


class _DirectWrites:
    """O_DIRECT writes, pipelined on helper threads, zero-copy where the device allows.

    O_DIRECT needs aligned offsets and lengths, and memory aligned as the device requires.
    When the device accepts the caller's (unaligned) memory, chunks are written from it
    with no copy. Otherwise (MLX buffers are not page aligned) each chunk is copied
    (ctypes.memmove, which releases the GIL) into one of a few page-aligned bounce
    buffers, hashed there while still in cache, and written by the helper threads while
    the next chunk is prepared. The tail of a tensor is zero-padded to the 4 KiB boundary,
    inside the padding before the next 16 KiB-aligned tensor.
    """

    DEPTH = 4
    THREADS = 2  # two writes in flight: the device sees a queue, not one request at a time

    def __init__(self, ops: FileOps, fd: int) -> None:
        self.ops = ops
        self.fd = fd
        self.pool = ThreadPoolExecutor(
            max_workers=self.THREADS, thread_name_prefix="kvtrio-direct-io"
        )
        self.bounce = [mmap.mmap(-1, _CHUNK) for _ in range(self.DEPTH)]
        self.views = [memoryview(b) for b in self.bounce]
        self.addresses = [_address(v) for v in self.views]
        self.pending: list[Future[None] | None] = [None] * self.DEPTH
        self.turn = 0
        # Whether the device takes O_DIRECT from unaligned memory (NVMe on Linux >= 6.0
        # needs only 4-byte alignment): None until probed on the first whole-block chunk.
        self.zero_copy: bool | None = None

    def _from_source(self, data: memoryview, offset: int, slot: int) -> bool:
        """Write ``data`` straight from the caller's memory if the device allows it."""
        if self.zero_copy is False or not len(data) or len(data) % _DIRECT_ALIGN:
            return False
        if self.zero_copy is None:
            try:
                pwrite_full(self.ops, self.fd, data, offset)  # a rejected write writes nothing
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.zero_copy = False
                return False
            self.zero_copy = True
            return True
        self.pending[slot] = self.pool.submit(_pwrite_or_bounce, self.ops, self.fd, data, offset)
        return True

    def _submit(
        self,
        data: memoryview | list[memoryview],
        offset: int,
        hasher: xxhash.xxh3_64 | None = None,
    ) -> None:
        """Write one chunk (one buffer, or the segment slices that make it) at ``offset``,
        feeding ``hasher`` its bytes: from the source, or from the bounce buffer piece by
        piece right after each piece is gathered into it (still in cache)."""
        slot = self.turn % self.DEPTH
        self.turn += 1
        previous = self.pending[slot]
        if previous is not None:
            self.pending[slot] = None
            previous.result()
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if isinstance(data, memoryview) and self._from_source(data, offset, slot):
            if hasher is not None:
                hasher.update(data)
            return
        n = 0
        bounce = self.views[slot]
        for part in [data] if isinstance(data, memoryview) else data:
            for at in range(0, len(part), _SUB):  # memmove releases the GIL
                size = min(_SUB, len(part) - at)
                ctypes.memmove(self.addresses[slot] + n, _address(part) + at, size)
                if hasher is not None:
                    hasher.update(bounce[n : n + size])
                n += size
        padded = align_up(n, _DIRECT_ALIGN)
        if padded > n:
            ctypes.memset(self.addresses[slot] + n, 0, padded - n)
        out = bounce[:padded]
        self.pending[slot] = self.pool.submit(pwrite_full, self.ops, self.fd, out, offset)

    def write(self, data: memoryview, offset: int) -> None:
        for start in range(0, len(data), _CHUNK):
            self._submit(data[start : start + _CHUNK], offset + start)

    def write_hashed(self, segments: Sequence[memoryview], offset: int, cancel: Cancel) -> str:
        hasher = xxhash.xxh3_64()
        for start, parts in _chunks(segments, _CHUNK):
            _check_cancel(cancel)
            self._submit(parts, offset + start, hasher)
        return hasher.hexdigest()

    def drain(self) -> None:
        """Wait for every submitted write; raise the first error."""
        first: BaseException | None = None
        for i, fut in enumerate(self.pending):
            self.pending[i] = None
            if fut is not None:
                try:
                    fut.result()
                except BaseException as exc:
                    first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for the helper thread (never abandon it while it holds a buffer), free all."""
        self.pool.shutdown(wait=True)
        # Dropped, not closed: a traceback may still hold a slice of a bounce buffer.
        self.views = []
        self.bounce = []


def write_single(
    path: str,
    header: Header,
    tensors: Sequence[Segmented],
    *,
    file_ops: FileOps = OS_FILE_OPS,
    cancel: Cancel = None,
    direct: bool | None = None,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> WriteResult:
    """Write ``header`` (a plan; it is placed here) and ``tensors`` as one cache file.

    ``direct=False`` (the default) streams buffered writes straight from the tensors'
    segments: each 8 MiB chunk is written in 1 MiB pieces, its writeback is started at
    once (``sync_file_range``), and chunks four back are waited for and dropped from the
    page cache, so the device stays busy and the server's page cache is not flooded; a
    helper thread computes the xxh3 meanwhile. ``direct=True`` writes with O_DIRECT
    through pipelined, reused aligned bounce buffers (a copy in user space where the
    device refuses unaligned memory, as virtio does; none where it accepts it); a
    filesystem without O_DIRECT falls back to buffered. ``None`` means
    ``options.save_direct``; without ``options.save_hash_thread`` the writing thread
    hashes. Both paths write the same bytes; durability is the same fsync, rename, fsync
    of the directory either way.
    """
    check_writable(header)
    placed = place_single(header)
    slots = list(placed.slots())
    if len(slots) != len(tensors):
        raise ValueError(f"header has {len(slots)} tensor slots, got {len(tensors)} buffers")
    views = [_segments(t) for t in tensors]
    _check_sizes(slots, views)
    prefix, data_start = encode_file_prefix(placed)
    _check_cancel(cancel)
    tmp = _TmpFile(path, file_ops, direct=options.save_direct if direct is None else direct)
    pipeline: _DirectWrites | _BufferedWrites | None = None
    try:
        assert tmp.fd is not None
        fd = tmp.fd
        pipeline = (
            _DirectWrites(file_ops, fd)
            if tmp.direct
            else _BufferedWrites(file_ops, fd, hash_thread=options.save_hash_thread)
        )
        hashed: list[TensorSlot] = []
        for slot, view in zip(slots, views, strict=True):
            _check_cancel(cancel)
            where = data_start + (slot.off or 0)
            digest = pipeline.write_hashed(view, where, cancel)
            hashed.append(attrs.evolve(slot, xxh3=digest))
        final, final_prefix = _with_hashes(placed, hashed, len(prefix), data_start)
        _check_cancel(cancel)
        pipeline.write(memoryview(final_prefix), 0)
        pipeline.drain()
        file_bytes = file_ops.fstat(fd).st_size
        tmp.publish()
    except BaseException:
        if pipeline is not None:
            pipeline.close()
            pipeline = None
        tmp.discard()
        raise
    finally:
        if pipeline is not None:
            pipeline.close()
    return WriteResult(path=tmp.final, header=final, file_bytes=file_bytes)


def _check_sizes(slots: Sequence[TensorSlot], views: Sequence[Sequence[memoryview]]) -> None:
    for i, (slot, view) in enumerate(zip(slots, views, strict=True)):
        size = sum(len(seg) for seg in view)
        if size != slot.nbytes:
            raise ValueError(f"tensor {i}: {size} bytes, slot says {slot.nbytes}")


def _with_hashes(
    placed: Header, hashed: Sequence[TensorSlot], prefix_len: int, data_start: int
) -> tuple[Header, bytes]:
    """The placed header with its tensors' hashes, and its file prefix (which must keep the
    length of the prefix written first: the data after it is already in place)."""
    final = placed.with_slots(hashed)
    final_prefix, final_start = encode_file_prefix(final)
    if final_start != data_start or len(final_prefix) != prefix_len:
        raise AssertionError("header length changed when hashes were filled in")
    return final, final_prefix


def write_blocks(
    path: str,
    header: Header,
    pieces: Sequence[Sequence[Segmented]],
    store: BlockStore,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    file_ops: FileOps = OS_FILE_OPS,
    cancel: Cancel = None,
    manifests: ManifestStore | None = None,
    index_keys_of: IndexKeysOf | None = None,
) -> WriteResult:
    """Store every piece as a sha256 block, then publish the manifest naming them.

    Where the manifest goes: with ``manifests``, it is ``manifests.put(path, ...)``
    (``path`` is then the manifest's name in that store: a
    :class:`~kvtrio.storage.manifeststore.LocalManifestStore` directory, or Redis);
    without, the file ``path`` is published durably as a local manifest store does (tmp,
    fsync, rename, fsync dir), through ``file_ops``. ``index_keys_of(manifest header)``
    gives the prefix-index keys the publication registers it under (for a store that
    declares ``supports_index``); a manifest it has no keys for (CorruptCacheError,
    ValueError) is published unindexed: the index only speeds up finding entries.

    Blocks are put (and durable: ``put_many`` returns after fsync) before the manifest is
    published (docs/design.md invariant 5). On cancel or failure the manifest is not
    published; blocks already stored are unreferenced and GC collects them after its
    grace period. Each block's sha256 (its name) and xxh3-64 (what a local load checks,
    docs/format.md rule 10) are computed over its segments, each segment hashed by both
    while it is in cache; a segmented block is
    gathered (memmove, GIL released) into a staging buffer reused from tensor to tensor,
    so it is warm after the first.
    """
    check_writable(header, block_tokens=block_tokens)
    slots = list(header.slots())
    if len(slots) != len(pieces):
        raise ValueError(f"header has {len(slots)} tensor slots, got {len(pieces)} piece lists")
    new_bytes = 0
    blocked: list[TensorSlot] = []
    staging = memoryview(bytearray())
    for i, (slot, slot_pieces) in enumerate(zip(slots, pieces, strict=True)):
        ranges = piece_ranges(slot, block_tokens)
        if len(ranges) != len(slot_pieces):
            raise ValueError(f"tensor {i}: {len(slot_pieces)} pieces, expected {len(ranges)}")
        batch, refs, staging = _hashed_blocks(i, slot, ranges, slot_pieces, staging, cancel)
        _check_cancel(cancel)
        new_bytes += store.put_many(batch)
        blocked.append(attrs.evolve(slot, off=None, xxh3=None, blocks=tuple(refs)))
    # The current version always: its block references carry their xxh3 (a plan header
    # loaded from an older file keeps that file's version number until written again).
    manifest = attrs.evolve(
        header.with_slots(blocked),
        layout="blocks",
        block_tokens=block_tokens,
        format_version=FORMAT_VERSION,
    )
    body = encode_header(manifest)
    data = encode_preamble(body, manifest.format_version) + body
    _check_cancel(cancel)
    if manifests is None:
        publish_bytes(path, data, file_ops=file_ops)
        where = os.path.abspath(path)
    else:
        index_keys: Sequence[str] = ()
        if index_keys_of is not None and manifests.supports_index:
            try:
                index_keys = index_keys_of(manifest)
            except (CorruptCacheError, ValueError):
                index_keys = ()  # published, just not indexed
        manifests.put(path, data, index_keys=index_keys)
        where = manifests.location(path)
    return WriteResult(path=where, header=manifest, file_bytes=len(data), new_block_bytes=new_bytes)


def _hashed_blocks(
    index: int,
    slot: TensorSlot,
    ranges: Sequence[tuple[int, int]],
    pieces: Sequence[Segmented],
    staging: memoryview,
    cancel: Cancel,
) -> tuple[list[tuple[str, memoryview]], list[BlockRef], memoryview]:
    """Tensor ``index``'s pieces as ``(sha256, contiguous bytes)`` blocks, their refs (with
    each block's xxh3-64), and
    the staging buffer (grown to the slot's size when a segmented piece needs it)."""
    batch: list[tuple[str, memoryview]] = []
    refs: list[BlockRef] = []
    used = 0
    for (start, stop), piece in zip(ranges, pieces, strict=True):
        _check_cancel(cancel)
        segments = _segments(piece)
        size = sum(len(seg) for seg in segments)
        if size != piece_nbytes(slot, start, stop):
            raise ValueError(f"tensor {index}: piece [{start}, {stop}) has {size} bytes")
        hasher = hashlib.sha256()
        checksum = xxhash.xxh3_64()
        for seg in segments:
            hasher.update(seg)
            checksum.update(seg)
        name = hasher.hexdigest()
        if len(segments) == 1:
            view = segments[0]
        elif not segments:
            view = memoryview(b"")
        else:
            if len(staging) < used + size:
                grown = max(slot.nbytes, used + size)
                staging = memoryview(mmap.mmap(-1, grown)) if not used else staging
                if len(staging) < used + size:  # pieces bigger than the slot says
                    raise ValueError(f"tensor {index}: pieces exceed {slot.nbytes} bytes")
            view = staging[used : used + size]
            _gather(view, segments)
            used += size
        batch.append((name, view))
        refs.append(BlockRef(name, size, checksum.hexdigest()))
    return batch, refs, staging


def _gather(view: memoryview, segments: Sequence[memoryview]) -> None:
    """Copy ``segments`` end to end into ``view`` (memmove: the GIL is released)."""
    where = _address(view)
    for seg in segments:
        ctypes.memmove(where, _address(seg), len(seg))
        where += len(seg)
