"""kvtrio.actors: the cold tier on the runtime: MLX owner, spill, writer, reader, tiers.

- :class:`MlxOwner` (:mod:`~kvtrio.actors.owner`): the one thread that touches MLX;
- :class:`TieredPromptCache` / :func:`open_tiered_cache` (:mod:`~kvtrio.actors.tiered`):
  RAM, then disk, then an optional shared store, with mlx-lm's lookup semantics;
- :class:`ColdTier` (:mod:`~kvtrio.actors.tier`): the cold tier alone (save, find, load);
- :class:`SpillActor` (:mod:`~kvtrio.actors.spill`): the byte-capped queue in front of
  the disk; :class:`Writer` / :class:`Reader`: CPU-only I/O in worker threads;
- :class:`PrefixIndex` / :class:`ModelKey` (:mod:`~kvtrio.actors.prefix`): the
  longest-prefix index over token-block hash chains.

Names load on first use (importing this package imports neither MLX nor trio).
See docs/actors.md and docs/tiered.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrio._lazy import lazy_exports

if TYPE_CHECKING:
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import MatchKind, ModelKey, PrefixIndex, PrefixMatch
    from kvtrio.actors.reader import Reader
    from kvtrio.actors.spill import SpillActor, SpillOutcome, SpillStatistics, SpillTicket
    from kvtrio.actors.testing import mlx_thread_guard
    from kvtrio.actors.tier import ColdTier, ColdTierStatistics, SaveResult, SaveTicket
    from kvtrio.actors.tiered import (
        ColdEntryInfo,
        Fetched,
        Tier,
        TieredPromptCache,
        TieredStatistics,
        WritePolicy,
        open_tiered_cache,
    )
    from kvtrio.actors.writer import Writer

_EXPORTS = {
    "ColdEntryInfo": "kvtrio.actors.tiered",
    "ColdTier": "kvtrio.actors.tier",
    "ColdTierStatistics": "kvtrio.actors.tier",
    "Fetched": "kvtrio.actors.tiered",
    "MatchKind": "kvtrio.actors.prefix",
    "MlxOwner": "kvtrio.actors.owner",
    "ModelKey": "kvtrio.actors.prefix",
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
    "WritePolicy": "kvtrio.actors.tiered",
    "Writer": "kvtrio.actors.writer",
    "mlx_thread_guard": "kvtrio.actors.testing",
    "open_tiered_cache": "kvtrio.actors.tiered",
}

__all__ = [
    "ColdEntryInfo",
    "ColdTier",
    "ColdTierStatistics",
    "Fetched",
    "MatchKind",
    "MlxOwner",
    "ModelKey",
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
    "WritePolicy",
    "Writer",
    "mlx_thread_guard",
    "open_tiered_cache",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
