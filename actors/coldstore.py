"""The cold store under the tiered cache: :class:`ColdTierStore`, the store over the
actors' :class:`~kvtrio.actors.tier.ColdTier` (the protocol it implements, ColdStore and
SharedColdStore, and their records are in :mod:`kvtrio.actors.coldtypes`, re-exported here).

The tiered cache keeps the ledger (reservations, the one eviction loop: see
:mod:`kvtrio.actors.tiered`); the store keeps what only it can know: which blocks exist
on disk, how many manifests name each, and so how many bytes a removal really frees.

Costs (N entries, B blocks, k blocks of one entry): ``create`` reads the catalogue's
block lists (O(N + references)) or, when it must be rebuilt, every manifest once (O(N)
reads), and lists the block directory once (O(B)) when the catalogue was not closed
cleanly (:mod:`kvtrio.actors.storeopen`, on a worker thread that gives the event loop
turns); :meth:`ColdTierStore.entries` then streams the entries in batches of
:data:`~kvtrio.storage.catalogue.SCAN_BATCH` compact rows, each fetched on a worker
thread; ``store`` and ``remove`` are O(k) plus the I/O; a failed write lists the block
directory once (O(B)) to take back the blocks it stored.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from kvtrio.actors.coldrecords import (
    DIGESTS,
    FILE_BYTES,
    block_names,
    conversations_of,
    digests,
    header_row,
    manifest_bytes,
    record_of,
)
from kvtrio.actors.coldtypes import (
    CONVERSATIONS_META,
    SHARED_CANDIDATES,
    ColdEntryInfo,
    ColdStore,
    FoundRows,
    SameModel,
    SharedColdStore,
    StoreResult,
)
from kvtrio.actors.collector import collector_paused
from kvtrio.actors.loopturns import LoopTurns
from kvtrio.actors.prefix import (
    DEFAULT_BLOCK_SIZE,
    ModelKey,
)
from kvtrio.actors.sharedkeys import index_keys, probe_keys
from kvtrio.actors.storeopen import CatalogueOpen, OpenReport
from kvtrio.actors.tier import SUFFIX, ColdTier, TierEntry
from kvtrio.errors import (
    CacheMissError,
    CorruptCacheError,
    KvtrioError,
    StoreUnavailableError,
)
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.cacheio import snapshot
from kvtrio.storage.catalogue import Catalogue, CatalogueRow, ScannedRows
from kvtrio.storage.format import Header
from kvtrio.storage.manifeststore import ManifestStore
from kvtrio.storage.writable import encoded_size

__all__ = [
    "CONVERSATIONS_META",
    "SHARED_CANDIDATES",
    "ColdEntryInfo",
    "ColdStore",
    "ColdTierStore",
    "FoundRows",
    "OpenReport",
    "SharedColdStore",
    "StoreResult",
]

_log = logging.getLogger("kvtrio.coldstore")


@attrs.define(eq=False)
class ColdTierStore:
    """:class:`ColdStore` over the actors' :class:`~kvtrio.actors.tier.ColdTier`.

    In the blocks layout, entries sharing a prefix share blocks, so deleting a manifest
    frees only the blocks no other manifest names. The store keeps a reference count per
    block named by a manifest, and the size of each block that exists (rebuilt from the
    manifests at :meth:`create`, when unreferenced blocks from earlier runs are swept),
    and deletes a block when its count drops to zero. Writes and sweeps take one lock: a
    write may re-reference a block a sweep is about to delete.

    Accounting rules (the ledger of the tiered cache adds up what these report):

    1. Bytes count only what exists: a manifest's blocks that are absent count nothing
       (a manifest declaring 275 GB of blocks that are not there is its file's size).
    2. A failed write takes back at once the blocks it stored that nothing names (one
       listing of the block directory, under the lock), so no byte is left uncounted
       until the next open. A write that failed for want of space says so
       (``StoreResult.no_space``): the caller evicts and retries.
    3. On a shared (Redis) tier this host never deletes blocks: another host's
       manifests may name them (the store has no local block store to delete with).
       Shared blocks leave by the store's own eviction, Redis's ``maxmemory``
       (docs/design.md invariant 17, docs/shared-tier.md); removing an entry frees
       its manifest alone, and its blocks are counted at their declared sizes (nothing
       lists a shared store cheaply).

    On a shared tier it is also a :class:`SharedColdStore`: created with
    ``index_block_size``, every manifest the tier publishes is registered in the store's
    prefix index under its chain hashes at that block size, and :meth:`find` asks that
    index (block reference counts stay local: see docs/shared-tier.md).
    """

    tier: ColdTier
    _blocks: LocalBlockStore | None  # None: a shared tier, whose blocks this host keeps
    _catalogue: Catalogue | None = None  # a local tier's (kvtrio.storage.catalogue)
    _infos: list[ColdEntryInfo] | None = None  # what create read, until entries() takes it
    # After a clean open, how many entries its table held: the first entries() hands the
    # table's keys to its scan (FoundRows.keys, the scan's order) if it holds as many still.
    _scan_order: int | None = None
    opening: OpenReport | None = None  # what the open found in the catalogue
    _refs: dict[str, int] = attrs.field(factory=dict)
    _block_sizes: dict[str, int] = attrs.field(factory=dict)  # blocks that exist (rule 1)
    # Per entry, one bytes object (:func:`_entry_record`): its manifest's bytes, then the
    # blocks it names as the catalogue stores them, 32-byte digests end to end, named only
    # when the entry is removed (:func:`_block_names`). One table of every entry, not two
    # (a second dict and an int per entry: ~75 bytes each at 100,000 entries).
    _entry_blocks: dict[str, bytes] = attrs.field(factory=dict)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _usage: int = 0
    _shared: ManifestStore | None = None  # the shared manifest store with a prefix index
    _manifests: ManifestStore | None = None  # a shared tier's manifests (last uses)
    _index_block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    async def create(cls, tier: ColdTier, *, index_block_size: int | None = None) -> ColdTierStore:
        """Index the tier's entries and sweep blocks that no manifest names.

        A local tier reads its catalogue (:mod:`kvtrio.storage.catalogue`), rebuilding
        what it lacks from the manifests; a shared tier reads every manifest once.
        ``index_block_size``: on a shared tier, register every published manifest in the
        store's prefix index, with chain hashes of token blocks of this size (the
        :class:`TieredPromptCache`'s ``block_size``), and answer :meth:`find`.
        """
        local = tier.root is not None
        self = cls(tier, LocalBlockStore(str(tier.block_dir), tier.file_ops) if local else None)
        manifests = tier.manifests
        if index_block_size is not None and manifests.supports_index:
            self._shared = manifests
            self._index_block_size = index_block_size
            tier.index_manifests(_ManifestIndexKeys(index_block_size))
        if local:
            # Everything proportional to N runs on the worker thread (nothing else
            # touches this new store yet), so the open never holds the loop for it.
            assert self._blocks is not None
            opening = CatalogueOpen(
                tier, self._blocks, self._pinned_keys, self._refs, self._entry_blocks,
                LoopTurns(),
            )  # fmt: skip
            with collector_paused():
                opened = await trio.to_thread.run_sync(opening.run)
            self._catalogue, self._block_sizes, self._usage = opened
            self.opening = opening.report
            if opening.report.clean:  # the rows as block_lists read them: the scan's order
                self._scan_order = len(self._entry_blocks)
        else:
            declared: dict[str, int] = {}
            entries = await tier.list()
            for entry in entries:
                self._note(entry.key, entry.header, entry.disk_bytes, declared)
            self._block_sizes.update(declared)
            if manifests.supports_touch:
                self._manifests = manifests
            keys = [entry.key for entry in entries]
            uses = await self._last_uses(keys)
            pinned = await trio.to_thread.run_sync(self._pinned_keys, keys)
            self._infos = [
                attrs.evolve(_entry_info(entry), mtime=used, pinned=entry.key in pinned)
                for entry, used in zip(entries, uses, strict=True)
            ]
            self._usage = manifest_bytes(self._entry_blocks.values()) + sum(
                self._block_sizes.values()
            )
        return self

    @property
    def directory(self) -> Path | None:
        return self.tier.root

    def shared_lookups(self) -> SharedColdStore | None:
        return self if self.tier.manifests.shared else None

    def _note(self, key: str, header: Header, file_bytes: int, sizes: dict[str, int]) -> None:
        """Count ``key``'s manifest and its block references; ``sizes`` gets the declared
        size of every block it names."""
        refs = [(ref.sha256, ref.nbytes) for slot in header.slots() for ref in slot.blocks or ()]
        for name, size in refs:
            self._refs[name] = self._refs.get(name, 0) + 1
            sizes.setdefault(name, size)
        self._entry_blocks[key] = record_of(file_bytes, (name for name, _ in refs))

    async def _sweep_locked(self) -> None:
        """Local tier: delete stored blocks no manifest names (rule 2)."""
        assert self._blocks is not None
        blocks = self._blocks
        stored = await trio.to_thread.run_sync(lambda: list(blocks.iter_blocks()))
        orphans = [b.name for b in stored if b.name not in self._refs]
        if orphans:
            await trio.to_thread.run_sync(blocks.delete_many, orphans)

    async def store(
        self,
        key: str,
        model: ModelKey,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        meta: Mapping[str, str],
    ) -> StoreResult:
        async with self._lock:
            freed = await self._remove_locked(key) if key in self._entry_blocks else 0
            try:
                ticket = await self.tier.save(
                    key,
                    tokens,
                    caches,
                    meta=meta,
                    model_id=model.model_id,
                    config_fingerprint=model.fingerprint,
                )
                result = await ticket.wait()
            except KvtrioError:
                await self._take_back_locked()
                return StoreResult(written=False, disk_bytes=-freed, unwritten="refused")
            if not result.written or result.write is None:
                await self._take_back_locked()
                error = result.error
                no_space = isinstance(error, OSError) and error.errno == errno.ENOSPC
                why = "failed" if result.written else result.outcome.value
                why = "error" if isinstance(error, OSError) and not no_space else why
                if error is not None and not no_space:  # why it raised: said once, here
                    # A disk or a store out of reach is one line; anything else, a bug's
                    # traceback (a store down at shutdown fails every write alike).
                    plain = isinstance(error, OSError | StoreUnavailableError)
                    _log.warning(
                        "cold write of %s did not land (%s): %s: %s",
                        *(key, why, type(error).__name__, error),
                        exc_info=None if plain else error,
                    )
                return StoreResult(
                    written=False, disk_bytes=-freed, no_space=no_space, unwritten=why
                )
            write = result.write
            declared: dict[str, int] = {}
            self._note(key, write.header, write.file_bytes, declared)
            # The writer stored (or found) every block it names: they exist now.
            fresh = [name for name in declared if name not in self._block_sizes]
            self._block_sizes.update((name, declared[name]) for name in fresh)
            new_bytes = write.file_bytes + sum(declared[name] for name in fresh)
            self._usage += new_bytes
            if self._catalogue is not None:
                row = header_row(key, write.header, write.file_bytes, time.time())
                new_blocks = {name: declared[name] for name in fresh}
                await trio.to_thread.run_sync(self._put_row, self._catalogue, row, new_blocks)
            dedup = 0
            if write.header.layout == "blocks":
                dedup = max(0, write.header.nbytes - write.new_block_bytes)
            return StoreResult(
                written=True,
                disk_bytes=new_bytes - freed,
                bytes_written=write.file_bytes + write.new_block_bytes,
                bytes_deduplicated=dedup,
            )

    def _put_row(
        self, catalogue: Catalogue, row: CatalogueRow, new_blocks: dict[str, int]
    ) -> None:
        """Worker thread: ``row`` of a manifest just published, with its mtime (a manifest
        gone meanwhile is recorded with none: ``kvtrio gc`` reads, finds nothing)."""
        try:
            mtime_ns = self.tier.file_ops.stat(str(self.tier.path_of(row.key))).st_mtime_ns
        except FileNotFoundError:
            mtime_ns = 0
        catalogue.put(attrs.evolve(row, manifest_mtime_ns=mtime_ns), new_blocks)

    def write_plan(
        self, model: ModelKey, tokens: Sequence[int], caches: list[Any], meta: Mapping[str, str]
    ) -> Header:
        extra = {k: v for k, v in meta.items() if k not in ("model_id", "config_fingerprint")}
        return snapshot(
            caches,
            tokens,
            model_id=model.model_id,
            config_fingerprint=model.fingerprint,
            meta=extra,
        ).header

    def plan_size(self, plan: object) -> int:
        assert isinstance(plan, Header)
        single = self.tier.layout == "single"
        return encoded_size(plan, block_tokens=None if single else self.tier.block_tokens)

    async def _take_back_locked(self) -> None:
        """Rule 2: a failed write's blocks that no manifest names go now (local tier)."""
        if self._blocks is not None:
            await self._sweep_locked()

    async def fetch(
        self, key: str, *, model: ModelKey, tokens: Sequence[int] | None = None
    ) -> tuple[list[Any], int]:
        expect = SameModel(model, None if tokens is None else tuple(tokens))
        restored = await self.tier.load(key, expect=expect)
        return restored.caches, restored.header.nbytes

    async def remove(self, key: str) -> int:
        async with self._lock:
            return await self._remove_locked(key)

    async def _remove_locked(self, key: str) -> int:
        freed = await self.tier.delete(key)
        record = self._entry_blocks.pop(key, None)
        orphans = []
        for name in () if record is None else block_names(record):
            self._refs[name] -= 1
            if self._refs[name] == 0:
                del self._refs[name]
                orphans.append(name)
        present = [name for name in orphans if name in self._block_sizes]
        if self._blocks is not None and present:  # rule 3: a shared tier's blocks stay
            await trio.to_thread.run_sync(self._blocks.delete_many, present)
        # Shared blocks leave this host's count although they stay in the store (rule 3).
        freed += sum(self._block_sizes.pop(name) for name in present)
        self._usage -= freed
        if self._catalogue is not None:
            await trio.to_thread.run_sync(self._catalogue.delete, key, present)
        return freed

    async def touch(self, last_use: Mapping[str, float]) -> None:
        if not last_use:
            return
        if self._catalogue is not None:
            await trio.to_thread.run_sync(self._catalogue.touch, dict(last_use))
        elif self._manifests is not None:  # a shared store keeps them beside the manifests
            named = {key + SUFFIX: when for key, when in last_use.items()}
            await trio.to_thread.run_sync(self._manifests.touch, named)

    async def pin(self, pins: Mapping[str, bool]) -> None:
        """Record pins in the manifest store (the truth: it survives the catalogue's
        loss), then in the catalogue's copy (what a clean open reads)."""
        async with self._lock:
            held = {key: pinned for key, pinned in pins.items() if key in self._entry_blocks}
            if not held:
                return
            named = {key + SUFFIX: pinned for key, pinned in held.items()}
            await trio.to_thread.run_sync(self.tier.manifests.set_pinned, named)
            if self._catalogue is not None:
                await trio.to_thread.run_sync(self._catalogue.set_pinned, held)

    def _pinned_keys(self, keys: Iterable[str]) -> set[str]:
        """Worker thread: which of ``keys`` the manifest store records as pinned (none when
        its record is unreadable: logged; the pins are lost, nothing else). A recorded
        name whose entry is gone (evicted behind this host's back, or a crash between a
        deletion and its unpin) is unpinned now, so a later entry of that key is not."""
        manifests = self.tier.manifests
        try:
            names = manifests.pinned_names()
        except (CorruptCacheError, StoreUnavailableError) as exc:
            _log.warning("cold tier: pins unreadable, none kept (%s)", exc)
            return set()
        pinned = {name[: -len(SUFFIX)] for name in names if name.endswith(SUFFIX)}
        held = pinned.intersection(keys)
        stale = {key + SUFFIX: False for key in pinned - held}
        if stale and not manifests.shared:  # other hosts' entries are theirs to unpin
            manifests.set_pinned(stale)
        return held

    async def _last_uses(self, keys: list[str]) -> list[float]:
        """A shared store's recorded last uses of ``keys`` (0.0, the oldest, if none)."""
        if self._manifests is None or not keys:
            return [0.0] * len(keys)
        manifests = self._manifests
        names = [key + SUFFIX for key in keys]
        uses = await trio.to_thread.run_sync(manifests.last_uses, names)
        return [0.0 if used is None else used for used in uses]

    async def close(self, *, clean: bool = True) -> None:
        """Close the catalogue; ``clean``: mark that every row matches a manifest."""
        catalogue, self._catalogue = self._catalogue, None
        if catalogue is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(catalogue.close, clean=clean))

    async def usage(self) -> int:
        return self._usage

    def entry_bytes(self, key: str) -> int | None:
        """:meth:`ColdStore.entry_bytes`: the sizes of the entry's blocks, as the store
        counts them (None: not held, of no blocks (the single layout), or a block absent)."""
        record = self._entry_blocks.get(key)
        sizes = self._block_sizes
        if record is None or len(record) == FILE_BYTES.size:
            return None
        try:
            return sum(sizes[digest.hex()] for (digest,) in DIGESTS.iter_unpack(digests(record)))
        except KeyError:
            return None

    def check(self) -> None:
        """Recompute the usage from the tables (tests): AssertionError if it drifted."""
        assert set(self._block_sizes) <= set(self._refs), "an unreferenced block is counted"
        expected = manifest_bytes(self._entry_blocks.values()) + sum(self._block_sizes.values())
        assert self._usage == expected, f"usage drifted: {self._usage} != {expected}"

    async def entries(self) -> AsyncGenerator[Sequence[ColdEntryInfo], None]:
        if self._infos is not None:  # what create read: handed over once, not kept
            infos, self._infos = self._infos, None
            yield infos
            return
        if self._catalogue is None:
            yield [_entry_info(entry) for entry in await self.tier.list()]
            return
        # One batch per worker-thread call, as the scan yields it (FoundRows: no object per
        # entry here); the cache enters each before the next is read.
        scan = self._catalogue.scan()
        # The table's keys in order, where nothing was added or removed since the open (the
        # first entries() is the cache's open, before anything writes): a dict's iterator.
        keys = iter(self._entry_blocks) if self._scan_order == len(self._entry_blocks) else None
        self._scan_order = None
        step = functools.partial(_next_rows, scan, keys)
        try:
            while True:
                batch = await trio.to_thread.run_sync(step)
                if batch is None:
                    return
                yield batch
        finally:
            scan.close()

    async def find(self, model: ModelKey, tokens: Sequence[int]) -> list[tuple[str, int]]:
        """:meth:`SharedColdStore.find`: one pipelined round trip to the prefix index."""
        if self._shared is None:
            return []
        probes = probe_keys(model, tokens, self._index_block_size)
        lookup = functools.partial(self._shared.lookup_each, limit=SHARED_CANDIDATES)
        # Abandoned on cancel: the lookup holds no borrowed buffer, and a stalled store
        # must not hold a cancelled request for its deadline.
        names = await trio.to_thread.run_sync(
            lookup, [key for key, _ in probes], abandon_on_cancel=True
        )
        found: dict[str, int] = {}
        for (_, bound), members in zip(probes, names, strict=True):
            for name in members:
                if name.endswith(SUFFIX):
                    found.setdefault(name[: -len(SUFFIX)], bound)  # deepest first
        return list(found.items())

    async def entry(self, key: str) -> ColdEntryInfo | None:
        """:meth:`SharedColdStore.entry`: the entry's manifest alone (None: gone or bad)."""
        try:
            return _entry_info(await self.tier.entry(key))
        except (CacheMissError, CorruptCacheError, ValueError):
            return None

    async def forget(self, key: str, model: ModelKey, tokens: Sequence[int]) -> None:
        """:meth:`SharedColdStore.forget`: unregister a vanished manifest (if still gone)."""
        if self._shared is None:
            return
        keys = [k for k, _ in probe_keys(model, tokens, self._index_block_size)]
        await trio.to_thread.run_sync(self._shared.unregister, key + SUFFIX, keys)


def _next_rows(scan: Iterator[ScannedRows], keys: Iterator[str] | None) -> FoundRows | None:
    """Worker thread: the scan's next batch (None at its end)."""
    rows = next(scan, None)
    return None if rows is None else FoundRows(rows, keys)


def _entry_info(entry: TierEntry) -> ColdEntryInfo:
    header = entry.header
    return ColdEntryInfo(
        key=entry.key,
        model=ModelKey(header.model_id or "", header.config_fingerprint or ""),
        tokens=header.tokens,
        trimmable=header.trimmable,
        min_reusable_offset=header.min_reusable_offset,
        mtime=entry.mtime,
        conversations=conversations_of(header.meta),
    )


@attrs.frozen
class _ManifestIndexKeys:
    """The prefix-index keys of a manifest being published (:meth:`ColdTier.index_manifests`):
    the chain hashes of its tokens, of its model. Runs on the writer's worker thread."""

    block_size: int

    def __call__(self, header: Header) -> list[str]:
        model = ModelKey(header.model_id or "", header.config_fingerprint or "")
        return index_keys(model, header.tokens, self.block_size)
