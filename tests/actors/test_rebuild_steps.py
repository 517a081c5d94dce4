"""A rebuild is an open too (docs/design.md invariant 16): with the catalogue missing, the
manifests are read on a worker thread a batch at a time, and nothing the rebuild
allocates is left for the event loop to free or to collect in one piece.

Regression: a rebuild of 100,000 manifests held every row it read until its end, then
freed them in one deallocation (0.2 s holding the GIL), and the collector, paused while
it read, found them all in its youngest generation when it resumed on the trio thread
(0.17 s): the loop stalled 0.23-0.37 s where a normal open stalls it 10-14 ms.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors import storeopen
from kvtrio.actors.coldstore import ColdTierStore
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.tiered import open_tiered_cache
from kvtrio.bench.scale import BLOCK, _model_of, _populate
from kvtrio.storage.catalogue import CATALOGUE_NAME, CatalogueRow

BATCH = 8  # manifests per batch here (SCAN_BATCH, 1,024, in use)
BATCHES = 24


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rebuild")
    _populate(directory, BATCH * BATCHES)
    return directory


async def _rebuild(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Open ``directory`` without its catalogue (so: rebuilt from every manifest) with
    batches of :data:`BATCH`; every row read is tracked. Returns the open's report."""
    for path in directory.glob(CATALOGUE_NAME + "*"):
        path.unlink()
    monkeypatch.setattr(storeopen, "SCAN_BATCH", BATCH)
    async with (
        MlxOwner.inline() as owner,
        open_tiered_cache(
            directory, _model_of(directory), owner=owner, hot_budget=1 << 30,
            cold_budget=1 << 50, block_size=BLOCK, min_free_bytes=0,
        ) as cache,
    ):  # fmt: skip
        assert cache.statistics().cold_entries == BATCH * BATCHES
        assert isinstance(cache.cold, ColdTierStore)
        return cache.cold.opening


class _Rows:
    """Every catalogue row a rebuild reads: where it was read, how many were alive at
    once, on which threads they were freed; and the collector's youngest generation as
    each manifest is read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop = threading.get_ident()
        self.read_on: set[int] = set()
        self.freed_on: set[int] = set()
        self.alive = self.most_alive = 0
        self.young: list[int] = []
        read = storeopen.CatalogueOpen._manifest_row

        def tracked(store: storeopen.CatalogueOpen, key: str) -> CatalogueRow | None:
            self.read_on.add(threading.get_ident())
            self.young.append(gc.get_count()[0])
            row = read(store, key)
            if row is not None:
                self.alive += 1
                self.most_alive = max(self.most_alive, self.alive)
                weakref.finalize(row, self._freed)
            return row

        monkeypatch.setattr(storeopen.CatalogueOpen, "_manifest_row", tracked)

    def _freed(self) -> None:
        self.alive -= 1
        self.freed_on.add(threading.get_ident())


async def test_a_rebuild_reads_on_a_worker_and_holds_at_most_a_batch_of_rows(
    manifests: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _Rows(monkeypatch)
    report = await _rebuild(manifests, monkeypatch)
    assert report.parsed == BATCH * BATCHES and not report.clean
    assert rows.read_on and rows.loop not in rows.read_on
    assert rows.alive == 0 and rows.loop not in rows.freed_on
    # A batch, the last of the one before (referenced until the next row is read) and the
    # first (read to learn whether anything changed): was every row, freed in one piece.
    assert rows.most_alive <= BATCH + 2


async def test_a_rebuild_leaves_no_pile_of_young_objects_for_the_loop(
    manifests: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The young generations are collected after each batch on the worker, so the pile
    the collector finds does not grow with the manifests read, and none is collected on
    the trio thread after the rebuild (the collector resumes there)."""
    rows = _Rows(monkeypatch)
    loop_piles: list[int] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and threading.get_ident() == rows.loop:
            loop_piles.append(gc.get_count()[0])

    gc.callbacks.append(on_collection)
    try:
        await _rebuild(manifests, monkeypatch)
    finally:
        gc.callbacks.remove(on_collection)
    first_batch = max(rows.young[:BATCH])
    assert max(rows.young) <= 2 * first_batch + 50, rows.young  # was linear in manifests
    assert all(pile <= 2 * first_batch + 700 for pile in loop_piles), loop_piles
