"""Open's work off the event loop (docs/design.md invariant 16): a worker thread's turns of
the event loop (:mod:`kvtrio.actors.loopturns`), a rebuild that gives them, and the index
build that looks no key up again."""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator
from pathlib import Path

import attrs
import pytest
import trio
from kvtrio.actors import loopturns
from kvtrio.actors.coldstore import ColdTierStore
from kvtrio.actors.coldtypes import ColdEntryInfo
from kvtrio.actors.loopturns import LoopTurns
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.tiered import open_tiered_cache
from kvtrio.bench.scale import BLOCK, _model_of, _populate
from kvtrio.storage.catalogue import CATALOGUE_NAME

from .fakes import MODEL, FakeColdStore, fake_tiered

ENTRIES = 40


async def test_a_due_turn_runs_on_the_loop_before_the_worker_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each offer past its period blocks the worker until the trio thread has run the
    turn: the worker's steps and the loop's turns alternate, one each."""
    steps: list[str] = []
    loop_thread = threading.get_ident()
    turns = LoopTurns(0.0)

    def job() -> None:
        for _ in range(5):
            steps.append("worker")
            turns.offer()

    real = loopturns._nothing

    def noted() -> None:
        assert threading.get_ident() == loop_thread
        steps.append("loop")
        real()

    monkeypatch.setattr(loopturns, "_nothing", noted)
    await trio.to_thread.run_sync(job)
    assert turns.turns == 5
    assert steps == ["worker", "loop"] * 5


async def test_an_offer_before_its_period_takes_no_turn() -> None:
    turns = LoopTurns(3600.0)

    def job() -> None:
        for _ in range(100):
            turns.offer()

    await trio.to_thread.run_sync(job)
    assert turns.turns == 0


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("turns")
    _populate(directory, ENTRIES)
    return directory


async def test_a_rebuild_giving_the_loop_a_turn_per_step_still_rebuilds_everything(
    populated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a turn due at every step (period 0), the rebuild's worker gives the loop one
    per manifest read and per row written, and still enters every entry: the catalogue it
    wrote then opens clean with every one of them, each found by its own tokens."""
    monkeypatch.setattr(loopturns, "TURN_PERIOD_S", 0.0)
    for path in populated.glob(CATALOGUE_NAME + "*"):
        path.unlink()
    model = _model_of(populated)
    async with MlxOwner.inline() as owner:
        for rebuilt in (True, False):
            async with open_tiered_cache(
                populated, model, owner=owner, hot_budget=1 << 30, cold_budget=1 << 50,
                block_size=BLOCK, min_free_bytes=0,
            ) as cache:  # fmt: skip
                store = cache.cold
                assert isinstance(store, ColdTierStore) and store.opening is not None
                report = store.opening
                assert cache.statistics().cold_entries == ENTRIES
                if rebuilt:
                    assert report.parsed == ENTRIES and not report.clean
                    assert report.loop_turns >= 2 * ENTRIES
                else:
                    assert report.clean and report.parsed == 0
                store.check()
                for entry in list(cache._index):
                    assert cache._index.lookup(model, [*entry.tokens, 1]) is not None


class _TwiceFound(FakeColdStore):
    """A store that lists one key twice, with other tokens each time, both with their
    rank in token order (so open indexes them in that order, from its by-order list)."""

    async def entries(self) -> AsyncGenerator[list[ColdEntryInfo], None]:
        older = ColdEntryInfo(
            key="k", model=MODEL, tokens=(1, 2, 3, 4, 5), trimmable=True,
            min_reusable_offset=0, mtime=1.0, order=0,
        )  # fmt: skip
        newer = attrs.evolve(older, tokens=(7, 8, 9, 10, 11), mtime=2.0, order=1)
        yield [newer, older]


async def test_a_key_found_twice_at_open_is_indexed_once_as_first_entered(
    tmp_path: Path,
) -> None:
    """Open enters a key once (the least recently used listing of it), and its index
    build adds the entry of the key's record alone, looking no key up again
    (tieredload._index_found): had the other listing been indexed too, it would have
    replaced the first in the index (the same key), leaving the record and the index
    disagreeing."""
    async with fake_tiered(_TwiceFound(tmp_path, MODEL)) as cache:
        indexed = list(cache._index)
        assert [entry.tokens for entry in indexed] == [(1, 2, 3, 4, 5)]
        assert indexed[0] is cache._records["k"].entry
