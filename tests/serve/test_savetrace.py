"""``kvtrio serve --save-trace``: when each save ran (kvtrio.serve.savetrace), as the
adapter records it and as the bench's spill phase reads it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kvtrio.actors.policy import MinimumTokens
from kvtrio.serve.savetrace import SaveSpan, SaveTrace, read_save_trace
from kvtrio.tests.serve.test_adapter import MODEL, _adapter, _cold_entries, _prefilled, _pump_until
from kvtrio.tinymodel import TinyModel, build_tiny_model


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=3)


def test_no_path_no_trace() -> None:
    assert SaveTrace.at(None) is None


def test_spans_round_trip_and_a_cut_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "saves.jsonl"
    trace = SaveTrace.at(path)
    assert trace is not None and path.read_text() == ""
    trace.record(1.0, 2.5, 40, (2.0, 2.25))
    trace.record(3.0, 3.0, 7)
    with path.open("a") as f:
        f.write('{"start": 4.0, "en')  # a writer cut mid-line
    assert read_save_trace(path) == [SaveSpan(1.0, 2.5, 40, 2.0, 2.25), SaveSpan(3.0, 3.0, 7)]
    assert read_save_trace(tmp_path / "none.jsonl") == []


@pytest.mark.parametrize(
    "line",
    [
        '{"start": 2.0, "end": 1.0, "tokens": 3}',
        '{"start": 1.0, "end": 2.0, "tokens": 3, "write_start": 1.5, "write_end": 1.2}',
        '{"start": 1.0, "end": 2.0, "tokens": 3, "write_start": 1.5, "write_end": null}',
    ],
)
def test_a_span_that_ends_before_it_starts_is_refused(tmp_path: Path, line: str) -> None:
    path = tmp_path / "saves.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError):
        read_save_trace(path)


def test_overlap_is_of_closed_intervals() -> None:
    span = SaveSpan(10.0, 12.0, 1, 11.0, 11.5)
    assert span.overlaps(9.0, 10.0) and span.overlaps(12.0, 13.0) and span.overlaps(10.5, 11)
    assert not span.overlaps(8.0, 9.99) and not span.overlaps(12.01, 13.0)
    assert span.write_overlaps(10.5, 11.0) and span.write_overlaps(11.5, 12.0)
    assert not span.write_overlaps(10.0, 10.99) and not span.write_overlaps(11.51, 12.0)
    assert not SaveSpan(10.0, 12.0, 1).write_overlaps(9.0, 13.0)  # not written


def test_a_fifo_or_a_directory_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):  # no reader: not a wait for one
        SaveTrace.at(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError):  # with a reader: opened, then refused as no file
            SaveTrace.at(fifo)
    finally:
        os.close(reader)
    with pytest.raises(OSError):
        SaveTrace.at(tmp_path)


def test_the_adapter_records_each_spill_from_hand_over_to_settled_writes(
    tiny: TinyModel, tmp_path: Path
) -> None:
    path = tmp_path / "saves.jsonl"
    a, b, c = list(range(1, 41)), list(range(100, 150)), list(range(200, 245))
    before = time.perf_counter()
    with _adapter(tiny, tmp_path / "kv", max_size=1, save_trace=SaveTrace.at(path)) as (
        cache,
        tier,
    ):
        cache.insert_cache(MODEL, a, _prefilled(tiny, a))
        cache.insert_cache(MODEL, b, _prefilled(tiny, b))  # evicts a
        cache.insert_cache(MODEL, c, _prefilled(tiny, c))  # evicts b
        _pump_until(cache, lambda: _cold_entries(tier) == 2 and len(read_save_trace(path)) == 2)
        spans = read_save_trace(path)
    after = time.perf_counter()
    assert sorted(span.tokens for span in spans) == [len(a), len(b)]
    # Times on the caller's perf_counter clock, each span after its hand-over, the
    # entry's own store (both were written) inside it.
    for span in spans:
        assert span.write_start is not None and span.write_end is not None
        assert before <= span.start <= span.write_start <= span.write_end <= span.end <= after


def test_without_a_trace_the_adapter_writes_none(tiny: TinyModel, tmp_path: Path) -> None:
    a, b = list(range(1, 41)), list(range(100, 150))
    with _adapter(tiny, tmp_path / "kv", max_size=1) as (cache, tier):
        cache.insert_cache(MODEL, a, _prefilled(tiny, a))
        cache.insert_cache(MODEL, b, _prefilled(tiny, b))
        _pump_until(cache, lambda: _cold_entries(tier) == 1)
        assert cache.save_trace is None
    assert list(tmp_path.glob("**/*.jsonl")) == []


def test_an_entry_admission_refuses_has_a_span_and_no_store(
    tiny: TinyModel, tmp_path: Path
) -> None:
    path = tmp_path / "saves.jsonl"
    a, b = list(range(1, 41)), list(range(100, 150))
    refuse = MinimumTokens(10_000)
    with _adapter(
        tiny, tmp_path / "kv", refuse, max_size=1, save_trace=SaveTrace.at(path)
    ) as (cache, tier):
        cache.insert_cache(MODEL, a, _prefilled(tiny, a))
        cache.insert_cache(MODEL, b, _prefilled(tiny, b))  # evicts a: handed over, refused
        _pump_until(cache, lambda: len(read_save_trace(path)) == 1)
        assert _cold_entries(tier) == 0
    (span,) = [s for s in read_save_trace(path) if s.tokens == len(a)]
    assert span.write_start is None and span.write_end is None
