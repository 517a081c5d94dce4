"""ColdTier: the cold tier a server embeds. Save and load KV caches without stalling.

::

    async with ColdTier.open("/var/cache/kvtrio") as tier:
        ticket = await tier.save("chat-42", tokens, caches, meta={"model_id": "llama"})
        ...                                    # serving goes on; the write is queued
        result = await ticket.wait()           # WRITTEN, DROPPED, CANCELLED or FAILED
        loaded = await tier.load("chat-42", expect=kvtrio.Expect(model_id="llama"))

Theory of operation
-------------------
0. ``open`` starts the parts under one :class:`~kvtrio.runtime.system.ActorSystem`: the
   MLX owner (its own thread, or the server's), the spill actor (the store task of the
   spill queue), and the writer and reader on a thread offload (``io_threads`` jobs at
   once).
1. ``save`` costs the caller one short owner job: the snapshot (lazy views and a header
   plan, no bytes copied). It returns a ticket at once; the snapshot then waits in the
   spill queue (byte cap, shedding, supersession: :mod:`kvtrio.actors.spill`).
2. The spill stores one snapshot at a time, in order: the owner materializes it in short
   jobs (``eval``, then segments of the live buffer, or a contiguous copy where the
   strides do not allow that), then the writer publishes it durably from a worker thread.
   The snapshot is released exactly once when its ticket settles (docs/design.md invariant 2); the
   ledger in :meth:`ColdTier.statistics` counts the live ones.
3. ``load`` reads and validates the header on a worker thread, checks ``expect``, has
   the owner allocate the destination arrays (one job and one backing per step of
   tensors), reads the tensors straight into them on a worker thread (verifying hashes
   by default; :mod:`kvtrio.actors.loadsteps`) and builds the caches on the owner. No
   tensor byte is copied on the event loop or under the GIL.
4. Leaving the ``async with`` normally is a graceful shutdown: intake stops (``save``
   raises ShuttingDown), queued saves are written until ``shutdown_grace`` seconds have
   passed, then the rest are cancelled and the write in flight stops at its next tensor
   or block boundary, removing its tmp file. Leaving with an exception (or being
   cancelled) skips the drain. Either way every snapshot is released.
5. One owner per directory: ``open`` takes the directory's advisory lock
   (:mod:`kvtrio.storage.dirlock`) before it touches anything, and holds it until the
   block exits. A second opener polls it on trio's clock for up to ``lock_timeout``
   seconds (a rolling restart: the old process flushes, closes, and the new one goes
   on), then gets :class:`~kvtrio.errors.DirectoryLockedError` naming the directory and
   the holder's pid. A shared (Redis) tier has no directory and no lock.
6. Under the lock, ``open`` removes crash debris (tmp files of writes that never
   finished) from the cache and block directories: no other process can be writing them.
7. Nothing under the root is reached by a path the kernel resolves again: once the lock
   is held, the root is opened as a directory descriptor and every open, listing,
   rename, unlink and mkdir of the tier (its stores, writer, reader and sweeps) walks
   from it without following a link (:class:`~kvtrio.storage.rootfd.RootedFileOps`),
   each directory once. A ``caches/`` or ``blocks/`` swapped for a link while the tier
   runs is refused where it is met by name (an OSError, contained by the caller), and
   kept descriptors stay in the tier's own directory: nothing leads outside
   (docs/design.md invariant 18).

Costs: ``open`` is O(files in the two directories) for the debris sweep, on a worker
thread; ``list`` reads every header (the tiered cache reads its catalogue instead).

Files: ``<root>/caches/<key>.kvc`` (a cache file, or a manifest in the blocks layout) and
``<root>/blocks/<sha256>`` (blocks). Given a ``redis://`` (or ``rediss://``) URL instead
of a directory, the tier keeps blocks and manifests in Redis through storage's
:func:`~kvtrio.storage.openstore.open_store` (blocks layout only; no directory), so several hosts
share one cold tier. Keys are 1-150 characters of ``[0-9A-Za-z._-]``,
starting with a letter or digit.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import logging
import math
import os
import re
import stat
import time
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from kvtrio.actors.callerchecks import check_tier_arguments
from kvtrio.actors.loadsteps import read_pipelined
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.plainerrors import plain_errors
from kvtrio.actors.reader import HeaderCheck, Reader
from kvtrio.actors.sched import BACKGROUND_SLICE
from kvtrio.actors.snapshot import Snapshot, SnapshotLedger
from kvtrio.actors.spill import Spill, SpillActor
from kvtrio.actors.tierrecords import (
    ColdTierStatistics,
    Expectation,
    SaveResult,
    SaveTicket,
    TierEntry,
)
from kvtrio.actors.writer import Writer
from kvtrio.errors import (
    CacheMissError,
    CorruptCacheError,
    DirectoryLockedError,
    InvalidInputError,
    ShuttingDown,
)
from kvtrio.runtime.offload import CancelToken, InlineOffload, Offload, ThreadOffload
from kvtrio.runtime.system import ActorSystem
from kvtrio.storage.blockstore import BlockStore, LocalBlockStore
from kvtrio.storage.cacheio import AttachmentData, HostTensor, Restored
from kvtrio.storage.codecs import check_kinds
from kvtrio.storage.dirlock import DirectoryLock, holder_pid, try_lock
from kvtrio.storage.fileops import OS_FILE_OPS, TMP_SUFFIX, FileOps, not_a_real_directory
from kvtrio.storage.format import Header, Layout
from kvtrio.storage.hostbuffers import LoadBuffers, check_allocatable
from kvtrio.storage.manifeststore import PINS_NAME, LocalManifestStore, ManifestStore
from kvtrio.storage.openstore import is_redis_url, open_store
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions, default_tier_load_streams
from kvtrio.storage.reader import CacheFile
from kvtrio.storage.rootfd import RootedFileOps
from kvtrio.storage.writable import check_meta, check_str_arg, check_token_ids
from kvtrio.storage.writer import DEFAULT_BLOCK_TOKENS, IndexKeysOf, WriteResult

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "KEY_RE",
    "ColdTier",
    "ColdTierStatistics",
    "Expectation",
    "SaveResult",
    "SaveTicket",
    "TierEntry",
]

_log = logging.getLogger(__name__)

KEY_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,149}")
# Keys joined by newlines (which no key holds), every one a KEY_RE: :meth:`ColdTier.list_keys`
# checks a listing a batch at a time, one regex call each, instead of one per key.
_KEYS_RE = re.compile(rf"{KEY_RE.pattern}(?:\n{KEY_RE.pattern})*")
_KEYS_BATCH = 1024
# Seconds a second opener of a directory waits for its owner to close (rule 5).
DEFAULT_LOCK_TIMEOUT = 30.0
# Seconds between its attempts (trio's clock).
LOCK_POLL = 0.05
SUFFIX = ".kvc"
_HEADER_META_KEYS = frozenset({"model_id", "config_fingerprint"})


def _open_shared(
    token: CancelToken, url: str, file_ops: FileOps, options: IoOptions
) -> tuple[BlockStore, ManifestStore]:
    token.check()
    return open_store(url, file_ops=file_ops, options=options)


def _open_rooted(token: CancelToken, root: Path, file_ops: FileOps) -> RootedFileOps:
    token.check()
    return RootedFileOps.at(root, file_ops)


async def take_directory_lock(directory: str, *, timeout: float) -> DirectoryLock:
    """Take ``directory``'s lock, polling every :data:`LOCK_POLL` seconds of trio's clock
    for up to ``timeout`` seconds; DirectoryLockedError naming the holder after that."""
    start = trio.current_time()
    while True:
        lock = try_lock(directory)
        if lock is not None:
            return lock
        waited = trio.current_time() - start
        if waited >= timeout:
            raise DirectoryLockedError(directory, holder_pid(directory), waited)
        await trio.sleep(min(LOCK_POLL, timeout - waited))


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid tier key; raise ValueError otherwise."""
    if not isinstance(key, str) or KEY_RE.fullmatch(key) is None:
        raise ValueError(f"tier key must match {KEY_RE.pattern}: {key!r:.80}")
    return key


class ColdTier:
    """The cold tier facade; create it with :meth:`open` (see the module docstring)."""

    def __init__(
        self,
        root: Path | None,
        *,
        owner: MlxOwner,
        offload: Offload,
        layout: Layout,
        block_tokens: int,
        cap_bytes: float,
        verify: bool,
        file_ops: FileOps,
        block_store: BlockStore | None = None,
        manifests: ManifestStore | None = None,
        url: str | None = None,
        background: float | None = BACKGROUND_SLICE,
        options: IoOptions = DEFAULT_IO_OPTIONS,
    ) -> None:
        # ``root`` None: a shared tier (``url``), whose ``block_store`` and ``manifests``
        # are given and which has no directory at all.
        self.root = root
        self.options = options
        self.url = url
        self.owner = owner
        self.layout: Layout = layout
        self.block_tokens = block_tokens
        self.verify = verify
        if root is None:
            if block_store is None or manifests is None:
                raise ValueError("a tier without a directory needs its block and manifest stores")
        else:
            if block_store is None:
                block_store = LocalBlockStore(str(root / "blocks"), file_ops)
            if manifests is None:
                # The entries' directory: its files are manifests (blocks layout) or cache
                # files (single layout); the tier reads both by path (_read_header).
                manifests = LocalManifestStore(
                    str(root / "caches"),
                    file_ops,
                    make_directory=False,
                    pins_path=str(root / PINS_NAME),
                )
        self.block_store = block_store
        self.manifests = manifests
        self.file_ops = file_ops
        self.load_streams = options.streams(default_tier_load_streams())
        self.ledger = SnapshotLedger()
        self.writer = Writer(
            offload,
            file_ops,
            block_store,
            block_tokens,
            background=background,
            options=options,
            manifests=manifests,
        )
        self.reader = Reader(
            offload,
            file_ops,
            block_store,
            manifests=None if root is not None else manifests,
            background=background,
            options=options,
        )
        self.spill: Spill[Snapshot] = Spill(
            self._store,
            Snapshot.release,
            cap_bytes=cap_bytes,
            bytes_of=lambda snap: snap.nbytes,
        )
        self.system: ActorSystem | None = None
        self._offload = offload
        self._closing = False
        self._loads = 0
        self._load_misses = 0
        self._load_failures = 0
        self._debris_removed = 0

    @property
    def cache_dir(self) -> Path:
        """A local tier's entries directory (ValueError on a shared tier: it has none)."""
        return self._directory() / "caches"

    @property
    def block_dir(self) -> Path:
        """A local tier's block directory (ValueError on a shared tier: it has none)."""
        return self._directory() / "blocks"

    def _directory(self) -> Path:
        if self.root is None:
            raise ValueError(f"the shared cold tier {self.url} has no directory")
        return self.root

    def index_manifests(self, keys_of: IndexKeysOf) -> None:
        """Register every manifest published from now on in the manifest store's prefix
        index under ``keys_of(its header)`` (a store that declares ``supports_index``;
        the others ignore index keys). Runs on the writer's worker thread."""
        self.writer.index_keys_of = keys_of

    # -- opening and closing ---------------------------------------------------------------

    @classmethod
    @plain_errors
    @asynccontextmanager
    async def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        layout: Layout = "single",
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        cap_bytes: float = math.inf,
        owner: MlxOwner | None = None,
        inline: bool = False,
        io_threads: int | None = None,
        verify: bool = True,
        shutdown_grace: float = 10.0,
        file_ops: FileOps = OS_FILE_OPS,
        background: float | None = BACKGROUND_SLICE,
        options: IoOptions = DEFAULT_IO_OPTIONS,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> AsyncIterator[ColdTier]:
        """Open (creating) the tier at ``directory`` and run it until the block exits.

        ``owner``: the server's MLX owner (its model steps and the tier's MLX work then
        share one thread); by default the tier starts its own. ``inline=True`` runs the
        owner and the I/O on the trio thread, for deterministic tests. ``cap_bytes``
        bounds the bytes queued for writing (soft for the newest save). ``io_threads``
        bounds concurrent worker-thread I/O jobs (default: 2, or a load's streams when
        more); ``options.load_streams`` how many of them one load reads tensors with (by
        default :func:`~kvtrio.storage.options.default_tier_load_streams`: one below eight
        CPUs, which measured both faster and gentler on the event loop than 2 on two
        cores). ``background``: the scheduler time slice
        (seconds) the tier's own threads ask for, so the event loop preempts them when it
        wakes (:mod:`kvtrio.actors.sched`; Linux >= 6.12, else nothing); None leaves
        every thread alone. ``options`` tune the I/O paths (direct I/O, drop-behind,
        helper threads, unfilled destinations: :class:`~kvtrio.storage.options.IoOptions`,
        docs/tuning.md), never what is written or checked. ``lock_timeout``: seconds to
        wait for another process that holds the directory (rule 5).
        """
        if layout not in ("single", "blocks"):
            raise ValueError(f"layout must be 'single' or 'blocks', not {layout!r}")
        check_tier_arguments(
            block_tokens=block_tokens,
            cap_bytes=cap_bytes,
            io_threads=2 if io_threads is None else io_threads,
            shutdown_grace=shutdown_grace,
            lock_timeout=lock_timeout,
            background=background,
        )
        async with AsyncExitStack() as stack:
            if owner is None:
                factory = MlxOwner.inline() if inline else MlxOwner.dedicated(background=background)
                owner = await stack.enter_async_context(factory)
            if io_threads is None:
                io_threads = max(2, options.streams(default_tier_load_streams()))
            offload: Offload = InlineOffload() if inline else ThreadOffload(io_threads)
            target = os.fspath(directory)
            shared = is_redis_url(target)
            block_store: BlockStore | None = None
            manifests: ManifestStore | None = None
            root: Path | None = None
            if shared:
                if layout != "blocks":
                    raise ValueError("a Redis cold tier stores blocks: use layout='blocks'")
                shared_blocks, shared_manifests = await offload.run(
                    _open_shared, target, file_ops, options
                )
                stack.callback(shared_manifests.close)
                stack.callback(shared_blocks.close)
                block_store, manifests = shared_blocks, shared_manifests
            else:
                root = Path(target).absolute()
                lock = await take_directory_lock(str(root), timeout=lock_timeout)
                stack.callback(lock.release)
                # Everything under the root from here on goes through its descriptor
                # (rule 7, kvtrio.storage.rootfd).
                rooted = await offload.run(_open_rooted, root, file_ops)
                stack.callback(rooted.close_root)
                file_ops = rooted
            tier = cls(
                root,
                owner=owner,
                offload=offload,
                layout=layout,
                block_tokens=block_tokens,
                cap_bytes=cap_bytes,
                verify=verify,
                file_ops=file_ops,
                block_store=block_store,
                manifests=manifests,
                url=target if shared else None,
                background=None if inline else background,
                options=options,
            )
            if not shared:
                await offload.run(tier._prepare_directories)
            try:
                async with ActorSystem(name="cold-tier", grace=shutdown_grace) as system:
                    tier.system = system
                    ref = await system.spawn(SpillActor(tier.spill), name="spill", mailbox_size=1)
                    tier.spill.attach(ref)
                    try:
                        yield tier
                    except BaseException:
                        tier._closing = True
                        tier.spill.abort()
                        raise
                    await tier.aclose(grace=shutdown_grace)
            finally:
                # The store task is gone (drained, or cancelled with the system): settle
                # and release whatever is left (invariant 2).
                tier.spill.stop()

    async def aclose(self, *, grace: float = 10.0) -> None:
        """Graceful shutdown: stop intake, write what is queued within ``grace`` seconds,
        then cancel the rest. Idempotent; leaving ``open``'s block calls it."""
        self._closing = True
        self.spill.close()
        with trio.move_on_after(grace):
            await self.spill.drain()
        self.spill.abort()
        await trio.lowlevel.checkpoint()

    def _prepare_directories(self, token: CancelToken) -> None:
        # Local tiers only: a shared (Redis) tier has neither directories nor tmp files.
        for directory in (self.cache_dir, self.block_dir):
            if not_a_real_directory(self.file_ops, str(directory)):
                # Never traversed: a sweep through a linked blocks/ would delete another
                # program's 64-hex-named files (issue 15).
                raise InvalidInputError(
                    f"{directory}: a symbolic link or not a directory; kvtrio follows no "
                    "link under its root"
                )
            self.file_ops.mkdir(str(directory))
            for name in self.file_ops.listdir(str(directory)):
                token.check()
                if name.endswith(TMP_SUFFIX):
                    try:
                        self.file_ops.unlink(str(directory / name))
                    except FileNotFoundError:
                        continue
                    self._debris_removed += 1

    # -- saving ----------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """The file of ``key`` on a local tier (a cache file, or a manifest in the blocks
        layout); ValueError on a shared tier, whose entries are manifests in its store."""
        return self.cache_dir / self.name_of(key)

    @staticmethod
    def name_of(key: str) -> str:
        """The entry's name in the manifest store (on a local tier, its file's name)."""
        return check_key(key) + SUFFIX

    async def _read_header(self, key: str, check: HeaderCheck | None = None) -> CacheFile:
        """The checked header of ``key``'s entry (FileNotFoundError when absent): a local
        entry is read by path (it may be a single-layout cache file), a shared one is
        a manifest got from the store; with ``check`` as :meth:`Reader.read_header`'s."""
        if self.root is None:
            return await self.reader.read_manifest(self.name_of(key), check=check)
        return await self.reader.read_header(str(self.path_of(key)), check=check)

    async def save(
        self,
        key: str,
        tokens: Sequence[int],
        caches: Sequence[Any],
        *,
        attachments: Sequence[AttachmentData] = (),
        meta: Mapping[str, str] | None = None,
        model_id: str | None = None,
        config_fingerprint: str | None = None,
        conversation: Hashable | None = None,
        droppable: bool = True,
    ) -> SaveTicket:
        """Snapshot ``caches`` (holding ``tokens``) and queue them to be written as ``key``.

        Returns after the snapshot alone; the caller may go on mutating its caches at
        once (invariant 1). ``meta`` keys ``model_id`` and ``config_fingerprint`` fill the
        header fields of those names (as in :func:`kvtrio.save_cache`) unless given as
        arguments; the other keys are kept in the header's ``meta``. A newer save of the
        same ``conversation`` (default: the same key) cancels the older queued ones.
        ``droppable=False`` makes the save survive the byte cap's shedding.
        """
        check_key(key)
        if self._closing:
            raise ShuttingDown("cold tier is shutting down: save refused")
        # The caller's arguments, checked as the reader will check them (issue 15): a bad
        # one fails here, not later in the writer's thread as a FAILED ticket.
        tokens = check_token_ids(tokens)
        meta = dict(meta or {})
        model_id = model_id if model_id is not None else meta.get("model_id")
        if config_fingerprint is None:
            config_fingerprint = meta.get("config_fingerprint")
        if model_id is not None:
            check_str_arg(model_id, "model_id")
        if config_fingerprint is not None:
            check_str_arg(config_fingerprint, "config_fingerprint")
        extra = check_meta({k: v for k, v in meta.items() if k not in _HEADER_META_KEYS})
        snap = await self.owner.snapshot(
            key,
            caches,
            tokens,
            ledger=self.ledger,
            model_id=model_id,
            config_fingerprint=config_fingerprint,
            meta=extra,
            attachments=attachments,
        )
        ticket = self.spill.submit_nowait(
            snap,
            key=conversation if conversation is not None else key,
            droppable=droppable,
            supersede=True,
        )
        return SaveTicket(key, snap.nbytes, ticket)

    async def drain(self) -> None:
        """Wait until every save queued so far has settled."""
        await self.spill.drain()

    async def _store(self, snap: Snapshot) -> WriteResult:
        name = self.name_of(str(snap.key))
        block_tokens = None if self.layout == "single" else self.block_tokens
        host: list[HostTensor] = []
        try:
            host = await self.owner.materialize(
                snap, block_tokens=block_tokens, options=self.options
            )
            if block_tokens is None:
                return await self.writer.write_single(
                    str(self.cache_dir / name), snap.plan, [h.segments[0] for h in host]
                )
            # The manifest goes to the manifest store (put), after its blocks are durable.
            return await self.writer.write_blocks(name, snap.plan, [h.segments for h in host])
        finally:
            # Free the materialized copies (and the views) on the owner, a few at a time
            # (MlxOwner.release says why).
            with trio.CancelScope(shield=True):
                await self.owner.release(host, snap)

    # -- loading ---------------------------------------------------------------------------

    async def load(
        self, key: str, *, expect: Expectation | None = None, verify: bool | None = None
    ) -> Restored:
        """Load ``key``'s caches, bit-exact, built on the owner thread.

        Raises CacheMissError (no such entry, or a block is missing), CorruptCacheError
        (the file fails validation or its hashes), CacheMismatchError (``expect`` not met).
        """
        check_key(key)
        self._loads += 1
        try:
            try:
                # One worker job: the header, ``expect`` and the kinds (an unknown kind:
                # before a byte is read), then the blocks' presence and sizes (nothing is
                # allocated from what a manifest claims before its blocks are seen).
                cache_file = await self._read_header(key, functools.partial(_before_read, expect))
            except FileNotFoundError:
                self._load_misses += 1
                raise CacheMissError(f"cold tier has no entry {key!r}") from None
            check_allocatable(cache_file.header.nbytes)
            loaded = await self._read_pipelined(
                cache_file, self.verify if verify is None else verify
            )
            return await self.owner.restore(cache_file.header, loaded)
        except CacheMissError:
            raise
        except BaseException:
            self._load_failures += 1
            raise

    async def _read_pipelined(self, cache_file: CacheFile, verify: bool) -> LoadBuffers:
        return await read_pipelined(
            self.owner,
            self.reader,
            cache_file,
            verify=verify,
            streams=self.load_streams,
            options=self.options,
            scatter=self.block_store.supports_scatter_reads,
        )

    async def entry(self, key: str) -> TierEntry:
        """The stored entry of ``key`` (CacheMissError if absent)."""
        try:
            return await self._offload.run(self._entry_job, self.name_of(key))
        except FileNotFoundError:
            raise CacheMissError(f"cold tier has no entry {key!r}") from None

    async def list(self) -> list[TierEntry]:
        """Every valid stored entry (files that fail validation are skipped)."""
        return await self._offload.run(self._list_job)

    async def delete(self, key: str) -> int:
        """Cancel queued saves of ``key``, let one in flight finish, delete the file;
        return the bytes freed (0 when there was no file)."""
        name = self.name_of(key)
        self.spill.cancel_where(lambda t: t.item.key == key)
        for ticket in self.spill.pending():
            if ticket.item.key == key:
                await ticket.wait()
        return await self._offload.run(self._delete_job, name)

    def statistics(self) -> ColdTierStatistics:
        return ColdTierStatistics(
            spill=self.spill.statistics(),
            writer=self.writer.statistics(),
            reader=self.reader.statistics(),
            snapshots=self.ledger.statistics(),
            actors=None if self.system is None else self.system.statistics(),
            loads=self._loads,
            load_misses=self._load_misses,
            load_failures=self._load_failures,
            debris_removed=self._debris_removed,
        )

    def list_keys(self) -> dict[str, None]:
        """Blocking (a worker thread): the keys of every stored entry, without reading one.
        A dict of str keys, not a set: the cyclic collector does not track it, so the
        young collections of an open never traverse its N names."""
        names = self.manifests.names()
        keys = [name[: -len(SUFFIX)] for name in names if name.endswith(SUFFIX)]
        out: dict[str, None] = {}
        for start in range(0, len(keys), _KEYS_BATCH):
            batch = keys[start : start + _KEYS_BATCH]
            if _KEYS_RE.fullmatch("\n".join(batch)) is None:  # a bad one: key by key
                batch = [key for key in batch if KEY_RE.fullmatch(key) is not None]
            out.update(zip(batch, itertools.repeat(None)))
        return out

    def entry_blocking(self, key: str) -> TierEntry:
        """Blocking (a worker thread): :meth:`entry`; FileNotFoundError if absent."""
        return self._read_entry(self.name_of(key))

    def _entry_job(self, token: CancelToken, name: str) -> TierEntry:
        token.check()
        return self._read_entry(name)

    def _read_entry(self, name: str) -> TierEntry:
        from kvtrio.storage.reader import read_header, read_manifest

        key = name[: -len(SUFFIX)]
        if self.root is None:
            # A shared store's last uses are the tiered cache's business (ColdTierStore).
            cache_file = read_manifest(self.manifests, name)
            return TierEntry(key, cache_file.header, cache_file.file_size, time.time())
        path = str(self.path_of(key))
        cache_file = read_header(path, file_ops=self.file_ops, follow_links=False)
        mtime = self.file_ops.stat(path).st_mtime
        return TierEntry(key, cache_file.header, cache_file.file_size, mtime)

    def _list_job(self, token: CancelToken) -> builtins.list[TierEntry]:
        entries: builtins.list[TierEntry] = []
        for name in self.manifests.list():
            if not name.endswith(SUFFIX) or KEY_RE.fullmatch(name[: -len(SUFFIX)]) is None:
                continue
            try:
                # Only a regular file reached without a link is opened: a FIFO would block
                # the open forever, a directory or link is not an entry (issue 15). A
                # shared tier's manifests are Redis values, not files: no stat for them.
                if self.root is not None:
                    path = self.cache_dir / name
                    if not stat.S_ISREG(self.file_ops.stat(str(path)).st_mode):
                        _log.warning("%s: not a regular file, ignored", path)
                        continue
                entries.append(self._entry_job(token, name))
            except (CorruptCacheError, CacheMissError, FileNotFoundError):
                continue
            except OSError as exc:  # unreadable: not an entry, and no reason to fail open
                _log.warning("%s: unreadable (%s), ignored", name, exc)
        return entries

    def _delete_job(self, token: CancelToken, name: str) -> int:
        size = self.manifests.size(name)
        if size is None or not self.manifests.delete(name):
            return 0
        return size


def _before_read(expect: Expectation | None, header: Header) -> None:
    """A load's checks of its validated header, before a block is looked at (on the
    header's worker job): ``expect``, then every entry's kind has a codec."""
    if expect is not None:
        expect.check(header)
    check_kinds(header)
