"""The cold entry lifecycle (kvtrio.actors.lifecycle): every transition of the table is
walked, every other (state, event) pair is refused, and the ledger's derived figures
(cold LRU, pending queue, reserved bytes) follow the states on every step.

Guards docs/design.md invariant 13.
"""

from __future__ import annotations

import itertools

import pytest
from kvtrio.actors.lifecycle import (
    TRANSITIONS,
    ColdEvent,
    ColdLedger,
    ColdSide,
    ColdState,
    next_state,
)
from kvtrio.errors import LifecycleError


@pytest.mark.parametrize(("state", "event"), sorted(TRANSITIONS, key=str))
def test_every_listed_transition_moves_the_ledger_with_it(
    state: ColdState, event: ColdEvent
) -> None:
    """Reach ``state`` by a legal path, apply ``event``, and check what derives from it."""
    ledger = ColdLedger()
    side = ColdSide("k", nbytes=100)
    for step in _path_to(state):
        ledger.apply(side, step)
    assert side.state is state
    new = ledger.apply(side, event)
    assert new is TRANSITIONS[state, event] is side.state
    ledger.check()
    assert ledger.durable_keys() == (["k"] if new is ColdState.DURABLE else [])
    assert ledger.queued_bytes == (100 if new is ColdState.QUEUED else 0)
    writing = new in (ColdState.WRITING, ColdState.WRITING_DOOMED)
    assert ledger.reserved == (100 if writing else 0)


def test_every_unlisted_pair_is_refused() -> None:
    refused = 0
    for state, event in itertools.product(ColdState, ColdEvent):
        if (state, event) in TRANSITIONS:
            continue
        with pytest.raises(LifecycleError):
            next_state(state, event)
        refused += 1
    assert refused == len(ColdState) * len(ColdEvent) - len(TRANSITIONS)


def test_every_state_is_reachable_and_can_get_back_to_none() -> None:
    for state in ColdState:
        ledger, side = ColdLedger(), ColdSide("k", 7)
        for step in [*_path_to(state), *_path_home(state)]:
            ledger.apply(side, step)
        assert side.state is ColdState.NONE
        assert (ledger.reserved, ledger.queued_bytes, ledger.durable_count()) == (0, 0, 0)


def test_a_refused_event_changes_nothing() -> None:
    ledger, side = ColdLedger(), ColdSide("k", 5)
    ledger.apply(side, ColdEvent.QUEUE)
    with pytest.raises(LifecycleError):
        ledger.apply(side, ColdEvent.WRITTEN)
    assert side.state is ColdState.QUEUED and ledger.queued_bytes == 5
    ledger.check()


def test_the_cold_lru_is_least_recently_used_first() -> None:
    ledger = ColdLedger()
    sides = [ColdSide(name, 1) for name in "abc"]
    for side in sides:
        ledger.apply(side, ColdEvent.FOUND)
    ledger.touch(sides[0])
    assert ledger.durable_keys() == ["b", "c", "a"]
    oldest = ledger.oldest_durable()
    assert oldest is sides[1]
    ledger.apply(oldest, ColdEvent.EVICT)
    assert ledger.durable_keys() == ["c", "a"]


def _path_to(state: ColdState) -> list[ColdEvent]:
    e = ColdEvent
    return {
        ColdState.NONE: [],
        ColdState.QUEUED: [e.QUEUE],
        ColdState.WRITING: [e.QUEUE, e.START],
        ColdState.WRITING_DOOMED: [e.QUEUE, e.START, e.DOOM],
        ColdState.DURABLE: [e.FOUND],
        ColdState.EVICTING: [e.FOUND, e.EVICT],
    }[state]


def _path_home(state: ColdState) -> list[ColdEvent]:
    e = ColdEvent
    return {
        ColdState.NONE: [],
        ColdState.QUEUED: [e.DROP],
        ColdState.WRITING: [e.FAILED],
        ColdState.WRITING_DOOMED: [e.WRITTEN, e.REMOVED],
        ColdState.DURABLE: [e.FORGET],
        ColdState.EVICTING: [e.REMOVED],
    }[state]


def test_found_many_is_apply_of_found_to_each() -> None:
    """``ColdLedger.found_many`` (open's, a batch at a time) is ``apply(FOUND)`` of each in
    order: NONE to DURABLE, last in the cold LRU (two sides of one key are two places: the
    LRU holds exactly the DURABLE sides); from any other state the table refuses it
    (LifecycleError) before any side of the batch moves."""
    by_apply, by_found = ColdLedger(), ColdLedger()
    keys = ["k0", "k1", "k2", "k1", "k3"]
    for key in keys:
        by_apply.apply(ColdSide(key, 10), ColdEvent.FOUND)
    by_found.found_many([ColdSide(key, 10) for key in keys[:2]])
    by_found.found_many([ColdSide(key, 10) for key in keys[2:]])
    assert by_found.durable_keys() == by_apply.durable_keys() == keys
    by_found.check()
    side = by_found.oldest_durable()
    assert side is not None and side.state is ColdState.DURABLE
    fresh = ColdSide("k9", 10)
    with pytest.raises(LifecycleError):
        by_found.found_many([fresh, side])
    assert fresh.state is ColdState.NONE and side.state is ColdState.DURABLE
    assert by_found.durable_keys() == keys
