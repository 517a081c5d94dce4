"""kvtrio.actors: the cold tier on the runtime: MLX owner, spill, writer, reader, tiers.

- :class:`MlxOwner` (:mod:`~kvtrio.actors.owner`): the one thread that touches MLX;
- :class:`TieredPromptCache` / :func:`open_tiered_cache` (:mod:`~kvtrio.actors.tiered`):
  RAM, then disk, then an optional shared store, with mlx-lm's lookup semantics;
- :class:`ColdTier` (:mod:`~kvtrio.actors.tier`): the cold tier alone (save, find, load);
- :class:`SpillActor` (:mod:`~kvtrio.actors.spill`): the byte-capped queue in front of
  the disk; :class:`Writer` / :class:`Reader`: CPU-only I/O in worker threads;
- :class:`PrefixIndex` / :class:`ModelKey` (:mod:`~kvtrio.actors.prefix`): the
  longest-prefix index over token-block hash chains;
- eviction and write admission (:mod:`~kvtrio.actors.policy`), explained misses
  (:mod:`~kvtrio.actors.misses`) and Prometheus text (:mod:`~kvtrio.actors.metrics`):
  docs/metrics.md.

Names load on first use (importing this package imports neither MLX nor trio).
See docs/actors.md and docs/tiered.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrio._lazy import lazy_exports

if TYPE_CHECKING:
    from kvtrio.actors.metrics import Histogram, tiered_metrics
    from kvtrio.actors.misses import Departures, Explanation, MissReason, explain
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.policy import (
        AdmissionPolicy,
        EvictionPolicy,
        GreedyDualPolicy,
        LruPolicy,
        PolicyKind,
        PrefillCost,
        default_admission,
        make_eviction_policy,
    )
    from kvtrio.actors.prefix import MatchKind, ModelKey, PrefixIndex, PrefixMatch
    from kvtrio.actors.reader import Reader
    from kvtrio.actors.spill import SpillActor, SpillOutcome, SpillStatistics, SpillTicket
    from kvtrio.actors.testing import mlx_thread_guard
    from kvtrio.actors.tier import ColdTier, ColdTierStatistics, SaveResult, SaveTicket
    from kvtrio.actors.tiered import (
        ColdEntryInfo,
        Fetched,
        Landing,
        Tier,
        TieredPromptCache,
        TieredStatistics,
        WritePolicy,
        open_tiered_cache,
    )
    from kvtrio.actors.wear import WearAccount
    from kvtrio.actors.writer import Writer

_EXPORTS = {
    "AdmissionPolicy": "kvtrio.actors.policy",
    "ColdEntryInfo": "kvtrio.actors.tiered",
    "ColdTier": "kvtrio.actors.tier",
    "ColdTierStatistics": "kvtrio.actors.tier",
    "Departures": "kvtrio.actors.misses",
    "EvictionPolicy": "kvtrio.actors.policy",
    "Explanation": "kvtrio.actors.misses",
    "Fetched": "kvtrio.actors.tiered",
    "Landing": "kvtrio.actors.tiered",
    "GreedyDualPolicy": "kvtrio.actors.policy",
    "Histogram": "kvtrio.actors.metrics",
    "LruPolicy": "kvtrio.actors.policy",
    "MatchKind": "kvtrio.actors.prefix",
    "MissReason": "kvtrio.actors.misses",
    "MlxOwner": "kvtrio.actors.owner",
    "ModelKey": "kvtrio.actors.prefix",
    "PolicyKind": "kvtrio.actors.policy",
    "PrefillCost": "kvtrio.actors.policy",
    "PrefixIndex": "kvtrio.actors.prefix",
    "PrefixMatch": "kvtrio.actors.prefix",
    "Reader": "kvtrio.actors.reader",
    "SaveResult": "kvtrio.actors.tier",
    "SaveTicket": "kvtrio.actors.tier",
    "SpillActor": "kvtrio.actors.spill",
    "SpillOutcome": "kvtrio.actors.spill",
    "SpillStatistics": "kvtrio.actors.spill",
    "SpillTicket": "kvtrio.actors.spill",
    "Tier": "kvtrio.actors.tiered",
    "TieredPromptCache": "kvtrio.actors.tiered",
    "TieredStatistics": "kvtrio.actors.tiered",
    "WearAccount": "kvtrio.actors.wear",
    "WritePolicy": "kvtrio.actors.tiered",
    "Writer": "kvtrio.actors.writer",
    "default_admission": "kvtrio.actors.policy",
    "explain": "kvtrio.actors.misses",
    "make_eviction_policy": "kvtrio.actors.policy",
    "mlx_thread_guard": "kvtrio.actors.testing",
    "open_tiered_cache": "kvtrio.actors.tiered",
    "tiered_metrics": "kvtrio.actors.metrics",
}

__all__ = [
    "AdmissionPolicy",
    "ColdEntryInfo",
    "ColdTier",
    "ColdTierStatistics",
    "Departures",
    "EvictionPolicy",
    "Explanation",
    "Fetched",
    "GreedyDualPolicy",
    "Histogram",
    "Landing",
    "LruPolicy",
    "MatchKind",
    "MissReason",
    "MlxOwner",
    "ModelKey",
    "PolicyKind",
    "PrefillCost",
    "PrefixIndex",
    "PrefixMatch",
    "Reader",
    "SaveResult",
    "SaveTicket",
    "SpillActor",
    "SpillOutcome",
    "SpillStatistics",
    "SpillTicket",
    "Tier",
    "TieredPromptCache",
    "TieredStatistics",
    "WearAccount",
    "WritePolicy",
    "Writer",
    "default_admission",
    "explain",
    "make_eviction_policy",
    "mlx_thread_guard",
    "open_tiered_cache",
    "tiered_metrics",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
