"""The records and helpers of :class:`~kvtrio.actors.tiered.TieredPromptCache`: its
policies' names and defaults, what a lookup returns, its statistics, and the owner-thread
steps it runs on caches."""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import trio
from kvtrio.actors.callerchecks import (
    check_held_tokens,
)
from kvtrio.actors.coldstore import (
    ColdEntryInfo,
)
from kvtrio.actors.misses import (
    Explanation,
    MissStatistics,
)
from kvtrio.actors.policy import EvictionStatistics
from kvtrio.actors.prefix import (
    PrefixMatch,
)
from kvtrio.actors.wear import WearStatistics

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "DEFAULT_PREFETCH_BYTES",
    "DEFAULT_LAG_INTERVAL",
    "DEFAULT_PREFETCH_DEADLINE",
    "Fetched",
    "Landing",
    "OPEN_BATCH",
    "OwnerLike",
    "RELOAD_BYTES_PER_SECOND",
    "Tier",
    "TieredStatistics",
    "WritePolicy",
]


# Issue 18: the disk's read speed a hot entry's reload is valued at (bytes per second), and
# the bytes per token assumed for entries found at open until an insert measures them
# (Llama-3-8B in fp16), as kvtrio bench policy does.
RELOAD_BYTES_PER_SECOND = 2e9


# Bytes per token of the cache's model until open measures a found entry's stored bytes
# (ColdStore.entry_bytes) or an insert measures its caches: what a found entry is valued at.
DEFAULT_BYTES_PER_TOKEN = 128 << 10


# Rule 14's defaults: prefetched bytes held at once, and seconds a prefetch waits for use.
DEFAULT_PREFETCH_BYTES = 2 << 30


DEFAULT_PREFETCH_DEADLINE = 30.0
# Seconds between the event-loop lag probe's wake-ups (20 a second).
DEFAULT_LAG_INTERVAL = 0.05


# Entries indexed per step of open, between checkpoints (rule: no long loop stall).
OPEN_BATCH = 128


class WritePolicy(enum.Enum):
    """When an entry is written to the cold tier."""

    WRITE_BACK = "write-back"  # when it is evicted from RAM
    WRITE_THROUGH = "write-through"  # at insert


class Landing(enum.Enum):
    """Where a flush's write stands (:meth:`TieredPromptCache.landing`): on disk, on its
    way, or not written and why (the ``unwritten_*`` counters' reasons)."""

    DURABLE = "on disk"
    QUEUED = "queued"  # waiting for the writer
    WRITING = "writing"  # the write in flight
    SHED = "shed"  # by the tier's own queue
    CANCELLED = "cancelled"
    FAILED = "failed"
    REFUSED = "refused"  # by the tier (closing)
    DISK_ERROR = "disk error"
    GONE = "gone"  # on disk once, since evicted by the cold budget or removed

    @classmethod
    def of_unwritten(cls, why: str | None) -> Landing:
        """The landing of a write that did not land, from ``StoreResult.unwritten``."""
        return _UNWRITTEN.get(why or "failed", cls.FAILED)


_UNWRITTEN = {
    "dropped": Landing.SHED,
    "cancelled": Landing.CANCELLED,
    "failed": Landing.FAILED,
    "refused": Landing.REFUSED,
    "error": Landing.DISK_ERROR,
}


class Tier(enum.Enum):
    """Where a hit came from."""

    HOT = "hot"
    COLD = "cold"


class OwnerLike(Protocol):
    """The MLX owner: runs ``fn(*args)`` on the one thread that may touch MLX."""

    async def run(self, fn: Any, *args: Any) -> Any: ...


@attrs.frozen
class Fetched:
    """What ``fetch_nearest`` found: caches to continue from and the tokens still to run.

    ``caches`` is None on a miss (then ``remaining`` is the whole prompt).
    """

    caches: list[Any] | None
    remaining: tuple[int, ...]
    tier: Tier | None
    match: PrefixMatch | None
    # Why it did not reuse more (kvtrio.actors.misses; None only for a caller-made one).
    explanation: Explanation | None = None

    @property
    def reused(self) -> int:
        return self.match.reuse if self.match is not None else 0


@attrs.define(eq=False)
class _Prefetch:
    """A cold load started ahead of its lookup (rule 14)."""

    record: Any  # CacheRecord
    nbytes: int
    scope: trio.CancelScope
    loaded: trio.Event = attrs.field(factory=trio.Event)
    taken: trio.Event = attrs.field(factory=trio.Event)
    caches: list[Any] | None = None


@attrs.frozen
class TieredStatistics:
    """Counters of a tiered prompt cache."""

    hot_entries: int
    hot_bytes: int
    hot_budget: int
    cold_entries: int
    cold_bytes: int
    cold_budget: int
    hits_hot: int
    hits_cold: int
    misses: int
    bytes_written: int
    bytes_read: int
    bytes_deduplicated: int
    hot_evictions: int
    cold_evictions: int
    drops: int
    superseded: int
    # Shared cold store (rule 8): prefix-index round trips, entries found through them,
    # index entries whose manifest was gone, and whole-catalogue re-reads (the fallback).
    shared_lookups: int = 0
    shared_found: int = 0
    shared_vanished: int = 0
    shared_refreshes: int = 0
    shared_errors: int = 0  # index lookups that failed (store out of reach): then paused
    # The ledger (rule 2) and the pending write-backs (rule 3).
    cold_reserved: int = 0  # bytes reserved by writes in flight
    pending_writes: int = 0
    pending_bytes: int = 0
    pending_budget: int = 0
    pending_dropped: int = 0  # pending write-backs shed by the byte cap (also in drops)
    # Writes begun that did not land (also in drops), by why (StoreResult.unwritten): shed
    # by the tier's own queue, cancelled (superseded, cut by its shutdown grace), failed,
    # refused by the tier (closing), or an OSError (also in cold_errors).
    unwritten_dropped: int = 0
    unwritten_cancelled: int = 0
    unwritten_failed: int = 0
    unwritten_refused: int = 0
    unwritten_error: int = 0
    no_space_retries: int = 0  # writes that found the volume full, evicted and retried
    # OSErrors around the cold tier (EIO on a load, a block replaced by a directory, ...),
    # each turned into a miss or a dropped write: a request never fails for the disk.
    cold_errors: int = 0
    # Cold matches reusing fewer than min_reuse_tokens tokens, not loaded (a miss).
    cold_skipped: int = 0
    # Pinned entries a tier holds unpinned: pinning them would pass its pin_limit (one
    # pinned before a restart, or promoted to RAM).
    pins_refused: int = 0
    # Issue 18: lookups by reason, disk wear, and each tier's eviction policy (pins, TTLs).
    lookups: MissStatistics | None = None
    wear: WearStatistics | None = None
    hot_policy: EvictionStatistics | None = None
    cold_policy: EvictionStatistics | None = None
    # Rule 14: prefetches started, and the bytes they loaded that a lookup used or that
    # were dropped (superseded, unused by the deadline, or the load failed).
    prefetches: int = 0
    prefetch_used_bytes: int = 0
    prefetch_wasted_bytes: int = 0
    prefetch_bytes: int = 0  # held or loading now


def _by_mtime(info: ColdEntryInfo) -> float:
    return info.mtime


def _cache_nbytes(caches: Sequence[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


def _min_reusable_offset(caches: Sequence[Any]) -> int:
    return max([0, *(int(getattr(c, "min_reusable_offset", 0) or 0) for c in caches)])


def _clone(caches: list[Any]) -> list[Any]:
    """Owner thread: an independent deep copy of mlx-lm caches."""
    return copy.deepcopy(caches)


def _clone_trimmed(caches: list[Any], trim: int) -> list[Any]:
    """Owner thread: a deep copy, trimmed back by ``trim`` tokens."""
    from mlx_lm.models.cache import trim_prompt_cache

    out = copy.deepcopy(caches)
    if trim:
        trim_prompt_cache(out, trim)
    return out


def _trim(caches: list[Any], trim: int) -> None:
    """Owner thread: trim ``caches`` back by ``trim`` tokens, in place."""
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(caches, trim)


def _describe(caches: list[Any], n_tokens: int) -> tuple[int, bool, int]:
    """Owner thread: bytes, trimmability and minimum reusable offset of ``caches``, after
    checking that every layer holds ``n_tokens`` tokens (CacheMismatchError)."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    check_held_tokens(caches, n_tokens)
    return _cache_nbytes(caches), bool(can_trim_prompt_cache(caches)), _min_reusable_offset(caches)


def _describe_for_write(
    caches: list[Any], n_tokens: int, plan: Callable[[], object]
) -> tuple[int, bool, int, object | None]:
    """Owner thread, one job for a spill: :func:`_describe`, and the write's plan
    (``plan()``: the store's ``write_plan``, from the caches' shapes and dtypes), None when
    planning fails (the writer then plans again, and the write fails the same way)."""
    from kvtrio.errors import KvtrioError

    nbytes, trimmable, min_offset = _describe(caches, n_tokens)
    try:
        planned = plan()
    except (KvtrioError, ValueError, TypeError):
        planned = None
    return nbytes, trimmable, min_offset, planned
