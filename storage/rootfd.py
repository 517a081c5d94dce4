"""Everything under a cold-tier root, reached through one directory descriptor.

Theory of operation
-------------------
A tier's root is the one path kvtrio trusts; every name beneath it is a neighbour's to
change at any moment. Checking a name (``lstat``) and then opening it by path leaves a
window in which a directory on the way is swapped for a link, and the open, listing or
sweep that follows runs outside the root (issue 15: a ``blocks/`` turned into a link to a
Hugging Face blob cache has a sweep delete its 64-hex-named files). :class:`RootedFileOps`
is a :class:`~kvtrio.storage.fileops.FileOps` over an inner one that closes the window:

1. The root is opened once, when the rooted operations are made: its path is resolved
   (``realpath``: a link an operator made to place the tier is theirs), then opened with
   ``O_RDONLY | O_DIRECTORY | O_NOFOLLOW``, and the descriptor is held until
   :meth:`RootedFileOps.close_root`. Nothing later resolves the root's path again.
2. Every other path must lie under the root (after ``abspath``, so ``..`` cannot climb
   out), else :class:`OutsideRootError` before anything is touched. Its directories are
   walked from the root's descriptor one name at a time, each opened relative to its
   parent with ``O_DIRECTORY | O_NOFOLLOW`` (:meth:`FileOps.open_dir`): a link is ELOOP
   and a file where a directory should be ENOTDIR, never followed. Each directory's
   descriptor is kept from its first walk until :meth:`RootedFileOps.close_root`, so no
   name is looked up twice: a directory swapped for a link before its first use stops
   that use, and one swapped after it is never reached through the link (operations go
   on in the tier's own directory, wherever it was moved).
3. The last name is acted on relative to its directory's descriptor (``dir_fd``):
   ``stat`` and ``utime`` never follow a link, ``rename`` and ``unlink`` act on the name
   itself (a link is unlinked, never its target), listings list the descriptor, and
   ``open`` adds ``O_NOFOLLOW`` (and, to read, ``O_NONBLOCK``: a FIFO cannot block it),
   then ``fstat``s what it opened and refuses anything but a regular file
   (:class:`NotRegularFileError`).
4. A directory is made durable by ``fsync`` of its own descriptor (``fsync_dir``).

Costs: one ``openat`` per directory, once; then each operation is the one call on its
name relative to a kept descriptor (plus an ``fstat`` for an open), and a dict lookup.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
from kvtrio.storage.fileops import O_NOFOLLOW, O_NONBLOCK, FileOps

__all__ = ["NotRegularFileError", "OutsideRootError", "RootedFileOps"]

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class OutsideRootError(PermissionError):
    """A path given to a tier's rooted file operations does not lie under its root."""


class NotRegularFileError(OSError):
    """What a name under the root opens to is not a regular file (a directory, a FIFO, a
    device): it is never read or written as one."""


def _close_all(ops: FileOps, root_fd: int, dirs: dict[tuple[str, ...], int], lock: Any) -> None:
    with lock:
        fds = [*dirs.values(), root_fd]
        dirs.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            ops.close(fd)


@attrs.define(eq=False)
class RootedFileOps:
    """File operations confined to ``path``'s tree (the module docstring's rules).

    Make one with :meth:`at`; :meth:`close_root` (or a ``with`` block) gives the root's
    descriptor back. Paths are the usual absolute (or cwd-relative) strings, so callers
    and path-based wrappers above it are unchanged; the inner operations receive names
    relative to directory descriptors.
    """

    path: str
    inner: FileOps
    root_fd: int
    # The kept descriptors of the directories walked so far (rule 2), by their names.
    _dirs: dict[tuple[str, ...], int] = attrs.field(factory=dict, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _finalizer: weakref.finalize | None = attrs.field(default=None, init=False)  # type: ignore[type-arg]

    @classmethod
    def at(cls, path: str | os.PathLike[str], inner: FileOps) -> RootedFileOps:
        """Open the root directory ``path`` (it must exist) under ``inner``'s operations."""
        given = os.path.abspath(os.fspath(path))
        fd = inner.open_dir(os.path.realpath(given))
        self = cls(given, inner, fd)
        self._finalizer = weakref.finalize(self, _close_all, inner, fd, self._dirs, self._lock)
        return self

    def close_root(self) -> None:
        """Give the root's descriptor back (idempotent); later operations fail (EBADF)."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> RootedFileOps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_root()

    # -- walking -----------------------------------------------------------------------

    def relative(self, path: str) -> tuple[str, ...]:
        """``path``'s names below the root (empty for the root); OutsideRootError when
        it is not under it."""
        full = os.path.abspath(path)
        if full == self.path:
            return ()
        prefix = self.path.rstrip(os.sep) + os.sep
        if not full.startswith(prefix):
            raise OutsideRootError(errno.EPERM, f"not under the tier's root {self.path}", path)
        return tuple(full[len(prefix) :].split(os.sep))

    def _split(self, path: str) -> tuple[tuple[str, ...], str]:
        parts = self.relative(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the tier's root itself", path)
        return parts[:-1], parts[-1]

    def _open_child(self, name: str, parent: int) -> int:
        """Directory ``name`` in ``parent``, never through a link: a link is ELOOP (Linux
        reports ENOTDIR for a link opened with O_DIRECTORY | O_NOFOLLOW; it is told apart
        here so that callers see one errno for a link)."""
        try:
            return self.inner.open_dir(name, dir_fd=parent)
        except NotADirectoryError:
            if stat.S_ISLNK(self.inner.stat(name, dir_fd=parent).st_mode):
                raise OSError(errno.ELOOP, "a symbolic link, not followed", name) from None
            raise

    def _directory(self, names: tuple[str, ...]) -> int:
        """The kept descriptor of the directory ``names`` below the root, walked on its
        first use without following a link (rule 2). Callers never close it."""
        if not names:
            return self.root_fd
        kept = self._dirs.get(names)
        if kept is not None:
            return kept
        child = self._open_child(names[-1], self._directory(names[:-1]))
        with self._lock:
            kept = self._dirs.setdefault(names, child)
        if kept != child:  # another thread walked it meanwhile
            self.inner.close(child)
        return kept

    # -- FileOps -----------------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        if dir_fd is not None:  # already relative to a descriptor the caller holds
            return self.inner.open(path, flags, mode, dir_fd=dir_fd)
        names, name = self._split(path)
        flags |= O_NOFOLLOW | (0 if flags & _WRITES else O_NONBLOCK)
        fd = self.inner.open(name, flags, mode, dir_fd=self._directory(names))
        try:
            if not stat.S_ISREG(self.inner.fstat(fd).st_mode):
                raise NotRegularFileError(errno.EINVAL, "not a regular file", path)
        except BaseException:
            self.inner.close(fd)
            raise
        return fd

    def open_dir(self, path: str, *, dir_fd: int | None = None) -> int:
        if dir_fd is not None:
            return self.inner.open_dir(path, dir_fd=dir_fd)
        parts = self.relative(path)
        if not parts:
            return self.inner.open_dir(".", dir_fd=self.root_fd)
        return self._open_child(parts[-1], self._directory(parts[:-1]))

    def close(self, fd: int) -> None:
        self.inner.close(fd)

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        return self.inner.write(fd, data, offset)

    def read(self, fd: int, buffer: memoryview, offset: int) -> int:
        return self.inner.read(fd, buffer, offset)

    def readv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return self.inner.readv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        self.inner.fsync(fd)

    def fsync_dir(self, directory: str | int) -> None:
        if isinstance(directory, int):
            self.inner.fsync_dir(directory)
            return
        self.inner.fsync_dir(self._directory(self.relative(directory)))

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        if src_dir_fd is not None or dst_dir_fd is not None:
            self.inner.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            return
        (src_names, src_name), (dst_names, dst_name) = self._split(src), self._split(dst)
        self.inner.rename(
            src_name,
            dst_name,
            src_dir_fd=self._directory(src_names),
            dst_dir_fd=self._directory(dst_names),
        )

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        if dir_fd is not None:
            self.inner.unlink(path, dir_fd=dir_fd)
            return
        names, name = self._split(path)
        self.inner.unlink(name, dir_fd=self._directory(names))

    def mkdir(self, path: str, *, dir_fd: int | None = None) -> None:
        """Make each missing directory from the root down to ``path``, one name at a
        time, never through a link (a link in the way is ELOOP)."""
        if dir_fd is not None:
            self.inner.mkdir(path, dir_fd=dir_fd)
            return
        parts = self.relative(path)
        for depth, name in enumerate(parts):
            self.inner.mkdir(name, dir_fd=self._directory(parts[:depth]))

    def listdir(self, directory: str | int) -> list[str]:
        if isinstance(directory, int):
            return self.inner.listdir(directory)
        return self.inner.listdir(self._directory(self.relative(directory)))

    def fstat(self, fd: int) -> os.stat_result:
        return self.inner.fstat(fd)

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        if dir_fd is not None:
            return self.inner.stat(path, dir_fd=dir_fd)
        parts = self.relative(path)
        if not parts:
            return self.inner.fstat(self.root_fd)
        return self.inner.stat(parts[-1], dir_fd=self._directory(parts[:-1]))

    def utime(
        self, path: str, times: tuple[float, float] | None = None, *, dir_fd: int | None = None
    ) -> None:
        if dir_fd is not None:
            self.inner.utime(path, times, dir_fd=dir_fd)
            return
        names, name = self._split(path)
        self.inner.utime(name, times, dir_fd=self._directory(names))

    def write_behind(self, fd: int, offset: int, length: int) -> None:
        self.inner.write_behind(fd, offset, length)

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        self.inner.drop_behind(fd, offset, length)

    def will_need(self, fd: int) -> None:
        self.inner.will_need(fd)
