"""The cold-tier lifecycle of one cached entry, as one transition table (h11's style).

An entry of the tiered cache is in RAM or not (its *hot* side: live caches, LRU by
bytes) and, independently, somewhere on its way to and from the disk (its *cold* side,
the :class:`ColdState` here). Every change of the cold side is one :class:`ColdEvent`
applied through :func:`next_state`; a pair the table does not list is a bug and raises
:class:`~kvtrio.errors.LifecycleError` at once, instead of leaving flags that disagree.

The table is the whole diagram: a write is NONE -> QUEUED -> WRITING -> DURABLE, an
eviction DURABLE -> EVICTING -> NONE; a pending write may be dropped (the byte cap) or
cancelled, an in-flight one doomed (removed meanwhile: deleted once written); an entry
listed by the store at open is FOUND straight into DURABLE.

What derives from the state (and nowhere else, see :class:`~kvtrio.actors.tiered`):

- the cold LRU holds exactly the DURABLE entries (the only ones eviction may pick);
- the ledger's reserved bytes are the reservations of WRITING and WRITING_DOOMED entries;
- an entry is findable (in the prefix index) iff it is hot or DURABLE (rule 3 of the cache);
- an entry is kept in the cache's table iff it is hot or its state is not NONE.

Keeps docs/design.md invariants 11 and 13.
"""

from __future__ import annotations

import enum
import operator
from collections import OrderedDict
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import attrs
from kvtrio.actors.seglru import SegmentedLru
from kvtrio.errors import LifecycleError

__all__ = [
    "FINDABLE_COLD",
    "ColdLedger",
    "ColdSide",
    "TRANSITIONS",
    "ColdEvent",
    "ColdState",
    "next_state",
]


class ColdState(enum.Enum):
    """Where an entry stands with the cold tier."""

    NONE = "none"  # not on disk, no write pending
    QUEUED = "queued"  # a write is pending; the entry's caches are held for it
    WRITING = "writing"  # the write is in flight; its bytes are reserved in the ledger
    WRITING_DOOMED = "writing-doomed"  # in flight, but removed meanwhile: delete once written
    DURABLE = "durable"  # on disk, in the cold LRU
    EVICTING = "evicting"  # its removal is in flight (its bytes are still on disk)

    # Members are singletons compared by identity: hashed by identity too, in C (Enum's
    # own hash is a Python call, and open looks up several per entry).
    __hash__ = object.__hash__


class ColdEvent(enum.Enum):
    """What happened to an entry's cold side."""

    QUEUE = "queue"  # a write was asked for
    DROP = "drop"  # the pending write-backs' byte cap shed it (counted)
    CANCEL = "cancel"  # removed or superseded before its write started
    START = "start"  # the writer took it: bytes reserved, write begins
    WRITTEN = "written"  # the store says durable
    FAILED = "failed"  # the write failed or was dropped by the store: reservation released
    DOOM = "doom"  # removed while being written
    FOUND = "found"  # listed by the store (open) or found in a shared store's index
    EVICT = "evict"  # picked by the eviction loop, or removed: removal started
    REMOVED = "removed"  # the removal completed (or the file was already gone)
    FORGET = "forget"  # unreadable now (a shared store out of reach): forgotten here only

    __hash__ = object.__hash__  # as ColdState's


_S, _E = ColdState, ColdEvent
TRANSITIONS = MappingProxyType(
    {
        (_S.NONE, _E.QUEUE): _S.QUEUED,
        (_S.NONE, _E.FOUND): _S.DURABLE,
        (_S.QUEUED, _E.DROP): _S.NONE,
        (_S.QUEUED, _E.CANCEL): _S.NONE,
        (_S.QUEUED, _E.START): _S.WRITING,
        (_S.WRITING, _E.WRITTEN): _S.DURABLE,
        (_S.WRITING, _E.FAILED): _S.NONE,
        (_S.WRITING, _E.DOOM): _S.WRITING_DOOMED,
        (_S.WRITING_DOOMED, _E.WRITTEN): _S.EVICTING,
        (_S.WRITING_DOOMED, _E.FAILED): _S.NONE,
        (_S.DURABLE, _E.EVICT): _S.EVICTING,
        (_S.DURABLE, _E.FORGET): _S.NONE,
        (_S.EVICTING, _E.REMOVED): _S.NONE,
    }
)
"""Every legal (state, event) pair and the state it leads to; nothing else is legal."""

FINDABLE_COLD = frozenset({ColdState.DURABLE})
"""Cold states in which an entry that is not hot is still findable (rule 3 of the cache)."""


def next_state(state: ColdState, event: ColdEvent) -> ColdState:
    """The state ``event`` leads to from ``state``; LifecycleError if it may not happen."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise LifecycleError(f"cold entry: event {event.value} in state {state.value}") from None


_RESERVING = frozenset({ColdState.WRITING, ColdState.WRITING_DOOMED})
_KEY = operator.attrgetter("key")


@attrs.define(eq=False)
class ColdSide:
    """One entry's cold side: its state, and what the ledger counts for it. The tiered
    cache's :class:`~kvtrio.actors.coldside.CacheRecord` is a subclass: the ledger holds
    the cache's records themselves."""

    key: str
    nbytes: int  # its caches' bytes in RAM: what its pending write holds
    state: ColdState = ColdState.NONE
    reserved: int = 0
    droppable: bool = True  # a pending write the byte cap may shed (not a flush's)
    # The bytes its write puts on disk at most (its encoded size, planned by the writer
    # before the write starts): its reservation; None: ``nbytes`` stands in.
    write_bytes: int | None = None
    # The ledger's cold LRU segment that holds it (:mod:`kvtrio.actors.seglru` rule 2):
    # not None exactly while it is in that LRU.
    lru_segment: Any = attrs.field(default=None, init=False, repr=False)


@attrs.define(eq=False)
class ColdLedger:
    """The one account of the cold tier's bytes, derived from the entries' states.

    - ``used``: bytes that exist in the store, as the store reports each change (a
      write's net bytes, a removal's freed bytes; absent blocks count nothing);
    - ``reserved``: the sum of the reservations of entries being written (a write
      reserves its encoded size, ``write_bytes``, when it starts, and releases it when it
      settles, when the store's report of what it really added takes its place in
      ``used``: blocks already on disk add nothing);
    - the cold LRU: exactly the DURABLE entries, least recently used first;
    - the pending write-backs: exactly the QUEUED entries, oldest first, and their bytes.

    :meth:`apply` is the only place a state changes, so none of these can disagree with
    the table. Costs: :meth:`apply`, :meth:`touch`, :meth:`oldest_durable` are O(1)
    (ordered dicts; the cold LRU a :class:`~kvtrio.actors.seglru.SegmentedLru`, so no
    single step of them is O(entries), not even a table's resize); :meth:`check` is
    O(entries), for tests.
    """

    used: int = 0
    _reserved: int = 0
    # Segmented (:mod:`kvtrio.actors.seglru`): open fills it with every stored entry on a
    # worker thread, where one OrderedDict's resize held the GIL (the loop) for 13 ms or
    # more; each side records its segment, so no table of every key is probed.
    _durable: SegmentedLru[str, ColdSide] = attrs.field(factory=SegmentedLru)
    _queued: OrderedDict[str, ColdSide] = attrs.field(factory=OrderedDict)
    _queued_bytes: int = 0
    _writing: dict[int, ColdSide] = attrs.field(factory=dict)

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def durable_count(self) -> int:
        return len(self._durable)

    def queued_count(self) -> int:
        return len(self._queued)

    def durable_keys(self) -> list[str]:
        """DURABLE keys, least recently used first."""
        return list(self._durable)

    def durable_newest_first(self) -> Iterator[ColdSide]:
        """DURABLE entries, most recently used first (lazily: a caller takes a few)."""
        return (side for _, side in self._durable.newest_first())

    def apply(self, side: ColdSide, event: ColdEvent) -> ColdState:
        """Move ``side`` by ``event`` (LifecycleError if the table forbids it)."""
        old, new = side.state, next_state(side.state, event)
        if old is ColdState.DURABLE and side.lru_segment is not None:
            self._durable.remove(side)
        elif old is ColdState.QUEUED and self._queued.get(side.key) is side:
            del self._queued[side.key]
            self._queued_bytes -= side.nbytes
        if old in _RESERVING and new not in _RESERVING:
            self._reserved -= side.reserved
            side.reserved = 0
            del self._writing[id(side)]
        elif new in _RESERVING and old not in _RESERVING:
            side.reserved = side.nbytes if side.write_bytes is None else side.write_bytes
            self._reserved += side.reserved
            self._writing[id(side)] = side
        if new is ColdState.DURABLE:
            self._durable.add(side.key, side)
        elif new is ColdState.QUEUED:
            self._queued[side.key] = side
            self._queued_bytes += side.nbytes
        side.state = new
        return new

    def found_many(self, sides: list[ColdSide]) -> None:
        """:meth:`apply` of FOUND to each side, in order, as open enters a batch of what
        the store holds: the same checks and outcome in fewer steps. The table allows FOUND
        only from NONE (to DURABLE): that pair is read from it once, every side's state is
        checked against it (LifecycleError, before any side moves, for one the table does
        not let FOUND leave), and the cold LRU is extended in one call."""
        ((source, target),) = [(s, t) for (s, e), t in TRANSITIONS.items() if e is _E.FOUND]
        for side in sides:
            if side.state is not source:
                next_state(side.state, ColdEvent.FOUND)  # raises: not a legal pair
        for side in sides:
            side.state = target
        # zip reuses its pair once the LRU has unpacked it: no tuple made per side.
        self._durable.extend(zip(map(_KEY, sides), sides, strict=True))

    def touch(self, side: ColdSide) -> None:
        """Mark a DURABLE entry as the most recently used."""
        if side.lru_segment is not None:
            self._durable.move_to_end(side)

    def oldest_durable(self) -> ColdSide | None:
        first = self._durable.first()
        return None if first is None else first[1]

    def oldest_queued(self) -> ColdSide | None:
        return next(iter(self._queued.values()), None)

    def oldest_droppable(self) -> ColdSide | None:
        """The oldest pending write the byte cap may shed (O(undroppable ones before it))."""
        return next((side for side in self._queued.values() if side.droppable), None)

    def check(self) -> None:
        """Recompute every derived figure (tests): AssertionError if one drifted."""
        assert all(s.state is ColdState.DURABLE for s in self._durable.values())
        assert all(s.state is ColdState.QUEUED for s in self._queued.values())
        assert all(s.state in _RESERVING for s in self._writing.values())
        assert self._queued_bytes == sum(s.nbytes for s in self._queued.values())
        assert self._reserved == sum(s.reserved for s in self._writing.values())
