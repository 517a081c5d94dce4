"""The index build at open, cold loads and RAM eviction of
:class:`~kvtrio.actors.tiered.TieredPromptCache`. A mixin: its methods run on the cache
(``self`` is the cache)."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import trio
from kvtrio.actors.coldside import (
    CacheRecord,
)
from kvtrio.actors.coldstore import (
    ColdEntryInfo,
    FoundRows,
)
from kvtrio.actors.collector import YoungCollections, collector_paused
from kvtrio.actors.lifecycle import ColdEvent, ColdSide, ColdState
from kvtrio.actors.misses import (
    MissReason,
)
from kvtrio.actors.policy import EntryCost
from kvtrio.actors.prefix import (
    ModelKey,
    PrefixEntry,
)
from kvtrio.actors.tieredtypes import (
    DEFAULT_BYTES_PER_TOKEN,
    OPEN_BATCH,
    WritePolicy,
    _by_mtime,
    _cache_nbytes,
)
from kvtrio.errors import (
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    NewerFormatError,
    PinLimitError,
    StoreUnavailableError,
    UnknownCacheKindError,
)
from kvtrio.storage.catalogue import SCAN_BATCH, conversations_of

if TYPE_CHECKING:
    from kvtrio.actors.tieredparts import CacheParts
else:
    CacheParts = object

__all__ = ["IndexAndLoadMixin", "entry_of_checked"]

# A frozen entry's fields set as attrs' own __init__ sets them (entry_of_checked).
_new_object = object.__new__
_set_slot = object.__setattr__


def entry_of_checked(
    key: str, model: ModelKey, packed: bytes, trimmable: bool, min_reusable_offset: int
) -> PrefixEntry:
    """The entry ``PrefixEntry(key, model, packed, trimmable, min_reusable_offset)`` makes,
    from fields its caller has checked as that would (``packed`` whole u32 values,
    ``min_reusable_offset`` within its length): open's catalogue rows, checked in bulk by
    :meth:`kvtrio.storage.catalogue.Catalogue.check`. Nothing is converted or checked
    again (one per stored entry at open); ``packed`` is taken as the
    :data:`PackedTokens` it is (no call of the NewType per entry)."""
    entry: PrefixEntry = _new_object(PrefixEntry)
    _set_slot(entry, "key", key)
    _set_slot(entry, "model", model)
    _set_slot(entry, "packed", packed)
    _set_slot(entry, "trimmable", trimmable)
    _set_slot(entry, "min_reusable_offset", min_reusable_offset)
    return entry


class IndexAndLoadMixin(CacheParts):
    """Open's index build in bounded batches, cold loads, promotion and RAM eviction."""

    async def _load_index(self) -> None:
        """Index every stored entry (open). The store's batches come least recently used
        first; each entry enters the ledger and the cold policy in that order, then the
        prefix index in token order (the entries' ``order``, when the store knows it), so
        the index's sorted runs are filled by appends, never a sort or an insertion search.

        Nothing else can touch the cache before open returns (its tasks start after), so
        the tables are built on a worker thread, one store batch per call, while the loop
        only waits: the loop does nothing per entry (docs/design.md invariant 16). What
        holds the GIL in one piece is bounded: a young collection per catalogue batch
        (:mod:`kvtrio.actors.collector`), and a plain dict's resize (the records', the
        cold policy's slots': a few ms at 100,000 entries). The two LRUs are segmented
        (:mod:`kvtrio.actors.seglru`): no resize of a table of every entry."""
        self._ledger.used = await self.cold.usage()
        by_order: list[PrefixEntry | None] = []
        young = YoungCollections()
        # The models of the found entries by (model id, fingerprint), the cache's own
        # first: an entry of this model holds this very ModelKey (identity, no equality
        # test per entry).
        models = {(self.model.model_id, self.model.fingerprint): self.model}
        enter = functools.partial(self._enter_found, by_order=by_order, young=young, models=models)
        with collector_paused():
            async with aclosing(self.cold.entries()) as batches:
                async for batch in batches:
                    await trio.to_thread.run_sync(enter, batch)
            await trio.to_thread.run_sync(self._index_found, by_order, young)

    def _enter_found(
        self,
        infos: Sequence[ColdEntryInfo],
        *,
        by_order: list[PrefixEntry | None],
        young: YoungCollections,
        models: dict[tuple[str, str], ModelKey],
    ) -> None:
        """Worker thread, at open: :meth:`_add_cold_entry` for a batch, least recently
        used first. Reads no clock (the cold policy has no default TTL, and found entries
        none of their own), so nothing here needs the trio thread."""
        assert self.cold_policy.default_ttl is None
        if isinstance(infos, FoundRows):
            self._enter_rows(infos, by_order, young, models)
            return
        for n, info in enumerate(sorted(infos, key=_by_mtime), 1):
            self._add_cold_entry(info, by_order)
            if n % OPEN_BATCH == 0:
                young.after_batch()
        young.after_batch()

    def _enter_rows(
        self,
        batch: FoundRows,
        by_order: list[PrefixEntry | None],
        young: YoungCollections,
        models: dict[tuple[str, str], ModelKey],
    ) -> None:
        """:meth:`_enter_found` of a catalogue's rows (already least recently used first,
        every field checked by the catalogue), each as :meth:`_add_cold_entry` enters an
        info, straight from sqlite's tuple: no info object, no sort, no tuple made again;
        the key interned (the store's tables hold the same str: one per entry). Each
        entry's FOUND is applied to the ledger here and to the cold policy once per batch,
        in the same order (:meth:`EvictionPolicy.insert_found`: the policy holds exactly
        the DURABLE entries, as :meth:`_apply` keeps it); the index follows in token order
        (:meth:`_index_found`); the batch's keys join the index here (its first step,
        :meth:`PrefixIndex.add_keys`), while each key's str and entry are fresh in the CPU's
        caches."""
        records, ledger = self._records, self._ledger
        entries: list[PrefixEntry] = []
        arrivals: list[tuple[str, EntryCost]] = []
        sides: list[ColdSide] = []
        pinned_found: list[CacheRecord] = []
        # _cold_cost of a found entry depends on its length and model alone (it shares one
        # cost object per pair): asked once per pair and batch, when it changes from the
        # row before's.
        costs: dict[tuple[int, int], EntryCost] = {}
        last_length: int = -1  # the first row asks: no length is -1
        last_model: ModelKey | None = None
        cost: EntryCost
        new_entry = entry_of_checked  # the catalogue checked every field (check)
        # The row before's model strings: rows of one model in a row compare their strings
        # (equal contents) instead of hashing a new pair each to look the model up.
        last_id: str | None = None  # none yet: the first row looks its model up
        last_fingerprint: str | None = None
        model = self.model
        ranks, intern = batch.scanned.ranks, sys.intern
        # The store's keys in its table's order, the scan's after a clean open: a row's key
        # taken from there when equal (the next one, in memory too: no probe of the
        # interned strings, a table of every key, at random), else interned.
        known = batch.keys
        for row in batch.scanned.rows:
            key, model_id, fingerprint, packed, trimmable, min_offset, conv, _, pinned, rowid = row
            stored = None if known is None else next(known, None)
            key = stored if stored is not None and stored == key else intern(key)
            if key in records:
                continue
            if model_id != last_id or fingerprint != last_fingerprint:
                last_id, last_fingerprint = model_id, fingerprint
                found = models.get((model_id, fingerprint))  # the cache's own is there already
                if found is None:
                    found = models[model_id, fingerprint] = ModelKey(model_id, fingerprint)
                    self._other_models.add(found)
                elif found is self.model and self._bytes_per_token == DEFAULT_BYTES_PER_TOKEN:
                    self._measure_found(key, len(packed) // 4)
                model = found
            entry = new_entry(key, model, packed, trimmable != 0, min_offset)
            record = records[key] = CacheRecord(key, 0, entry=entry)
            sides.append(record)  # its own cold side
            entries.append(entry)
            if len(packed) != last_length or model is not last_model:
                last_length, last_model = len(packed), model
                shared = costs.get((last_length, id(model)))
                if shared is None:
                    shared = costs[last_length, id(model)] = self._cold_cost(record)
                cost = shared
            arrivals.append((key, cost))
            if pinned:
                record.pinned = True  # rule 12: pins survive a restart
                pinned_found.append(record)
            rank = ranks[rowid]
            if rank >= len(by_order):
                by_order.extend([None] * (rank + 1 - len(by_order)))
            by_order[rank] = entry
            if conv != "[]":
                self._note_conversations(record, conversations_of(row))
        ledger.found_many(sides)  # NONE -> DURABLE, each in the batch's order
        self._index.add_keys(entries)
        self.cold_policy.insert_found(arrivals)
        for record in pinned_found:
            try:
                self.cold_policy.pin(record.entry.key)
            except PinLimitError:
                self._count("pins_refused")
        young.after_batch()

    def _measure_found(self, key: str, tokens: int) -> None:
        """Open: this model's bytes per token from a found entry's bytes as its store holds
        them, so that found entries are valued (rule 10) at about their size, not at the
        estimate of 128 KiB a token; one entry, once per open."""
        stored = self.cold.entry_bytes(key)
        if stored and tokens:
            self._bytes_per_token = max(1, stored // tokens)

    def _index_found(self, by_order: list[PrefixEntry | None], young: YoungCollections) -> None:
        """Worker thread, at open: the found entries into the prefix index's runs, in token
        order (:meth:`PrefixIndex.add_runs`; their keys joined it as they were entered),
        :data:`~kvtrio.storage.catalogue.SCAN_BATCH` at a time. What :meth:`_sync` would
        do for each: every found entry is DURABLE, so findable (rule 3), and none was
        indexed or departed yet. Each is its key's entry (a key found twice entered once:
        :meth:`_enter_rows` and :meth:`_add_cold_entry` skip a key already recorded), so
        no record or key is reached here: only the entries, in an order unrelated to where
        they lie in memory (at 100,000 entries, each object reached so is a cache miss)."""
        index = self._index
        for start in range(0, len(by_order), SCAN_BATCH):
            batch = by_order[start : start + SCAN_BATCH]
            index.add_runs(entry for entry in batch if entry is not None)
            young.after_batch()

    async def _add_cold_entries(
        self,
        infos: Iterable[ColdEntryInfo],
        by_order: list[PrefixEntry | None] | None = None,
        young: YoungCollections | None = None,
    ) -> None:
        """Enter stored entries, least recently used first, :data:`OPEN_BATCH` at a time
        with a checkpoint between batches (the loop never stalls for all N at once). With
        ``by_order``, an entry whose ``order`` is known is put there instead of into the
        prefix index (the caller indexes them in that order). ``young``: open's young
        collections, run after each batch (:mod:`kvtrio.actors.collector`)."""
        listed = infos if isinstance(infos, list) else list(infos)
        if len(listed) > OPEN_BATCH:  # a sort of N on the loop would be one long step
            by_mtime = functools.partial(sorted, listed, key=_by_mtime)
            ordered = await trio.to_thread.run_sync(by_mtime)
        else:
            ordered = sorted(listed, key=_by_mtime)
        for start in range(0, len(ordered), OPEN_BATCH):
            for info in ordered[start : start + OPEN_BATCH]:
                self._add_cold_entry(info, by_order)
            if young is not None:
                young.after_batch()
            await trio.lowlevel.checkpoint()

    def _add_cold_entry(
        self, info: ColdEntryInfo, by_order: list[PrefixEntry | None] | None
    ) -> None:
        key = info.key
        if key in self._records:
            return
        model = info.model
        entry = PrefixEntry(key, model, info.tokens, info.trimmable, info.min_reusable_offset)
        if model is not self.model and model != self.model:
            self._other_models.add(model)
        elif self._bytes_per_token == DEFAULT_BYTES_PER_TOKEN:
            self._measure_found(key, entry.length)
        record = self._records[key] = CacheRecord.of(entry)
        if info.pinned:
            record.pinned = True  # rule 12: pins survive a restart
        order = info.order
        if by_order is None or order is None:
            self._apply(record, ColdEvent.FOUND)
        else:
            self._apply(record, ColdEvent.FOUND, index=False)
            self._index.add_keys((entry,))
            if order >= len(by_order):
                by_order.extend([None] * (order + 1 - len(by_order)))
            by_order[order] = entry
        if info.conversations:
            self._note_conversations(record, info.conversations)

    def _note_conversations(self, record: CacheRecord, conversations: Sequence[str]) -> None:
        """A found entry is the checkpoint of ``conversations``: the latest of each is the
        longest."""
        record.conversations = frozenset(conversations)
        key, length = record.entry.key, record.entry.length
        for conversation in conversations:
            latest = self._records.get(self._conversations.get(conversation, ""))
            if latest is None or latest.entry.length < length:
                self._conversations[conversation] = key

    async def _load_cold(self, record: CacheRecord) -> list[Any] | None:
        """Read a DURABLE entry's caches (None: gone or bad, counted and forgotten)."""
        key = record.entry.key
        started = time.perf_counter()
        try:
            # Content is bound to its key: a manifest replaced by another valid one (a
            # Redis value overwritten, a file copied over) is a mismatch, never a hit.
            caches, nbytes = await self.cold.fetch(
                key, model=self.model, tokens=record.entry.tokens
            )
        except NewerFormatError:
            # A newer kvtrio's entry (a shared store's key rewritten by a newer host since
            # this process indexed it): a miss here, forgotten, not deleted: it is not
            # damaged, and the kvtrio that reads it keeps it (docs/format.md).
            self._count("drops")
            record.leaving = MissReason.CORRUPT
            if record.cold.state is ColdState.DURABLE:
                self._apply(record, ColdEvent.FORGET)
            return None
        except (CacheMissError, CorruptCacheError, CacheMismatchError) as error:
            self._count("drops")
            record.leaving = (
                MissReason.EVICTED if isinstance(error, CacheMissError) else MissReason.CORRUPT
            )
            if record.cold.state is ColdState.DURABLE:
                self._evict(record)
                self._spawn_removal(record)
            return None
        except StoreUnavailableError:
            # A shared store (Redis) out of reach: a miss for this request. The entry is
            # forgotten here only; it stays in the store for every host (and this one's
            # next open).
            self._count("drops")
            record.leaving = MissReason.STORE_UNREACHABLE
            self._pause_shared()
            if record.cold.state is ColdState.DURABLE:
                self._apply(record, ColdEvent.FORGET)
            return None
        except (OSError, UnknownCacheKindError) as error:
            # The disk failed under this entry (EIO, a directory in its place), or it is of
            # a kind this process has no codec for: a miss, counted. Forgotten here, not
            # deleted: neither proves corruption.
            self._count("drops")
            self._count("cold_errors")
            record.leaving = (
                MissReason.STORE_UNREACHABLE if isinstance(error, OSError) else MissReason.CORRUPT
            )
            if record.cold.state is ColdState.DURABLE:
                self._apply(record, ColdEvent.FORGET)
            return None
        self.load_seconds.observe(time.perf_counter() - started)
        self._count("bytes_read", nbytes)
        self.wear.on_read(key, nbytes)
        self._touch_cold(record)
        return caches

    async def _admit_hot(self, record: CacheRecord, caches: list[Any]) -> None:
        """Promote a disk hit to RAM, unless the entry changed while it was loading."""
        nbytes = await self.owner.run(_cache_nbytes, caches)
        if (
            record.hot is not None
            or record.retired
            or self._records.get(record.entry.key) is not record
        ):
            return
        self._set_hot(record, caches, nbytes)
        await self._enforce_hot_budget({})

    async def _enforce_hot_budget(self, meta: Mapping[str, str]) -> None:
        while self._hot_bytes > self.hot_budget and len(self._hot_lru) > 1:
            key = self.hot_policy.victim()  # rule 10 (never a pinned one)
            if key is None:
                break
            record = self._records[key]
            caches = record.hot
            record.leaving = MissReason.EVICTED
            if self.policy is WritePolicy.WRITE_BACK and record.cold.state is ColdState.NONE:
                assert caches is not None
                if self._admit(record, record.hot_bytes):  # rule 11
                    self._queue_write(record, caches, meta)
                else:
                    record.leaving = MissReason.DROPPED
            self._set_hot(record, None)  # rule 3: findable again once durable
            self._count("hot_evictions")
        await trio.lowlevel.checkpoint()

    async def _supersede(self, conversation: str, record: CacheRecord) -> None:
        old_key = self._conversations.get(conversation)
        self._conversations[conversation] = record.entry.key
        record.conversations |= {conversation}
        if old_key is None or old_key == record.entry.key:
            return
        old = self._records.get(old_key)
        if old is None:
            return
        old.conversations -= {conversation}
        n = old.entry.length
        if old.conversations or record.entry.packed[: 4 * n] != old.entry.packed:
            return  # still another conversation's, or not a prefix of the new checkpoint
        self._count("superseded")
        old.retired = True
        old.leaving = None  # its newer checkpoint answers its lookups: not a miss's cause
        record.supersedes += old.supersedes
        old.supersedes = ()
        if record.cold.state is ColdState.DURABLE:
            await self._remove(old)
            return
        # Rule 4: the old checkpoint leaves RAM now, and the disk once the new one is durable
        # there (a crash in between keeps the old one; the new write shares its blocks).
        self._set_hot(old, None)
        if old.cold.state is ColdState.NONE:
            await self._remove(old)
        else:
            record.supersedes += (old,)

    async def _remove(self, record: CacheRecord) -> None:
        """Take ``record`` out of both tiers (its file in the background)."""
        self._set_hot(record, None)
        state = record.cold.state
        if state is ColdState.QUEUED:
            self._cancel_pending(record)
        elif state is ColdState.WRITING:
            self._apply(record, ColdEvent.DOOM)  # deleted once written
        elif state is ColdState.DURABLE:
            self._apply(record, ColdEvent.EVICT)
            # In the background: the store may be busy with a write (never on the request path).
            self._spawn_removal(record)
        await trio.lowlevel.checkpoint()
