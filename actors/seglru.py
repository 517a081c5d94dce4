"""An LRU order of objects whose every step is bounded: no table of all its members
resizes, and no table of all its members is probed.

An :class:`~collections.OrderedDict` of N keys grows its table in one C call that holds the
GIL for time proportional to N (13-28 ms at 87,381 keys on the 2-core VM,
docs/benchmarks.md, sixth pass): on a worker thread during the cold tier's open, that one
call is a stall of the trio loop. :class:`SegmentedLru` keeps the same order in pieces.

Theory of operation
-------------------
1. The members (objects, each with its key) live in *segments*: small plain dicts from
   member to key (insertion-ordered; a third of an OrderedDict's memory per key, which
   open pays for every stored entry) chained oldest to newest, each of at most
   :data:`SEGMENT_KEYS` members. The order is the segments' order, then each segment's
   own. A member is added, or touched (``move_to_end``), at the end of the newest
   segment; a new newest segment starts when it is full.
2. Which segment holds a member is written on the member itself (its ``lru_segment``,
   :class:`Linked`; None while it is in no order), so there is no table from every key to
   its segment: adding a member writes to the newest segment and to the member alone (a
   table of every key, probed at random once per member, was most of open's cost of
   this order at 100,000 entries: cache misses, docs/bench/scale.md, thirteenth
   session). A segment is keyed by the members themselves (hashed by identity, in C),
   so two members of one key are two members; a member is in at most one order.
3. An empty segment leaves the chain at once. A segment that falls to
   ``SEGMENT_KEYS // 4`` members or fewer (*small*) is merged into a neighbour that has
   room (its members moved and re-pointed, order kept: at most ``SEGMENT_KEYS // 4``
   moves; a small result is checked again), so no two small segments are neighbours
   and the chain holds at most ``2 N / (SEGMENT_KEYS // 4 + 1) + 2`` segments (about
   ``8 N / SEGMENT_KEYS``).

Costs: add, touch, remove and the newest member are O(1) (a merge is a bounded
``SEGMENT_KEYS`` moves); the oldest member (``first``, ``pop_first``) is O(1) plus a skip
over the members already taken from the front of its segment, which a plain dict leaves
as holes until it is merged or resized: about 4/3 :data:`SEGMENT_KEYS` at most (a segment
churned first in, first out holds up to its dict's usable size in holes, 5,460 at 4,096
members), a few microseconds; ``extend`` of k members O(k); iteration is O(N) in Python
steps, none of them proportional to N.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["SEGMENT_KEYS", "Linked", "SegmentedLru"]


class Linked(Protocol):
    """What a :class:`SegmentedLru` orders: an object (hashed by identity) with a
    writable ``lru_segment``, None while it is in no order (rule 2)."""

    lru_segment: Any


K = TypeVar("K")
V = TypeVar("V", bound=Linked)

SEGMENT_KEYS = 4096
"""Most members in one segment (its table's resize: well under a millisecond)."""

_SMALL = SEGMENT_KEYS // 4


class _Segment(dict[V, K]):
    """One piece of the order (member -> key), linked to its older and newer neighbours."""

    __slots__ = ("newer", "older")

    def __init__(self) -> None:
        super().__init__()
        self.older: _Segment[V, K] | None = None
        self.newer: _Segment[V, K] | None = None


class SegmentedLru(Generic[K, V]):
    """Members in order of use, least recent first, each with its key: an OrderedDict's
    LRU operations without any O(N) step, reached through the members themselves."""

    __slots__ = ("_len", "_newest", "_oldest")

    def __init__(self) -> None:
        self._oldest: _Segment[V, K] | None = None
        self._newest: _Segment[V, K] | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        seg = self._oldest
        while seg is not None:
            yield from list(seg.values())  # a segment's: bounded; the order may change meanwhile
            seg = seg.newer

    def values(self) -> Iterator[V]:
        """The members, least recently used first."""
        seg = self._oldest
        while seg is not None:
            yield from list(seg)
            seg = seg.newer

    def newest_first(self) -> Iterator[tuple[K, V]]:
        """The (key, member) pairs, most recently used first (a segment's copied as it is
        reached: the order may change meanwhile)."""
        seg = self._newest
        while seg is not None:
            yield from reversed([(key, member) for member, key in seg.items()])
            seg = seg.older

    def add(self, key: K, member: V) -> None:
        """``member`` (in no order: ValueError) as the most recently used, under ``key``."""
        if member.lru_segment is not None:
            raise ValueError("SegmentedLru.add: the member is in an order already")
        seg = self._tail()
        seg[member] = key
        member.lru_segment = seg
        self._len += 1

    def extend(self, items: Iterable[tuple[K, V]]) -> None:
        """:meth:`add` of each ``(key, member)`` in order, in one call: a segment's room
        at a time (open's bulk add: no method call per member). ValueError, at the member
        in an order already (those before it added)."""
        seg, room = self._newest, 0
        for key, member in items:
            if member.lru_segment is not None:
                raise ValueError("SegmentedLru.extend: a member is in an order already")
            if room == 0 or seg is None:
                seg = self._tail()
                room = SEGMENT_KEYS - len(seg)
            seg[member] = key
            member.lru_segment = seg
            room -= 1
            self._len += 1

    def _tail(self) -> _Segment[V, K]:
        """The newest segment, with room for one more member."""
        seg = self._newest
        if seg is None or len(seg) >= SEGMENT_KEYS:
            fresh: _Segment[V, K] = _Segment()
            fresh.older = seg
            if seg is None:
                self._oldest = fresh
            else:
                seg.newer = fresh
            self._newest = seg = fresh
        return seg

    def move_to_end(self, member: V) -> None:
        """Mark ``member`` the most recently used (ValueError if it is in no order)."""
        seg: _Segment[V, K] | None = member.lru_segment
        if seg is None:
            raise ValueError("SegmentedLru.move_to_end: the member is in no order")
        key = seg.pop(member)
        if seg is self._newest:
            seg[member] = key  # re-inserted: at its dict's end
            return
        tail = self._tail()
        tail[member] = key
        member.lru_segment = tail
        self._shrunk(seg)

    def remove(self, member: V) -> K:
        """Take ``member`` out of the order (ValueError if it is in none); its key."""
        seg: _Segment[V, K] | None = member.lru_segment
        if seg is None:
            raise ValueError("SegmentedLru.remove: the member is in no order")
        key = seg.pop(member)
        member.lru_segment = None
        self._len -= 1
        self._shrunk(seg)
        return key

    def first(self) -> tuple[K, V] | None:
        """The least recently used (key, member), or None."""
        seg = self._oldest
        if seg is None:
            return None
        member, key = next(iter(seg.items()))
        return key, member

    def pop_first(self) -> tuple[K, V]:
        """Take the least recently used (key, member) out (KeyError if empty)."""
        first = self.first()
        if first is None:
            raise KeyError("pop_first(): SegmentedLru is empty")
        self.remove(first[1])
        return first

    def _shrunk(self, seg: _Segment[V, K]) -> None:
        """Rule 3 after ``seg`` lost a member."""
        size = len(seg)
        if size == 0:
            self._unlink(seg)
            return
        if size > _SMALL:
            return
        older, newer = seg.older, seg.newer
        if older is not None and len(older) + size <= SEGMENT_KEYS:
            older.update(seg)  # after the older one's members: order kept
            into = older
        elif newer is not None and len(newer) + size <= SEGMENT_KEYS:
            kept = list(newer.items())  # in front of the newer one's members, order kept
            newer.clear()
            newer.update(seg)
            newer.update(kept)
            into = newer
        else:
            return
        for member in seg:
            member.lru_segment = into
        self._unlink(seg)
        if len(into) <= _SMALL:  # two small ones made one: it may merge on
            self._shrunk(into)

    def _unlink(self, seg: _Segment[V, K]) -> None:
        older, newer = seg.older, seg.newer
        if older is None:
            self._oldest = newer
        else:
            older.newer = newer
        if newer is None:
            self._newest = older
        else:
            newer.older = older
        seg.older = seg.newer = None

    def segment_sizes(self) -> list[int]:
        """Each segment's member count, oldest first (tests: rule 3)."""
        sizes, seg = [], self._oldest
        while seg is not None:
            sizes.append(len(seg))
            seg = seg.newer
        return sizes
