"""SegmentedLru keeps an OrderedDict's LRU order and eviction, in bounded segments, each
member recording the segment that holds it."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtrio.actors import seglru
from kvtrio.actors.seglru import SegmentedLru

# Few keys and small segments, so that operations cross segments, merge and empty them.
_KEYS = st.integers(min_value=0, max_value=15).map(lambda n: f"k{n}")
# Weighted towards adds and touches, so the order grows past a few segments before the
# removals shrink, merge and empty them.
_OP = st.sampled_from(["add"] * 5 + ["touch"] * 4 + ["remove", "evict"])
_OPS = st.lists(st.tuples(_OP, _KEYS), min_size=20, max_size=200)


@attrs.define(eq=False)
class _Member:
    key: str
    lru_segment: Any = attrs.field(default=None, init=False, repr=False)


@pytest.fixture
def tiny_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seglru, "SEGMENT_KEYS", 6)
    monkeypatch.setattr(seglru, "_SMALL", 2)


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seglru, "SEGMENT_KEYS", 8)
    monkeypatch.setattr(seglru, "_SMALL", 2)


def _check(lru: SegmentedLru[Any, Any], model: OrderedDict[Any, Any]) -> None:
    assert list(lru) == list(model)
    assert list(lru.values()) == list(model.values())
    assert list(lru.newest_first()) == list(reversed(model.items()))  # the warm restart's order
    assert len(lru) == len(model) and bool(lru) == bool(model)
    assert lru.first() == next(iter(model.items()), None)
    sizes = lru.segment_sizes()
    assert sum(sizes) == len(model) and all(0 < n <= seglru.SEGMENT_KEYS for n in sizes)
    # Rule 3: no two small segments are neighbours, so few segments for the keys.
    small = [n <= seglru._SMALL for n in sizes]
    assert not any(a and b for a, b in itertools.pairwise(small))
    assert len(sizes) <= 2 * len(model) / (seglru._SMALL + 1) + 2
    # Rule 2: each member names the segment that holds it, merged or not.
    seg = lru._oldest
    while seg is not None:
        assert all(member.lru_segment is seg for member in seg)
        seg = seg.newer


_FIXTURE_KEPT = [HealthCheck.function_scoped_fixture]  # the same constants for every input


@settings(max_examples=200, deadline=None, suppress_health_check=_FIXTURE_KEPT)
@given(ops=_OPS)
def test_order_and_eviction_agree_with_an_ordered_dict(
    tiny_segments: None, ops: list[tuple[str, str]]
) -> None:
    lru: SegmentedLru[str, _Member] = SegmentedLru()
    model: OrderedDict[str, _Member] = OrderedDict()
    for op, key in ops:
        if op == "add":
            if key in model:
                with pytest.raises(ValueError, match=r"^SegmentedLru.add: the member is in"):
                    lru.add(key, model[key])
            else:
                member = model[key] = _Member(key)
                lru.add(key, member)
        elif op == "touch":
            if key in model:
                lru.move_to_end(model[key])
                model.move_to_end(key)
            else:
                with pytest.raises(ValueError, match=r"^SegmentedLru.move_to_end: the member"):
                    lru.move_to_end(_Member(key))
        elif op == "remove":
            if key in model:
                member = model.pop(key)
                assert lru.remove(member) == key and member.lru_segment is None
            else:
                with pytest.raises(ValueError, match=r"^SegmentedLru.remove: the member is in"):
                    lru.remove(_Member(key))
        elif model:
            key, member = lru.pop_first()
            assert (key, member) == model.popitem(last=False)
            assert member.lru_segment is None
        else:
            with pytest.raises(KeyError):
                lru.pop_first()
        _check(lru, model)


def test_no_segment_grows_past_its_bound_and_the_order_is_kept_at_scale() -> None:
    lru: SegmentedLru[int, _Member] = SegmentedLru()
    n = 3 * seglru.SEGMENT_KEYS + 5
    members = [_Member(str(i)) for i in range(n)]
    for i, member in enumerate(members):
        lru.add(i, member)
    assert lru.segment_sizes() == [seglru.SEGMENT_KEYS] * 3 + [5]
    for i in range(0, n, 2):  # touch every even key: odd ones are now the oldest
        lru.move_to_end(members[i])
    assert list(lru) == list(range(1, n, 2)) + list(range(0, n, 2))
    assert max(lru.segment_sizes()) <= seglru.SEGMENT_KEYS
    assert [lru.pop_first()[0] for _ in range(3)] == [1, 3, 5]


def _filled(n: int) -> tuple[SegmentedLru[int, _Member], OrderedDict[int, _Member]]:
    lru: SegmentedLru[int, _Member] = SegmentedLru()
    model: OrderedDict[int, _Member] = OrderedDict()
    for i in range(n):
        model[i] = _Member(str(i))
        lru.add(i, model[i])
    return lru, model


def test_a_small_oldest_segment_merges_in_front_of_the_next_in_order(small_segments: None) -> None:
    lru, model = _filled(12)  # segments [0..7] [8..11]
    for _ in range(6):  # the oldest falls to 2 keys: merged in front of [8..11]
        assert lru.pop_first() == model.popitem(last=False)
    assert lru.segment_sizes() == [6]
    _check(lru, model)
    assert list(lru) == [6, 7, 8, 9, 10, 11]


def test_a_small_segment_merges_after_the_older_one_in_order(small_segments: None) -> None:
    lru, model = _filled(20)  # segments [0..7] [8..15] [16..19]
    for key in range(6):  # the oldest falls to [6, 7]: merged in front of [8..15]? full
        lru.remove(model.pop(key))
    for key in range(8, 14):  # the middle one falls to [14, 15]: after [6, 7]
        lru.move_to_end(model[key])
        model.move_to_end(key)
    _check(lru, model)
    assert lru.segment_sizes()[0] == 4 and list(lru)[:4] == [6, 7, 14, 15]


@settings(max_examples=200, deadline=None, suppress_health_check=_FIXTURE_KEPT)
@given(
    before=st.lists(_KEYS, max_size=30, unique=True),
    gone=st.sets(_KEYS),
    added=st.lists(st.integers(16, 60).map(lambda n: f"k{n}"), unique=True),
)
def test_extend_is_add_of_each(
    tiny_segments: None, before: list[str], gone: set[str], added: list[str]
) -> None:
    """``extend`` (open's bulk add) leaves the order, members and segments that ``add``
    of each leaves, over an order whose newest segment is full, part full or gone; a
    member in an order already is refused there, those before it added."""
    lru: SegmentedLru[str, _Member] = SegmentedLru()
    model: OrderedDict[str, _Member] = OrderedDict()
    for key in before:
        model[key] = _Member(key)
        lru.add(key, model[key])
    for key in gone & set(model):
        lru.remove(model.pop(key))
    items = [(key, _Member(key)) for key in added]
    lru.extend(items)
    model.update(items)
    _check(lru, model)
    if model:
        fresh, (key, present) = _Member("new"), next(iter(model.items()))
        with pytest.raises(ValueError, match=r"^SegmentedLru.extend: a member is in an order"):
            lru.extend([("new", fresh), (key, present)])
        model["new"] = fresh
        _check(lru, model)


def test_a_member_costs_the_lru_less_than_a_plain_dicts_entry_with_a_key_table() -> None:
    """Open puts every stored entry in the cold LRU and every found slot in the cold
    policy's: a member costs its segment's entry alone (about 36 bytes here), with no
    table from keys to segments (SegmentedLru before branch open13: about 59 bytes a key)
    and no OrderedDict's linked node (about 106)."""
    import tracemalloc

    members = [_Member(f"{n:064x}") for n in range(3 * seglru.SEGMENT_KEYS)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        lru: SegmentedLru[str, _Member] = SegmentedLru()
        lru.extend((member.key, member) for member in members)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / len(members)
    finally:
        tracemalloc.stop()
    assert len(lru) == len(members)
    assert per_key < 50, per_key
