"""One constructor for a cold tier's stores, local or shared: :func:`open_store`.

``open_store("/var/cache/kvtrio")`` gives the local directory stores (``blocks/`` and
``manifests/`` under the directory); ``open_store("redis://host:6379/0?prefix=kvtrio")``
(or ``rediss://`` for TLS) gives the Redis stores, sharing one connection pool, so every
host opening the same URL shares blocks, manifests and the prefix index.

:class:`ManifestFileOps` lets the path-based writers and readers of
:mod:`kvtrio.storage.writer` / :mod:`kvtrio.storage.reader` publish and read manifests in
any :class:`~kvtrio.storage.manifeststore.ManifestStore`: it is a
:class:`~kvtrio.storage.fileops.FileOps` in which the files of one directory are the
store's manifests. The mapping keeps the writer's rules:

1. A tmp file (``open`` with ``O_CREAT | O_EXCL``) lives in memory; ``rename`` onto a
   manifest name is the atomic publication (``ManifestStore.put``). No reader ever sees a
   partial manifest, and a write that fails or is cancelled before its rename leaves
   nothing in the store (docs/design.md invariant 4).
2. ``fsync`` and ``fsync_dir`` are no-ops: ``put`` returns once the store has it (for
   Redis, its persistence settings decide what survives a restart of Redis itself).
3. A manifest that is absent is ``FileNotFoundError``, as a missing file is; a store that
   cannot be reached raises :class:`~kvtrio.errors.StoreUnavailableError` unchanged.
4. Paths outside the directory go to ``inner`` (the real file system).
5. With ``index_keys_of`` set, the publication registers the manifest in the store's
   shared prefix index under the keys it returns for the manifest's name and bytes, in
   the same atomic ``put`` (the tier sets it: the keys are its token-block chain hashes).
   A manifest it cannot make keys for is published unindexed: the index only speeds up
   finding entries, every host can still list them.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence

import attrs
from kvtrio.errors import CorruptCacheError
from kvtrio.storage.blockstore import BlockStore, LocalBlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, FileOps
from kvtrio.storage.manifeststore import (
    LocalManifestStore,
    ManifestStore,
    RedisManifestStore,
)
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.redisstore import RedisBlockStore, connect, is_redis_url, parse_redis_url

__all__ = ["ManifestFileOps", "is_redis_url", "open_store"]


def open_store(
    url_or_path: str | os.PathLike[str],
    *,
    file_ops: FileOps = OS_FILE_OPS,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> tuple[BlockStore, ManifestStore]:
    """The block store and manifest store of a cold tier at ``url_or_path`` (``options``:
    the Redis store's verified reads use ``redis_hash_threads``).

    Raises StoreUnavailableError when a Redis URL's server does not answer (or redis-py
    is not installed), ValueError for a malformed URL.
    """
    target_text = os.fspath(url_or_path)
    if is_redis_url(target_text):
        target = parse_redis_url(target_text)
        client = connect(target)
        return RedisBlockStore(client, target, options), RedisManifestStore(client, target)
    root = os.path.abspath(target_text)
    blocks = LocalBlockStore(os.path.join(root, "blocks"), file_ops)
    manifests = LocalManifestStore(os.path.join(root, "manifests"), file_ops)
    return blocks, manifests


# File descriptors handed out for in-memory manifests: far above any real descriptor.
_FD_BASE = 1 << 40


@attrs.define
class _Open:
    name: str
    data: bytearray
    writable: bool


@attrs.define(eq=False)
class ManifestFileOps:
    """A FileOps whose files in ``directory`` are the manifests of ``manifests``."""

    manifests: ManifestStore
    directory: str
    inner: FileOps = OS_FILE_OPS
    # (manifest name, manifest bytes) -> the prefix-index keys to register it under (rule 5)
    index_keys_of: Callable[[str, bytes], Sequence[str]] | None = None
    _open: dict[int, _Open] = attrs.field(init=False, factory=dict)
    _tmp: dict[str, bytearray] = attrs.field(init=False, factory=dict)  # written, unpublished
    _fds: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(_FD_BASE))
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def __attrs_post_init__(self) -> None:
        self.directory = os.path.abspath(self.directory)

    def _name(self, path: str) -> str | None:
        """The manifest name of ``path``, or None when the path is outside the directory."""
        head, name = os.path.split(os.path.abspath(path))
        return name if head == self.directory and name else None

    def _file(self, fd: int) -> _Open:
        with self._lock:
            return self._open[fd]

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        name = self._name(path)
        if name is None:
            return self.inner.open(path, flags, mode)
        if flags & os.O_CREAT:
            with self._lock:
                if name in self._tmp:
                    raise FileExistsError(errno.EEXIST, "tmp manifest exists", path)
                self._tmp[name] = buffer = bytearray()
            handle = _Open(name, buffer, writable=True)
        else:
            data = self.manifests.get(name)
            if data is None:
                raise FileNotFoundError(errno.ENOENT, "no such manifest", path)
            handle = _Open(name, bytearray(data), writable=False)
        with self._lock:
            fd = next(self._fds)
            self._open[fd] = handle
        return fd

    def close(self, fd: int) -> None:
        if fd < _FD_BASE:
            self.inner.close(fd)
            return
        with self._lock:
            self._open.pop(fd, None)

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        if fd < _FD_BASE:
            return self.inner.write(fd, data, offset)
        handle = self._file(fd)
        if not handle.writable:
            raise OSError(errno.EBADF, "manifest opened read-only")
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        end = offset + len(view)
        if len(handle.data) < end:
            handle.data.extend(bytes(end - len(handle.data)))
        handle.data[offset:end] = view
        return len(view)

    def read(self, fd: int, buffer: memoryview, offset: int) -> int:
        if fd < _FD_BASE:
            return self.inner.read(fd, buffer, offset)
        data = self._file(fd).data
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        chunk = data[offset : offset + len(view)]
        view[: len(chunk)] = chunk
        return len(chunk)

    def fsync(self, fd: int) -> None:
        if fd < _FD_BASE:
            self.inner.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        if os.path.abspath(path) != self.directory:
            self.inner.fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        src_name, dst_name = self._name(src), self._name(dst)
        if src_name is None and dst_name is None:
            self.inner.rename(src, dst)
            return
        if src_name is None or dst_name is None:
            raise OSError(errno.EXDEV, "cannot move files into or out of a manifest store")
        with self._lock:
            data = self._tmp.pop(src_name, None)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no tmp manifest being written", src)
        published = bytes(data)
        index_keys: Sequence[str] = ()
        if self.index_keys_of is not None:
            try:
                index_keys = self.index_keys_of(dst_name, published)
            except (CorruptCacheError, ValueError):
                index_keys = ()  # rule 5: published, just not indexed
        self.manifests.put(dst_name, published, index_keys=index_keys)

    def unlink(self, path: str) -> None:
        name = self._name(path)
        if name is None:
            self.inner.unlink(path)
            return
        with self._lock:
            if self._tmp.pop(name, None) is not None:
                return
        if not self.manifests.delete(name):
            raise FileNotFoundError(errno.ENOENT, "no such manifest", path)

    def mkdir(self, path: str) -> None:
        if os.path.abspath(path) != self.directory:
            self.inner.mkdir(path)

    def listdir(self, path: str) -> list[str]:
        if os.path.abspath(path) != self.directory:
            return self.inner.listdir(path)
        return self.manifests.list()

    def fstat(self, fd: int) -> os.stat_result:
        if fd < _FD_BASE:
            return self.inner.fstat(fd)
        return _stat_of(len(self._file(fd).data), fd)

    def stat(self, path: str) -> os.stat_result:
        name = self._name(path)
        if name is None:
            return self.inner.stat(path)
        with self._lock:
            tmp = self._tmp.get(name)
        if tmp is not None:
            return _stat_of(len(tmp), 0)
        size = self.manifests.size(name)  # not the bytes: a stat reads no manifest
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such manifest", path)
        return _stat_of(size, 0)


def _stat_of(size: int, ino: int) -> os.stat_result:
    now = time.time()
    # (mode, ino, dev, nlink, uid, gid, size, atime, mtime, ctime)
    return os.stat_result((stat.S_IFREG | 0o600, ino, 0, 1, 0, 0, size, now, now, now))
