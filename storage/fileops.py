"""The one injectable file-operations interface every storage write and read goes through.

``FileOps`` is a small protocol over file descriptors; :data:`OS_FILE_OPS` is the real
one (``os.pwrite``/``os.preadv``, which release the GIL). :class:`FaultyFileOps` wraps any
``FileOps`` and calls ``hook(op_name)`` before each operation, so tests inject faults
(raise) or delays (sleep) at an exact step; ``kvtrio.runtime.testing.FaultPlan`` is such
a hook. Hooked op names: ``"open"``, ``"open_dir"``, ``"write"``, ``"fsync"``,
``"rename"``, ``"fsync_dir"``, ``"read"``, ``"unlink"``, ``"mkdir"``, ``"listdir"``.
``close``, ``stat``/``fstat``, ``utime`` and the write-behind hints are not hooked
(cleanup paths must be able to run).

Write-behind hints, declared by every ``FileOps`` (one that has nothing to do makes them
no-ops): :meth:`OsFileOps.write_behind` starts the writeback of a range just written
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``) and :meth:`OsFileOps.drop_behind` waits for
it and drops the clean pages (``posix_fadvise(DONTNEED)``), so a streaming buffered write
keeps the device busy and reuses a few MiB of page cache instead of filling it. They are
not durability: the writers still fsync the file, rename, and fsync the directory.

Descriptor-relative operations mirror ``os``: ``open``, ``stat``, ``utime``, ``unlink``
and ``mkdir`` take ``dir_fd``, ``rename`` takes ``src_dir_fd`` / ``dst_dir_fd``,
``listdir`` and ``fsync_dir`` take a directory descriptor in place of a path, and
:meth:`FileOps.open_dir` opens a directory without following a link (hooked as
``"open_dir"``). :class:`kvtrio.storage.rootfd.RootedFileOps` uses them so that nothing
under a cold-tier root is reached by a path the kernel resolves again.

Durability helpers (docs/design.md invariant 5): :meth:`FileOps.fsync` is ``F_FULLFSYNC`` on
macOS (a plain fsync there does not flush the drive's cache) and ``fsync`` elsewhere;
:meth:`FileOps.fsync_dir` fsyncs a directory so a rename inside it is durable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

__all__ = [
    "O_NOFOLLOW",
    "O_NONBLOCK",
    "OS_FILE_OPS",
    "TMP_SUFFIX",
    "FaultyFileOps",
    "FileOps",
    "Piece",
    "Scatter",
    "byte_view",
    "not_a_real_directory",
    "OsFileOps",
    "piece_bytes",
    "pread_full",
    "preadv_full",
    "pwrite_full",
]

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Opening a FIFO for reading with it returns at once instead of waiting for a writer.
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Suffix of every tmp file the library creates; GC removes old ones (crash debris).
TMP_SUFFIX = ".kvtrio-tmp"
_HAS_PREADV = hasattr(os, "preadv")
# One pwrite/preadv call moves at most this much (Linux caps a call at ~2 GiB).
_MAX_IO = 1 << 30


class FileOps(Protocol):
    """Blocking file operations on descriptors; callers run them on worker threads.

    ``dir_fd`` (``src_dir_fd``, ``dst_dir_fd``): ``path`` is relative to that open
    directory, as in ``os``; None: ``path`` is resolved as usual.
    """

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        """``os.open``; the library adds O_CLOEXEC and, for blocks, O_NOFOLLOW."""
        ...

    def open_dir(self, path: str, *, dir_fd: int | None = None) -> int:
        """Open a directory for descriptor-relative operations, never through a link
        (``O_RDONLY | O_DIRECTORY | O_NOFOLLOW``: a link is ELOOP, a file ENOTDIR)."""
        ...

    def close(self, fd: int) -> None: ...

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        """Write some of ``data`` at ``offset``; return the byte count (maybe short)."""
        ...

    def read(self, fd: int, buffer: memoryview, offset: int) -> int:
        """Read into ``buffer`` from ``offset``; return the byte count (0 at EOF)."""
        ...

    def readv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Read into ``buffers`` in order from ``offset`` (one ``preadv``: a block read
        straight into its runs of a tensor); return the byte count (maybe short)."""
        ...

    def fsync(self, fd: int) -> None:
        """Make the file's data durable (F_FULLFSYNC on macOS)."""
        ...

    def fsync_dir(self, directory: str | int) -> None:
        """Make the directory's entries (a rename, a create) durable; ``directory`` is a
        path or an open directory descriptor."""
        ...

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None: ...

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None: ...

    def mkdir(self, path: str, *, dir_fd: int | None = None) -> None:
        """Create a directory (mode 0700); no error if it exists. With a path, its parents
        too; with ``dir_fd``, only ``path`` itself (one name)."""
        ...

    def listdir(self, directory: str | int) -> list[str]:
        """The names in a directory, given as a path or an open directory descriptor."""
        ...

    def fstat(self, fd: int) -> os.stat_result: ...

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        """lstat: a symlink is reported as the link, not followed."""
        ...

    def utime(
        self, path: str, times: tuple[float, float] | None = None, *, dir_fd: int | None = None
    ) -> None:
        """Set a file's (atime, mtime), now when None; a link's own, never its target's."""
        ...

    def write_behind(self, fd: int, offset: int, length: int) -> None:
        """Start the writeback of a range just written (a hint; may do nothing)."""
        ...

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        """Wait for a range's writeback and drop its clean pages (a hint; may do nothing)."""
        ...

    def will_need(self, fd: int) -> None:
        """Start reading a whole file into the page cache now (a hint; may do nothing)."""
        ...


_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class OsFileOps:
    """The real file operations."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        return os.open(path, flags | O_CLOEXEC, mode, dir_fd=dir_fd)

    def open_dir(self, path: str, *, dir_fd: int | None = None) -> int:
        return os.open(path, os.O_RDONLY | _O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data[:_MAX_IO], offset)

    def read(self, fd: int, buffer: memoryview, offset: int) -> int:
        if _HAS_PREADV:
            return os.preadv(fd, [buffer[:_MAX_IO]], offset)
        # Pythons without preadv (some macOS builds): seek + readv into the same buffer.
        # Safe here because every reader opens its own descriptor.
        os.lseek(fd, offset, os.SEEK_SET)
        return os.readv(fd, [buffer[:_MAX_IO]])

    def readv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if _HAS_PREADV:
            return os.preadv(fd, buffers, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        return os.readv(fd, buffers)

    def fsync(self, fd: int) -> None:
        if sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, getattr(fcntl, "F_FULLFSYNC", 51))
        else:
            os.fsync(fd)

    def fsync_dir(self, directory: str | int) -> None:
        if isinstance(directory, int):
            self.fsync(directory)
            return
        fd = os.open(directory, os.O_RDONLY | _O_DIRECTORY | O_CLOEXEC)
        try:
            self.fsync(fd)
        finally:
            os.close(fd)

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        os.unlink(path, dir_fd=dir_fd)

    def mkdir(self, path: str, *, dir_fd: int | None = None) -> None:
        if dir_fd is None:
            os.makedirs(path, mode=0o700, exist_ok=True)
            return
        try:
            os.mkdir(path, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass  # a link or file in its place is refused by the open_dir that follows

    def listdir(self, directory: str | int) -> list[str]:
        return os.listdir(directory)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def utime(
        self, path: str, times: tuple[float, float] | None = None, *, dir_fd: int | None = None
    ) -> None:
        os.utime(path, times, dir_fd=dir_fd, follow_symlinks=False)

    def write_behind(self, fd: int, offset: int, length: int) -> None:
        """Start writeback of a written range now (a hint; durability is still fsync's)."""
        _sync_file_range(fd, offset, length, _SFR_WRITE)

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        """Wait for a range's writeback, then drop its (clean) pages from the page cache."""
        if _sync_file_range(fd, offset, length, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER):
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def will_need(self, fd: int) -> None:
        """``POSIX_FADV_WILLNEED`` of the whole file: the kernel queues its reads at once
        (nothing where the pages are cached already)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)


OS_FILE_OPS: FileOps = OsFileOps()

_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()


def _sync_file_range(fd: int, offset: int, length: int, flags: int) -> bool:
    """Linux sync_file_range (releases the GIL); False where unsupported or refused."""
    if _SYNC_FILE_RANGE is None or length <= 0:
        return False
    return bool(_SYNC_FILE_RANGE(fd, offset, length, flags) == 0)


@attrs.define
class FaultyFileOps:
    """Wraps ``inner`` and calls ``hook(op_name)`` before each hooked operation.

    The hook raises to inject a fault (the operation does not happen) or sleeps to
    inject a delay. ``calls`` counts hooked calls per op name.
    """

    inner: FileOps
    hook: Callable[[str], None]
    calls: dict[str, int] = attrs.field(factory=dict)

    def _before(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.hook(op)

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        self._before("open")
        return self.inner.open(path, flags, mode, dir_fd=dir_fd)

    def open_dir(self, path: str, *, dir_fd: int | None = None) -> int:
        self._before("open_dir")
        return self.inner.open_dir(path, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        self.inner.close(fd)

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        self._before("write")
        return self.inner.write(fd, data, offset)

    def read(self, fd: int, buffer: memoryview, offset: int) -> int:
        self._before("read")
        return self.inner.read(fd, buffer, offset)

    def readv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._before("read")
        return self.inner.readv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        self._before("fsync")
        self.inner.fsync(fd)

    def fsync_dir(self, directory: str | int) -> None:
        self._before("fsync_dir")
        self.inner.fsync_dir(directory)

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        self._before("rename")
        self.inner.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        self._before("unlink")
        self.inner.unlink(path, dir_fd=dir_fd)

    def mkdir(self, path: str, *, dir_fd: int | None = None) -> None:
        self._before("mkdir")
        self.inner.mkdir(path, dir_fd=dir_fd)

    def listdir(self, directory: str | int) -> list[str]:
        self._before("listdir")
        return self.inner.listdir(directory)

    def fstat(self, fd: int) -> os.stat_result:
        return self.inner.fstat(fd)

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        return self.inner.stat(path, dir_fd=dir_fd)

    def utime(
        self, path: str, times: tuple[float, float] | None = None, *, dir_fd: int | None = None
    ) -> None:
        self.inner.utime(path, times, dir_fd=dir_fd)

    # Write-behind hints are forwarded unhooked (like close and fstat): they are not file
    # operations a fault can be injected into, only advice on when the kernel writes back.
    def write_behind(self, fd: int, offset: int, length: int) -> None:
        self.inner.write_behind(fd, offset, length)

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        self.inner.drop_behind(fd, offset, length)

    def will_need(self, fd: int) -> None:
        self._before("will_need")
        self.inner.will_need(fd)


def not_a_real_directory(ops: FileOps, path: str) -> bool:
    """Whether ``path`` exists as something other than a directory reached without a link
    (a symbolic link to one, a file, a FIFO). Under a tier's root such a thing is never
    traversed: a symlinked ``blocks/`` could lead a sweep to delete another program's
    64-hex-named files (Hugging Face blob caches, OCI stores)."""
    try:
        info = ops.stat(path)  # lstat: a link is reported as the link
    except FileNotFoundError:
        return False
    return not stat.S_ISDIR(info.st_mode)


def byte_view(buffer: memoryview) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer, no copy (empty buffers too)."""
    if buffer.nbytes == 0:
        return memoryview(bytearray())  # a 0 in the shape makes cast() refuse
    if buffer.format == "B" and buffer.ndim == 1:
        return buffer
    if not buffer.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    return buffer.cast("B")


@attrs.frozen(eq=False)
class Scatter:
    """One read's destination in several runs, filled in order as one buffer of
    ``nbytes``: a token block of several kv heads read straight into each head's run of
    its tensor (no join after the read)."""

    parts: tuple[memoryview, ...]
    nbytes: int = attrs.field(init=False)

    @nbytes.default
    def _sum(self) -> int:
        return sum(part.nbytes for part in self.parts)


#: Where one block (or tensor piece) is read: one buffer, or runs of one (:class:`Scatter`).
Piece = memoryview | Scatter


def piece_bytes(piece: Piece) -> int:
    """The bytes ``piece`` receives."""
    return piece.nbytes


def preadv_full(ops: FileOps, fd: int, parts: Sequence[memoryview], offset: int) -> int:
    """Fill ``parts`` in order from ``offset`` (one ``preadv``, resumed where a short read
    stopped); return the bytes read (short only at EOF)."""
    views = [byte_view(part) for part in parts if part.nbytes]
    done = 0
    while views:
        n = ops.readv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return done


def pwrite_full(ops: FileOps, fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``, looping over short writes."""
    view = byte_view(data)
    done = 0
    while done < len(view):
        n = ops.write(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at {offset + done}")
        done += n


def pread_full(ops: FileOps, fd: int, buffer: memoryview, offset: int) -> int:
    """Fill ``buffer`` from ``offset``; return the bytes read (short only at EOF)."""
    view = byte_view(buffer)
    done = 0
    while done < len(view):
        n = ops.read(fd, view[done:], offset + done)
        if n == 0:
            break
        done += n
    return done
