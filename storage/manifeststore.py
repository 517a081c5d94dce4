"""Where manifests live: a small store of named byte strings, local or shared (Redis).

A manifest is the small per-cache header that lists a cache's blocks (the block layout:
:func:`kvtrio.storage.writer.write_blocks`). Its bytes carry their own hash (the
preamble's xxh3-64 of the header), so whoever reads one checks it before trusting it.

Two stores keep the same contract, :class:`ManifestStore`:

- :class:`LocalManifestStore`: one file per manifest in a directory, published with the
  storage layer's atomic durable write (tmp, fsync, rename, fsync dir). One host writes
  it; the tier's own in-memory prefix index is rebuilt from :meth:`~ManifestStore.list`
  at start and is authoritative afterwards.
- :class:`RedisManifestStore`: manifests shared by every host on the same Redis URL, with
  a prefix-index keyspace so a host finds, at lookup time, caches that other hosts saved
  after it started. Keys under the URL's prefix ``P``::

      P:manifest:<name>       sha256(data) || data       (re-checked on every get)
      P:manifest-keys:<name>  set of the index keys the manifest was registered under
      P:prefix:<index key>    set of manifest names registered under that key
      P:manifest-last-use     sorted set: manifest name -> last use (seconds since epoch)
      P:manifest-pinned       set of the pinned manifests' names

  A manifest and its index entries are written in one MULTI/EXEC transaction, so no host
  sees an index entry before the manifest it names. Keys may vanish at any time (Redis's
  ``allkeys-lru`` eviction, an operator's DEL): a missing manifest is a clean miss
  (``None``), and an index entry naming a missing manifest is skipped by the reader.

Index keys are opaque strings to the store; the tier uses the hex chain hashes of token
blocks (:func:`kvtrio.actors.prefix.chain_hashes`), so "which manifests pass through this
prefix" is one pipelined round trip for a whole prompt.
"""

from __future__ import annotations

import abc
import builtins
import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs
from kvtrio.errors import CorruptCacheError
from kvtrio.storage.fileops import O_NOFOLLOW, O_NONBLOCK, OS_FILE_OPS, FileOps, pread_full
from kvtrio.storage.redisstore import (
    RedisTarget,
    connect,
    glob_escape,
    parse_redis_url,
    translate_redis_errors,
)
from kvtrio.storage.rootfd import NotRegularFileError
from kvtrio.storage.writer import TMP_SUFFIX, publish_bytes

if TYPE_CHECKING:
    import redis

__all__ = [
    "MANIFEST_NAME_RE",
    "MAX_MANIFEST_BYTES",
    "PINS_NAME",
    "LocalManifestStore",
    "ManifestStore",
    "RedisManifestStore",
    "check_manifest_name",
]

MANIFEST_NAME_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,199}")
# Names a newline each, every one a MANIFEST_NAME_RE (LocalManifestStore.names).
_NAMES_RE = re.compile(rf"(?:{MANIFEST_NAME_RE.pattern}\n)*")
_NAMES_BATCH = 1024
_TMP_END = TMP_SUFFIX + "\n"  # a temporary file's name, at its end
# A manifest lists blocks, not data: even a 1M-token cache of a deep model stays far below.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
# A local store's record of its pinned names (hidden: no manifest name, no cache file).
PINS_NAME = ".kvtrio-pins"
_DIGEST = 32
_SCAN_COUNT = 1000


def check_manifest_name(name: str) -> str:
    """Return ``name`` if it is a valid manifest name; raise CorruptCacheError otherwise."""
    if (
        not isinstance(name, str)
        or MANIFEST_NAME_RE.fullmatch(name) is None
        or name.endswith(TMP_SUFFIX)
    ):
        raise CorruptCacheError(f"manifest name: not [0-9A-Za-z._-]{{1,200}}: {name!r:.80}")
    return name


class ManifestStore(abc.ABC):
    """Named manifests, key -> bytes: atomic put, get, delete, list; blocking, for worker
    threads.

    What a store can do beyond that is declared, not probed (the model is zarr-python
    v3's store ABC): the class attributes below, read by the callers. The methods of an
    ability a store lacks keep their defaults here (an empty lookup, no last uses), and
    the batch methods have defaults built on the single ones.
    """

    #: Other hosts write to this store too: lookups must ask it (and a host never deletes
    #: the blocks its manifests name: docs/shared-tier.md).
    shared: ClassVar[bool] = False
    #: :meth:`list` names every stored manifest.
    supports_listing: ClassVar[bool] = True
    #: :meth:`delete` removes a manifest.
    supports_deletes: ClassVar[bool] = True
    #: :meth:`touch` records last uses that :meth:`last_uses` reads back.
    supports_touch: ClassVar[bool] = False
    #: :meth:`set_pinned` records pins that :meth:`pinned_names` reads back.
    supports_pins: ClassVar[bool] = False
    #: ``put(index_keys=...)`` registers a manifest in a prefix index that
    #: :meth:`lookup_each` asks and :meth:`unregister` cleans.
    supports_index: ClassVar[bool] = False

    @abc.abstractmethod
    def put(self, name: str, data: bytes, *, index_keys: Sequence[str] = ()) -> None:
        """Publish ``data`` under ``name`` atomically (replacing any), durable on return.

        ``index_keys`` register the manifest in the prefix index (ignored by a store that
        does not declare ``supports_index``: its single writer's own index knows them).
        """

    @abc.abstractmethod
    def get(self, name: str) -> bytes | None:
        """The manifest's bytes, or None if absent. CorruptCacheError if they fail checks."""

    @abc.abstractmethod
    def size(self, name: str) -> int | None:
        """The manifest's size in bytes without reading it, or None if absent."""

    @abc.abstractmethod
    def delete(self, name: str) -> bool:
        """Remove the manifest (and its index entries); False if it was absent."""

    @abc.abstractmethod
    def list(self) -> builtins.list[str]:
        """Names of every stored manifest."""

    def names(self) -> Iterable[str]:
        """Names of every stored manifest, in no particular order (:meth:`list`, unless
        a store has them cheaper unsorted: a sort of 100,000 names holds the GIL for
        tens of milliseconds in one piece)."""
        return self.list()

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections or handles."""

    def location(self, name: str) -> str:
        """Where manifest ``name`` lives, for messages and results (a path, a key)."""
        return name

    def get_many(self, names: Sequence[str]) -> builtins.list[bytes | None]:
        """:meth:`get` of each of ``names``."""
        return [self.get(name) for name in names]

    def lookup(self, index_keys: Sequence[str]) -> builtins.list[str]:
        """Names of manifests registered under any of ``index_keys`` (no duplicates)."""
        seen: dict[str, None] = {}
        for names in self.lookup_each(index_keys):
            for name in names:
                seen.setdefault(name, None)
        return builtins.list(seen)

    def lookup_each(
        self, index_keys: Sequence[str], *, limit: int | None = None
    ) -> builtins.list[builtins.list[str]]:
        """For each of ``index_keys``, in order, the names registered under it (sorted).

        One round trip for a whole prompt, so the caller can tell how deep each name's
        prefix goes; without ``supports_index``, an empty list per key. With ``limit``,
        at most that many names per key, chosen at random: the key of a prefix every
        entry shares (a system prompt) may name thousands.
        """
        return [[] for _ in index_keys]

    def unregister(self, name: str, index_keys: Sequence[str]) -> bool:
        """Remove ``name`` from the index under ``index_keys`` (and every key its record
        of registrations still names) if the manifest is absent (a stale entry: the
        manifest was evicted or deleted); True if it was removed. Without
        ``supports_index``, False.
        """
        return False

    def touch(self, last_use: Mapping[str, float]) -> None:
        """Record when manifests were last used (seconds since the epoch), so a tier's
        LRU order survives a restart; names that are absent are ignored. Without
        ``supports_touch``, nothing is recorded."""
        return None

    def last_uses(self, names: Sequence[str]) -> builtins.list[float | None]:
        """The last use of each of ``names`` (None: never recorded, or absent)."""
        return [None for _ in names]

    def set_pinned(self, pins: Mapping[str, bool]) -> None:
        """Record that manifests are pinned (True) or not (False), so a tier's pins survive
        a restart; deleting a manifest unpins it. Without ``supports_pins``, nothing is
        recorded."""
        return None

    def pinned_names(self) -> set[str]:
        """Names recorded as pinned (a name whose manifest vanished without a
        :meth:`delete`, evicted or lost in a crash, may remain: the caller checks).
        CorruptCacheError if the record is unreadable."""
        return set()


@attrs.define(eq=False)
class LocalManifestStore(ManifestStore):
    """Manifests as files ``<directory>/<name>``, published atomically and durably; a
    manifest's mtime is its last use (``supports_touch``); the pinned names are a JSON
    list in the file ``pins_path`` (default: the hidden ``<directory>/.kvtrio-pins``,
    :data:`PINS_NAME`; a tier keeps it in its root, beside its other metadata),
    republished whole (atomically, durably) on each change. One process writes a
    directory (the tier's lock), so the names read once are kept in memory."""

    supports_touch: ClassVar[bool] = True
    supports_pins: ClassVar[bool] = True

    directory: str
    file_ops: FileOps = OS_FILE_OPS
    # False: the owner makes (and checks) the directory itself (ColdTier, under its lock).
    make_directory: bool = attrs.field(default=True, kw_only=True)
    pins_path: str | None = attrs.field(default=None, kw_only=True)
    _pins: set[str] | None = attrs.field(default=None, init=False)  # read once, then kept

    def __attrs_post_init__(self) -> None:
        if self.make_directory:
            self.file_ops.mkdir(self.directory)

    def path_of(self, name: str) -> str:
        """The file of manifest ``name``."""
        return os.path.join(self.directory, check_manifest_name(name))

    def location(self, name: str) -> str:
        return os.path.abspath(self.path_of(name))

    def put(self, name: str, data: bytes, *, index_keys: Sequence[str] = ()) -> None:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest {name}: {len(data)} bytes > {MAX_MANIFEST_BYTES}")
        publish_bytes(self.path_of(name), data, file_ops=self.file_ops)

    def get(self, name: str) -> bytes | None:
        return self._read(self.path_of(name), f"manifest {name}")

    def _read(self, path: str, what: str) -> bytes | None:
        """The bytes of the regular file ``path`` (None if absent), at most
        :data:`MAX_MANIFEST_BYTES`; CorruptCacheError naming ``what`` for a link or a
        file over the cap."""
        try:
            fd = self.file_ops.open(path, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK)
        except FileNotFoundError:
            return None
        except NotRegularFileError:
            raise CorruptCacheError(f"{what}: not a regular file") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCacheError(f"{what}: is a symbolic link") from exc
            raise
        try:
            info = self.file_ops.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # a FIFO or a directory: never read
                raise CorruptCacheError(f"{what}: not a regular file")
            size = info.st_size
            if size > MAX_MANIFEST_BYTES:
                raise CorruptCacheError(f"{what}: {size} bytes > {MAX_MANIFEST_BYTES}")
            buffer = bytearray(size)
            if pread_full(self.file_ops, fd, memoryview(buffer), 0) != size:
                raise CorruptCacheError(f"{what}: shorter than its size")
            return bytes(buffer)
        finally:
            self.file_ops.close(fd)

    def size(self, name: str) -> int | None:
        try:
            return self.file_ops.stat(self.path_of(name)).st_size
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> bool:
        try:
            self.file_ops.unlink(self.path_of(name))
        except FileNotFoundError:
            return False
        self.file_ops.fsync_dir(self.directory)
        try:
            if name in self._pinned():
                self.set_pinned({name: False})
        except OSError:
            pass  # the manifest is gone all the same; the tier's next unclean open prunes
        return True

    def list(self) -> builtins.list[str]:
        return sorted(self.names())

    def names(self) -> builtins.list[str]:
        """The listing's manifest names (no temporary file), checked :data:`_NAMES_BATCH`
        at a time: names joined by newlines (counted: none may hold one) in one regex call
        and one search for the temporary suffix; a batch that fails is checked name by name
        (an open lists every entry: 100,000 regex calls were a tenth of a second)."""
        listed = self.file_ops.listdir(self.directory)
        out: builtins.list[str] = []
        for start in range(0, len(listed), _NAMES_BATCH):
            batch = listed[start : start + _NAMES_BATCH]
            joined = "\n".join(batch) + "\n"
            if (
                joined.count("\n") == len(batch)  # no name holds a newline of its own
                and _NAMES_RE.fullmatch(joined) is not None
                and _TMP_END not in joined
            ):
                out += batch
            else:
                out += [
                    n for n in batch if MANIFEST_NAME_RE.fullmatch(n) and not n.endswith(TMP_SUFFIX)
                ]
        return out

    def touch(self, last_use: Mapping[str, float]) -> None:
        # A local manifest's mtime is its last use.
        for name, when in last_use.items():
            try:
                self.file_ops.utime(self.path_of(name), (when, when))
            except FileNotFoundError:
                continue

    def last_uses(self, names: Sequence[str]) -> builtins.list[float | None]:
        out: builtins.list[float | None] = []
        for name in names:
            try:
                out.append(self.file_ops.stat(self.path_of(name)).st_mtime)
            except FileNotFoundError:
                out.append(None)
        return out

    def set_pinned(self, pins: Mapping[str, bool]) -> None:
        names = self._pinned()
        updated = {n for n in names if pins.get(n, True)}
        updated.update(check_manifest_name(n) for n, pinned in pins.items() if pinned)
        if updated == names:
            return
        data = json.dumps(sorted(updated)).encode()
        publish_bytes(self._pins_file(), data, file_ops=self.file_ops)
        self._pins = updated

    def pinned_names(self) -> set[str]:
        if self._pins is None:
            self._pins = self._read_pins()  # an unreadable record raises, for the caller
        return set(self._pins)

    def _pinned(self) -> set[str]:
        """The names, read once; an unreadable record counts as none (the next change
        replaces it), so it never fails a deletion."""
        if self._pins is None:
            try:
                self._pins = self._read_pins()
            except CorruptCacheError:
                self._pins = set()
        return self._pins

    def _pins_file(self) -> str:
        return self.pins_path or os.path.join(self.directory, PINS_NAME)

    def _read_pins(self) -> set[str]:
        path = self._pins_file()
        data = self._read(path, path)
        if data is None:
            return set()
        try:
            names = json.loads(data)
        except ValueError as exc:
            raise CorruptCacheError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(names, builtins.list) or not all(
            isinstance(n, str) and MANIFEST_NAME_RE.fullmatch(n) for n in names
        ):
            raise CorruptCacheError(f"{path}: not a list of manifest names")
        return set(names)

    def close(self) -> None:
        return None


@attrs.define(eq=False)
class RedisManifestStore(ManifestStore):
    """Manifests and the prefix index in Redis, shared by every host on the URL."""

    shared: ClassVar[bool] = True
    supports_touch: ClassVar[bool] = True
    supports_pins: ClassVar[bool] = True
    supports_index: ClassVar[bool] = True

    client: redis.Redis
    target: RedisTarget

    @classmethod
    def open(cls, url: str) -> RedisManifestStore:
        """Connect to the Redis URL (see :func:`~kvtrio.storage.redisstore.parse_redis_url`)."""
        target = parse_redis_url(url)
        return cls(connect(target), target)

    def manifest_key(self, name: str) -> str:
        """The Redis key of manifest ``name``."""
        return f"{self.target.prefix}:manifest:{check_manifest_name(name)}"

    def location(self, name: str) -> str:
        return self.manifest_key(name)

    def _keys_key(self, name: str) -> str:
        return f"{self.target.prefix}:manifest-keys:{name}"

    def _index_key(self, index_key: str) -> str:
        return f"{self.target.prefix}:prefix:{index_key}"

    def _last_use_key(self) -> str:
        return f"{self.target.prefix}:manifest-last-use"

    def _pinned_key(self) -> str:
        return f"{self.target.prefix}:manifest-pinned"

    def put(self, name: str, data: bytes, *, index_keys: Sequence[str] = ()) -> None:
        key = self.manifest_key(name)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest {name}: {len(data)} bytes > {MAX_MANIFEST_BYTES}")
        value = hashlib.sha256(data).digest() + data
        with translate_redis_errors(self.target):
            old_keys = self.client.smembers(self._keys_key(name))
            pipe = self.client.pipeline(transaction=True)
            for old in old_keys:
                pipe.srem(self._index_key(_text(old)), name)
            pipe.set(key, value)
            pipe.zadd(self._last_use_key(), {name: time.time()})
            pipe.delete(self._keys_key(name))
            if index_keys:
                pipe.sadd(self._keys_key(name), *index_keys)
                for index_key in index_keys:
                    pipe.sadd(self._index_key(index_key), name)
            pipe.execute()

    def get(self, name: str) -> bytes | None:
        key = self.manifest_key(name)
        with translate_redis_errors(self.target):
            # At most one byte over the cap is ever transferred (the local store's cap:
            # a value padded to hundreds of MB with a recomputed hash is refused, not read).
            value = self.client.getrange(key, 0, _DIGEST + MAX_MANIFEST_BYTES)
        if not value:
            return None  # missing (an empty value is no manifest either)
        raw = value if isinstance(value, bytes) else value.encode()
        if len(raw) > _DIGEST + MAX_MANIFEST_BYTES:
            raise CorruptCacheError(f"manifest {name}: over the {MAX_MANIFEST_BYTES}-byte cap")
        if len(raw) < _DIGEST or hashlib.sha256(raw[_DIGEST:]).digest() != raw[:_DIGEST]:
            raise CorruptCacheError(f"manifest {name}: content does not match its sha256")
        return raw[_DIGEST:]

    def size(self, name: str) -> int | None:
        key = self.manifest_key(name)
        with translate_redis_errors(self.target):
            stored = int(self.client.strlen(key))  # 0 for a missing key
        return stored - _DIGEST if stored >= _DIGEST else None

    def delete(self, name: str) -> bool:
        key = self.manifest_key(name)
        with translate_redis_errors(self.target):
            index_keys = self.client.smembers(self._keys_key(name))
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            pipe.zrem(self._last_use_key(), name)
            pipe.srem(self._pinned_key(), name)
            pipe.delete(self._keys_key(name))
            for index_key in index_keys:
                pipe.srem(self._index_key(_text(index_key)), name)
            replies = pipe.execute()
        return bool(replies[0])

    def list(self) -> builtins.list[str]:
        prefix = f"{self.target.prefix}:manifest:"
        pattern = glob_escape(prefix) + "*"
        with translate_redis_errors(self.target):
            keys = [_text(k) for k in self.client.scan_iter(match=pattern, count=_SCAN_COUNT)]
        names = (key[len(prefix) :] for key in keys)
        return sorted(name for name in names if MANIFEST_NAME_RE.fullmatch(name))

    def lookup_each(
        self, index_keys: Sequence[str], *, limit: int | None = None
    ) -> builtins.list[builtins.list[str]]:
        if not index_keys:
            return []
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        with translate_redis_errors(self.target):
            pipe = self.client.pipeline(transaction=False)
            for index_key in index_keys:
                if limit is None:
                    pipe.smembers(self._index_key(index_key))
                else:  # distinct members, at most ``limit``
                    pipe.srandmember(self._index_key(index_key), limit)
            replies = pipe.execute()
        # Members come from the shared (untrusted) store: only valid names go on.
        return [
            sorted(name for name in map(_text, members) if MANIFEST_NAME_RE.fullmatch(name))
            for members in replies
        ]

    def unregister(self, name: str, index_keys: Sequence[str]) -> bool:
        from redis.exceptions import WatchError

        key = self.manifest_key(name)
        with translate_redis_errors(self.target):
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]  # a re-publication aborts
                    if pipe.exists(key):
                        return False
                    # The keys it was registered under, where that record survives too.
                    known = {_text(k) for k in pipe.smembers(self._keys_key(name))}
                    pipe.multi()
                    for index_key in sorted(known.union(index_keys)):
                        pipe.srem(self._index_key(index_key), name)
                    pipe.delete(self._keys_key(name))
                    pipe.execute()
                except WatchError:
                    return False
        return True

    def touch(self, last_use: Mapping[str, float]) -> None:
        if not last_use:
            return
        names = [check_manifest_name(name) for name in last_use]
        with translate_redis_errors(self.target):
            # XX: only members already there (a manifest deleted meanwhile stays out).
            self.client.zadd(self._last_use_key(), {n: last_use[n] for n in names}, xx=True)

    def last_uses(self, names: Sequence[str]) -> builtins.list[float | None]:
        if not names:
            return []
        with translate_redis_errors(self.target):
            scores = self.client.zmscore(self._last_use_key(), list(names))
        return [None if score is None else float(score) for score in scores]

    def set_pinned(self, pins: Mapping[str, bool]) -> None:
        added = [check_manifest_name(n) for n, pinned in pins.items() if pinned]
        removed = [check_manifest_name(n) for n, pinned in pins.items() if not pinned]
        if not pins:
            return
        with translate_redis_errors(self.target):
            pipe = self.client.pipeline(transaction=True)
            if added:
                pipe.sadd(self._pinned_key(), *added)
            if removed:
                pipe.srem(self._pinned_key(), *removed)
            pipe.execute()

    def pinned_names(self) -> set[str]:
        with translate_redis_errors(self.target):
            members = self.client.smembers(self._pinned_key())
        # From the shared (untrusted) store: only valid names go on.
        return {name for name in map(_text, members) if MANIFEST_NAME_RE.fullmatch(name)}

    def close(self) -> None:
        self.client.close()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
