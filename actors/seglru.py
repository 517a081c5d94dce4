"""An ordered map for LRUs whose every step is bounded: no table of all its keys resizes.

An :class:`~collections.OrderedDict` of N keys grows its table in one C call that holds the
GIL for time proportional to N (13-28 ms at 87,381 keys on the 2-core VM,
docs/benchmarks.md, sixth pass): on a worker thread during the cold tier's open, that one
call is a stall of the trio loop. :class:`SegmentedLru` keeps the same order in pieces.

Theory of operation
-------------------
1. The keys live in *segments*: small plain dicts (insertion-ordered; a third of an
   OrderedDict's memory per key, which open pays for every stored entry) chained oldest
   to newest, each of at most :data:`SEGMENT_KEYS` keys. The map's order is the
   segments' order, then each segment's own. A key is added, or touched
   (``move_to_end``), at the end of the newest segment; a new newest segment starts
   when it is full.
2. Which segment holds a key is a second table, split by the key's hash into
   :data:`PARTS` plain dicts (the hash of a ``str`` is cached, so that costs nothing
   more), so at 1,000,000 keys each part holds ~16,000 and its resize stays under a
   millisecond.
3. An empty segment leaves the chain at once. A segment that falls to
   ``SEGMENT_KEYS // 4`` keys or fewer (*small*) is merged into a neighbour that has
   room (its keys moved, order kept: at most ``SEGMENT_KEYS // 4`` moves; a small result
   is checked again), so no two small segments are neighbours and the chain holds at
   most ``2 N / (SEGMENT_KEYS // 4 + 1) + 2`` segments (about ``8 N / SEGMENT_KEYS``).

Costs: add, touch, get, pop and the newest item are O(1) (a merge is a bounded
``SEGMENT_KEYS`` moves); the oldest item (``first``, ``popitem(last=False)``) is O(1)
plus a skip over the keys already taken from the front of its segment, which a plain dict
leaves as holes until it is merged or resized: about 4/3 :data:`SEGMENT_KEYS` at most (a
segment churned first in, first out holds up to its dict's usable size in holes, 5,460
at 4,096 keys), a few microseconds; ``extend`` of k items O(k); iteration is O(N) in
Python steps, none of them proportional to N.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["PARTS", "SEGMENT_KEYS", "SegmentedLru"]

K = TypeVar("K")
V = TypeVar("V")

SEGMENT_KEYS = 4096
"""Most keys in one segment (its table's resize: well under a millisecond)."""

PARTS = 64
"""How many plain dicts the key -> segment table is split into (a power of two)."""

_MASK = PARTS - 1
_SMALL = SEGMENT_KEYS // 4


class _Segment(dict[K, V]):
    """One piece of the order, linked to its older and newer neighbours."""

    __slots__ = ("newer", "older")

    def __init__(self) -> None:
        super().__init__()
        self.older: _Segment[K, V] | None = None
        self.newer: _Segment[K, V] | None = None


class SegmentedLru(Generic[K, V]):
    """Keys in order of use, least recent first: an OrderedDict's LRU operations
    (``d[k] = v`` keeps a present key's place, as OrderedDict does) without any O(N) step."""

    __slots__ = ("_len", "_newest", "_oldest", "_parts")

    def __init__(self) -> None:
        self._parts: list[dict[K, _Segment[K, V]]] = [{} for _ in range(PARTS)]
        self._oldest: _Segment[K, V] | None = None
        self._newest: _Segment[K, V] | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, key: K) -> bool:
        return key in self._parts[hash(key) & _MASK]

    def __iter__(self) -> Iterator[K]:
        seg = self._oldest
        while seg is not None:
            yield from list(seg)  # a segment's keys: bounded; the map may change meanwhile
            seg = seg.newer

    def newest_first(self) -> Iterator[tuple[K, V]]:
        """The items, most recently used first (a segment's items copied as it is reached:
        the map may change meanwhile)."""
        seg = self._newest
        while seg is not None:
            yield from reversed(list(seg.items()))
            seg = seg.older

    def values(self) -> Iterator[V]:
        """The values, least recently used first."""
        seg = self._oldest
        while seg is not None:
            yield from list(seg.values())
            seg = seg.newer

    def get(self, key: K, default: V | None = None) -> V | None:
        seg = self._parts[hash(key) & _MASK].get(key)
        return default if seg is None else seg[key]

    def __getitem__(self, key: K) -> V:
        return self._parts[hash(key) & _MASK][key][key]

    def __setitem__(self, key: K, value: V) -> None:
        part = self._parts[hash(key) & _MASK]
        seg = part.get(key)
        if seg is not None:  # present: its value changes, its place does not
            seg[key] = value
            return
        part[key] = self._append(key, value)
        self._len += 1

    def extend(self, items: Iterable[tuple[K, V]]) -> None:
        """``self[key] = value`` of each item in order (a present key keeps its place),
        in one call: the new keys go into the newest segment a segment's room at a time
        (open's bulk add: no method call per key)."""
        parts, seg, room, added = self._parts, self._newest, 0, 0
        for key, value in items:
            part = parts[hash(key) & _MASK]
            present = part.get(key)
            if present is not None:
                present[key] = value
                continue
            if room == 0 or seg is None:
                seg = self._tail()
                room = SEGMENT_KEYS - len(seg)
            seg[key] = value
            part[key] = seg
            room -= 1
            added += 1
        self._len += added

    def _append(self, key: K, value: V) -> _Segment[K, V]:
        seg = self._tail()
        seg[key] = value
        return seg

    def _tail(self) -> _Segment[K, V]:
        """The newest segment, with room for one more key."""
        seg = self._newest
        if seg is None or len(seg) >= SEGMENT_KEYS:
            fresh: _Segment[K, V] = _Segment()
            fresh.older = seg
            if seg is None:
                self._oldest = fresh
            else:
                seg.newer = fresh
            self._newest = seg = fresh
        return seg

    def move_to_end(self, key: K) -> None:
        """Mark ``key`` the most recently used (KeyError if absent)."""
        part = self._parts[hash(key) & _MASK]
        seg = part[key]
        if seg is self._newest:
            seg[key] = seg.pop(key)  # re-inserted: at its dict's end
            return
        value = seg.pop(key)
        part[key] = self._append(key, value)
        self._shrunk(seg)

    def __delitem__(self, key: K) -> None:
        seg = self._parts[hash(key) & _MASK].pop(key)
        del seg[key]
        self._len -= 1
        self._shrunk(seg)

    def pop(self, key: K, default: V | None = None) -> V | None:
        seg = self._parts[hash(key) & _MASK].pop(key, None)
        if seg is None:
            return default
        value = seg.pop(key)
        self._len -= 1
        self._shrunk(seg)
        return value

    def popitem(self, last: bool = True) -> tuple[K, V]:
        """Take the newest (``last``) or the oldest item out (KeyError if empty)."""
        seg = self._newest if last else self._oldest
        if seg is None:
            raise KeyError("popitem(): SegmentedLru is empty")
        if last:
            key, value = seg.popitem()  # a dict pops its last item
        else:
            key = next(iter(seg))
            value = seg.pop(key)
        del self._parts[hash(key) & _MASK][key]
        self._len -= 1
        self._shrunk(seg)
        return key, value

    def first(self) -> tuple[K, V] | None:
        """The least recently used item, or None."""
        seg = self._oldest
        return None if seg is None else next(iter(seg.items()))

    def _shrunk(self, seg: _Segment[K, V]) -> None:
        """Rule 3 after ``seg`` lost a key."""
        size = len(seg)
        if size == 0:
            self._unlink(seg)
            return
        if size > _SMALL:
            return
        older, newer = seg.older, seg.newer
        if older is not None and len(older) + size <= SEGMENT_KEYS:
            older.update(seg)  # after the older one's keys: order kept
            into = older
        elif newer is not None and len(newer) + size <= SEGMENT_KEYS:
            kept = list(newer.items())  # in front of the newer one's keys, order kept
            newer.clear()
            newer.update(seg)
            newer.update(kept)
            into = newer
        else:
            return
        self._repoint(seg, into)
        self._unlink(seg)
        if len(into) <= _SMALL:  # two small ones made one: it may merge on
            self._shrunk(into)

    def _repoint(self, moved: _Segment[K, V], into: _Segment[K, V]) -> None:
        parts = self._parts
        for key in moved:
            parts[hash(key) & _MASK][key] = into

    def _unlink(self, seg: _Segment[K, V]) -> None:
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
        """Each segment's key count, oldest first (tests: rule 3)."""
        sizes, seg = [], self._oldest
        while seg is not None:
            sizes.append(len(seg))
            seg = seg.newer
        return sizes
