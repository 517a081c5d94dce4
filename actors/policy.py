"""Eviction and write-admission policies for the tiered cache's tiers, pins and TTLs.

A tier (the RAM tier or the disk tier) keeps its entries; a policy only orders them. The
tier tells its :class:`EvictionPolicy` of every entry that arrives (``on_insert``), is used
(``on_hit``) or leaves for a reason of its own (``on_remove``: superseded, corrupt); when
it is over its byte budget it asks for ``victim()``, which takes the least valuable entry
out of the policy and names it. A write-back asks an :class:`AdmissionPolicy` whether an
entry leaving RAM is worth writing to disk at all; :mod:`kvtrio.actors.wear` counts what
the disk was given and what it gave back.

Theory of operation
-------------------
1. :class:`LruPolicy`: the least recently used entry is the victim (an ordered map in
   bounded segments, :mod:`~kvtrio.actors.seglru`: no step resizes a table of them all).
2. :class:`GreedyDualPolicy` (GreedyDual-Size, optionally -Frequency): every entry has a
   priority ``H = L + uses * cost / bytes``, where ``cost`` is the seconds it would take
   to prefill its tokens again (a :class:`PrefillCost`, measured at run time, per model),
   ``uses`` is 1 (or its hit count, with ``frequency``), and ``L`` is the priority of the
   last victim. The victim is the lowest ``H``. ``L`` only grows, so an entry that is not
   used again ages: newer entries start above it, and a hit lifts an entry to the
   current ``L`` plus its value. Cheap-per-byte entries (short chats) go before costly
   ones (long documents, whose prefill grows faster than their bytes) of the same age.
   An entry given ``reload_seconds`` (in RAM, one the disk holds or will admit) costs the
   lesser of its recompute and its reload: losing it from RAM loses only the reload.
3. A pinned entry is never a victim and never expires. Its bytes stay in :attr:`nbytes`
   (the tier's budget sees them); ``pin`` refuses (:class:`~kvtrio.errors.PinLimitError`)
   when the pinned bytes would exceed ``pin_limit``.
4. An entry inserted with a TTL expires ``ttl`` seconds after its last use (insert or
   hit) on the policy's clock (trio's by default: docs/design.md invariant 7);
   :meth:`EvictionPolicy.expire` takes the expired entries out and names them.

Costs (N entries in the policy): LRU is O(1) per operation. GreedyDual keeps a binary
heap with lazy deletion (an item is live while its entry's slot holds its number: no
second table of every entry beside the slots): ``on_insert`` and ``on_hit`` push one
item (O(log N)), ``on_remove`` is O(1) (its item goes stale), ``victim`` pops stale
items until a live one, O(log N) amortized: the heap is rebuilt (O(N)) whenever it
holds more than twice the live entries plus 64, so stale items never outnumber live ones
for long. ``expire`` costs O(log N) per entry it takes out, plus the stale deadlines it
skips (rebuilt the same way when they outnumber the entries).
"""

from __future__ import annotations

import abc
import enum
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import attrs
import trio
from kvtrio.actors.seglru import SegmentedLru
from kvtrio.errors import PinLimitError

__all__ = [
    "DEFAULT_ADMIT_SECONDS_PER_GIB",
    "DEFAULT_PREFILL_TOKENS_PER_SECOND",
    "AdmissionCandidate",
    "AdmissionPolicy",
    "AdmitAll",
    "AllOf",
    "AnyOf",
    "EntryCost",
    "EvictionPolicy",
    "EvictionStatistics",
    "GreedyDualPolicy",
    "LruPolicy",
    "MinimumTokens",
    "PolicyKind",
    "PrefillCost",
    "RecomputePerByte",
    "SecondUse",
    "default_admission",
    "make_eviction_policy",
]

# A prefill speed for models not yet measured (tokens per second; a 7B model on a laptop).
DEFAULT_PREFILL_TOKENS_PER_SECOND = 1000.0

# The default admission's threshold: seconds of prefill an entry saves per GiB it writes
# (for Llama-3-8B in fp16 at about 1000 tokens/s, entries of 16k tokens and more).
DEFAULT_ADMIT_SECONDS_PER_GIB = 12.0

Clock = Callable[[], float]


# -- the recompute cost, measured at run time ------------------------------------------


@attrs.define
class _Fit:
    """Least-squares sums for ``seconds = a * (end - start) + b * (end**2 - start**2)``."""

    xx11: float = 0.0
    xx12: float = 0.0
    xx22: float = 0.0
    xy1: float = 0.0
    xy2: float = 0.0
    observations: int = 0

    def add(self, start: int, end: int, seconds: float) -> None:
        x1, x2 = float(end - start), float(end * end - start * start)
        self.xx11 += x1 * x1
        self.xx12 += x1 * x2
        self.xx22 += x2 * x2
        self.xy1 += x1 * seconds
        self.xy2 += x2 * seconds
        self.observations += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both non-negative: the two-term fit when it is well posed and has
        non-negative terms, else the linear term alone."""
        det = self.xx11 * self.xx22 - self.xx12 * self.xx12
        if det > 1e-9 * self.xx11 * self.xx22:
            a = (self.xy1 * self.xx22 - self.xy2 * self.xx12) / det
            b = (self.xx11 * self.xy2 - self.xx12 * self.xy1) / det
            if a >= 0 and b >= 0:
                return a, b
        return max(0.0, self.xy1 / self.xx11), 0.0


@attrs.define
class PrefillCost:
    """Seconds to prefill ``n`` tokens from scratch, per model, fitted to what the server
    measures: ``t(n) = a * n + b * n**2`` (attention makes long prompts cost more than
    their length). Until a model has an observation, ``n / default_tokens_per_second``.

    Costs: :meth:`observe` is O(1); :meth:`seconds` is O(1) (the fit is cached until the
    next observation of that model).
    """

    default_tokens_per_second: float = DEFAULT_PREFILL_TOKENS_PER_SECOND
    _fits: dict[Hashable, _Fit] = attrs.field(init=False, factory=dict)
    _coefficients: dict[Hashable, tuple[float, float]] = attrs.field(init=False, factory=dict)

    def observe(self, model: Hashable, start: int, end: int, seconds: float) -> None:
        """A prefill of tokens ``start .. end`` (a cached prefix of ``start`` tokens was
        reused) took ``seconds``."""
        if not 0 <= start < end or seconds < 0:
            raise ValueError("a prefill observation needs 0 <= start < end and seconds >= 0")
        self._fits.setdefault(model, _Fit()).add(start, end, seconds)
        self._coefficients.pop(model, None)

    def coefficients(self, model: Hashable) -> tuple[float, float]:
        """(a, b) of ``model``'s fit (the default speed's ``(1 / speed, 0)`` if unmeasured)."""
        found = self._coefficients.get(model)
        if found is None:
            fit = self._fits.get(model)
            if fit is None:
                return 1.0 / self.default_tokens_per_second, 0.0
            found = self._coefficients[model] = fit.coefficients()
        return found

    def seconds(self, model: Hashable, tokens: int) -> float:
        a, b = self.coefficients(model)
        return a * tokens + b * tokens * tokens


# -- eviction --------------------------------------------------------------------------


@attrs.frozen
class EntryCost:
    """What a policy knows of an entry: its bytes in the tier, its tokens, its model, and
    (``reload_seconds``) how long it would take to get it back from a lower tier, when it
    is there or will be (the RAM tier over a disk that holds or will admit the entry)."""

    nbytes: int
    tokens: int
    model: Hashable = None
    reload_seconds: float | None = None


@attrs.frozen
class EvictionStatistics:
    """Counters of one eviction policy (derived from its live state where it can be)."""

    entries: int
    nbytes: int
    pinned_entries: int
    pinned_bytes: int
    victims: int
    expired: int


@attrs.define(eq=False)
class _Slot:
    cost: EntryCost
    ttl: float | None
    deadline: float  # +inf without a TTL
    pinned: bool = False
    uses: int = 1
    # GreedyDual's place in its order: the priority H and the number of its live heap item
    # (-1: not in the order). Kept here, not in a second table of every entry.
    priority: float = 0.0
    number: int = -1
    # LRU's place in its order (:mod:`kvtrio.actors.seglru` rule 2; None: not in it).
    lru_segment: Any = attrs.field(default=None, init=False, repr=False)


@attrs.define(eq=False)
class EvictionPolicy(abc.ABC):
    """The order in which one tier gives up its entries (see the module's rules 3, 4).

    Subclasses keep the order (:meth:`_order_add`, :meth:`_order_touch`,
    :meth:`_order_discard`, :meth:`_order_pop`); this class keeps the bytes, the pins and
    the TTLs. A pinned entry is out of the order altogether, so ``victim`` never sees it.
    """

    pin_limit: int = 0  # bytes that may be pinned at once
    default_ttl: float | None = None
    clock: Clock = trio.current_time
    _slots: dict[str, _Slot] = attrs.field(init=False, factory=dict)
    _nbytes: int = attrs.field(init=False, default=0)
    _pinned_bytes: int = attrs.field(init=False, default=0)
    _pinned: int = attrs.field(init=False, default=0)
    _deadlines: list[tuple[float, int, str]] = attrs.field(init=False, factory=list)
    _seq: itertools.count[int] = attrs.field(init=False, factory=itertools.count)
    _victims: int = attrs.field(init=False, default=0)
    _expired: int = attrs.field(init=False, default=0)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    @property
    def nbytes(self) -> int:
        """Bytes of every entry in the policy, pinned ones included."""
        return self._nbytes

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def on_insert(self, key: str, cost: EntryCost, *, ttl: float | None = None) -> None:
        """``key`` arrived in the tier (again: replaces what was known; a pin is kept, even
        if the new size takes the pinned bytes past ``pin_limit``). ``ttl`` (else
        ``default_ttl``): it expires that many seconds after its last use."""
        old = self._slots.get(key)
        pinned = old is not None and old.pinned
        if old is not None:
            self.on_remove(key)
        ttl = self.default_ttl if ttl is None else ttl
        if ttl is not None and ttl < 0:
            raise ValueError("ttl must be >= 0")
        slot = self._slots[key] = _Slot(cost, ttl, self._deadline_of(ttl))
        self._nbytes += cost.nbytes
        self._push_deadline(key, slot)
        if pinned:
            self._set_pinned(key, slot)
        else:
            self._order_add(key, slot)

    def insert_found(self, arrivals: Iterable[tuple[str, EntryCost]]) -> None:
        """:meth:`on_insert` of each ``(key, cost)`` in order, without a TTL: the entries a
        tier found at open, in their order of last use. The same outcome as one
        ``on_insert`` each; what they share is worked out once (a cost-aware policy values
        each distinct cost once, and entries found at open share theirs per length)."""
        if self.default_ttl is not None:
            for key, cost in arrivals:
                self.on_insert(key, cost)
            return
        slots, forever = self._slots, float("inf")
        fresh: list[tuple[str, _Slot]] = []
        added = 0  # the fresh slots' bytes, into _nbytes before any on_insert in between
        for key, cost in arrivals:
            if key in slots:  # known already: replaced, as on_insert does, in its turn
                self._nbytes += added
                added = 0
                self._order_extend(fresh)
                fresh = []
                self.on_insert(key, cost)
                continue
            slot = slots[key] = _Slot(cost, None, forever)
            added += cost.nbytes
            fresh.append((key, slot))
        self._nbytes += added
        self._order_extend(fresh)

    def on_hit(self, key: str) -> None:
        """``key`` served a lookup (absent: nothing)."""
        slot = self._slots.get(key)
        if slot is None:
            return
        slot.uses += 1
        slot.deadline = self._deadline_of(slot.ttl)
        self._push_deadline(key, slot)
        if not slot.pinned:
            self._order_touch(key, slot)

    def on_remove(self, key: str) -> None:
        """``key`` left the tier for a reason of its own (absent: nothing)."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        self._nbytes -= slot.cost.nbytes
        if slot.pinned:
            self._pinned_bytes -= slot.cost.nbytes
            self._pinned -= 1
        else:
            self._order_discard(key, slot)

    def victim(self) -> str | None:
        """Take the least valuable unpinned entry out of the policy and name it (None:
        nothing left but pinned entries). The tier then evicts it."""
        key = self._order_pop()
        if key is None:
            return None
        slot = self._slots.pop(key)
        self._nbytes -= slot.cost.nbytes
        self._victims += 1
        return key

    def expire(self) -> list[str]:
        """Take every expired unpinned entry out of the policy and name them (rule 4)."""
        now = self.clock()
        out: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, key = heapq.heappop(self._deadlines)
            slot = self._slots.get(key)
            if slot is None or slot.pinned or slot.deadline != deadline:
                continue  # stale: removed, pinned, or used since
            self.on_remove(key)
            out.append(key)
        self._expired += len(out)
        return out

    def pin(self, key: str) -> None:
        """Never evict or expire ``key`` (rule 3). KeyError if absent; PinLimitError if
        the pinned bytes would exceed ``pin_limit``."""
        slot = self._slots[key]
        if slot.pinned:
            return
        if self._pinned_bytes + slot.cost.nbytes > self.pin_limit:
            raise PinLimitError(
                f"pinning {slot.cost.nbytes} bytes would exceed the pin limit of "
                f"{self.pin_limit} bytes ({self._pinned_bytes} pinned)"
            )
        self._order_discard(key, slot)
        self._set_pinned(key, slot)

    def unpin(self, key: str) -> None:
        """Make ``key`` evictable again, as if just used (absent or unpinned: nothing)."""
        slot = self._slots.get(key)
        if slot is None or not slot.pinned:
            return
        slot.pinned = False
        self._pinned_bytes -= slot.cost.nbytes
        self._pinned -= 1
        slot.deadline = self._deadline_of(slot.ttl)
        self._push_deadline(key, slot)
        self._order_add(key, slot)

    def is_pinned(self, key: str) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.pinned

    def statistics(self) -> EvictionStatistics:
        return EvictionStatistics(
            entries=len(self._slots),
            nbytes=self._nbytes,
            pinned_entries=self._pinned,
            pinned_bytes=self._pinned_bytes,
            victims=self._victims,
            expired=self._expired,
        )

    def _set_pinned(self, key: str, slot: _Slot) -> None:
        slot.pinned = True
        self._pinned_bytes += slot.cost.nbytes
        self._pinned += 1

    def _deadline_of(self, ttl: float | None) -> float:
        return float("inf") if ttl is None else self.clock() + ttl

    def _push_deadline(self, key: str, slot: _Slot) -> None:
        if slot.ttl is None:
            return
        heapq.heappush(self._deadlines, (slot.deadline, next(self._seq), key))
        if len(self._deadlines) > 2 * len(self._slots) + 64:  # stale items: rebuild, O(N)
            self._deadlines = [
                (s.deadline, next(self._seq), k)
                for k, s in self._slots.items()
                if s.ttl is not None and not s.pinned
            ]
            heapq.heapify(self._deadlines)

    @abc.abstractmethod
    def _order_add(self, key: str, slot: _Slot) -> None: ...

    def _order_extend(self, added: list[tuple[str, _Slot]]) -> None:
        """:meth:`_order_add` of each, in order."""
        for key, slot in added:
            self._order_add(key, slot)

    @abc.abstractmethod
    def _order_touch(self, key: str, slot: _Slot) -> None: ...

    @abc.abstractmethod
    def _order_discard(self, key: str, slot: _Slot) -> None: ...

    @abc.abstractmethod
    def _order_pop(self) -> str | None: ...


@attrs.define(eq=False)
class LruPolicy(EvictionPolicy):
    """Least recently used first (rule 1). O(1) per operation."""

    # The slots themselves in order, each recording its segment: no table of every key.
    _lru: SegmentedLru[str, _Slot] = attrs.field(init=False, factory=SegmentedLru)

    def _order_add(self, key: str, slot: _Slot) -> None:
        self._lru.add(key, slot)

    def _order_extend(self, added: list[tuple[str, _Slot]]) -> None:
        self._lru.extend(added)

    def _order_touch(self, key: str, slot: _Slot) -> None:
        self._lru.move_to_end(slot)

    def _order_discard(self, key: str, slot: _Slot) -> None:
        if slot.lru_segment is not None:
            self._lru.remove(slot)

    def _order_pop(self) -> str | None:
        if not self._lru:
            return None
        key, _ = self._lru.pop_first()
        return key


@attrs.define(eq=False)
class GreedyDualPolicy(EvictionPolicy):
    """GreedyDual-Size (rule 2): the lowest ``L + uses * recompute seconds / bytes`` goes
    first. ``frequency``: ``uses`` counts the entry's hits (GreedyDual-Size-Frequency),
    else it is 1. O(log N) per operation (see the module's costs)."""

    prefill: PrefillCost = attrs.field(factory=PrefillCost)
    frequency: bool = False
    _inflation: float = attrs.field(init=False, default=0.0)  # L
    # Items (H, number, key); an item is live while its entry's slot holds its number
    # (older ones are stale, dropped as they surface or when the heap is rebuilt).
    _heap: list[tuple[float, int, str]] = attrs.field(init=False, factory=list)
    _ordered: int = attrs.field(init=False, default=0)  # entries in the order (live items)

    @property
    def inflation(self) -> float:
        """L: the priority of the last victim (0 before the first)."""
        return self._inflation

    def priority(self, key: str) -> float | None:
        """The entry's current H (None: absent or pinned)."""
        slot = self._slots.get(key)
        return None if slot is None or slot.number < 0 else slot.priority

    def value(self, cost: EntryCost, uses: int) -> float:
        """What losing the entry costs, per byte: its recompute seconds, or its reload
        seconds when that is less (times uses, with ``frequency``)."""
        seconds = self.prefill.seconds(cost.model, cost.tokens)
        if cost.reload_seconds is not None:
            seconds = min(seconds, cost.reload_seconds)
        weight = uses if self.frequency else 1
        return weight * seconds / max(1, cost.nbytes)

    def _order_add(self, key: str, slot: _Slot) -> None:
        if slot.number < 0:
            self._ordered += 1
        slot.priority = self._inflation + self.value(slot.cost, slot.uses)
        slot.number = next(self._seq)
        heapq.heappush(self._heap, (slot.priority, slot.number, key))
        self._compact()

    def _order_extend(self, added: list[tuple[str, _Slot]]) -> None:
        """:meth:`_order_add` of each, valuing each distinct cost object once (L does not
        move in between: nothing is evicted)."""
        values: dict[int, float] = {}  # by id(): the costs stay alive in their slots
        heap, seq, inflation = self._heap, self._seq, self._inflation
        push, last_cost, last_h = heapq.heappush, None, 0.0
        for key, slot in added:
            cost = slot.cost
            if cost is not last_cost:  # found entries come in runs of one shared cost
                value = values.get(id(cost))
                if value is None:
                    value = values[id(cost)] = self.value(cost, slot.uses)
                last_cost, last_h = cost, inflation + value
            if slot.number < 0:
                self._ordered += 1
            number = slot.number = next(seq)
            slot.priority = last_h
            push(heap, (last_h, number, key))
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live items once stale ones outnumber them (O(N))."""
        if len(self._heap) > 2 * self._ordered + 64:
            self._heap = [
                (slot.priority, slot.number, key)
                for key, slot in self._slots.items()
                if slot.number >= 0
            ]
            heapq.heapify(self._heap)

    def _order_touch(self, key: str, slot: _Slot) -> None:
        self._order_add(key, slot)  # the old item goes stale

    def _order_discard(self, key: str, slot: _Slot) -> None:
        if slot.number >= 0:
            slot.number = -1
            self._ordered -= 1

    def _order_pop(self) -> str | None:
        while self._heap:
            h, number, key = heapq.heappop(self._heap)
            slot = self._slots.get(key)
            if slot is not None and slot.number == number:
                slot.number = -1
                self._ordered -= 1
                self._inflation = max(self._inflation, h)
                return key
        return None


class PolicyKind(enum.Enum):
    """The eviction policies a tier can be configured with."""

    LRU = "lru"
    COST = "cost"  # GreedyDual-Size with recompute cost (the default)
    COST_FREQUENCY = "cost-frequency"  # GreedyDual-Size-Frequency


def make_eviction_policy(
    kind: PolicyKind,
    *,
    prefill: PrefillCost | None = None,
    pin_limit: int = 0,
    default_ttl: float | None = None,
    clock: Clock = trio.current_time,
) -> EvictionPolicy:
    """A fresh policy of ``kind``; the cost-aware ones share ``prefill`` (one per process
    is the point: the RAM and disk tiers then value entries by the same measurements)."""
    if kind is PolicyKind.LRU:
        return LruPolicy(pin_limit, default_ttl, clock)
    return GreedyDualPolicy(
        pin_limit,
        default_ttl,
        clock,
        prefill if prefill is not None else PrefillCost(),
        kind is PolicyKind.COST_FREQUENCY,
    )


# -- write admission -------------------------------------------------------------------


@attrs.frozen
class AdmissionCandidate:
    """An entry leaving RAM, offered to the disk."""

    key: str
    tokens: int
    nbytes: int
    uses: int  # lookups it served while in RAM
    recompute_seconds: float  # PrefillCost.seconds of its tokens


class AdmissionPolicy(abc.ABC):
    """Whether an entry leaving RAM is written to disk (the rest are simply forgotten)."""

    @abc.abstractmethod
    def admit(self, candidate: AdmissionCandidate) -> bool:
        """Decide (a stateful policy remembers the decision)."""

    def would_admit(self, candidate: AdmissionCandidate) -> bool:
        """What :meth:`admit` would answer now, remembering nothing (for valuing an entry
        in RAM by its reload cost when the disk will take it)."""
        return self.admit(candidate)


@attrs.frozen
class AdmitAll(AdmissionPolicy):
    """Write every entry (kvtrio's behaviour before admission existed)."""

    def admit(self, candidate: AdmissionCandidate) -> bool:
        return True


@attrs.frozen
class MinimumTokens(AdmissionPolicy):
    """Write entries of at least ``tokens`` tokens."""

    tokens: int

    def admit(self, candidate: AdmissionCandidate) -> bool:
        return candidate.tokens >= self.tokens


@attrs.frozen
class RecomputePerByte(AdmissionPolicy):
    """Write entries that save at least ``seconds_per_gib`` of prefill per GiB written."""

    seconds_per_gib: float

    def admit(self, candidate: AdmissionCandidate) -> bool:
        gib = max(1, candidate.nbytes) / (1 << 30)
        return candidate.recompute_seconds >= self.seconds_per_gib * gib


@attrs.define(eq=False)
class SecondUse(AdmissionPolicy):
    """Write an entry on its second chance: it served a lookup while in RAM, or it was
    refused once before (a bounded memory of ``remember`` refused keys: a prompt that comes
    back and is recomputed is written the next time it leaves RAM). O(1) per decision."""

    remember: int = 4096
    _refused: OrderedDict[str, None] = attrs.field(init=False, factory=OrderedDict)

    def would_admit(self, candidate: AdmissionCandidate) -> bool:
        return candidate.uses > 0 or candidate.key in self._refused

    def admit(self, candidate: AdmissionCandidate) -> bool:
        if candidate.uses > 0:
            return True
        if candidate.key in self._refused:
            del self._refused[candidate.key]
            return True
        self._refused[candidate.key] = None
        if len(self._refused) > self.remember:
            self._refused.popitem(last=False)
        return False


@attrs.frozen
class AllOf(AdmissionPolicy):
    """Write an entry only if every one of ``policies`` would (each is asked, in order,
    until one refuses)."""

    policies: tuple[AdmissionPolicy, ...]

    def admit(self, candidate: AdmissionCandidate) -> bool:
        return all(p.admit(candidate) for p in self.policies)

    def would_admit(self, candidate: AdmissionCandidate) -> bool:
        return all(p.would_admit(candidate) for p in self.policies)


@attrs.frozen
class AnyOf(AdmissionPolicy):
    """Write an entry if any one of ``policies`` would (each is asked, in order, until
    one admits: a stateful one such as :class:`SecondUse` is asked only if reached)."""

    policies: tuple[AdmissionPolicy, ...]

    def admit(self, candidate: AdmissionCandidate) -> bool:
        return any(p.admit(candidate) for p in self.policies)

    def would_admit(self, candidate: AdmissionCandidate) -> bool:
        return any(p.would_admit(candidate) for p in self.policies)


def default_admission() -> AdmissionPolicy:
    """The write admission chosen on ``kvtrio bench policy``'s workload: entries that save
    at least :data:`DEFAULT_ADMIT_SECONDS_PER_GIB` of prefill per GiB written (there it
    cut bytes written 2.3x to 3.8x for at most 3.5 % less prefill time saved;
    docs/benchmarks.md, "Eviction and write admission")."""
    return RecomputePerByte(DEFAULT_ADMIT_SECONDS_PER_GIB)
