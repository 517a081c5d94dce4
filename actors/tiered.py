"""TieredPromptCache: a prompt cache in RAM (hot) over a cold tier on disk.

A server asks ``fetch_nearest(tokens)`` before prefill and calls ``insert(tokens,
caches)`` after a turn. Entries live in the hot tier (live MLX caches, LRU by bytes)
and/or the cold tier (files written by the actors' ColdTier, LRU by bytes, aware of
free disk space). One :class:`~kvtrio.actors.prefix.PrefixIndex` over both tiers finds
the longest reusable prefix; on open it is rebuilt from the cold store's catalogue, so a
restart keeps the cache.

Theory of operation
-------------------
1. The hot tier owns private copies: ``insert`` clones the caller's caches on the MLX
   owner thread, and ``fetch_nearest`` hands out a fresh clone (trimmed when the match
   was a longer entry), so neither side can change what the other holds.
2. Budgets are soft by at most one entry. Hot: after an insert, least recently used hot
   entries are evicted while the hot bytes exceed the budget and more than one entry is
   hot. Cold: one ledger (:class:`~kvtrio.actors.lifecycle.ColdLedger`) counts the bytes
   that exist plus the reservations of writes in flight; a write reserves its bytes
   *before* it starts, and the one eviction loop (run by the one writer task, before each
   write) evicts least recently used entries until used + reserved fits the effective
   budget: ``min(cold_budget, used + free - min_free_bytes)``, where ``min_free_bytes``
   defaults to :data:`DEFAULT_MIN_FREE_SHARE` of the volume. A failed write releases its
   reservation at once; a write that found the volume full evicts and retries once.
3. Policy ``write-back`` writes an entry to the cold tier when it leaves the hot tier;
   ``write-through`` writes every insert at once. Pending writes wait in a queue capped
   by bytes (``pending_budget``; the oldest is dropped, counted, when a new one would
   exceed it, so a burst holds at most hot budget + cap in RAM). Until a write is durable
   the entry is findable only while it is hot: an entry in neither tier is not indexed.
4. A checkpoint supersedes the older entry of the same conversation that it extends: the
   older one leaves RAM at once and the disk once the newer one is durable there.
5. The cold tier is best effort: a failed or dropped write, a missing or corrupt file is
   counted, the entry forgotten, and the lookup retried; it never fails a request.
6. Lookups are namespaced by the model key (model id and config fingerprint); entries
   of other models on the same disk count towards the disk budget but never match.
7. Cold operations on one key (write, delete) run one at a time in the order started.
8. A shared cold store (Redis: :class:`SharedColdStore`) is searched at lookup time: a
   lookup without an exact entry asks the store's prefix index, in one round trip, which
   entries any host registered under the query's token-block chain hashes, reads the
   manifest of the deepest one this host does not know (a few at most) and adds it to the
   index; nothing else of the catalogue is read. Every save registers its entry there
   (the tier's manifest publication does). A store out of reach, or an entry gone since it
   was registered, leaves the lookup a miss. Re-reading the whole catalogue
   (``shared_refresh``) remains as an optional fallback for entries saved without
   registration.
9. Every entry's cold side moves only through the transition table of
   :mod:`kvtrio.actors.lifecycle`; the cold LRU, the pending queue and the reserved bytes
   derive from it, and an entry is indexed iff it is hot or DURABLE.
10. Each tier orders its evictions by an :class:`~kvtrio.actors.policy.EvictionPolicy`
   (``eviction``; both tiers one kind, sharing one :class:`~kvtrio.actors.policy.
   PrefillCost` fed by :meth:`TieredPromptCache.observe_prefill`): the hot budget evicts
   ``hot_policy.victim()``, the one eviction loop ``cold_policy.victim()``. The default
   is the cost-aware GreedyDual-Size (recompute seconds per byte, aged; a hot entry the
   disk holds or will take is valued by its reload instead); ``PolicyKind.LRU`` keeps
   plain LRU. The cold policy holds exactly the DURABLE entries.
11. A write-back (an entry leaving RAM, or :meth:`TieredPromptCache.spill`) is queued only
   if ``admission`` admits it (default: :func:`~kvtrio.actors.policy.default_admission`);
   a refused entry is forgotten (a DROPPED departure). A flush (a graceful close) writes
   every hot entry regardless. ``wear`` counts bytes written, read and read back.
12. A pinned entry (:meth:`TieredPromptCache.pin`) is never a victim of either tier and
   never expires; its bytes count against the budgets, and each tier holds at most
   ``pin_limit`` pinned bytes. A pin is recorded in the cold store once the entry is on
   disk (``ColdStore.pin``, by the writer task): it survives a restart, and the entry
   is pinned again at the next open. ``insert(ttl=)``: the entry leaves both tiers ``ttl``
   seconds (trio's clock) after its last use in a tier; expiry is checked at each lookup
   and insert.
13. Every lookup is explained (:func:`~kvtrio.actors.misses.explain`, ``Fetched.
   explanation``) and counted by reason (``statistics().lookups``); every entry that
   leaves the index is noted in ``departures`` with why (evicted, dropped or refused,
   corrupt, unreachable, expired; not a superseded one), and forgotten there when it
   comes back. A lookup the shared store could not answer (its index lookup failed, or
   is paused after a failure) that finds nothing better to blame is a
   ``store-unreachable`` miss, not ``no-entry``: the store may hold a longer prefix.
14. ``prefetch(tokens)`` starts the cold load of the entry a lookup of ``tokens`` would
   reuse (``more_than=n``: only one reusing more than ``n`` tokens), in the background;
   the next lookup that picks that entry adopts the loaded
   caches instead of reading them again; a prefetch of an entry that a lookup is
   loading already starts nothing (one read of an entry at a time, whichever of the
   two asked first). Prefetched bytes held at once are capped by
   ``prefetch_budget`` (an entry found at open counts the bytes its store holds), softly:
   a prefetch alone always starts; a prefetch is cancelled when its entry leaves the index
   (evicted, removed, superseded) and dropped when no lookup takes it within
   ``prefetch_deadline`` seconds; ``statistics()`` counts the bytes used and wasted.
15. ``metrics_text()`` carries histograms of the seconds per cold load and per cold save
   (each one that completed: a failed one is a drop) and of the event loop's lag: a task
   started with the cache sleeps ``loop_lag_interval`` seconds on trio's clock and
   records how late it woke (:func:`~kvtrio.actors.metrics.watch_loop_lag`).

Costs (N entries, P prompt blocks, C candidates examined): ``open`` is O(N) in batches
of :data:`OPEN_BATCH` entries with a checkpoint between batches; a lookup is O(P + C)
(:class:`~kvtrio.actors.prefix.PrefixIndex`); an eviction is O(1) per victim plus its
removal's I/O.

Seams for callers that harden the boundary: every cold read goes through
:meth:`TieredPromptCache._load_cold` (content binding belongs there) and every cold
error is turned into a counted drop in :meth:`_load_cold` and :meth:`_write` (error
containment belongs there).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio
from kvtrio.actors.callerchecks import (
    DEFAULT_MIN_REUSE_TOKENS,
    check_open_arguments,
)
from kvtrio.actors.coldside import (
    DEFAULT_MIN_FREE_SHARE,
    DEFAULT_PENDING_BYTES,
    CacheRecord,
    ColdSideMixin,
)
from kvtrio.actors.coldstore import (
    CONVERSATIONS_META,
    SHARED_CANDIDATES,
    ColdEntryInfo,
    ColdStore,
    ColdTierStore,
    SharedColdStore,
    StoreResult,
)
from kvtrio.actors.lifecycle import ColdLedger, ColdState
from kvtrio.actors.metrics import LAG_BUCKETS, Histogram, watch_loop_lag
from kvtrio.actors.misses import Departures, MissCounter, MissReason
from kvtrio.actors.plainerrors import plain_errors
from kvtrio.actors.policy import (
    AdmissionPolicy,
    EvictionPolicy,
    PolicyKind,
    PrefillCost,
    default_admission,
    make_eviction_policy,
)
from kvtrio.actors.prefix import (
    DEFAULT_BLOCK_SIZE,
    MatchKind,
    ModelKey,
    PrefixIndex,
    PrefixMatch,
)
from kvtrio.actors.sharedlookup import SHARED_READS, SharedLookupMixin
from kvtrio.actors.tieredextras import PolicyFeaturesMixin
from kvtrio.actors.tieredload import IndexAndLoadMixin
from kvtrio.actors.tieredtypes import (
    DEFAULT_BYTES_PER_TOKEN,
    DEFAULT_LAG_INTERVAL,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_PREFETCH_DEADLINE,
    Fetched,
    Landing,
    OwnerLike,
    Tier,
    TieredStatistics,
    WritePolicy,
    _clone,
    _clone_trimmed,
    _describe,
    _describe_for_write,
    _Prefetch,
    _trim,
)
from kvtrio.actors.wear import WearAccount
from kvtrio.actors.writegate import WriteGate
from kvtrio.errors import InvalidInputError, ShuttingDown
from kvtrio.storage.writable import check_meta, check_token_ids

if TYPE_CHECKING:
    from kvtrio.actors.factory import open_tiered_cache

__all__ = [
    "CONVERSATIONS_META",
    "DEFAULT_MIN_FREE_SHARE",
    "DEFAULT_PENDING_BYTES",
    "SHARED_CANDIDATES",
    "SHARED_READS",
    "ColdEntryInfo",
    "ColdStore",
    "ColdTierStore",
    "Fetched",
    "Landing",
    "OwnerLike",
    "SharedColdStore",
    "StoreResult",
    "Tier",
    "TieredPromptCache",
    "TieredStatistics",
    "WritePolicy",
    "open_tiered_cache",
]


def __getattr__(name: str) -> Any:
    # The factory imports this module; re-exporting it lazily keeps the old import path.
    if name == "open_tiered_cache":
        from kvtrio.actors.factory import open_tiered_cache

        return open_tiered_cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@attrs.define(eq=False)
class TieredPromptCache(PolicyFeaturesMixin, IndexAndLoadMixin, SharedLookupMixin, ColdSideMixin):
    """The prompt cache a server embeds. Open with :meth:`open`."""

    owner: OwnerLike
    cold: ColdStore
    model: ModelKey
    hot_budget: int
    cold_budget: int
    policy: WritePolicy = WritePolicy.WRITE_BACK
    # Bytes to leave free on the cold tier's volume (None: DEFAULT_MIN_FREE_SHARE of it).
    min_free_bytes: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    # Seconds between catalogue refreshes from a shared cold store (None: none; a local
    # store, which this process alone writes, has an index authoritative after open).
    shared_refresh: float | None = None
    # Ask the shared cold store's prefix index on lookups without an exact entry (rule 8).
    shared_index: bool = False
    pending_budget: int = DEFAULT_PENDING_BYTES
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS
    # Issue 18: each tier's eviction order (rules 10-12), the write admission of entries
    # leaving RAM, the prefill speed both tiers value entries by, and the pinned bytes
    # each tier may hold.
    eviction: PolicyKind = PolicyKind.COST
    admission: AdmissionPolicy = attrs.field(factory=default_admission)
    prefill: PrefillCost = attrs.field(factory=PrefillCost)
    pin_limit: int = 0
    # Rule 14: bytes of prefetched cold loads held at once, and how long one waits to be
    # used (seconds, trio's clock).
    prefetch_budget: int = DEFAULT_PREFETCH_BYTES
    prefetch_deadline: float = DEFAULT_PREFETCH_DEADLINE
    # Rule 15: seconds between the event-loop lag probe's wake-ups (None: no probe).
    loop_lag_interval: float | None = DEFAULT_LAG_INTERVAL
    _nursery: trio.Nursery | None = None
    load_seconds: Histogram = attrs.field(init=False, factory=Histogram)
    save_seconds: Histogram = attrs.field(init=False, factory=Histogram)
    #: Called on the loop after each write lands: key, its store's start and end (perf_counter).
    on_written: Callable[[str, float, float], object] | None = attrs.field(init=False, default=None)
    loop_lag_seconds: Histogram = attrs.field(init=False, factory=lambda: Histogram(LAG_BUCKETS))
    hot_policy: EvictionPolicy = attrs.field(init=False)
    cold_policy: EvictionPolicy = attrs.field(init=False)
    wear: WearAccount = attrs.field(init=False, factory=WearAccount)
    departures: Departures = attrs.field(init=False)
    _misses: MissCounter = attrs.field(init=False, factory=MissCounter)
    _other_models: set[ModelKey] = attrs.field(init=False, factory=set)
    _prefetches: dict[str, _Prefetch] = attrs.field(init=False, factory=dict)
    _lookup_loads: dict[str, int] = attrs.field(init=False, factory=dict)
    _prefetch_bytes: int = attrs.field(init=False, default=0)
    _index: PrefixIndex = attrs.field(init=False)
    _records: dict[str, CacheRecord] = attrs.field(init=False, factory=dict)
    _hot_lru: OrderedDict[str, None] = attrs.field(init=False, factory=OrderedDict)
    _ledger: ColdLedger = attrs.field(init=False, factory=ColdLedger)
    _conversations: dict[str, str] = attrs.field(init=False, factory=dict)
    _key_tail: dict[str, trio.Event] = attrs.field(init=False, factory=dict)
    _hot_bytes: int = attrs.field(init=False, default=0)
    _touched: dict[str, float] = attrs.field(init=False, factory=dict)  # last uses to record
    _pins_to_record: dict[str, bool] = attrs.field(init=False, factory=dict)  # ... and pins
    _counts: dict[str, int] = attrs.field(init=False, factory=dict)
    _flush_unwritten: dict[str, Landing] = attrs.field(init=False, factory=dict)  # by key
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _busy: int = attrs.field(init=False, default=0)  # queued writes + background tasks
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)
    _gate: WriteGate = attrs.field(init=False, factory=WriteGate)  # cold side rule 5
    _refreshed_at: float = attrs.field(init=False, default=-math.inf)
    _refreshing: bool = attrs.field(init=False, default=False)
    _shared_paused_until: float = attrs.field(init=False, default=-math.inf)
    _shared_backoff: float = attrs.field(init=False, default=0.0)
    _bytes_per_token: int = attrs.field(init=False, default=DEFAULT_BYTES_PER_TOKEN)

    def __attrs_post_init__(self) -> None:
        self._index = PrefixIndex(block_size=self.block_size)
        self.departures = Departures(block_size=self.block_size)
        self.hot_policy = make_eviction_policy(
            self.eviction, prefill=self.prefill, pin_limit=self.pin_limit
        )
        self.cold_policy = make_eviction_policy(
            self.eviction, prefill=self.prefill, pin_limit=self.pin_limit
        )
        self._idle.set()

    @classmethod
    @plain_errors
    @asynccontextmanager
    async def open(
        cls,
        owner: OwnerLike,
        cold: ColdStore,
        model: ModelKey,
        *,
        hot_budget: int,
        cold_budget: int,
        policy: WritePolicy = WritePolicy.WRITE_BACK,
        min_free_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        flush_on_close: bool = True,
        shared_refresh: float | None = None,
        shared_index: bool = False,
        pending_budget: int = DEFAULT_PENDING_BYTES,
        min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS,
        eviction: PolicyKind = PolicyKind.COST,
        admission: AdmissionPolicy | None = None,
        prefill: PrefillCost | None = None,
        pin_limit: int = 0,
        loop_lag_interval: float | None = DEFAULT_LAG_INTERVAL,
    ) -> AsyncIterator[TieredPromptCache]:
        """Rebuild the index from ``cold`` and serve.

        ``min_reuse_tokens``: a cold match reusing fewer tokens is not loaded (a miss,
        counted in ``cold_skipped``): below it a load is slower than recomputing
        (:data:`~kvtrio.actors.callerchecks.DEFAULT_MIN_REUSE_TOKENS` says how that was
        measured). Hot matches are always used.

        ``shared_index``: ``cold.shared_lookups()`` gives a :class:`SharedColdStore` (Redis,
        shared with other hosts); a lookup with no exact entry first asks its prefix index for a
        longer prefix another host saved (rule 8). ``shared_refresh``: such a lookup also
        re-reads the store's whole catalogue, at most once per ``shared_refresh`` seconds
        (trio's clock): a fallback for entries saved without index registration.
        ``min_free_bytes``: the free-space floor of the cold tier's volume (rule 2);
        ``pending_budget``: the byte cap of pending write-backs (rule 3).
        ``eviction``: both tiers' eviction order (rule 10; ``PolicyKind.LRU`` for plain
        LRU); ``admission``: which entries leaving RAM are written back (rule 11; default
        :func:`~kvtrio.actors.policy.default_admission`); ``prefill``: the prefill speeds
        entries are valued by (fed by :meth:`observe_prefill`); ``pin_limit``: the bytes
        each tier may hold pinned (rule 12). ``loop_lag_interval``: the period of the
        event-loop lag probe (rule 15; None: none).

        Leaving the block normally writes the hot entries not yet on disk (with
        ``flush_on_close``, so a graceful restart keeps them) and waits for every write.
        """
        check_open_arguments(
            hot_budget=hot_budget,
            cold_budget=cold_budget,
            min_free_bytes=min_free_bytes,
            block_size=block_size,
            min_reuse_tokens=min_reuse_tokens,
            pending_budget=pending_budget,
            pin_limit=pin_limit,
            shared_refresh=shared_refresh,
        )
        self = cls(
            owner=owner,
            cold=cold,
            model=model,
            hot_budget=hot_budget,
            cold_budget=cold_budget,
            policy=policy,
            min_free_bytes=min_free_bytes,
            block_size=block_size,
            shared_refresh=shared_refresh,
            shared_index=shared_index,
            pending_budget=pending_budget,
            eviction=eviction,
            admission=admission if admission is not None else default_admission(),
            prefill=prefill if prefill is not None else PrefillCost(),
            pin_limit=pin_limit,
            min_reuse_tokens=min_reuse_tokens,
            loop_lag_interval=loop_lag_interval,
        )
        if shared_index and cold.shared_lookups() is None:
            raise TypeError("shared_index needs a cold store whose shared_lookups() is not None")
        await self._load_index()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._writer)
            if loop_lag_interval is not None:  # not a _spawn: it runs until the close
                nursery.start_soon(
                    functools.partial(
                        watch_loop_lag, self.loop_lag_seconds, interval=loop_lag_interval
                    )
                )
            try:
                yield self
                self._gate.close()  # nothing is held back any more (cold side rule 5)
                if flush_on_close:
                    await self.flush()
                await self.wait_writes_settled()
                await self._flush_touches()
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()  # the writer task: idle now, or abandoned

    # -- the server's API ------------------------------------------------------------

    async def fetch_nearest(
        self, tokens: Sequence[int], *, need_logits: bool = False, admit: bool = True
    ) -> Fetched:
        """The caches of the longest reusable prefix of ``tokens`` (see mlx-lm's
        ``LRUPromptCache.fetch_nearest_cache``), and the tokens still to process.

        An exact hit leaves no token to process. With ``need_logits``, at least one is
        left: the exact entry is trimmed by one token when it may be, else the lookup is
        made for ``tokens[:-1]``. ``admit=False``: a disk hit is handed over as loaded
        (trimmed in place, not cloned) and not promoted to RAM (a caller with a RAM tier
        of its own, such as kvtrio.serve's adapter).
        """
        query = tuple(map(int, tokens))
        await self._expire()
        unreachable = False  # the shared store could not be asked (rule 13)
        if self.shared_index or self.shared_refresh is not None:
            found = self._index.lookup(self.model, query)
            if found is None or found.kind is not MatchKind.EXACT:
                # Another host may have saved a better one (rule 8).
                if self.shared_index:
                    unreachable = not await self._find_shared(query, found)
                if self.shared_refresh is not None:
                    await self._refresh_shared()
        for _ in range(8):  # bounded: each retry forgot a bad cold entry
            match = self._index.lookup(self.model, query)
            if need_logits and match is not None and match.kind is MatchKind.EXACT:
                match = self._leave_one(match, query)
            if match is None:
                break
            record = self._records[match.entry.key]
            if record.hot is not None:
                caches = await self.owner.run(_clone_trimmed, record.hot, match.trim)
                self._touch(record)
                self._count("hits_hot")
                return Fetched(
                    caches,
                    query[match.reuse :],
                    Tier.HOT,
                    match,
                    self._explained(query, match, unreachable),
                )
            if trio.current_time() < self._shared_paused_until:
                unreachable = True
                break  # the shared store just failed: a miss, not another deadline spent
            if match.reuse < self.min_reuse_tokens:
                # Loading would be slower than recomputing so few tokens (bench reuse);
                # the best match is this one, so no other is worth it either.
                self._count("cold_skipped")
                break
            # The explanation's index walks (a few ms of hashing for a long prompt) run
            # before the load, overlapping its I/O, not after it on the request's path.
            explanation = self._explanation(query, match, unreachable)
            loaded = await self._take_prefetch(record)
            if loaded is None and self._owns(record) and record.cold.state is ColdState.DURABLE:
                loaded = await self._load_for_lookup(record)
            if loaded is None:
                continue
            self._count("hits_cold")
            record.uses += 1
            self._misses.add(explanation)
            if not admit:
                if match.trim:
                    await self.owner.run(_trim, loaded, match.trim)
                return Fetched(loaded, query[match.reuse :], Tier.COLD, match, explanation)
            caches = await self.owner.run(_clone_trimmed, loaded, match.trim)
            await self._admit_hot(record, loaded)
            return Fetched(caches, query[match.reuse :], Tier.COLD, match, explanation)
        self._count("misses")
        return Fetched(None, query, None, None, self._explained(query, None, unreachable))

    def _leave_one(self, exact: PrefixMatch, query: tuple[int, ...]) -> PrefixMatch | None:
        entry = exact.entry
        keep = len(query) - 1
        if entry.trimmable and keep >= max(1, entry.min_reusable_offset):
            return PrefixMatch(entry, MatchKind.LONGER, keep)
        return self._index.lookup(self.model, query[:-1]) if keep else None

    async def insert(
        self,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        conversation: str | None = None,
        meta: Mapping[str, str] | None = None,
        ttl: float | None = None,
    ) -> str:
        """Cache a copy of ``caches`` (which hold exactly ``tokens``); return its key.

        With ``conversation``, this entry supersedes that conversation's older entries
        whose tokens it extends (a checkpoint during a long generation, or a turn).

        Refused before anything is kept (the tier can only write what it can read back):
        token ids outside ``[0, 2**31)`` or not ints, a ``conversation`` that is not a
        str or ``meta`` that is not str -> str (InvalidInputError); a layer whose offset
        is not ``len(tokens)`` (CacheMismatchError); after the cache closed
        (ShuttingDown). ``ttl``: the entry leaves both tiers ``ttl`` seconds (trio's clock)
        after its last use in a tier, unless pinned (rule 12).
        """
        if self._nursery is None:
            raise ShuttingDown("tiered prompt cache is closed: insert refused")
        tokens = check_token_ids(tokens)
        if conversation is not None and not isinstance(conversation, str):
            raise InvalidInputError(
                f"conversation: expected a str, got {type(conversation).__name__}"
            )
        meta = check_meta(meta or {})
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 0
        ):
            raise InvalidInputError(f"ttl: expected a number >= 0, got {ttl!r}")
        await self._expire()
        nbytes, trimmable, min_offset = await self.owner.run(_describe, caches, len(tokens))
        if tokens:
            self._bytes_per_token = max(1, nbytes // len(tokens))
        clone = await self.owner.run(_clone, caches)
        entry = self._index.make_entry(
            self.model, tokens, trimmable=trimmable, min_reusable_offset=min_offset
        )
        record = self._records.get(entry.key)
        if record is not None and record.cold.state in (
            ColdState.EVICTING,
            ColdState.WRITING_DOOMED,
        ):
            # On its way out: it finishes leaving on its own (rule 7 orders its removal
            # before this key's next write); the new entry starts afresh.
            self._set_hot(record, None)
            self._records.pop(entry.key, None)
            record = None
        if record is None:
            record = self._records[entry.key] = CacheRecord.of(entry, nbytes)
        record.entry = entry
        record.ttl = ttl
        record.leaving = MissReason.EVICTED
        self._set_hot(record, clone, nbytes)
        if conversation is not None:
            await self._supersede(conversation, record)
        if self.policy is WritePolicy.WRITE_THROUGH and record.cold.state is ColdState.NONE:
            self._queue_write(record, clone, meta or {})
        await self._enforce_hot_budget(meta or {})
        return entry.key

    def peek(self, tokens: Sequence[int]) -> PrefixMatch | None:
        """What :meth:`fetch_nearest` would reuse for ``tokens`` now (either tier), loading
        nothing (the index alone; a shared store is not asked). Any thread: the index
        takes its own lock (:class:`~kvtrio.actors.prefix.PrefixIndex` rule 4)."""
        return self._index.lookup(self.model, tuple(map(int, tokens)))

    async def spill(
        self,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        meta: Mapping[str, str] | None = None,
        flush: bool = False,
    ) -> str:
        """Write ``caches`` (which hold exactly ``tokens``) to the cold tier without keeping
        a copy in RAM; return its key. The caller hands them over: it must not change them
        (a server's own RAM tier evicting an entry). Findable once durable (rule 3); an
        entry already on disk, or being written, is left as it is (a queued one made
        unsheddable by a ``flush``). The write waits with the others (rule 3's byte cap
        may shed it, counted; never a ``flush``'s, which sheds none). The
        admission policy decides whether it is written (rule 11), unless ``flush`` (a
        graceful close's write). Its arguments are checked as :meth:`insert` checks them."""
        if self._nursery is None:
            raise ShuttingDown("tiered prompt cache is closed: spill refused")
        tokens = check_token_ids(tokens)
        meta = check_meta(meta or {})
        # One owner job describes the caches and plans their write (the writer's
        # reservation is then worked out here, off the owner: cold side rule 2).
        plan = functools.partial(self.cold.write_plan, self.model, tokens, caches, meta)
        nbytes, trimmable, min_offset, planned = await self.owner.run(
            _describe_for_write, caches, len(tokens), plan
        )
        entry = self._index.make_entry(
            self.model, tokens, trimmable=trimmable, min_reusable_offset=min_offset
        )
        record = self._records.get(entry.key)
        if record is not None:
            state = record.cold.state
            if state in (ColdState.QUEUED, ColdState.WRITING, ColdState.DURABLE):
                record.cold.droppable &= not flush  # a flush's write is never shed
                return entry.key
            if state is not ColdState.NONE:  # on its way out: start afresh (rule 7 orders it)
                self._set_hot(record, None)
                self._records.pop(entry.key, None)
                record = None
        if record is None:
            record = self._records[entry.key] = CacheRecord.of(entry, nbytes)
        record.entry = entry
        if not flush and not self._admit(record, nbytes):  # rule 11: RAM's eviction
            record.leaving = MissReason.DROPPED
            self._set_hot(record, None)
            await trio.lowlevel.checkpoint()
            return entry.key
        if record.conversations:  # their meta was not in the plan: the writer plans it
            planned = None
        # A flush's write (a server's close hands over every RAM entry at once) is not shed
        # by rule 3's byte cap, as flush()'s are not: shedding one would lose it.
        self._queue_write(record, caches, meta, droppable=not flush, nbytes=nbytes, plan=planned)
        self._set_hot(record, None)  # the RAM copy, if any, goes: the caller keeps its own
        await trio.lowlevel.checkpoint()
        return entry.key

    async def wait_writes_settled(self) -> None:
        """Wait until every cold write queued or started so far has settled."""
        while self._busy:
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    async def flush(self) -> None:
        """Write every hot entry not yet on disk to the cold tier, and wait for it."""
        for key in list(self._hot_lru):
            record = self._records[key]
            if record.cold.state is ColdState.NONE and record.hot is not None:
                self._queue_write(record, record.hot, {}, droppable=False)
        with self._gate.hurry():
            await self.wait_writes_settled()

    def statistics(self) -> TieredStatistics:
        c = self._counts.get
        return TieredStatistics(
            hot_entries=len(self._hot_lru),
            hot_bytes=self._hot_bytes,
            hot_budget=self.hot_budget,
            cold_entries=self._ledger.durable_count(),
            cold_bytes=self._ledger.used,
            cold_budget=self.cold_budget,
            hits_hot=c("hits_hot", 0),
            hits_cold=c("hits_cold", 0),
            misses=c("misses", 0),
            bytes_written=c("bytes_written", 0),
            bytes_read=c("bytes_read", 0),
            bytes_deduplicated=c("bytes_deduplicated", 0),
            hot_evictions=c("hot_evictions", 0),
            cold_evictions=c("cold_evictions", 0),
            drops=c("drops", 0),
            superseded=c("superseded", 0),
            shared_lookups=c("shared_lookups", 0),
            shared_found=c("shared_found", 0),
            shared_vanished=c("shared_vanished", 0),
            shared_refreshes=c("shared_refreshes", 0),
            shared_errors=c("shared_errors", 0),
            cold_reserved=self._ledger.reserved,
            pending_writes=self._ledger.queued_count(),
            pending_bytes=self._ledger.queued_bytes,
            pending_budget=self.pending_budget,
            pending_dropped=c("pending_dropped", 0),
            unwritten_dropped=c("unwritten_dropped", 0),
            unwritten_cancelled=c("unwritten_cancelled", 0),
            unwritten_failed=c("unwritten_failed", 0),
            unwritten_refused=c("unwritten_refused", 0),
            unwritten_error=c("unwritten_error", 0),
            no_space_retries=c("no_space_retries", 0),
            cold_errors=c("cold_errors", 0),
            cold_skipped=c("cold_skipped", 0),
            pins_refused=c("pins_refused", 0),
            lookups=self._misses.statistics(),
            wear=self.wear.statistics(),
            hot_policy=self.hot_policy.statistics(),
            cold_policy=self.cold_policy.statistics(),
            prefetches=c("prefetches", 0),
            prefetch_used_bytes=c("prefetch_used_bytes", 0),
            prefetch_wasted_bytes=c("prefetch_wasted_bytes", 0),
            prefetch_bytes=self._prefetch_bytes,
        )

    def check(self) -> None:
        """Check every derived figure against the records (tests; O(entries)):
        AssertionError when one disagrees."""
        self._ledger.check()
        for key, record in self._records.items():
            assert record.entry.key == key
            assert record.hot is not None or record.cold.state is not ColdState.NONE, key
            assert (key in self._index) is record.findable, key
            assert (key in self._hot_lru) is (record.hot is not None), key
        assert all(key in self._records for key in self._index_keys())
        assert self._hot_bytes == sum(self._records[k].hot_bytes for k in self._hot_lru)
        durable = {k for k, r in self._records.items() if r.cold.state is ColdState.DURABLE}
        assert set(self._ledger.durable_keys()) == durable

    # -- internals: the index and the hot side ------------------------------------------

    def _index_keys(self) -> list[str]:
        return [entry.key for entry in self._index]

    def _set_hot(self, record: CacheRecord, caches: list[Any] | None, nbytes: int = 0) -> None:
        key = record.entry.key
        if record.hot is not None:
            self._hot_bytes -= record.hot_bytes
            self._hot_lru.pop(key, None)
            self.hot_policy.on_remove(key)
        record.hot, record.hot_bytes = caches, (nbytes if caches is not None else 0)
        if caches is not None:
            self._hot_bytes += nbytes
            self._hot_lru[key] = None
            self._enter_policy(self.hot_policy, record, self._hot_cost(record, nbytes))
        self._sync(record)

    # -- internals: the policies (rules 10-12) -------------------------------------------

    def _touch(self, record: CacheRecord) -> None:
        """Mark a hit as most recent in both tiers (it may have left them while cloning)."""
        key = record.entry.key
        record.uses += 1
        if key in self._hot_lru:
            self._hot_lru.move_to_end(key)
            self.hot_policy.on_hit(key)
        self._touch_cold(record)
