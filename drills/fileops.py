"""File-operation wrappers for the drills: simulated power loss, and no-sync speed.

:class:`NoSyncFileOps` is the real file operations with fsync skipped. A kill -9 does
not lose the page cache, so fsync changes nothing a crash drill (or a fault or race
drill) can observe; skipping it makes CI-sized drills fast on a shared disk. Durability
against power loss is what :class:`LossyFileOps` simulates on top, and the ``--full``
drills use the real fsync.

:class:`LossyFileOps` wraps a :class:`~kvtrio.storage.fileops.FileOps` and remembers
what the disk would not have kept if power failed now: file bytes written since the
file's last fsync, and directory entries (creates, renames, unlinks) made since the
directory's last fsync. :meth:`LossyFileOps.lose_unsynced` then undoes them on the real
file system, choosing at random how much survives (all of it lost, a torn prefix, or
zeros where data never reached the platter), the way ext4, XFS and APFS may leave a
file after a crash. What an fsync (file) or fsync_dir (directory) covered is kept.

Only the crash child uses this; it calls ``lose_unsynced()`` and then kills itself
with SIGKILL, so the next process sees what a rebooted machine would.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
from kvtrio.storage.fileops import OS_FILE_OPS, FileOps, OsFileOps

__all__ = ["LossyFileOps", "NoSyncFileOps", "drill_dir", "drill_file_ops"]

_backup_names = itertools.count()


class NoSyncFileOps(OsFileOps):
    """The real file operations without fsync (see the module doc for why that is sound)."""

    def fsync(self, fd: int) -> None:
        return None

    def fsync_dir(self, directory: str | int) -> None:
        return None


NO_SYNC_FILE_OPS: FileOps = NoSyncFileOps()


def drill_file_ops(*, full: bool) -> FileOps:
    """The base file operations of a drill: real fsync with ``full``, none otherwise."""
    return OS_FILE_OPS if full else NO_SYNC_FILE_OPS


@contextlib.contextmanager
def drill_dir(workdir: Path, *, full: bool) -> Iterator[Path]:
    """Where a drill keeps its files: ``workdir`` (a real disk) with ``full``, otherwise a
    tmpfs directory when there is one. kill -9, EIO and races behave the same on tmpfs
    (the page cache outlives a killed process), and it keeps CI runs off a shared disk."""
    shm = "/dev/shm"
    if full or not os.access(shm, os.W_OK):
        yield workdir
        return
    with tempfile.TemporaryDirectory(prefix="kvtrio-drill-", dir=shm) as tmp:
        yield Path(tmp)


@attrs.define
class _FileState:
    """One inode's unsynced history: its length at the last fsync, and its writes since."""

    synced_len: int
    dirty: list[tuple[int, int]] = attrs.field(factory=list)  # (offset, length)
    undo: list[tuple[int, bytes]] = attrs.field(factory=list)  # old bytes of synced ranges


@attrs.frozen
class _DirOp:
    kind: str  # "create", "rename", "unlink"
    path: str
    dst: str = ""
    backup: str = ""  # a hard link to what the op replaced or removed


@attrs.define
class LossyFileOps:
    """A FileOps that can forget everything not yet made durable (see the module doc)."""

    inner: FileOps
    backup_dir: str
    rng: random.Random
    _fd_inode: dict[int, int] = attrs.field(factory=dict)
    _inode_path: dict[int, str] = attrs.field(factory=dict)
    _files: dict[int, _FileState] = attrs.field(factory=dict)
    _dirs: dict[str, list[_DirOp]] = attrs.field(factory=dict)
    _dir_path: dict[int, str] = attrs.field(factory=dict)  # open_dir descriptors

    def _log(self, path: str, op: _DirOp) -> None:
        self._dirs.setdefault(os.path.dirname(os.path.abspath(path)), []).append(op)

    def _backup(self, path: str) -> str:
        if not os.path.lexists(path):
            return ""
        backup = os.path.join(self.backup_dir, f"b{os.getpid()}-{next(_backup_names)}")
        os.link(path, backup)
        return backup

    def _abs(self, path: str, dir_fd: int | None) -> str:
        """The absolute path of ``path`` (relative to ``dir_fd``, a directory opened
        through :meth:`open_dir`, when given)."""
        if dir_fd is None:
            return os.path.abspath(path)
        return os.path.normpath(os.path.join(self._dir_path[dir_fd], path))

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        full = self._abs(path, dir_fd)
        existed = os.path.lexists(full)
        fd = self.inner.open(path, flags, mode, dir_fd=dir_fd)
        inode = os.fstat(fd).st_ino
        self._fd_inode[fd] = inode
        self._inode_path[inode] = full
        if inode not in self._files:
            self._files[inode] = _FileState(synced_len=0 if not existed else os.fstat(fd).st_size)
        if not existed and flags & os.O_CREAT:
            self._log(full, _DirOp("create", full))
        return fd

    def open_dir(self, path: str, *, dir_fd: int | None = None) -> int:
        full = self._abs(path, dir_fd)
        fd = self.inner.open_dir(path, dir_fd=dir_fd)
        self._dir_path[fd] = full
        return fd

    def close(self, fd: int) -> None:
        self._fd_inode.pop(fd, None)
        self._dir_path.pop(fd, None)
        self.inner.close(fd)

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        state = self._files[self._fd_inode[fd]]
        if offset < state.synced_len:
            end = min(offset + len(data), state.synced_len)
            with open(self._inode_path[self._fd_inode[fd]], "rb") as f:
                f.seek(offset)
                state.undo.append((offset, f.read(end - offset)))
        n = self.inner.write(fd, data, offset)
        state.dirty.append((offset, n))
        return n

    def read(self, fd: int, buffer: memoryview, offset: int) -> int:
        return self.inner.read(fd, buffer, offset)

    def readv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return self.inner.readv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        self.inner.fsync(fd)
        state = self._files[self._fd_inode[fd]]
        state.synced_len = os.fstat(fd).st_size
        state.dirty.clear()
        state.undo.clear()

    def fsync_dir(self, directory: str | int) -> None:
        self.inner.fsync_dir(directory)
        path = self._dir_path[directory] if isinstance(directory, int) else directory
        self._dirs.pop(os.path.abspath(path), None)

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        full_src, full_dst = self._abs(src, src_dir_fd), self._abs(dst, dst_dir_fd)
        backup = self._backup(full_dst)
        self.inner.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        self._log(full_dst, _DirOp("rename", full_src, full_dst, backup))
        inode = os.lstat(full_dst).st_ino
        if inode in self._inode_path:
            self._inode_path[inode] = full_dst

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        full = self._abs(path, dir_fd)
        backup = self._backup(full)
        self.inner.unlink(path, dir_fd=dir_fd)
        self._log(full, _DirOp("unlink", full, backup=backup))

    def mkdir(self, path: str, *, dir_fd: int | None = None) -> None:
        self.inner.mkdir(path, dir_fd=dir_fd)

    def listdir(self, directory: str | int) -> list[str]:
        return self.inner.listdir(directory)

    def fstat(self, fd: int) -> os.stat_result:
        return self.inner.fstat(fd)

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        return self.inner.stat(path, dir_fd=dir_fd)

    def utime(
        self, path: str, times: tuple[float, float] | None = None, *, dir_fd: int | None = None
    ) -> None:
        self.inner.utime(path, times, dir_fd=dir_fd)

    def write_behind(self, fd: int, offset: int, length: int) -> None:
        self.inner.write_behind(fd, offset, length)

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        self.inner.drop_behind(fd, offset, length)

    def will_need(self, fd: int) -> None:
        self.inner.will_need(fd)

    def lose_unsynced(self) -> int:
        """Undo, on disk, what a power cut could lose; return how many changes were undone."""
        undone = 0
        for inode, state in self._files.items():
            path = self._inode_path.get(inode)
            if path is None or not (state.dirty or state.undo) or not os.path.exists(path):
                continue
            if os.lstat(path).st_ino != inode:
                continue
            undone += len(state.dirty)
            self._lose_file_data(path, state)
        for ops in self._dirs.values():
            keep = self.rng.randint(0, len(ops))  # journaled metadata: a prefix survives
            for op in reversed(ops[keep:]):
                self._undo_dir_op(op)
                undone += 1
        return undone

    def _lose_file_data(self, path: str, state: _FileState) -> None:
        mode = self.rng.choice(("drop", "torn", "zeros"))
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if mode == "drop":
                for offset, old in reversed(state.undo):
                    f.seek(offset)
                    f.write(old)
                f.truncate(state.synced_len)
                return
            for offset, length in state.dirty:
                if mode == "zeros" or self.rng.random() < 0.5:
                    f.seek(offset)
                    f.write(bytes(length))
            if mode == "torn" and size > state.synced_len:
                f.truncate(self.rng.randint(state.synced_len, size))

    def _undo_dir_op(self, op: _DirOp) -> None:
        if op.kind == "create":
            if os.path.lexists(op.path):
                os.unlink(op.path)
        elif op.kind == "rename":
            if os.path.lexists(op.dst):
                os.rename(op.dst, op.path)
            if op.backup:
                os.link(op.backup, op.dst)
        elif op.kind == "unlink" and op.backup and not os.path.lexists(op.path):
            os.link(op.backup, op.path)
