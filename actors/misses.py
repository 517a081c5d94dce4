"""Explained misses: why a lookup did not reuse more of the prompt.

A user whose prompt missed the cache asks why (mlx-lm #1802, vllm-mlx #714). Every lookup
of the tiered cache can be explained by :func:`explain`: how many tokens it reused, and
the :class:`MissReason` it did not reuse more (None when nothing cached could have done
better). :class:`MissCounter` counts the reasons for ``statistics()`` and the metrics.

Theory of operation
-------------------
1. A lookup's match (or None) comes from the cache's :class:`~kvtrio.actors.prefix.
   PrefixIndex`. The explanation looks for what would have reused more, in three places:
   the live index (a longer entry that rule 3 of the index refused: not trimmable, or
   below its minimum reusable offset), the entries that recently left the cache
   (:class:`Departures`: evicted, expired, dropped, corrupt, unreachable), and the same
   index under the other model keys the cache has seen (entries of another model or
   configuration never match).
2. Of those candidates the one that would have reused the most tokens names the reason;
   on a tie the order of :class:`MissReason` decides (the most actionable first). With
   no candidate the reason is NO_ENTRY, unless the match was exact (reason None).
3. :class:`Departures` is itself a small prefix index of entries that left, bounded by
   count and by tokens (oldest forgotten first); an entry that comes back (re-inserted, re-found) is
   taken out of it, so it never explains a miss it did not cause.

Costs: :func:`explain` is O(prompt blocks + candidates examined) per index asked: the live
index, the departures, and one lookup per other model key (a handful). ``note`` and
``forget`` cost what :meth:`PrefixIndex.add` and ``remove`` do; trimming the bound is O(1)
per departure forgotten.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import attrs
from kvtrio.actors.prefix import (
    DEFAULT_BLOCK_SIZE,
    MatchKind,
    ModelKey,
    PrefixEntry,
    PrefixIndex,
    PrefixMatch,
)

__all__ = [
    "DEFAULT_DEPARTED_TOKENS",
    "DEFAULT_DEPARTURES",
    "Departures",
    "Explanation",
    "MissCounter",
    "MissReason",
    "MissStatistics",
    "explain",
]

# How many departed entries are remembered for explanations by default, and how many of
# their tokens (a departed entry keeps its token tuple: about 8 bytes a token, shared with
# nothing once the entry is gone).
DEFAULT_DEPARTURES = 4096
DEFAULT_DEPARTED_TOKENS = 1 << 21


class MissReason(enum.Enum):
    """Why a lookup did not reuse more of its prompt. The order is the tie-break order."""

    NOT_TRIMMABLE = "not-trimmable"  # a longer entry matched, but its caches cannot be trimmed
    BELOW_MIN_REUSE = "below-min-reuse"  # a longer entry matched below its minimum reusable offset
    CORRUPT = "corrupt"  # the entry's file or blocks failed validation on load
    STORE_UNREACHABLE = "store-unreachable"  # the (shared) store could not be reached
    DROPPED = "dropped"  # its write to disk was dropped, refused or failed: only RAM had it
    EXPIRED = "expired"  # its TTL ran out
    EVICTED = "evicted"  # a byte budget evicted it
    OTHER_MODEL = "other-model"  # an entry matched, of another model id or fingerprint
    NO_ENTRY = "no-entry"  # nothing cached shares more of the prompt


_DEPARTURE_REASONS = frozenset(
    {
        MissReason.CORRUPT,
        MissReason.STORE_UNREACHABLE,
        MissReason.DROPPED,
        MissReason.EXPIRED,
        MissReason.EVICTED,
    }
)
_RANK = {reason: rank for rank, reason in enumerate(MissReason)}


@attrs.frozen
class Explanation:
    """What a lookup reused, and why not more.

    ``reason`` None: nothing cached could have reused more (an exact hit, or the best
    there is). Otherwise ``possible`` is what the entry named by ``key`` would have reused
    (for NO_ENTRY: ``reused``, and no key).
    """

    prompt_tokens: int
    reused: int
    reason: MissReason | None
    possible: int
    key: str | None = None

    @property
    def hit(self) -> bool:
        return self.reused > 0


@attrs.define
class Departures:
    """Entries that recently left the cache, and why (rule 3), as a bounded prefix index."""

    block_size: int = DEFAULT_BLOCK_SIZE
    limit: int = DEFAULT_DEPARTURES
    token_limit: int = DEFAULT_DEPARTED_TOKENS
    _index: PrefixIndex = attrs.field(init=False)
    _reasons: OrderedDict[str, MissReason] = attrs.field(init=False, factory=OrderedDict)
    _tokens: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._index = PrefixIndex(block_size=self.block_size)

    def __len__(self) -> int:
        return len(self._reasons)

    def note(self, entry: PrefixEntry, reason: MissReason) -> None:
        """``entry`` left the cache for ``reason`` (one of the departure reasons)."""
        if reason not in _DEPARTURE_REASONS:
            raise ValueError(f"{reason.value} is not a reason an entry leaves the cache")
        self.forget(entry.key)
        self._reasons[entry.key] = reason
        self._index.add(entry)
        self._tokens += entry.length
        while len(self._reasons) > self.limit or self._tokens > self.token_limit:
            key, _ = self._reasons.popitem(last=False)
            self._drop(key)

    def forget(self, key: str) -> None:
        """``key`` is back in the cache (absent: nothing)."""
        if self._reasons.pop(key, None) is not None:
            self._drop(key)

    def _drop(self, key: str) -> None:
        gone = self._index.remove(key)
        assert gone is not None
        self._tokens -= gone.length

    def best(self, model: ModelKey, tokens: Sequence[int]) -> tuple[PrefixMatch, MissReason] | None:
        match = self._index.lookup(model, tokens)
        if match is None:
            return None
        return match, self._reasons[match.entry.key]


def explain(
    index: PrefixIndex,
    model: ModelKey,
    tokens: Sequence[int],
    match: PrefixMatch | None,
    *,
    departures: Departures | None = None,
    other_models: Iterable[ModelKey] = (),
) -> Explanation:
    """Why the lookup of ``tokens`` that found ``match`` in ``index`` did not reuse more
    (rules 1 and 2). ``match`` is what the cache used (it may differ from the index's
    answer, e.g. with ``need_logits``); ``departures``: the cache's departed entries;
    ``other_models``: the other model keys whose entries share ``index``."""
    n = len(tokens)
    reused = match.reuse if match is not None else 0
    if match is not None and match.kind is MatchKind.EXACT:
        return Explanation(n, reused, None, reused, match.entry.key)
    candidates: list[tuple[int, MissReason, str]] = []
    refused = index.refused_longer(model, tokens, reused)
    if refused is not None:
        entry, kept = refused
        reason = MissReason.NOT_TRIMMABLE if not entry.trimmable else MissReason.BELOW_MIN_REUSE
        candidates.append((kept, reason, entry.key))
    if departures is not None:
        departed = departures.best(model, tokens)
        if departed is not None and departed[0].reuse > reused:
            candidates.append((departed[0].reuse, departed[1], departed[0].entry.key))
    for other in other_models:
        if other == model:
            continue
        found = index.lookup(other, tokens)
        if found is not None and found.reuse > reused:
            candidates.append((found.reuse, MissReason.OTHER_MODEL, found.entry.key))
    if not candidates:
        return Explanation(n, reused, MissReason.NO_ENTRY, reused)
    possible, reason, key = min(candidates, key=lambda c: (-c[0], _RANK[c[1]]))
    return Explanation(n, reused, reason, possible, key)


@attrs.frozen
class MissStatistics:
    """Lookups, full hits (nothing better was cached), and lookups per reason."""

    lookups: int
    best_possible: int
    not_trimmable: int
    below_min_reuse: int
    corrupt: int
    store_unreachable: int
    dropped: int
    expired: int
    evicted: int
    other_model: int
    no_entry: int

    def count(self, reason: MissReason) -> int:
        return int(getattr(self, reason.name.lower()))


@attrs.define
class MissCounter:
    """Counts explanations (O(1) each)."""

    _lookups: int = attrs.field(init=False, default=0)
    _counts: dict[MissReason | None, int] = attrs.field(init=False, factory=dict)

    def add(self, explanation: Explanation) -> None:
        self._lookups += 1
        reason = explanation.reason
        self._counts[reason] = self._counts.get(reason, 0) + 1

    def statistics(self) -> MissStatistics:
        c = self._counts.get
        return MissStatistics(
            self._lookups,
            c(None, 0),
            *(c(reason, 0) for reason in MissReason),
        )
