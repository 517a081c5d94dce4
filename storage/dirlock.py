"""One owner per cold-tier directory: an advisory lock file in its root.

A cold-tier directory belongs to one process at a time. The owner holds
``fcntl.flock(LOCK_EX)`` on ``<root>/.kvtrio-lock`` from open to close and writes its
pid into the file; everything that deletes (eviction, the open's sweep of orphan blocks
and tmp debris, ``kvtrio gc``) runs under it, so a second process can neither delete
blocks a newer entry of the first shares nor sweep a save still in flight.

Rules:

1. The lock is a ``flock`` on an open file description: the kernel releases it when the
   holder's descriptor closes, including when the process dies (``kill -9``, a crash),
   so a stale lock file never blocks anyone; the pid in it is only a report.
2. :func:`try_lock` never blocks; a caller that waits (a rolling restart: the new
   process waits while the old one flushes) polls it on its own clock.
3. The lock file is opened without following links (a link planted in the root is not
   followed) and is never deleted: unlinking a locked file would let a second process
   lock a new file of the same name. It sits in the root itself, so its own name is the
   only one below the root on its path, and O_NOFOLLOW covers it (docs/design.md
   invariant 18 needs no descriptor walk here; the lock is taken before the tier opens
   its root's descriptor).

Advisory only: a process that does not use it (``rm -rf``) is not stopped. NFS and
other network filesystems may not honour ``flock``; a cold tier belongs on local disk.

Keeps docs/design.md invariant 10.
"""

from __future__ import annotations

import errno
import fcntl
import os

import attrs
from kvtrio.storage.fileops import O_NOFOLLOW, O_NONBLOCK

__all__ = ["LOCK_NAME", "DirectoryLock", "holder_pid", "try_lock"]

LOCK_NAME = ".kvtrio-lock"
_PID_BYTES = 32


@attrs.define(eq=False)
class DirectoryLock:
    """A held directory lock; :meth:`release` (or process exit) gives it back."""

    directory: str
    fd: int | None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Give the lock back (idempotent). The file stays (rule 3)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)  # nobody holds it: name no holder
        finally:
            os.close(fd)  # closing releases the flock


def _open_lock_file(directory: str) -> int:
    path = os.path.join(directory, LOCK_NAME)
    return os.open(path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def try_lock(directory: str) -> DirectoryLock | None:
    """Take ``directory``'s lock if it is free (creating the directory and the lock file
    as needed) and write this process's pid into it; None when another holds it.
    NotADirectoryError when ``directory`` is something else (a file, a FIFO, a link to
    one): makedirs's own FileExistsError said only "File exists"."""
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory) from None
    fd = _open_lock_file(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return DirectoryLock(directory, fd)


def holder_pid(directory: str) -> int | None:
    """The pid the lock file names (None: none, or not a pid). A report, not a proof."""
    try:
        # O_NONBLOCK: a FIFO a neighbour put there cannot block the report.
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK)
    except OSError:
        return None
    try:
        text = os.pread(fd, _PID_BYTES, 0).decode("ascii", "replace").strip()
    except OSError:  # not a file (a FIFO): no pid to report
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None
