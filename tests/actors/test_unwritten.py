"""A write that does not land says why (StoreResult.unwritten, TieredStatistics'
``unwritten_*``, kvtrio serve's exit line): its ``drops`` alone lumped together a write
shed by the tier's queue, one cut by the shutdown grace, one that failed and one the
tier refused, which a restart that lost an entry could not tell apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.coldstore import ColdTierStore
from kvtrio.actors.coldtypes import StoreResult
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.spill import SpillOutcome
from kvtrio.actors.tier import ColdTier
from kvtrio.actors.tierrecords import SaveResult
from kvtrio.errors import ShuttingDown

from .fakes import MODEL, FakeColdStore, fake_caches, fake_tiered


class _Settled:
    """A save ticket that has settled as ``outcome``."""

    def __init__(self, outcome: SpillOutcome) -> None:
        self.outcome = outcome

    async def wait(self) -> SaveResult:
        failed = self.outcome is SpillOutcome.FAILED
        return SaveResult(self.outcome, RuntimeError("injected") if failed else None)


@pytest.mark.parametrize(
    "outcome", [SpillOutcome.DROPPED, SpillOutcome.CANCELLED, SpillOutcome.FAILED]
)
async def test_the_tiers_store_names_how_a_save_that_did_not_land_settled(
    tmp_path: Path, outcome: SpillOutcome, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with MlxOwner.inline() as owner, ColdTier.open(tmp_path, owner=owner) as tier:
        store = await ColdTierStore.create(tier)

        async def settled(*args: Any, **kwargs: Any) -> _Settled:
            return _Settled(outcome)

        monkeypatch.setattr(tier, "save", settled)
        result = await store.store("k", ModelKey("m", "f"), [1, 2, 3], [], meta={})
    assert not result.written and result.unwritten == outcome.value


async def _store_failing_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> StoreResult:
    class FailedTicket:
        async def wait(self) -> SaveResult:
            return SaveResult(SpillOutcome.FAILED, error)

    async with MlxOwner.inline() as owner, ColdTier.open(tmp_path, owner=owner) as tier:
        store = await ColdTierStore.create(tier)

        async def failing(*args: Any, **kwargs: Any) -> FailedTicket:
            return FailedTicket()

        monkeypatch.setattr(tier, "save", failing)
        return await store.store("k", ModelKey("m", "f"), [1, 2, 3], [], meta={})


async def test_a_write_the_disk_failed_under_is_a_disk_error_and_its_error_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An OSError under the tier's own write (EIO) is ``error`` (counted in cold_errors
    too), not ``failed``; and a write that raised says what it raised, once, in the log
    (the counters alone could not tell a probe's failing wrapper from a disk): a disk's
    error in one line, with no traceback (a store down at shutdown fails every write)."""
    import errno

    result = await _store_failing_with(tmp_path, monkeypatch, OSError(errno.EIO, "injected EIO"))
    assert not result.written and result.unwritten == "error"
    logged = [r for r in caplog.records if "cold write of k did not land (error)" in r.message]
    assert len(logged) == 1 and "injected EIO" in logged[0].getMessage()
    assert logged[0].exc_info is None


async def test_a_write_that_raised_a_bug_is_logged_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    result = await _store_failing_with(tmp_path, monkeypatch, RuntimeError("injected bug"))
    assert not result.written and result.unwritten == "failed"
    logged = [r for r in caplog.records if "cold write of k did not land (failed)" in r.message]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert isinstance(logged[0].exc_info[1], RuntimeError)


async def test_the_tiers_store_names_a_save_the_tier_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with MlxOwner.inline() as owner, ColdTier.open(tmp_path, owner=owner) as tier:
        store = await ColdTierStore.create(tier)

        async def closing(*args: Any, **kwargs: Any) -> None:
            raise ShuttingDown("closing")

        monkeypatch.setattr(tier, "save", closing)
        result = await store.store("k", ModelKey("m", "f"), [1, 2, 3], [], meta={})
    assert not result.written and result.unwritten == "refused"


async def _one_refused_write(tmp_path: Path) -> tuple[Any, str]:
    """One spill to a store that refuses it (raises KvtrioError), settled: the tiered
    cache's statistics and metrics text after it."""
    store = FakeColdStore(tmp_path, MODEL, fail_stores=True)
    async with fake_tiered(store, hot_budget=0) as cache:
        await cache.spill(list(range(8)), fake_caches(8))
        await cache.wait_writes_settled()
        return cache.statistics(), cache.metrics_text()


async def test_a_write_that_did_not_land_is_counted_by_why(tmp_path: Path) -> None:
    stats, _ = await _one_refused_write(tmp_path)
    assert stats.drops == 1 and stats.cold_entries == 0
    assert stats.unwritten_refused == 1
    assert (
        stats.unwritten_dropped,
        stats.unwritten_cancelled,
        stats.unwritten_failed,
        stats.unwritten_error,
    ) == (0, 0, 0, 0)


async def test_a_write_that_did_not_land_is_in_the_metrics_by_why(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    _, text = await _one_refused_write(tmp_path)
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "kvtrio_cold_unwritten"
    )
    got = {s.labels["reason"]: s.value for s in family.samples}
    assert got == {"dropped": 0, "cancelled": 0, "failed": 0, "refused": 1, "error": 0}


async def test_landing_names_each_flushed_write_on_disk_on_its_way_or_lost_and_why(
    tmp_path: Path,
) -> None:
    """What a closing server prints entry by entry when its deadline passed: the writes
    it handed over that are on disk, queued, in flight, and a lost one with its reason
    (counters alone said how many, not which)."""
    import trio
    import trio.testing
    from kvtrio.actors.tieredtypes import Landing

    gate = trio.Event()
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0) as cache:
        durable = await cache.spill(list(range(8)), fake_caches(8), flush=True)
        await cache.wait_writes_settled()
        store.fail_stores = True
        refused = await cache.spill(list(range(100, 108)), fake_caches(8), flush=True)
        await cache.wait_writes_settled()
        store.fail_stores, store.store_gate = False, gate
        writing = await cache.spill(list(range(200, 208)), fake_caches(8), flush=True)
        await trio.testing.wait_all_tasks_blocked()
        queued = await cache.spill(list(range(300, 308)), fake_caches(8), flush=True)
        assert cache.landing([durable, refused, writing, queued]) == {
            durable: Landing.DURABLE,
            refused: Landing.REFUSED,
            writing: Landing.WRITING,
            queued: Landing.QUEUED,
        }
        gate.set()


async def test_a_disk_error_under_the_tiers_write_is_counted_in_cold_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cold_errors`` counts every OSError around the cold tier: one the tier's own
    write met (its store's result says ``error``) as well as one the store raised."""
    from kvtrio.actors.coldstore import StoreResult

    store = FakeColdStore(tmp_path, MODEL)

    async def eio(*args: Any, **kwargs: Any) -> StoreResult:
        return StoreResult(written=False, unwritten="error")

    monkeypatch.setattr(FakeColdStore, "store", eio)
    async with fake_tiered(store, hot_budget=0) as cache:
        await cache.spill(list(range(8)), fake_caches(8))
        await cache.wait_writes_settled()
        stats = cache.statistics()
    assert (stats.drops, stats.unwritten_error, stats.cold_errors) == (1, 1, 1)
