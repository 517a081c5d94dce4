"""Blocks in Redis (or Valkey), shared by every host that opens the same URL.

Theory of operation
-------------------
Keys, under a configurable prefix ``P`` (``?prefix=`` in the URL, default ``kvtrio``)::

    P:block:<sha256>    the block's bytes, written with SET NX (once, never overwritten)
    P:block-mtime       sorted set: block name -> last time a host put it (GC's grace period)

Rules this module keeps:

1. A block is written once: ``SET key value NX``. A host that puts a block another host
   already stored sends it but stores nothing, and counts nothing as newly stored.
2. Many blocks travel in one pipeline (one round trip per batch of up to
   :data:`PIPELINE_BYTES`), in both directions; block bytes are sent from the caller's
   memoryviews without a Python-level copy (redis-py writes memoryviews as separate
   chunks), and received into the caller's buffers with ``recv_into`` (the GET replies
   are parsed here, on a connection checked out of redis-py's pool, so no ``bytes``
   object is built per block and copied again).
3. The store is untrusted: sizes are checked here, content is re-hashed by the caller
   (``read_into`` does not hash, like every :class:`~kvtrio.storage.blockstore.BlockStore`).
   A block that is absent -- never stored, deleted, or evicted by ``maxmemory`` +
   ``allkeys-lru`` -- is a clean miss (``False``), not an error.
4. Every put refreshes the block's time in ``P:block-mtime`` (git's "freshen"), so a GC
   sweeping with a grace period never deletes a block a writer just relied on. A block
   with no recorded time reports "now": unknown age is treated as young.
5. Every failure to talk to Redis -- refused, reset, timed out, out of memory, read-only
   replica -- becomes :class:`~kvtrio.errors.StoreUnavailableError` at this boundary,
   with the redis-py exception as ``__cause__``. The cold tier is best effort: the
   caller turns that into a FAILED ticket or a miss, and the server keeps serving.

Why the synchronous client, on worker threads: kvtrio runs every blocking I/O job on
worker threads behind a capacity limiter (``kvtrio.runtime.offload``) so the trio thread
never waits; Redis I/O takes the same road as disk I/O, with the same cancellation
points at block-batch boundaries. redis-py's asyncio client would need an asyncio loop
(trio is not asyncio), and its socket reads and writes release the GIL in the sync client
just as ``os.pwrite`` does. The client is thread-safe: each call checks a connection out
of its pool, so concurrent worker threads never share a socket.

Durability: a put returns once Redis has acknowledged every SET. Whether that survives a
Redis restart is Redis's configuration (``appendonly yes`` + ``appendfsync``); see
docs/shared-tier.md.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import attrs
from kvtrio.errors import StoreUnavailableError
from kvtrio.storage.blockstore import (
    BLOCK_NAME_RE,
    BlockInfo,
    BlockStore,
    CorruptBlockError,
    check_block_name,
)
from kvtrio.storage.hashpool import HashPool
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.redisrecv import (
    PooledVerifier,
    Verifier,
    get_raw,
    ignore_progress,
    pack_gets,
)

if TYPE_CHECKING:
    import redis

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_PREFIX",
    "PIPELINE_BYTES",
    "RedisBlockStore",
    "RedisBlockStoreStatistics",
    "RedisTarget",
    "connect",
    "glob_escape",
    "is_redis_url",
    "parse_redis_url",
    "translate_redis_errors",
]

DEFAULT_PREFIX = "kvtrio"
# One pipeline carries at most this many block bytes (and at most PIPELINE_BLOCKS blocks):
# large enough to amortize the round trip, small enough to bound the replies buffered.
PIPELINE_BYTES = 64 * 1024 * 1024
PIPELINE_BLOCKS = 512
_SCAN_COUNT = 1000


# redis-py keeps a connection's socket in this private attribute. Without it (another
# redis-py version), reads fall back to redis-py's public reply parser: correct, slower.
_SOCKET_ATTRIBUTE = "_sock"
_log = logging.getLogger(__name__)
#: Seconds any one Redis operation may wait on the server (connect, or each reply read)
#: before it fails with StoreUnavailableError: a stalled store costs a request at most
#: this per round trip, never redis-py's default of waiting forever. ``?socket_timeout=``
#: and ``?socket_connect_timeout=`` in the URL change it.
DEFAULT_DEADLINE_S = 1.0
# Connection defaults chosen so an unreachable server fails a save in about a second
# instead of redis-py's ten retries; each is overridable in the URL's query string.
_DEFAULT_OPTIONS = {
    "socket_connect_timeout": str(DEFAULT_DEADLINE_S),
    "socket_timeout": str(DEFAULT_DEADLINE_S),
    "health_check_interval": "30",
}
_DEFAULT_RETRIES = 2


def is_redis_url(target: str) -> bool:
    """Whether ``target`` names a Redis server (``redis://``, ``rediss://`` or ``unix://``)."""
    return target.startswith(("redis://", "rediss://", "unix://"))


@attrs.frozen
class RedisTarget:
    """A parsed Redis URL: what redis-py connects to, and kvtrio's own options."""

    url: str  # the URL handed to redis-py: kvtrio's own options removed
    prefix: str
    retries: int

    @property
    def display(self) -> str:
        """The server's URL without password or options, for messages and logs."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        if parts.password is not None:
            netloc = f"{parts.username or ''}:***@{netloc}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def parse_redis_url(url: str) -> RedisTarget:
    """Split kvtrio's options (``prefix``, ``retries``) from a redis-py connection URL.

    Everything else -- host, port, ``/db``, ``user:password@``, ``rediss://`` for TLS,
    ``?ssl_cert_reqs=``, ``?socket_timeout=`` ... -- is redis-py's ``from_url`` syntax.
    """
    if not is_redis_url(url):
        raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {url!r:.80}")
    parts = urlsplit(url)
    options = dict(_DEFAULT_OPTIONS)
    prefix = DEFAULT_PREFIX
    retries = _DEFAULT_RETRIES
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "prefix":
            prefix = value
        elif name == "retries":
            retries = int(value)
        else:
            options[name] = value
    if not prefix or any(c in prefix for c in " \r\n") or len(prefix) > 200:
        raise ValueError(f"Redis key prefix: 1 to 200 characters, no whitespace: {prefix!r}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    stripped = urlunsplit(
        (parts.scheme, parts.netloc, parts.path, urlencode(options), parts.fragment)
    )
    return RedisTarget(url=stripped, prefix=prefix, retries=retries)


def connect(target: RedisTarget) -> redis.Redis:
    """A redis-py client for ``target`` (lazily imported: redis is the ``redis`` extra).

    Raises StoreUnavailableError when redis-py is missing or the server does not answer
    PING.
    """
    try:
        import redis
        from redis.backoff import ExponentialWithJitterBackoff
        from redis.retry import Retry
    except ImportError as exc:
        raise StoreUnavailableError(
            "the Redis tier needs redis-py: pip install 'kvtrio[redis]'"
        ) from exc
    from redis.exceptions import ConnectionError as RedisConnectionError

    # Retry a refused or reset connection, never a timeout: a server that accepts and
    # does not answer (stalled, SIGSTOPped, swapping) then costs one deadline per
    # operation, not (retries + 1) of them.
    retry = Retry(
        ExponentialWithJitterBackoff(base=0.01, cap=0.25),
        target.retries,
        supported_errors=(RedisConnectionError,),
    )
    client = redis.Redis.from_url(target.url, retry=retry)
    with translate_redis_errors(target):
        client.ping()
    return client


@functools.cache
def _redis_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError

    return (RedisError, OSError)


class translate_redis_errors:
    """Turn every redis-py error raised inside into StoreUnavailableError (rule 5).

    Stateless, so one instance may be shared by threads and re-entered.
    """

    __slots__ = ("_on_error", "_target")

    def __init__(self, target: RedisTarget, on_error: Callable[[], None] | None = None) -> None:
        self._target = target
        self._on_error = on_error

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or not isinstance(exc, _redis_errors()):
            return
        if self._on_error is not None:
            self._on_error()
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StoreUnavailableError(f"redis {self._target.display}: {detail}") from exc


@attrs.frozen
class RedisBlockStoreStatistics:
    """Counts since the store was opened (this process only)."""

    blocks_put: int  # blocks sent
    blocks_stored: int  # of those, newly stored (the rest already existed: dedup)
    bytes_stored: int
    bytes_deduplicated: int  # bytes sent for blocks that already existed
    blocks_read: int
    bytes_read: int
    misses: int  # reads of absent blocks
    errors: int  # calls that raised StoreUnavailableError
    blocks_verified: int = 0  # blocks re-hashed against their names by verified reads
    public_api_reads: int = 0  # pipelines read through redis-py's parser (no raw socket)


def _as_bytes_view(buffer: memoryview) -> memoryview:
    """A 1-D unsigned-byte view of ``buffer`` (len() then counts bytes, not items)."""
    if buffer.format == "B" and buffer.ndim == 1:
        return buffer
    return buffer.cast("B")


def _batches(sizes: Sequence[int]) -> Iterator[range]:
    """Index ranges of at most PIPELINE_BLOCKS items and about PIPELINE_BYTES bytes."""
    start = 0
    while start < len(sizes):
        end = start
        total = 0
        while end < len(sizes) and end - start < PIPELINE_BLOCKS:
            if end > start and total + sizes[end] > PIPELINE_BYTES:
                break
            total += sizes[end]
            end += 1
        yield range(start, end)
        start = end


def glob_escape(text: str) -> str:
    """``text`` with the glob characters of Redis MATCH patterns escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@attrs.define(eq=False)
class RedisBlockStore(BlockStore):
    """A :class:`~kvtrio.storage.blockstore.BlockStore` on Redis; safe to share between threads.

    Build it with :meth:`open` (from a URL) or from an existing client and target (to share
    one connection pool with a :class:`~kvtrio.storage.manifeststore.RedisManifestStore`).
    Declares every optional ability: pipelined batches, reads verified as they arrive,
    sizes by STRLEN.
    """

    supports_batched_reads: ClassVar[bool] = True
    supports_verified_reads: ClassVar[bool] = True
    supports_sizes: ClassVar[bool] = True
    written_by_others: ClassVar[bool] = True  # every host writes it: sha256 checks

    client: redis.Redis
    target: RedisTarget
    options: IoOptions = DEFAULT_IO_OPTIONS
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _counts: dict[str, int] = attrs.field(init=False, factory=dict)
    _translator: translate_redis_errors = attrs.field(init=False)
    _warned_public: bool = attrs.field(init=False, default=False)
    # sha256 helpers of verified reads (hashlib releases the GIL while it hashes); their
    # threads start on the first verified read and end with close().
    _hashes: HashPool = attrs.field(init=False)

    @_translator.default
    def _make_translator(self) -> translate_redis_errors:
        return translate_redis_errors(self.target, lambda: self._count(errors=1))

    @_hashes.default
    def _make_hashes(self) -> HashPool:
        return HashPool(self.options.redis_hash_threads, name="kvtrio-sha256")

    @classmethod
    def open(cls, url: str, *, options: IoOptions = DEFAULT_IO_OPTIONS) -> RedisBlockStore:
        """Connect to the Redis URL (see :func:`parse_redis_url`) and check it answers."""
        target = parse_redis_url(url)
        return cls(connect(target), target, options)

    # -- keys ---------------------------------------------------------------------------

    def block_key(self, name: str) -> str:
        """The Redis key of block ``name``."""
        return f"{self.target.prefix}:block:{name}"

    @property
    def mtime_key(self) -> str:
        """The sorted set of block put times."""
        return f"{self.target.prefix}:block-mtime"

    # -- BlockStore ---------------------------------------------------------------------

    def put_many(self, blocks: Sequence[tuple[str, memoryview]]) -> int:
        """Store the absent blocks (SET NX, pipelined); return the bytes newly stored."""
        views = [(check_block_name(name), _as_bytes_view(data)) for name, data in blocks]
        stored_bytes = 0
        with self._io():
            for batch in _batches([len(view) for _, view in views]):
                pipe = self.client.pipeline(transaction=False)
                for i in batch:
                    name, view = views[i]
                    pipe.set(self.block_key(name), view, nx=True)
                now = time.time()
                pipe.zadd(self.mtime_key, {views[i][0]: now for i in batch})
                stored = pipe.execute()[: len(batch)]  # SET NX: True if stored, None if present
                sent = sum(len(views[i][1]) for i in batch)
                new = sum(len(views[i][1]) for i, ok in zip(batch, stored, strict=True) if ok)
                stored_bytes += new
                self._count(
                    blocks_put=len(batch),
                    blocks_stored=sum(1 for ok in stored if ok),
                    bytes_stored=new,
                    bytes_deduplicated=sent - new,
                )
        return stored_bytes

    def has_many(self, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` are present (one pipelined EXISTS per name)."""
        keys = [self.block_key(check_block_name(name)) for name in names]
        if not keys:
            return []
        with self._io():
            return [bool(reply) for reply in self._each_key("exists", keys)]

    def read_into(self, name: str, buffer: memoryview) -> bool:
        """Fill ``buffer`` with the block; False if it is absent (deleted or evicted)."""
        return self.read_many_into([(name, buffer)])[0]

    def read_many_into(
        self, items: Sequence[tuple[str, memoryview]], *, verify: bool = False
    ) -> list[bool]:
        """Fill each buffer with its block, pipelined; False for each absent block.

        Raises CorruptCacheError when a stored size differs from its buffer's size, and,
        with ``verify``, when a block's bytes do not hash to its name: each block is
        re-hashed (sha256) the moment it is received, while Redis goes on sending the next
        ones into the socket's buffer (:class:`Verifier`), so the check overlaps the
        network instead of following the whole batch. Without ``verify`` the caller
        hashes. Each block's bytes go from the socket straight into its buffer (rule 2):
        no ``bytes`` reply is built and copied, which is what a GET through redis-py's
        parser costs.
        """
        targets = [(check_block_name(name), _as_bytes_view(buf)) for name, buf in items]
        found: list[bool] = []
        with self._io():
            for batch in _batches([len(view) for _, view in targets]):
                chunk = [targets[i] for i in batch]
                found.extend(self._with_retries(self._get_into, chunk, verify))
        self._count(
            blocks_read=sum(found),
            bytes_read=sum(len(view) for ok, (_, view) in zip(found, targets, strict=True) if ok),
            misses=len(found) - sum(found),
            blocks_verified=sum(found) if verify else 0,
        )
        return found

    def read_many_verified_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        """:meth:`read_many_into` with ``verify=True``: the block reader's verified path."""
        return self.read_many_into(items, verify=True)

    def stored_size(self, name: str) -> int | None:
        """The size of block ``name`` in Redis (STRLEN), or None if it is absent."""
        return self.stored_sizes([name])[0]

    def stored_sizes(self, names: Sequence[str]) -> list[int | None]:
        """Sizes of the named blocks, None for each absent one (one pipelined round trip).

        STRLEN answers 0 for a missing key; only those zeros are asked again with EXISTS
        (an empty block is stored as an empty value).
        """
        keys = [self.block_key(check_block_name(name)) for name in names]
        if not keys:
            return []
        with self._io():
            sizes: list[int | None] = [int(reply) for reply in self._each_key("strlen", keys)]
            zeros = [i for i, size in enumerate(sizes) if size == 0]
            if zeros:
                exists = self._each_key("exists", [keys[i] for i in zeros])
                for i, present in zip(zeros, exists, strict=True):
                    sizes[i] = 0 if present else None
        return sizes

    def _each_key(self, command: str, keys: Sequence[str]) -> list[Any]:
        """One ``command key`` per key, pipelined in one round trip (inside ``_io``)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(key)
        replies: list[Any] = pipe.execute()
        return replies

    def delete_many(self, names: Sequence[str]) -> int:
        """Delete the named blocks that exist; return how many were deleted."""
        checked = [check_block_name(name) for name in names]
        if not checked:
            return 0
        with self._io():
            pipe = self.client.pipeline(transaction=False)
            for name in checked:
                pipe.delete(self.block_key(name))
            pipe.zrem(self.mtime_key, *checked)
            replies = pipe.execute()
        return sum(int(reply) for reply in replies[: len(checked)])

    def iter_blocks(self) -> Iterator[BlockInfo]:
        """Every stored block with its size and last put time (SCAN; consistent per key)."""
        prefix = f"{self.target.prefix}:block:"
        pattern = glob_escape(prefix) + "*"
        with self._io():
            batch: list[str] = []
            for raw in self.client.scan_iter(match=pattern, count=_SCAN_COUNT):
                key = raw.decode() if isinstance(raw, bytes) else str(raw)
                batch.append(key[len(prefix) :])
                if len(batch) >= _SCAN_COUNT:
                    yield from self._infos(batch)
                    batch = []
            if batch:
                yield from self._infos(batch)

    def close(self) -> None:
        """Disconnect the client's pooled connections; let the hash helpers go."""
        self.client.close()
        self._hashes.close()

    # -- extras -------------------------------------------------------------------------

    def count_blocks(self) -> tuple[int, int]:
        """(number of blocks, total bytes) under this prefix, by SCAN: for tests and stats."""
        count = 0
        total = 0
        for info in self.iter_blocks():
            count += 1
            total += info.size
        return count, total

    def statistics(self) -> RedisBlockStoreStatistics:
        """Counts of this process's puts, dedup hits, reads, misses and errors."""
        with self._lock:
            counts = dict(self._counts)
        fields = attrs.fields_dict(RedisBlockStoreStatistics)
        return RedisBlockStoreStatistics(**{name: counts.get(name, 0) for name in fields})

    # -- internals ----------------------------------------------------------------------

    def _io(self) -> translate_redis_errors:
        return self._translator

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] = self._counts.get(name, 0) + delta

    def _with_retries(
        self, fn: Callable[[list[tuple[str, memoryview]], bool], list[bool]],
        chunk: list[tuple[str, memoryview]], verify: bool,
    ) -> list[bool]:  # fmt: skip
        """Run an idempotent read again on a fresh connection when the connection failed."""
        from redis.exceptions import ConnectionError as RedisConnectionError

        for attempt in range(self.target.retries + 1):
            try:
                return fn(chunk, verify)
            except (RedisConnectionError, ConnectionError):
                if attempt == self.target.retries:
                    raise
                time.sleep(min(0.25, 0.01 * 2**attempt))
        raise AssertionError("unreachable")

    def _get_into(self, chunk: list[tuple[str, memoryview]], verify: bool) -> list[bool]:
        """One pipelined round trip of GETs whose replies are read into the buffers.

        The replies are parsed here (RESP bulk strings: ``$<n>`` CRLF, the bytes, CRLF;
        ``$-1`` or RESP3's ``_`` for a missing key) so their bytes can be received straight
        into each buffer: scattered by ``recvmsg_into`` over the expected framing and the
        buffers (:func:`receive_expected`), or, once the replies differ from the
        expectation (a miss) or on a TLS socket, reply by reply with ``recv_into``. The
        connection is checked out of the client's pool (which reconnects one the server
        closed), and dropped on any error or size mismatch, so a half-read reply never
        reaches the next command. A connection without the raw socket this needs (a
        redis-py whose internals changed) is read through redis-py's public parser.
        """
        pool = self.client.connection_pool
        conn: Any = pool.get_connection()  # redis-py's Connection is untyped
        clean = False
        try:
            with self._hashes.batch() as batch:
                pooled: PooledVerifier | None = None
                done: Callable[[int], None] = ignore_progress
                if verify and not batch.inline:
                    done = pooled = PooledVerifier(chunk, batch)
                elif verify:
                    done = Verifier(chunk)
                conn.send_packed_command(pack_gets([self.block_key(name) for name, _ in chunk]))
                sock = getattr(conn, _SOCKET_ATTRIBUTE, None)
                if not isinstance(sock, socket.socket):
                    found = self._get_public(conn, chunk, done)
                    clean = True
                else:
                    found, clean = get_raw(sock, chunk, done)
                if pooled is not None:
                    pooled.finish()
                return found
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)

    def _get_public(
        self, conn: Any, chunk: list[tuple[str, memoryview]], done: Callable[[int], None]
    ) -> list[bool]:
        """Read the GET replies through redis-py's public ``read_response`` and copy each
        into its buffer (one more copy per block than the raw path; same checks)."""
        self._count(public_api_reads=1)
        if not self._warned_public:
            self._warned_public = True
            _log.warning(
                "redis-py connection has no %r socket: reading blocks through redis-py's "
                "reply parser (correct, slower)",
                _SOCKET_ATTRIBUTE,
            )
        found: list[bool] = []
        for i, (name, view) in enumerate(chunk):
            value = conn.read_response()
            if value is None:
                found.append(False)
                continue
            if not isinstance(value, bytes):
                value = bytes(value) if isinstance(value, (bytearray, memoryview)) else b""
            if len(value) != len(view):
                raise CorruptBlockError(
                    name, "bytes", f"stored size {len(value)} != expected {len(view)}"
                )
            view[:] = value
            found.append(True)
            done(i)
        return found

    def _infos(self, names: list[str]) -> Iterator[BlockInfo]:
        valid = [name for name in names if BLOCK_NAME_RE.fullmatch(name)]
        if not valid:
            return
        pipe = self.client.pipeline(transaction=False)
        for name in valid:
            pipe.strlen(self.block_key(name))
        pipe.zmscore(self.mtime_key, valid)
        replies = pipe.execute()
        now = time.time()
        mtimes = cast(list[float | None], replies[-1])
        for name, size, mtime in zip(valid, replies[:-1], mtimes, strict=True):
            if int(size) == 0:  # vanished between SCAN and STRLEN
                continue
            yield BlockInfo(name=name, size=int(size), mtime=now if mtime is None else mtime)
