"""What each part of :class:`~kvtrio.actors.tiered.TieredPromptCache` may use of the
whole: one declaration of the cache's fields and of the methods its mixins call on one
another, for the type checker only.

The cache is assembled from mixins by job (``coldside``: the cold tier's ledger, writes and
evictions; ``tieredload``: the index and cold loads; ``sharedlookup``: the shared index;
``tieredextras``: policies, prefetch, pins and metrics) over the fields that
``tiered.TieredPromptCache`` defines. Each mixin derives from :class:`CacheParts` when
type checking (and from ``object`` at run time), so mypy checks every mixin against the
same declarations: a field renamed in one place and not the other, or a method whose
signature drifts from its declaration, is a type error, and so is a cache class that
lacks one of the methods (the declared methods are abstract; the mixins provide them).
A plain class, not a ``typing.Protocol``: mypy cannot infer a protocol member that a
subclass assigns.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from kvtrio.actors.coldside import CacheRecord
    from kvtrio.actors.coldstore import ColdEntryInfo, ColdStore
    from kvtrio.actors.lifecycle import ColdEvent, ColdLedger, ColdState
    from kvtrio.actors.metrics import Histogram
    from kvtrio.actors.misses import Departures, MissCounter
    from kvtrio.actors.policy import (
        AdmissionPolicy,
        EntryCost,
        EvictionPolicy,
        PrefillCost,
    )
    from kvtrio.actors.prefix import ModelKey, PrefixIndex
    from kvtrio.actors.tieredtypes import (
        Landing,
        OwnerLike,
        TieredStatistics,
        WritePolicy,
        _Prefetch,
    )
    from kvtrio.actors.wear import WearAccount
    from kvtrio.actors.writegate import WriteGate

__all__ = ["CacheParts"]


class CacheParts(abc.ABC):
    """The cache's fields and the methods one mixin calls on another (see the module)."""

    # Configuration (attrs fields of TieredPromptCache).
    owner: OwnerLike
    cold: ColdStore
    model: ModelKey
    policy: WritePolicy
    hot_budget: int
    cold_budget: int
    min_free_bytes: int | None
    pending_budget: int
    shared_refresh: float | None
    prefetch_budget: int
    prefetch_deadline: float
    hot_policy: EvictionPolicy
    cold_policy: EvictionPolicy
    admission: AdmissionPolicy
    prefill: PrefillCost
    wear: WearAccount
    departures: Departures
    load_seconds: Histogram
    save_seconds: Histogram
    loop_lag_seconds: Histogram
    on_written: Callable[[str, float, float], object] | None

    # State.
    _nursery: trio.Nursery | None
    _index: PrefixIndex
    _records: dict[str, CacheRecord]
    _conversations: dict[str, str]
    _ledger: ColdLedger
    _hot_lru: OrderedDict[str, None]
    _hot_bytes: int
    _key_tail: dict[str, trio.Event]
    _counts: dict[str, int]
    _flush_unwritten: dict[str, Landing]
    _idle: trio.Event
    _busy: int
    _wake: trio.Event
    _gate: WriteGate
    _touched: dict[str, float]
    _pins_to_record: dict[str, bool]
    _other_models: set[ModelKey]
    _bytes_per_token: int
    _misses: MissCounter
    _prefetch_bytes: int
    _prefetches: dict[str, _Prefetch]
    _lookup_loads: dict[str, int]
    _refreshed_at: float
    _refreshing: bool
    _shared_paused_until: float
    _shared_backoff: float

    # Methods one part calls on another.
    @abc.abstractmethod
    def statistics(self) -> TieredStatistics: ...
    @abc.abstractmethod
    def _count(self, name: str, n: int = 1) -> None: ...
    @abc.abstractmethod
    def _admit(self, record: CacheRecord, nbytes: int) -> bool: ...
    @abc.abstractmethod
    def _apply(self, record: CacheRecord, event: ColdEvent, *, index: bool = True) -> ColdState: ...
    @abc.abstractmethod
    def _sync(self, record: CacheRecord) -> None: ...
    @abc.abstractmethod
    def _set_hot(self, record: CacheRecord, caches: list[Any] | None, nbytes: int = 0) -> None: ...
    @abc.abstractmethod
    def _touch_cold(self, record: CacheRecord) -> None: ...
    @abc.abstractmethod
    def _evict(self, record: CacheRecord) -> None: ...
    @abc.abstractmethod
    def _queue_write(
        self,
        record: CacheRecord,
        caches: list[Any],
        meta: Mapping[str, str],
        *,
        droppable: bool = True,
        nbytes: int | None = None,
        plan: object | None = None,
    ) -> None: ...
    @abc.abstractmethod
    def _cancel_pending(self, record: CacheRecord) -> None: ...
    @abc.abstractmethod
    def _spawn_removal(self, record: CacheRecord) -> None: ...
    @abc.abstractmethod
    async def _remove(self, record: CacheRecord) -> None: ...
    @abc.abstractmethod
    async def _load_cold(self, record: CacheRecord) -> list[Any] | None: ...
    @abc.abstractmethod
    def _pause_shared(self) -> None: ...
    @abc.abstractmethod
    def _note_pin(self, key: str, pinned: bool) -> None: ...
    @abc.abstractmethod
    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None: ...
    @abc.abstractmethod
    def _cold_cost(self, record: CacheRecord) -> EntryCost: ...
    @abc.abstractmethod
    def _enter_policy(
        self, policy: EvictionPolicy, record: CacheRecord, cost: EntryCost
    ) -> None: ...
    @abc.abstractmethod
    def _prefetch_gone(self, key: str) -> None: ...
    @abc.abstractmethod
    async def _add_cold_entries(self, infos: Iterable[ColdEntryInfo]) -> None: ...
