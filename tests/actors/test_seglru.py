"""SegmentedLru keeps an OrderedDict's LRU order and eviction, in bounded segments."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtrio.actors import seglru
from kvtrio.actors.seglru import SegmentedLru

# Few keys and small segments, so that operations cross segments, merge and empty them.
_KEYS = st.integers(min_value=0, max_value=15).map(lambda n: f"k{n}")
# Weighted towards adds and touches, so the map grows past a few segments before the
# removals shrink, merge and empty them.
_OP = st.sampled_from(["set"] * 5 + ["touch"] * 4 + ["pop", "del", "evict", "popnewest"])
_OPS = st.lists(st.tuples(_OP, _KEYS, st.integers(0, 9)), min_size=20, max_size=200)


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
    for key in model:
        assert key in lru and lru[key] == model[key] == lru.get(key)


_FIXTURE_KEPT = [HealthCheck.function_scoped_fixture]  # the same constants for every input


@settings(max_examples=200, deadline=None, suppress_health_check=_FIXTURE_KEPT)
@given(ops=_OPS)
def test_order_and_eviction_agree_with_an_ordered_dict(
    tiny_segments: None, ops: list[tuple[str, str, int]]
) -> None:
    lru: SegmentedLru[str, int] = SegmentedLru()
    model: OrderedDict[str, int] = OrderedDict()
    for op, key, value in ops:
        if op == "set":
            lru[key] = value
            model[key] = value
        elif op == "touch":
            if key in model:
                lru.move_to_end(key)
                model.move_to_end(key)
            else:
                with pytest.raises(KeyError):
                    lru.move_to_end(key)
        elif op == "pop":
            assert lru.pop(key, None) == model.pop(key, None)
        elif op == "del":
            if key in model:
                del lru[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del lru[key]
        elif model:
            last = op == "popnewest"
            assert lru.popitem(last=last) == model.popitem(last=last)
        else:
            with pytest.raises(KeyError):
                lru.popitem(last=op == "popnewest")
        _check(lru, model)
    assert lru.get("absent") is None and "absent" not in lru


def test_no_segment_grows_past_its_bound_and_the_order_is_kept_at_scale() -> None:
    lru: SegmentedLru[int, None] = SegmentedLru()
    n = 3 * seglru.SEGMENT_KEYS + 5
    for i in range(n):
        lru[i] = None
    assert lru.segment_sizes() == [seglru.SEGMENT_KEYS] * 3 + [5]
    for i in range(0, n, 2):  # touch every even key: odd ones are now the oldest
        lru.move_to_end(i)
    assert list(lru) == list(range(1, n, 2)) + list(range(0, n, 2))
    assert max(lru.segment_sizes()) <= seglru.SEGMENT_KEYS
    assert [lru.popitem(last=False)[0] for _ in range(3)] == [1, 3, 5]


def test_a_small_oldest_segment_merges_in_front_of_the_next_in_order(small_segments: None) -> None:
    lru: SegmentedLru[int, None] = SegmentedLru()
    model: OrderedDict[int, None] = OrderedDict()
    for i in range(12):  # segments [0..7] [8..11]
        lru[i] = model[i] = None
    for _ in range(6):  # the oldest falls to 2 keys: merged in front of [8..11]
        assert lru.popitem(last=False) == model.popitem(last=False)
    assert lru.segment_sizes() == [6]
    _check(lru, model)
    assert list(lru) == [6, 7, 8, 9, 10, 11]


def test_a_small_segment_merges_after_the_older_one_in_order(small_segments: None) -> None:
    lru: SegmentedLru[int, None] = SegmentedLru()
    model: OrderedDict[int, None] = OrderedDict()
    for i in range(20):  # segments [0..7] [8..15] [16..19]
        lru[i] = model[i] = None
    for key in range(6):  # the oldest falls to [6, 7]: merged in front of [8..15]? full
        del lru[key], model[key]
    for key in range(8, 14):  # the middle one falls to [14, 15]: after [6, 7]
        lru.move_to_end(key)
        model.move_to_end(key)
    _check(lru, model)
    assert lru.segment_sizes()[0] == 4 and list(lru)[:4] == [6, 7, 14, 15]


@settings(max_examples=200, deadline=None, suppress_health_check=_FIXTURE_KEPT)
@given(
    before=st.lists(st.tuples(_KEYS, st.integers(0, 9)), max_size=30),
    gone=st.sets(_KEYS),
    items=st.lists(
        st.tuples(_KEYS | st.integers(16, 60).map(lambda n: f"k{n}"), st.integers(0, 9))
    ),
)
def test_extend_is_setitem_of_each(
    tiny_segments: None,
    before: list[tuple[str, int]],
    gone: set[str],
    items: list[tuple[str, int]],
) -> None:
    """``extend`` (open's bulk add) leaves the order, values and segments that
    ``lru[key] = value`` of each item leaves, present keys included (their places kept),
    over a map whose newest segment is full, part full or gone."""
    lru: SegmentedLru[str, int] = SegmentedLru()
    model: OrderedDict[str, int] = OrderedDict()
    for key, value in before:
        lru[key] = value
        model[key] = value
    for key in gone:
        lru.pop(key)
        model.pop(key, None)
    lru.extend(items)
    for key, value in items:
        model[key] = value
    _check(lru, model)


def test_a_key_costs_the_lru_about_a_plain_dicts_memory() -> None:
    """Open puts every stored entry in the cold LRU: its segments are plain dicts (with
    the key -> segment table, about 59 bytes a key here), not OrderedDicts (a linked node
    per key: about 106)."""
    import tracemalloc

    keys = [f"{n:064x}" for n in range(3 * seglru.SEGMENT_KEYS)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        lru: SegmentedLru[str, None] = SegmentedLru()
        lru.extend((key, None) for key in keys)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    finally:
        tracemalloc.stop()
    assert len(lru) == len(keys)
    assert per_key < 80, per_key
