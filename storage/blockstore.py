"""Where content-addressed blocks live: the interface, and the local-directory store.

A block is named by the sha256 of its bytes (64 lowercase hex digits). Stores are
untrusted: every read is re-hashed against the name by the caller-facing helpers
(:func:`read_block_verified`), and a block that is missing is a clean miss (``None``
/ ``False``), never an exception. All methods are blocking and CPU/IO only: callers
run them on worker threads.
"""

from __future__ import annotations

import abc
import errno
import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Literal, TypeVar

import attrs
from kvtrio.errors import CorruptCacheError
from kvtrio.storage.fileops import (
    O_NOFOLLOW,
    O_NONBLOCK,
    OS_FILE_OPS,
    TMP_SUFFIX,
    FileOps,
    Piece,
    Scatter,
    not_a_real_directory,
    pread_full,
    preadv_full,
    pwrite_full,
)
from kvtrio.storage.rootfd import NotRegularFileError

__all__ = [
    "BLOCK_NAME_RE",
    "READ_AHEAD_BLOCKS",
    "BlockInfo",
    "BlockStore",
    "CorruptBlockError",
    "LocalBlockStore",
    "check_block_name",
    "read_block_verified",
]

BLOCK_NAME_RE = re.compile(r"[0-9a-f]{64}")
#: Blocks a local read opens and advises before reading the first of them (and so at most
#: the descriptors it holds open at once).
READ_AHEAD_BLOCKS = 32
_T = TypeVar("_T")
_log = logging.getLogger(__name__)


class CorruptBlockError(CorruptCacheError):
    """A stored block failed a check: its bytes do not hash to its name (``field`` is
    ``"sha256"``) or its stored size is not the expected one (``"bytes"``).

    The message is ``block <name>: <detail>``; a reader that knows which header field the
    block fills restates it from ``field`` and ``detail`` (never by parsing the message).
    """

    def __init__(self, name: str, field: Literal["sha256", "bytes"], detail: str) -> None:
        super().__init__(f"block {name}: {detail}")
        self.name = name
        self.field = field
        self.detail = detail

    def __reduce__(self) -> tuple[type[CorruptBlockError], tuple[str, str, str]]:
        return (type(self), (self.name, self.field, self.detail))


def check_block_name(name: str) -> str:
    """Return ``name`` if it is a valid block name; raise CorruptCacheError otherwise."""
    if not isinstance(name, str) or BLOCK_NAME_RE.fullmatch(name) is None:
        raise CorruptCacheError(f"block name: not 64 lowercase hex digits: {name!r:.80}")
    return name


@attrs.frozen
class BlockInfo:
    """What a store knows of one stored block (for GC's grace period and accounting)."""

    name: str
    size: int
    mtime: float  # seconds since the epoch; stores without mtimes report the time first seen


class BlockStore(abc.ABC):
    """A store of immutable blocks named by their sha256.

    Implementations: the local directory store (the default) and Redis (shared by
    hosts). Writes are idempotent: putting a block that exists stores nothing.

    Optional abilities are declared, not probed (the model is zarr-python v3's store
    ABC): each ``supports_*`` class attribute says whether the method of that name does
    more than the default here, and callers read the attribute. The batch methods have
    defaults built on the single ones, so every store answers every call.
    """

    #: :meth:`read_many_into` reads a batch in one round trip (the block reader then
    #: sends batches of up to ``BLOCK_BATCH_BYTES``, else of up to ``SMALL_BATCH_BYTES``).
    supports_batched_reads: ClassVar[bool] = False
    #: :meth:`read_many_verified_into` re-hashes each block as it arrives (the block
    #: reader then leaves the sha256 check to the store).
    supports_verified_reads: ClassVar[bool] = False
    #: :meth:`stored_size` / :meth:`stored_sizes` tell a block's size without reading it
    #: (the block reader then checks sizes before it allocates).
    supports_sizes: ClassVar[bool] = False
    #: :meth:`read_many_scattered_into` reads a block straight into its runs (a tier then
    #: allocates a tensor of several kv heads whole and reads each block into it, with no
    #: join after the read; the default reads into a buffer and copies the runs out).
    supports_scatter_reads: ClassVar[bool] = False
    #: Other clients write this store's blocks (Redis, shared by hosts): a block read from
    #: it is verified against its sha256 name, whatever hash a manifest records, so a
    #: block another client forged cannot pass for this content. False for a store that
    #: only its own process writes (:class:`LocalBlockStore`, a directory whose manifests
    #: and blocks share one owner, docs/design.md invariant 10): whoever could forge a
    #: block there could rewrite the manifest naming it, so a load checks each block
    #: against the xxh3-64 its manifest records (format version 2 on; docs/format.md
    #: rule 10), which catches corruption and torn writes as the sha256 did, at several
    #: times the speed. True by default: a store that says nothing is treated as shared.
    written_by_others: ClassVar[bool] = True

    @abc.abstractmethod
    def put_many(self, blocks: Sequence[tuple[str, memoryview]]) -> int:
        """Store the blocks that are absent; return the number of bytes newly stored.

        Durable on return (local store: file fsynced, renamed, directory fsynced).
        """

    @abc.abstractmethod
    def has_many(self, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` are present."""

    @abc.abstractmethod
    def read_into(self, name: str, buffer: memoryview) -> bool:
        """Fill ``buffer`` (exactly the block's size) with the block; False if it is missing.

        Raises CorruptCacheError when the stored size differs from ``len(buffer)``.
        Does not hash: the caller verifies against the name.
        """

    @abc.abstractmethod
    def delete_many(self, names: Sequence[str]) -> int:
        """Delete the named blocks that exist; return how many were deleted."""

    @abc.abstractmethod
    def iter_blocks(self) -> Iterator[BlockInfo]:
        """Every stored block (for GC and verify)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections or handles."""

    def read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """:meth:`read_into` for each ``(name, buffer)``; False for each missing block."""
        return [self.read_into(name, buffer) for name, buffer in items]

    def read_many_scattered_into(self, items: Sequence[tuple[str, Piece]]) -> list[bool]:
        """:meth:`read_many_into` where a destination may be a :class:`Scatter`, filled in
        order as one buffer of its ``nbytes``."""
        staged = [
            (name, memoryview(bytearray(piece.nbytes)) if isinstance(piece, Scatter) else piece)
            for name, piece in items
        ]
        found = self.read_many_into(staged)
        for (_, piece), (_, buffer), ok in zip(items, staged, found, strict=True):
            if ok and isinstance(piece, Scatter):
                at = 0
                for part in piece.parts:
                    part[:] = buffer[at : at + part.nbytes]
                    at += part.nbytes
        return found

    def read_many_verified_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """:meth:`read_many_into`, then each block that was read re-hashed against its name
        (CorruptBlockError with ``field="sha256"`` for one that does not match)."""
        found = self.read_many_into(items)
        for (name, buffer), ok in zip(items, found, strict=True):
            if ok and hashlib.sha256(buffer).hexdigest() != name:
                raise CorruptBlockError(name, "sha256", "block content does not hash to its name")
        return found

    def stored_size(self, name: str) -> int | None:
        """The stored size of block ``name``, None if absent (only with ``supports_sizes``)."""
        raise NotImplementedError(f"{type(self).__name__} does not support sizes")

    def stored_sizes(self, names: Sequence[str]) -> list[int | None]:
        """:meth:`stored_size` of each of ``names`` (only with ``supports_sizes``)."""
        return [self.stored_size(name) for name in names]


def read_block_verified(store: BlockStore, name: str, buffer: memoryview) -> bool:
    """Read block ``name`` into ``buffer`` and re-hash it against its name.

    False if the block is missing (a clean miss); CorruptCacheError if its bytes do not
    hash to its name or its size differs from ``len(buffer)``.
    """
    check_block_name(name)
    if not store.read_into(name, buffer):
        return False
    if hashlib.sha256(buffer).hexdigest() != name:
        raise CorruptBlockError(name, "sha256", "content does not hash to its name")
    return True


@attrs.define
class LocalBlockStore(BlockStore):
    """Blocks as files ``<directory>/<sha256>``, written durably, read without following links.

    ``put_many`` writes each absent block to an O_EXCL 0600 tmp file, fsyncs it, renames it
    into place, then fsyncs the directory once: the blocks are durable on return. The
    caller names blocks by their sha256 (the writer computes it); the store does not
    re-hash on put. ``read_into`` opens with O_NOFOLLOW and requires a regular file of
    exactly the buffer's size. Putting a block that exists freshens its mtime, so GC's
    grace period covers blocks a writer is about to name in a manifest.

    A ``directory`` that is a symbolic link (or not a directory) is never traversed: it
    lists no block, holds none (reads miss), deletes nothing, and refuses puts
    (StoreUnavailableError), with a warning in the log.
    """

    supports_sizes: ClassVar[bool] = True  # a stat, no read
    supports_scatter_reads: ClassVar[bool] = True  # one preadv into the runs
    written_by_others: ClassVar[bool] = False  # its directory's owner alone writes it

    directory: str
    file_ops: FileOps = OS_FILE_OPS
    _made: bool = attrs.field(default=False, init=False)

    def path_of(self, name: str) -> str:
        """The file of block ``name`` (the name is checked, so it cannot traverse)."""
        return os.path.join(self.directory, check_block_name(name))

    def _linked(self) -> bool:
        """Whether the directory is a link or not a directory (checked on every call: it
        may be replaced while the store is open)."""
        if not_a_real_directory(self.file_ops, self.directory):
            _log.warning(
                "block directory %s is a symbolic link or not a directory: not traversed",
                self.directory,
            )
            return True
        return False

    def _ensure_dir(self) -> None:
        if self._linked():
            from kvtrio.errors import StoreUnavailableError

            raise StoreUnavailableError(
                f"block directory {self.directory}: a symbolic link or not a directory"
            )
        if not self._made:
            existed = self._exists(self.directory)
            self.file_ops.mkdir(self.directory)
            if not existed:  # the new directory's own entry must be durable too
                self.file_ops.fsync_dir(os.path.dirname(os.path.abspath(self.directory)))
            self._made = True

    def _exists(self, path: str, *, dir_fd: int | None = None) -> bool:
        try:
            self.file_ops.stat(path, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        return True

    def put_many(self, blocks: Sequence[tuple[str, memoryview]]) -> int:
        self._ensure_dir()
        stored = 0
        created = False
        seen: set[str] = set()
        for name, data in blocks:
            path = self.path_of(name)
            if name in seen:
                continue
            seen.add(name)
            if self._freshen(path):
                continue
            tmp = os.path.join(self.directory, f".{name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
            fd = self.file_ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW, 0o600)
            try:
                pwrite_full(self.file_ops, fd, data, 0)
                self.file_ops.fsync(fd)
            except BaseException:
                self.file_ops.close(fd)
                _unlink_quietly(self.file_ops, tmp)
                raise
            self.file_ops.close(fd)
            try:
                self.file_ops.rename(tmp, path)
            except BaseException:
                _unlink_quietly(self.file_ops, tmp)
                raise
            stored += data.nbytes
            created = True
        if created:
            self.file_ops.fsync_dir(self.directory)
        return stored

    def delete_stale(self, names: Sequence[str], cutoff: float) -> tuple[int, int]:
        """Delete the named blocks not freshened since ``cutoff``; return (count, bytes).

        Two phases, so a concurrent :meth:`put_many` never loses a block it is about to
        reference: the block is first renamed to a quarantine name, then its mtime is read
        there. A writer that freshened it before the rename left a recent mtime, and the
        block is renamed back; a writer that comes after the rename finds no block and
        writes it again. Only a block still stale in quarantine is unlinked.
        """
        deleted = 0
        freed = 0
        changed = False
        if self._linked():
            return 0, 0
        for name in names:
            path = self.path_of(name)
            doomed = os.path.join(
                self.directory, f".{name}.{secrets.token_hex(6)}.doomed{TMP_SUFFIX}"
            )
            try:
                self.file_ops.rename(path, doomed)
            except FileNotFoundError:
                continue
            changed = True
            try:
                info = self.file_ops.stat(doomed)
                if info.st_mtime >= cutoff:
                    self.file_ops.rename(doomed, path)
                    continue
                self.file_ops.unlink(doomed)
            except FileNotFoundError:  # another GC's debris sweep took it: deleted anyway
                continue
            deleted += 1
            freed += info.st_size
        if changed:
            self.file_ops.fsync_dir(self.directory)
        return deleted, freed

    def stored_size(self, name: str) -> int | None:
        """The size of block ``name`` on disk, or None if it is absent.

        Raises CorruptCacheError for a symbolic link or anything but a regular file.
        """
        if self._linked():
            return None
        return self._size(self.path_of(name), name, dir_fd=None)

    def stored_sizes(self, names: Sequence[str]) -> list[int | None]:
        """:meth:`stored_size` of each of ``names`` through one descriptor of the
        directory (one link check and one walk from the root for the batch, then one
        ``fstatat`` a block): a load's look at its blocks before it allocates."""
        return self._in_directory(
            len(names),
            lambda fd: [self._size(check_block_name(name), name, dir_fd=fd) for name in names],
            None,
        )

    def _size(self, path: str, name: str, *, dir_fd: int | None) -> int | None:
        try:
            info = self.file_ops.stat(path, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(info.st_mode):
            raise CorruptCacheError(f"block {name}: is a symbolic link")
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"block {name}: not a regular file")
        return info.st_size

    def _freshen(self, path: str) -> bool:
        """Restart GC's grace period of an existing block; False if there is none."""
        try:
            self.file_ops.utime(path)
        except FileNotFoundError:
            return False
        return True

    def has_many(self, names: Sequence[str]) -> list[bool]:
        return self._in_directory(
            len(names),
            lambda fd: [self._exists(check_block_name(name), dir_fd=fd) for name in names],
            False,
        )

    def _in_directory(self, count: int, each: Callable[[int], list[_T]], absent: _T) -> list[_T]:
        """``each(fd)`` with one descriptor of the block directory (one link check and one
        walk from the root for the whole batch); ``count`` times ``absent`` when there is
        none."""
        if self._linked():
            return [absent] * count
        try:
            fd = self.file_ops.open_dir(self.directory)
        except FileNotFoundError:
            return [absent] * count
        try:
            return each(fd)
        finally:
            self.file_ops.close(fd)

    def read_into(self, name: str, buffer: memoryview) -> bool:
        if self._linked():
            return False
        return self._read_block(self.path_of(name), name, buffer, dir_fd=None)

    def read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """:meth:`read_into` for each item through one descriptor of the directory: one
        link check and one walk from the root per batch instead of per block, and each
        block opened relative to the descriptor (under the tier's rooted file operations
        a block costs 4 system calls, not 6: no link check and no second fstat)."""
        return self.read_many_scattered_into(items)

    def read_many_scattered_into(self, items: Sequence[tuple[str, Piece]]) -> list[bool]:
        """:meth:`read_many_into`, a :class:`Scatter` destination read by one ``preadv``
        into its runs. Blocks go in groups of :data:`READ_AHEAD_BLOCKS`: each block of a
        group is opened, checked and advised (``will_need``) before the first is read, so
        on a cold page cache the kernel reads the group's files at once instead of one
        after the other (1,020 blocks of 96 KiB: 359 ms of a 536 ms load, one in flight)."""
        return self._in_directory(len(items), lambda fd: self._read_groups(fd, items), False)

    def _read_groups(self, dir_fd: int, items: Sequence[tuple[str, Piece]]) -> list[bool]:
        found: list[bool] = []
        for start in range(0, len(items), READ_AHEAD_BLOCKS):
            group = items[start : start + READ_AHEAD_BLOCKS]
            fds: list[int | None] = []
            try:
                for name, buffer in group:
                    fd = self._open_block(check_block_name(name), name, buffer.nbytes, dir_fd)
                    fds.append(fd)
                    if fd is not None:
                        self.file_ops.will_need(fd)
                for (name, buffer), fd in zip(group, fds, strict=True):
                    if fd is not None:
                        self._fill(fd, name, buffer)
                    found.append(fd is not None)
            finally:
                for fd in fds:
                    if fd is not None:
                        self.file_ops.close(fd)
        return found

    def _read_block(self, path: str, name: str, buffer: Piece, *, dir_fd: int | None) -> bool:
        fd = self._open_block(path, name, buffer.nbytes, dir_fd)
        if fd is None:
            return False
        try:
            self._fill(fd, name, buffer)
        finally:
            self.file_ops.close(fd)
        return True

    def _open_block(self, path: str, name: str, nbytes: int, dir_fd: int | None) -> int | None:
        """A descriptor of block ``name``, a regular file of ``nbytes`` reached without a
        link (None: there is none; the caller closes it)."""
        try:
            fd = self.file_ops.open(path, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except NotRegularFileError:
            raise CorruptCacheError(f"block {name}: not a regular file") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCacheError(f"block {name}: is a symbolic link") from None
            raise
        try:
            info = self.file_ops.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CorruptCacheError(f"block {name}: not a regular file")
            if info.st_size != nbytes:
                raise CorruptBlockError(
                    name, "bytes", f"stored size {info.st_size} != expected {nbytes}"
                )
        except BaseException:
            self.file_ops.close(fd)
            raise
        return fd

    def _fill(self, fd: int, name: str, buffer: Piece) -> None:
        if isinstance(buffer, Scatter):
            got = preadv_full(self.file_ops, fd, buffer.parts, 0)
        else:
            got = pread_full(self.file_ops, fd, buffer, 0)
        if got != buffer.nbytes:
            raise CorruptCacheError(f"block {name}: short read ({got} of {buffer.nbytes})")

    def delete_many(self, names: Sequence[str]) -> int:
        deleted = 0
        if self._linked():
            return 0
        for name in names:
            try:
                self.file_ops.unlink(self.path_of(name))
            except (FileNotFoundError, IsADirectoryError):  # a directory is no block
                continue
            deleted += 1
        if deleted:
            self.file_ops.fsync_dir(self.directory)
        return deleted

    def iter_blocks(self) -> Iterator[BlockInfo]:
        if self._linked():
            return
        # One descriptor of the directory for the listing and every stat: under a tier's
        # rooted file operations, one walk from the root instead of one per block.
        try:
            fd = self.file_ops.open_dir(self.directory)
        except FileNotFoundError:
            return
        try:
            names = self.file_ops.listdir(fd)
            for name in sorted(names):
                if BLOCK_NAME_RE.fullmatch(name) is None:
                    continue
                try:
                    info = self.file_ops.stat(name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    yield BlockInfo(name=name, size=info.st_size, mtime=info.st_mtime)
        finally:
            self.file_ops.close(fd)

    def close(self) -> None:
        return None


def _unlink_quietly(ops: FileOps, path: str) -> None:
    try:
        ops.unlink(path)
    except OSError:
        pass
