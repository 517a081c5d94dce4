"""Issue 18's parts of :class:`~kvtrio.actors.tiered.TieredPromptCache`: prefetch, pins,
the policies' valuation of entries (rules 10-14), TTL expiry, explained misses and the
Prometheus text. A mixin: its methods run on the cache (``self`` is the cache)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio
from kvtrio.actors.coldside import (
    CacheRecord,
)
from kvtrio.actors.lifecycle import ColdState
from kvtrio.actors.metrics import tiered_metrics
from kvtrio.actors.misses import (
    Explanation,
    MissReason,
    explain,
)
from kvtrio.actors.policy import (
    AdmissionCandidate,
    EntryCost,
    EvictionPolicy,
)
from kvtrio.actors.prefix import (
    MatchKind,
    ModelKey,
    PrefixMatch,
)
from kvtrio.actors.tieredtypes import (
    RELOAD_BYTES_PER_SECOND,
    WritePolicy,
    _Prefetch,
)
from kvtrio.errors import (
    CacheMissError,
    PinLimitError,
)

# (tokens, bytes per token, model) -> the cost of an entry found at open (see _cold_cost).
_FOUND_COSTS: dict[tuple[int, int, ModelKey], EntryCost] = {}

if TYPE_CHECKING:
    from kvtrio.actors.tieredparts import CacheParts
else:
    CacheParts = object

__all__ = ["PolicyFeaturesMixin"]


class PolicyFeaturesMixin(CacheParts):
    """Prefetch, pins, valuation, expiry, explanations and metrics of the tiered cache."""

    def prefetch(self, tokens: Sequence[int], *, more_than: int = 0) -> bool:
        """Start loading, off the request path, the disk entry that :meth:`fetch_nearest`
        would reuse for ``tokens`` (rule 14); the lookup then adopts it. False (nothing
        started) when the best match is hot, none is on disk, it reuses no more than
        ``more_than`` tokens (a caller's RAM serves as much: one index lookup decides
        both), one is already loading, or the prefetched bytes would exceed
        ``prefetch_budget``."""
        match = self._index.lookup(self.model, tuple(map(int, tokens)))
        if match is None or match.reuse <= more_than:
            return False
        record = self._records[match.entry.key]
        key = record.entry.key
        if record.hot is not None or record.cold.state is not ColdState.DURABLE:
            return False
        if key in self._prefetches or key in self._lookup_loads:
            return False  # one read of an entry at a time (a lookup's own, or a prefetch)
        nbytes = record.cold.nbytes or self._stored_bytes(record)
        # Soft by one (rule 14): a cap that refused one prefetch alone would refuse the
        # first turn of a long conversation, whose lookup then loads it anyway, later.
        if self._prefetch_bytes and self._prefetch_bytes + nbytes > self.prefetch_budget:
            self._count("prefetches_refused")
            return False
        pending = self._prefetches[key] = _Prefetch(record, nbytes, trio.CancelScope())
        self._prefetch_bytes += nbytes
        self._count("prefetches")
        if self._nursery is None:
            raise RuntimeError("TieredPromptCache is not open")
        # Not a _spawn: an unused prefetch must not hold wait_writes_settled (or a close)
        # until its deadline; the close's cancel ends it.
        self._nursery.start_soon(self._run_prefetch, pending)
        return True

    def recent_entries(self, max_bytes: int, max_entries: int) -> list[tuple[tuple[int, ...], int]]:
        """The token sequences and stored bytes of this cache's model's entries on disk,
        most recently used first (the order survives a restart: the store records each
        use), as many as fit in ``max_bytes`` and ``max_entries``: what a server loads
        back into RAM while idle after a start (kvtrio.serve.restore). The first entry
        that does not fit ends the list; entries in RAM here, or of other models, are
        passed over. Loads nothing."""
        out: list[tuple[tuple[int, ...], int]] = []
        total = 0
        for side in self._ledger.durable_newest_first():
            if len(out) >= max_entries:
                break
            record = self._records.get(side.key)
            if record is None or record.hot is not None or record.entry.model != self.model:
                continue
            nbytes = record.cold.nbytes or self._stored_bytes(record)
            if total + nbytes > max_bytes:
                break
            total += nbytes
            out.append((record.entry.tokens, nbytes))
        return out

    def _stored_bytes(self, record: CacheRecord) -> int:
        """A DURABLE entry's tensor bytes as its store counts them (an entry found at open
        has no count of its own), or where the store does not know them the estimate of
        this model's bytes per token."""
        stored = self.cold.entry_bytes(record.entry.key)
        return stored if stored else record.entry.length * self._bytes_per_token

    async def _run_prefetch(self, pending: _Prefetch) -> None:
        """Load, then hold the caches until a lookup takes them or the deadline passes."""
        key = pending.record.entry.key
        try:
            with pending.scope:
                pending.caches = await self._load_cold(pending.record)
                pending.loaded.set()
                if pending.caches is not None:
                    with trio.move_on_after(self.prefetch_deadline):
                        await pending.taken.wait()
        finally:
            pending.loaded.set()
            if self._prefetches.get(key) is pending:
                del self._prefetches[key]
            self._prefetch_bytes -= pending.nbytes
            if not pending.taken.is_set() and pending.caches is not None:
                pending.caches = None  # loaded, never used: wasted
                self._count("prefetch_wasted_bytes", pending.nbytes)

    async def _load_for_lookup(self, record: CacheRecord) -> list[Any] | None:
        """A lookup's own load of ``record`` (no prefetch of it was in flight). A prefetch
        asked for while it runs (an arrival's, whose task the loop ran after the lookup's)
        starts no second read of the same entry (:meth:`prefetch`)."""
        key = record.entry.key
        self._lookup_loads[key] = self._lookup_loads.get(key, 0) + 1
        try:
            return await self._load_cold(record)
        finally:
            left = self._lookup_loads.pop(key) - 1
            if left:
                self._lookup_loads[key] = left

    async def _take_prefetch(self, record: CacheRecord) -> list[Any] | None:
        """The caches a prefetch of ``record`` loaded (waiting for it if it is in flight),
        or None when there is none (or it failed)."""
        pending = self._prefetches.get(record.entry.key)
        if pending is None or pending.record is not record:
            return None
        await pending.loaded.wait()
        caches = pending.caches
        if caches is None or pending.taken.is_set():
            return None
        pending.taken.set()
        self._count("prefetch_used_bytes", pending.nbytes)
        return caches

    def _prefetch_gone(self, key: str) -> None:
        """Rule 14: the entry left the index (or is hot again): a prefetch of it is
        superseded (cancelled; its bytes counted as wasted)."""
        pending = self._prefetches.get(key)
        if pending is not None and not pending.taken.is_set():
            pending.scope.cancel()

    def _explained(
        self, query: tuple[int, ...], match: PrefixMatch | None, unreachable: bool = False
    ) -> Explanation:
        """Why this lookup did not reuse more (kvtrio.actors.misses), counted.
        ``unreachable``: the shared store could not be asked, so it, not the absence of
        an entry, is why (rule 13)."""
        explanation = self._explanation(query, match, unreachable)
        self._misses.add(explanation)
        return explanation

    def _explanation(
        self, query: tuple[int, ...], match: PrefixMatch | None, unreachable: bool = False
    ) -> Explanation:
        """:meth:`_explained`, not counted (a cold hit computes it while its load is in
        flight and counts it once the load has succeeded)."""
        explanation = explain(
            self._index,
            self.model,
            query,
            match,
            departures=self.departures,
            other_models=self._other_models,
        )
        if unreachable and explanation.reason is MissReason.NO_ENTRY:
            explanation = attrs.evolve(explanation, reason=MissReason.STORE_UNREACHABLE)
        return explanation

    def metrics_text(self) -> str:
        """Prometheus text (kvtrio.actors.metrics, format 0.0.4) of :meth:`statistics`:
        hits and misses per tier and reason, bytes, wear, pins and TTL expiries, evictions,
        the cold write queue's depth, and histograms of the seconds per cold load and
        save (those that completed) and of the event loop's lag (rule 15; docs/metrics.md
        names every family)."""
        stats = self.statistics()
        assert stats.hot_policy is not None and stats.cold_policy is not None
        return tiered_metrics(
            stats,
            misses=stats.lookups,
            wear=stats.wear,
            eviction={"hot": stats.hot_policy, "cold": stats.cold_policy},
            queue_depth=stats.pending_writes,
            prefetch=(stats.prefetches, stats.prefetch_used_bytes, stats.prefetch_wasted_bytes),
            load_seconds=self.load_seconds.statistics(),
            save_seconds=self.save_seconds.statistics(),
            loop_lag_seconds=self.loop_lag_seconds.statistics(),
        )

    def observe_prefill(self, start: int, end: int, seconds: float) -> None:
        """A prefill of this model's tokens ``start .. end`` (``start`` reused from the
        cache) took ``seconds``: the cost-aware policies value entries by these
        measurements (:class:`~kvtrio.actors.policy.PrefillCost`)."""
        self.prefill.observe(self.model, start, end, seconds)

    def pin(self, tokens: Sequence[int]) -> str:
        """Never evict or expire the entry of exactly ``tokens`` from either tier (rule 12);
        return its key. CacheMissError if there is none; PinLimitError (nothing pinned) if
        a tier's pinned bytes would exceed ``pin_limit``."""
        record = self._exact(tokens)
        key = record.entry.key
        done: list[EvictionPolicy] = []
        try:
            for policy in (self.hot_policy, self.cold_policy):
                if key in policy and not policy.is_pinned(key):
                    policy.pin(key)
                    done.append(policy)
        except PinLimitError:
            for policy in done:
                policy.unpin(key)
            raise
        record.pinned = True
        self._record_pin(record)
        return key

    def unpin(self, tokens: Sequence[int]) -> None:
        """Make the entry of exactly ``tokens`` evictable again (absent: nothing)."""
        match = self._index.lookup(self.model, tuple(map(int, tokens)))
        if match is None or match.kind is not MatchKind.EXACT:
            return
        record = self._records[match.entry.key]
        record.pinned = False
        self.hot_policy.unpin(record.entry.key)
        self.cold_policy.unpin(record.entry.key)
        self._record_pin(record)

    def _record_pin(self, record: CacheRecord) -> None:
        """Have the writer task record ``record``'s pin in the cold store, so it survives a
        restart (rule 12). An entry not on disk yet is recorded once its write is."""
        if record.cold.state is ColdState.DURABLE:
            self._note_pin(record.entry.key, record.pinned)

    def _exact(self, tokens: Sequence[int]) -> CacheRecord:
        query = tuple(map(int, tokens))
        match = self._index.lookup(self.model, query)
        if match is None or match.kind is not MatchKind.EXACT:
            raise CacheMissError(f"no entry of exactly these {len(query)} tokens")
        return self._records[match.entry.key]

    def _enter_policy(
        self, policy: EvictionPolicy, record: CacheRecord, cost: EntryCost
    ) -> None:
        """``record`` arrived in ``policy``'s tier: with its TTL, and pinned if it is (a
        tier whose pin limit it would exceed holds it unpinned, counted)."""
        key = record.entry.key
        policy.on_insert(key, cost, ttl=record.ttl)
        if record.pinned and not policy.is_pinned(key):
            try:
                policy.pin(key)
            except PinLimitError:
                self._count("pins_refused")

    def _hot_cost(self, record: CacheRecord, nbytes: int) -> EntryCost:
        """What losing a hot entry costs: its recompute, or its reload when the disk holds
        it or will take it (write-through, or the admission would write it back)."""
        tokens = record.entry.length
        reload: float | None = None
        if (
            record.cold.state is not ColdState.NONE
            or self.policy is WritePolicy.WRITE_THROUGH
            or self.admission.would_admit(self._candidate(record, nbytes))
        ):
            reload = nbytes / RELOAD_BYTES_PER_SECOND
        return EntryCost(nbytes, tokens, self.model, reload)

    def _cold_cost(self, record: CacheRecord) -> EntryCost:
        """What losing a DURABLE entry costs: its recompute. An entry found at open has no
        byte count: this model's last bytes per token stand in, and entries of one length
        share one (immutable) cost, one object fewer per entry for the collector to
        traverse (docs/tiered.md, memory per entry)."""
        tokens = record.entry.length
        if record.cold.nbytes:
            return EntryCost(record.cold.nbytes, tokens, record.entry.model)
        shared = (tokens, self._bytes_per_token, record.entry.model)
        cost = _FOUND_COSTS.get(shared)
        if cost is None:
            if len(_FOUND_COSTS) >= 4096:  # bounded, whatever the lengths
                _FOUND_COSTS.clear()
            cost = _FOUND_COSTS[shared] = EntryCost(
                tokens * self._bytes_per_token, tokens, record.entry.model
            )
        return cost

    def _candidate(self, record: CacheRecord, nbytes: int) -> AdmissionCandidate:
        tokens = record.entry.length
        return AdmissionCandidate(
            record.entry.key,
            tokens,
            nbytes,
            record.uses,
            self.prefill.seconds(self.model, tokens),
        )

    def _admit(self, record: CacheRecord, nbytes: int) -> bool:
        """Rule 11: whether a write-back of ``record`` leaving RAM is queued (counted)."""
        candidate = self._candidate(record, nbytes)
        admitted = self.admission.admit(candidate)
        self.wear.on_admission(candidate, admitted)
        return admitted

    async def _expire(self) -> None:
        """Rule 12: entries whose TTL ran out in either tier leave both."""
        expired = self.hot_policy.expire() + self.cold_policy.expire()
        for key in expired:
            record = self._records.get(key)
            if record is None or record.pinned:
                continue
            self._count("expired")
            record.leaving = MissReason.EXPIRED
            await self._remove(record)
