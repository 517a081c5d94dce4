"""The cold side of the tiered cache: its ledger, its pending write-backs, the one writer
task and the one eviction loop (rules 2, 3, 7 and 9 of :mod:`kvtrio.actors.tiered`).

:class:`ColdSideMixin` is a part of :class:`~kvtrio.actors.tiered.TieredPromptCache`, kept
apart by job: the cache decides *what* is hot, cold, superseded or found (policy); this
part carries each decision out against the store while keeping the ledger right.

Theory of operation
-------------------
1. A write is queued (NONE -> QUEUED) with the caches it will store; the queue is capped
   by bytes (``pending_budget``): when a droppable write (a RAM eviction) exceeds it,
   the oldest droppable pending write is shed (counted in ``pending_dropped`` and
   ``drops``), never the newest. A flush's write is undroppable and sheds none.
2. One writer task takes pending writes oldest first. Each write's encoded size (header
   and tensor payload: the bytes it puts on disk if no block is there yet) comes from its
   plan, made on the owner from the caches' shapes and dtypes (by the spill's one owner
   job, else by the writer) and sized off the owner (``ColdStore.plan_size``, no MLX
   call); then, before each store attempt,
   reserves that (QUEUED -> WRITING) and runs the eviction loop: least
   recently used DURABLE entries are removed, one at a time and each completely, while
   used + reserved exceeds the effective budget. No other task evicts, so no two loops
   can both count the same bytes as still to free.
3. The write settles: WRITTEN (DURABLE, or straight to removal when it was removed
   meanwhile) or FAILED; either way the reservation is released at once, and what the
   store reports it added (blocks already on disk count nothing) goes into ``used``. A write the
   store reports as out of space (ENOSPC) evicts at least one entry and is retried once.
4. Removals (supersession, a bad file) run in the background, ordered per key with the
   writes (rule 7); their freed bytes leave ``used`` when the store reports them.
5. Write-behind yields to the server: while it says it is busy (:meth:`ColdSideMixin.
   set_foreground`), the writer holds the oldest pending write back, for at most the
   gate's ``defer`` seconds, and not at all once the pending bytes reach half of
   ``pending_budget`` or while the cache flushes or closes (:mod:`kvtrio.actors.
   writegate`). The byte cap of rule 1 holds as ever: what waits is counted there.
6. Each flush's write that did not land is noted with why (a :class:`~kvtrio.actors.
   tieredtypes.Landing`): :meth:`ColdSideMixin.landing` tells a closing server, entry by
   entry, which of the RAM entries it handed over are on disk, still on their way (its
   deadline passed), or lost and why.

Costs: queueing is O(1) amortized (plus the sheds); one eviction is O(1) plus its
removal's I/O; a write's admission evicts as many entries as its bytes need.

Keeps docs/design.md invariants 12 and 14.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio
from kvtrio.actors.coldstore import CONVERSATIONS_META, StoreResult
from kvtrio.actors.lifecycle import FINDABLE_COLD, ColdEvent, ColdSide, ColdState
from kvtrio.actors.misses import MissReason
from kvtrio.actors.prefix import PrefixEntry
from kvtrio.actors.tieredtypes import Landing
from kvtrio.errors import KvtrioError

if TYPE_CHECKING:
    from kvtrio.actors.tieredparts import CacheParts
else:
    CacheParts = object

__all__ = [
    "DEFAULT_MIN_FREE_SHARE",
    "DEFAULT_PENDING_BYTES",
    "CacheRecord",
    "ColdSideMixin",
]

# The free-space floor when none is given: this share of the cold tier's volume stays
# free (ext4 reserves 5% for root by default; a cache should not take the last of it).
DEFAULT_MIN_FREE_SHARE = 0.05
# Pending write-backs hold at most this many bytes of caches by default (rule 1).
DEFAULT_PENDING_BYTES = 256 << 20
# What landing() says of an entry in these states (rule 6).
_LANDINGS = {
    ColdState.DURABLE: Landing.DURABLE,
    ColdState.QUEUED: Landing.QUEUED,
    ColdState.WRITING: Landing.WRITING,
    ColdState.WRITING_DOOMED: Landing.WRITING,
}


@attrs.define(eq=False)
class CacheRecord(ColdSide):
    """One entry: its hot side (caches in RAM) and its cold side (a state, rule 9).

    The record is its own cold side (a :class:`ColdSide`, :attr:`cold` is itself): the
    ledger holds the records, one object per entry where a record and a side were two
    (open makes one per stored entry: ~90 bytes and an object for the collector each)."""

    entry: PrefixEntry = attrs.field(kw_only=True)
    # Small per entry (open indexes every stored one): empty immutable defaults, replaced
    # when they change.
    conversations: frozenset[str] = frozenset()
    hot: list[Any] | None = None
    hot_bytes: int = 0
    pending: list[Any] | None = None  # the caches a QUEUED write will store
    pending_meta: dict[str, str] | None = None
    retired: bool = False  # superseded: never promoted to RAM again
    # Issue 18: lookups it served (admission's "uses"), its TTL, its pin, and why it would
    # leave the index next (noted in the cache's Departures; None: not a miss's cause).
    uses: int = 0
    ttl: float | None = None
    pinned: bool = False
    leaving: MissReason | None = MissReason.EVICTED
    supersedes: tuple[CacheRecord, ...] = ()  # deleted once this is durable

    @classmethod
    def of(cls, entry: PrefixEntry, nbytes: int = 0) -> CacheRecord:
        return cls(entry.key, nbytes, entry=entry)

    @property
    def cold(self) -> ColdSide:
        """Its cold side: the record itself."""
        return self

    @property
    def findable(self) -> bool:
        """Rule 3: indexed iff hot or durable on disk."""
        return self.hot is not None or self.cold.state in FINDABLE_COLD


class ColdSideMixin(CacheParts):
    """The cold side of :class:`~kvtrio.actors.tiered.TieredPromptCache` (see above)."""

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    def _sync(self, record: CacheRecord) -> None:
        """Bring the index and the table in line with ``record``'s state (rules 3, 9)."""
        key = record.entry.key
        if self._records.get(key) is not record:
            return  # replaced: its key belongs to the new record now
        if record.findable:
            if key not in self._index:
                self._index.add(record.entry)
                self.departures.forget(key)  # back: no longer a miss's cause
        elif key in self._index:
            self._index.remove(key)
            self._prefetch_gone(key)
            if record.leaving is not None:
                self.departures.note(record.entry, record.leaving)
        if record.hot is None and record.cold.state is ColdState.NONE:
            del self._records[key]
            for conversation in record.conversations:
                if self._conversations.get(conversation) == key:
                    del self._conversations[conversation]

    def _apply(self, record: CacheRecord, event: ColdEvent, *, index: bool = True) -> ColdState:
        """Move ``record``'s cold side by ``event``, and the cold policy and (with
        ``index``; open indexes its entries afterwards, in token order) the prefix index
        with it."""
        old = record.cold.state
        state = self._ledger.apply(record.cold, event)
        if state is not old and self._owns(record):
            # The cold policy holds exactly the DURABLE entries (the eviction loop's choice).
            if state is ColdState.DURABLE:
                self._enter_policy(self.cold_policy, record, self._cold_cost(record))
            elif old is ColdState.DURABLE:
                self.cold_policy.on_remove(record.entry.key)
        if index:
            self._sync(record)
        return state

    def _owns(self, record: CacheRecord) -> bool:
        """Whether ``record`` is still the live record of its key (not replaced)."""
        return self._records.get(record.entry.key) is record

    def _effective_cold_budget(self) -> int:
        """Rule 2: the budget, shrunk so the volume keeps its free-space floor."""
        directory = self.cold.directory
        if directory is None:  # no local volume (a shared store): the budget alone
            return self.cold_budget
        try:
            disk = shutil.disk_usage(directory)
        except OSError:
            return self.cold_budget
        floor = self.min_free_bytes
        if floor is None:
            floor = int(disk.total * DEFAULT_MIN_FREE_SHARE)
        return min(self.cold_budget, max(0, self._ledger.used + disk.free - floor))

    def _evict(self, record: CacheRecord) -> None:
        self._apply(record, ColdEvent.EVICT)

    # Rule 7: cold operations on one key run one at a time, in the order they were started
    # (a removal started before a rewrite of the same key must not delete the new file).

    def _reserve_turn(self, key: str) -> tuple[trio.Event | None, trio.Event]:
        previous = self._key_tail.get(key)
        done = self._key_tail[key] = trio.Event()
        return previous, done

    def _release_turn(self, key: str, done: trio.Event) -> None:
        done.set()
        if self._key_tail.get(key) is done:
            del self._key_tail[key]

    def _spawn_removal(self, record: CacheRecord) -> None:
        """Delete an EVICTING record's file in the background (rule 7 orders it)."""
        previous, done = self._reserve_turn(record.entry.key)
        self._spawn(self._removal, record, previous, done)

    async def _removal(
        self, record: CacheRecord, previous: trio.Event | None, done: trio.Event
    ) -> None:
        try:
            if previous is not None:
                await previous.wait()
            await self._remove_cold_file(record)
        finally:
            self._release_turn(record.entry.key, done)

    async def _remove_cold_file(self, record: CacheRecord) -> None:
        """EVICTING -> NONE: delete the file, and count what that freed."""
        try:
            freed = await self.cold.remove(record.entry.key)
            self._ledger.used -= freed  # not `-= await`: that reads the total before the await
            self.wear.on_removed(record.entry.key)
        except KvtrioError:
            self._count("drops")
        except OSError:  # a background removal must never kill the cache
            self._count("drops")
            self._count("cold_errors")
        self._apply(record, ColdEvent.REMOVED)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background; ``wait_writes_settled`` waits for it."""
        if self._nursery is None:
            raise RuntimeError("TieredPromptCache is not open")
        self._busy_up()
        self._nursery.start_soon(self._settle, fn, *args)

    async def _settle(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        finally:
            self._busy_down()

    def _busy_up(self) -> None:
        self._busy += 1
        if self._idle.is_set():  # keep the event waiters hold while work is in flight
            self._idle = trio.Event()

    def _busy_down(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    # -- internals: the pending write-backs and the one writer --------------------------

    def _queue_write(
        self,
        record: CacheRecord,
        caches: list[Any],
        meta: Mapping[str, str],
        *,
        droppable: bool = True,
        nbytes: int | None = None,
        plan: object | None = None,
    ) -> None:
        """NONE -> QUEUED; then shed the oldest droppable pending writes while their bytes
        exceed ``pending_budget`` (rule 3: soft by the newest one alone). ``nbytes``: the
        caches' bytes (default: the entry's hot bytes, its RAM copy being written);
        ``plan``: the store's ``write_plan`` of this write, made already (rule 2)."""
        record.pending, record.pending_meta = caches, dict(meta)
        # The caches' bytes in RAM (a KVCache's buffer is rounded up to its step): what
        # the byte cap counts; the reservation is the write's encoded size (rule 2).
        record.cold.nbytes = record.hot_bytes if nbytes is None else nbytes
        # Rule 2: sized from its plan here (no MLX call), else planned by the writer.
        record.cold.write_bytes = None if plan is None else self.cold.plan_size(plan)
        record.cold.droppable = droppable
        self._apply(record, ColdEvent.QUEUE)
        self._busy_up()
        self._wake.set()
        self._gate.poke()  # the pending bytes grew (rule 5)
        # A flush's write (a close hands every RAM entry over at once, all in RAM anyway)
        # sheds nothing: what the tier admitted before it lands too.
        while droppable and self._ledger.queued_bytes > self.pending_budget:
            victim = self._ledger.oldest_droppable()
            if victim is None or victim is record.cold:
                break
            self._count("pending_dropped")
            self._count("drops")
            self._records[victim.key].leaving = MissReason.DROPPED
            self._settle_pending(self._records[victim.key], ColdEvent.DROP)

    def _cancel_pending(self, record: CacheRecord) -> None:
        self._settle_pending(record, ColdEvent.CANCEL)

    def _settle_pending(self, record: CacheRecord, event: ColdEvent) -> None:
        record.pending, record.pending_meta = None, None
        self._apply(record, event)
        self._busy_down()

    def _touch_cold(self, record: CacheRecord) -> None:
        """A use of a DURABLE entry: most recent in the cold LRU, and recorded in the store
        (by the writer, in batches) so the order survives a restart."""
        if record.cold.state is ColdState.DURABLE:
            self._ledger.touch(record.cold)
            self.cold_policy.on_hit(record.entry.key)
            self._touched[record.entry.key] = time.time()

    async def _flush_touches(self) -> None:
        """Record the last uses and pins noted since the last flush (the writer task, and
        the close)."""
        if self._touched:
            batch, self._touched = self._touched, {}
            try:
                await self.cold.touch(batch)
            except (KvtrioError, OSError):
                pass  # best effort: the order since the last flush is lost, nothing else
        if self._pins_to_record:
            pins, self._pins_to_record = self._pins_to_record, {}
            try:
                await self.cold.pin(pins)
            except (KvtrioError, OSError):
                self._count("cold_errors")  # held in this run; lost at the next open
            finally:
                self._busy_down()

    def _note_pin(self, key: str, pinned: bool) -> None:
        """Have the writer task record a DURABLE entry's pin in the store (rule 12);
        ``wait_writes_settled`` (and so a close) waits until it has."""
        if not self._pins_to_record:
            self._busy_up()
        self._pins_to_record[key] = pinned
        self._wake.set()

    def landing(self, keys: Iterable[str]) -> dict[str, Landing]:
        """Where the writes of ``keys`` stand (keys :meth:`spill` returned): on disk,
        queued, writing, or, for a flush's write that did not land, why (rule 6). Loop
        thread; O(len(keys))."""
        out = {}
        for key in keys:
            record = self._records.get(key)
            state = record.cold.state if record is not None else ColdState.NONE
            if state in _LANDINGS:
                out[key] = _LANDINGS[state]
            else:
                out[key] = self._flush_unwritten.get(key, Landing.GONE)
        return out

    def set_foreground(self, busy: bool, *, defer: float | None = None) -> None:
        """The server is busy (decoding) or not: while it is, a write-back waits to start
        for up to ``defer`` seconds (:mod:`kvtrio.actors.writegate`; default
        :data:`~kvtrio.actors.writegate.DEFAULT_WRITE_DEFER`), unless the pending bytes
        reach half of ``pending_budget`` or the cache flushes or closes. Loop thread."""
        self._gate.set_busy(busy, defer=defer)

    async def _writer(self) -> None:
        """The one writer task: takes pending writes oldest first, one at a time (and
        records the last uses of entries in between); a write-back starts only when the
        write gate lets it (rule 5)."""
        held: tuple[str, float] | None = None  # the write held back, and since when
        while True:
            await self._flush_touches()
            side = self._ledger.oldest_queued()
            if side is None:
                held = None
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            if held is None or held[0] != side.key:
                held = (side.key, trio.current_time())
            pressed = 2 * self._ledger.queued_bytes >= self.pending_budget
            if self._gate.holds(held_since=held[1], pressed=pressed):
                await self._gate.wait_changed(held_since=held[1])
                continue
            held = None
            record = self._records[side.key]
            if side.write_bytes is None:
                side.write_bytes = await self._encoded_size(record)
                if side.state is not ColdState.QUEUED or self._records.get(side.key) is not record:
                    continue  # dropped or cancelled meanwhile: settled (and counted) there
            try:
                await self._write(record)
            finally:
                self._busy_down()

    async def _encoded_size(self, record: CacheRecord) -> int:
        """Rule 2: the bytes a QUEUED write will put on disk at most, planned on the owner
        from its caches' shapes and dtypes and sized from that plan here, off the owner
        (its RAM bytes when the plan fails: the write will fail the same way, counted)."""
        caches = record.pending
        assert caches is not None
        meta = self._write_meta(record, record.pending_meta or {})
        entry = record.entry
        try:
            plan = await self.owner.run(
                self.cold.write_plan, entry.model, entry.tokens, caches, meta
            )
        except (KvtrioError, ValueError, TypeError):
            return record.cold.nbytes
        return self.cold.plan_size(plan)

    @staticmethod
    def _write_meta(record: CacheRecord, meta: Mapping[str, str]) -> dict[str, str]:
        """The header meta of ``record``'s write: ``meta`` and the conversations it is
        the checkpoint of."""
        out = dict(meta)
        if record.conversations:
            out[CONVERSATIONS_META] = json.dumps(sorted(record.conversations))
        return out

    async def _write(self, record: CacheRecord) -> None:
        key = record.entry.key
        caches, meta = record.pending, record.pending_meta or {}
        assert caches is not None
        record.pending, record.pending_meta = None, None
        self._apply(record, ColdEvent.START)  # reserves its bytes (rule 2)
        previous, done = self._reserve_turn(key)
        try:
            if previous is not None:
                await previous.wait()
            result = await self._store(record, caches, meta)
            if result.no_space and await self._make_room(extra=record.cold.reserved):
                self._count("no_space_retries")
                result = await self._store(record, caches, meta)
            if result.written:
                self._count("bytes_written", result.bytes_written)
                self._count("bytes_deduplicated", result.bytes_deduplicated)
                self.wear.on_written(key, result.bytes_written)
                self._apply(record, ColdEvent.WRITTEN)
                if record.pinned:  # pinned before it was on disk: recorded now (rule 12)
                    self._note_pin(key, True)
            else:
                self._count("drops")
                self._count(f"unwritten_{result.unwritten or 'failed'}")
                if not record.cold.droppable:  # a flush's: landing() names it
                    self._flush_unwritten[key] = Landing.of_unwritten(result.unwritten)
                record.leaving = MissReason.DROPPED
                self._apply(record, ColdEvent.FAILED)
            if record.cold.state is ColdState.EVICTING:  # removed while it was written
                await self._remove_cold_file(record)
        finally:
            self._release_turn(key, done)
        if record.cold.state is ColdState.DURABLE:
            for old in record.supersedes:
                if self._owns(old):
                    await self._remove(old)
            record.supersedes = ()

    async def _store(
        self, record: CacheRecord, caches: list[Any], meta: dict[str, str]
    ) -> StoreResult:
        """One attempt at the write, after the eviction loop made room for it."""
        await self._make_room()
        started = time.perf_counter()
        try:
            result = await self.cold.store(
                record.entry.key,
                record.entry.model,
                record.entry.tokens,
                caches,
                meta=self._write_meta(record, meta),
            )
            if result.written:
                self.save_seconds.observe(time.perf_counter() - started)
                if self.on_written is not None:  # kvtrio serve --save-trace
                    self.on_written(record.entry.key, started, time.perf_counter())
        except KvtrioError:
            result = StoreResult(written=False, unwritten="refused")
        except OSError:  # the disk failed under the write: a counted drop (issue 15)
            result = StoreResult(written=False, unwritten="error")
        if result.unwritten == "error":  # here, or under the tier's own write
            self._count("cold_errors")
        self._ledger.used += result.disk_bytes  # a failed rewrite may still have freed bytes
        return result

    async def _make_room(self, *, extra: int = 0) -> bool:
        """The one eviction loop (only the writer task runs it): evict the DURABLE entries
        the cold policy names (``cold_policy.victim()``: least recently used with LRU, the
        least valuable with the cost-aware policy; never a pinned one), one removal at a
        time, while used + reserved + ``extra`` exceeds the effective budget; with
        ``extra``, evict at least one. True if it evicted."""
        evicted = False
        while True:
            need = self._ledger.used + self._ledger.reserved + extra
            if need <= self._effective_cold_budget() and (evicted or not extra):
                return evicted
            key = self.cold_policy.victim()
            if key is None:
                return evicted
            record = self._records[key]
            assert record.cold.state is ColdState.DURABLE, key
            record.leaving = MissReason.EVICTED
            self._evict(record)
            self._count("cold_evictions")
            previous, done = self._reserve_turn(key)
            try:
                if previous is not None:
                    await previous.wait()
                await self._remove_cold_file(record)
            finally:
                self._release_turn(key, done)
            evicted = True
