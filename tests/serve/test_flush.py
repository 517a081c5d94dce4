"""kvtrio serve's SIGTERM promise (issue 17): every RAM entry is written unless the stated
deadline passes, and then the exit lines name each entry that did not land, and why."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from kvtrio.serve.flushreport import (
    FLUSH_BYTES_PER_SECOND,
    FlushedEntry,
    FlushReport,
    HandOver,
    flush_deadline,
    print_exit,
)
from kvtrio.tinymodel import TinyModel, build_tiny_model

from .test_adapter import MODEL, _adapter, _prefilled, _stall_stores

PROMPTS = [[100 * (i + 1), *range(1, 40)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=3)


def test_a_close_that_writes_everything_reports_every_entry_on_disk(
    tiny: TinyModel, tmp_path: Path
) -> None:
    with _adapter(tiny, tmp_path) as (cache, _):
        for prompt in PROMPTS:
            cache.insert_cache(MODEL, prompt, _prefilled(tiny, prompt))
    report = cache.flush_report()
    assert report == FlushReport(handed=3, landed=3, lost=())


def test_a_close_past_its_deadline_names_each_entry_not_written_and_why(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk stalls: no write can land before the close's deadline, whatever the
    timing. The close gives up (False: kvtrio serve exits 1), and the report, read on
    the tier's loop that still runs, names all three entries: one in flight at most,
    the others queued or not yet queued (their spill waiting for an owner job). Before,
    the exit line counted the queued ones alone ("pending writes left"), and neither
    the write in flight nor a spill not yet queued showed anywhere."""
    gate = _stall_stores(monkeypatch)
    with _adapter(tiny, tmp_path) as (cache, tier):
        for prompt in PROMPTS:
            cache.insert_cache(MODEL, prompt, _prefilled(tiny, prompt))
        assert not cache.close(timeout=0.5)
        report = cache.flush_report()
        assert (report.handed, report.landed, len(report.lost)) == (3, 0, 3)
        whys = [why for _, _, why in report.lost]
        assert set(whys) <= {"writing", "queued", "not queued"} and whys.count("writing") <= 1
        assert sorted(tokens for tokens, _, _ in report.lost) == [len(p) for p in PROMPTS]
        gate.set()  # let the tier's loop finish (it needs this thread's pumps)
        deadline = time.monotonic() + 60
        while tier._thread.is_alive():
            assert time.monotonic() < deadline, "the tier's loop did not end"
            cache.pump(0.01)
            time.sleep(0.001)


def test_the_report_names_entries_that_never_reached_the_tier() -> None:
    """Entries the close could not hand over are named with why, beside the tier's
    answers for the others (a write lost on disk is named by its reason)."""

    class Durable:
        value = "on disk"

    class Refused:
        value = "refused"

    entries = [
        FlushedEntry(10, key="a"),
        FlushedEntry(20, key="b"),
        FlushedEntry(30),  # its spill had not queued the write
        FlushedEntry(40, why=HandOver.NOT_SAVEABLE),
    ]
    report = FlushReport.of(entries, {"a": Durable(), "b": Refused()})  # type: ignore[dict-item]
    assert report == FlushReport(
        handed=4,
        landed=1,
        lost=((20, "b", "refused"), (30, None, "not queued"), (40, None, "not saveable")),
    )
    assert report.counts() == {"refused": 1, "not queued": 1, "not saveable": 1}


def test_the_deadline_is_the_flag_or_grows_with_the_bytes_to_write() -> None:
    assert flush_deadline(10.0, 0) == 25.0
    assert flush_deadline(10.0, 40 * FLUSH_BYTES_PER_SECOND) == 65.0
    assert flush_deadline(10.0, 40 * FLUSH_BYTES_PER_SECOND, flush_timeout=3.0) == 3.0


def test_the_exit_lines_name_each_entry_not_on_disk(
    tiny: TinyModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gate = _stall_stores(monkeypatch)
    with _adapter(tiny, tmp_path) as (cache, tier):
        cache.insert_cache(MODEL, PROMPTS[0], _prefilled(tiny, PROMPTS[0]))
        assert not cache.close(timeout=0.5)
        print_exit(cache, lookups_before_open=0)
        gate.set()
        while tier._thread.is_alive():
            cache.pump(0.01)
            time.sleep(0.001)
    lines = capsys.readouterr().out.splitlines()
    summary = [line for line in lines if "RAM entries at exit" in line]
    assert len(summary) == 1 and summary[0].startswith(
        "kvtrio serve: RAM entries at exit (handed 1, on disk 0, not landed 1, "
    )
    named = [line for line in lines if line.startswith("kvtrio serve: not on disk: 40 tokens")]
    assert len(named) == 1


def test_a_close_while_the_tier_still_opens_names_the_entries_it_could_not_write(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """kvtrio serve stopped before its cold tier opened (its open outlived the close's
    wait): RAM's entries cannot be written, and each is named ``cold tier not open``
    (before, they vanished without a line: the tier's exit line needs a tier)."""
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.serve.bridge import TierOptions
    from kvtrio.serve.coldopen import ColdOpening, ServeCache

    release = threading.Event()

    def never_in_time() -> TierOptions:
        release.wait(60)
        return TierOptions(str(tmp_path), ModelKey(tiny.model_id, tiny.fingerprint))

    opening = ColdOpening(never_in_time)
    opening.start()
    serving = ServeCache(1, 1 << 63, opening=opening, tier_model=MODEL, load_timeout=30)
    first, second = PROMPTS[0], PROMPTS[1]
    serving.insert_cache(MODEL, first, _prefilled(tiny, first))
    serving.insert_cache(MODEL, second, _prefilled(tiny, second))  # evicts the first: held
    serving.close(timeout=0.1)
    report = serving.flush_report()
    assert report == FlushReport(
        handed=2,
        landed=0,
        lost=(
            (len(second), None, "cold tier not open"),
            (len(first), None, "cold tier not open"),
        ),
    )
    release.set()
    assert opening.done.wait(60) and opening.tier is not None
    opening.tier.bind()
    assert opening.tier.close(timeout=30)


def test_a_close_whose_writes_fail_is_not_complete(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cold write fails with a disk error: the close ends in time, but the report
    names each entry as ``disk error`` and is not complete, so kvtrio serve exits 1
    (flush report rule 4); before, a close in time exited 0 whatever its writes did."""
    from kvtrio.actors.coldtypes import StoreResult
    from kvtrio.actors.tiered import ColdTierStore

    async def failing_store(self: object, *args: object, **kwargs: object) -> StoreResult:
        return StoreResult(written=False, unwritten="error")

    monkeypatch.setattr(ColdTierStore, "store", failing_store)
    with _adapter(tiny, tmp_path) as (cache, _):
        for prompt in PROMPTS[:2]:
            cache.insert_cache(MODEL, prompt, _prefilled(tiny, prompt))
    report = cache.flush_report()
    assert (report.handed, report.landed) == (2, 0)
    assert report.counts() == {"disk error": 2}
    assert not report.complete


def test_only_entries_left_out_by_design_keep_a_report_complete() -> None:
    """``gone`` (written, then evicted by the cold budget) and ``not saveable`` are not
    losses; any other reason is (flush report rule 4)."""
    entries = [FlushedEntry(10, key="a"), FlushedEntry(20, why=HandOver.NOT_SAVEABLE)]

    class Landed:
        def __init__(self, value: str) -> None:
            self.value = value

    def report(why: str) -> FlushReport:
        return FlushReport.of(entries, {"a": Landed(why)})  # type: ignore[dict-item]

    assert report("on disk").complete and report("gone").complete
    for why in ("failed", "disk error", "refused", "cancelled", "shed", "writing", "queued"):
        assert not report(why).complete, why
    assert not FlushReport.of([FlushedEntry(5, why=HandOver.TIER_CLOSED)], {}).complete
    assert FlushReport(handed=0, landed=0, lost=()).complete
