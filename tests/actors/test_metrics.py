"""kvtrio.actors.metrics: the text parses with prometheus_client's parser, every family
follows the naming conventions, and the figures are the statistics'."""

from __future__ import annotations

import functools
import time

import pytest
import trio
from kvtrio.actors.metrics import (
    LAG_BUCKETS,
    Histogram,
    MetricFamily,
    render,
    tiered_metrics,
    watch_loop_lag,
)
from kvtrio.actors.misses import Explanation, MissCounter, MissReason
from kvtrio.actors.policy import AdmissionCandidate, EntryCost, LruPolicy
from kvtrio.actors.tiered import TieredStatistics
from kvtrio.actors.wear import WearAccount
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def _stats() -> TieredStatistics:
    return TieredStatistics(
        hot_entries=3, hot_bytes=3000, hot_budget=4096, cold_entries=7, cold_bytes=70_000,
        cold_budget=1 << 40, hits_hot=11, hits_cold=5, misses=2, bytes_written=123_456,
        bytes_read=65_536, bytes_deduplicated=4096, hot_evictions=9, cold_evictions=1,
        drops=4, superseded=0, unwritten_dropped=1, unwritten_cancelled=2,
        unwritten_failed=3, unwritten_refused=4, unwritten_error=5,
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert isinstance(s, Sample)
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _full_text() -> str:
    misses = MissCounter()
    for reason in (MissReason.EVICTED, MissReason.EVICTED, MissReason.NOT_TRIMMABLE, None):
        misses.add(Explanation(10, 0, reason, 5))
    wear = WearAccount()
    wear.on_admission(AdmissionCandidate("a", 10, 100, 0, 1.0), True)
    wear.on_admission(AdmissionCandidate("b", 10, 100, 0, 1.0), False)
    wear.on_written("a", 100)
    wear.on_read("a", 100)
    hot = LruPolicy(pin_limit=100, clock=lambda: 0.0)
    hot.on_insert("system", EntryCost(50, 5))
    hot.pin("system")
    load = Histogram()
    for seconds in (0.003, 0.2, 0.2, 45.0):
        load.observe(seconds)
    return tiered_metrics(
        _stats(),
        misses=misses.statistics(),
        wear=wear.statistics(),
        eviction={"hot": hot.statistics(), "cold": LruPolicy().statistics()},
        queue_depth=2,
        prefetch=(3, 1000, 200),
        load_seconds=load.statistics(),
        save_seconds=Histogram().statistics(),
        loop_lag_seconds=Histogram(LAG_BUCKETS).statistics(),
    )


def test_metrics_parse_and_carry_the_statistics() -> None:
    samples = _samples(_full_text())
    assert samples["kvtrio_cache_hits_total", (("tier", "hot"),)] == 11
    assert samples["kvtrio_cache_hits_total", (("tier", "cold"),)] == 5
    assert samples["kvtrio_cache_misses_total", ()] == 2
    assert samples["kvtrio_cache_bytes", (("tier", "cold"),)] == 70_000
    assert samples["kvtrio_cache_budget_bytes", (("tier", "cold"),)] == 1 << 40
    assert samples["kvtrio_cache_evictions_total", (("tier", "hot"),)] == 9
    assert samples["kvtrio_cold_written_bytes_total", ()] == 123_456
    assert samples["kvtrio_cold_read_bytes_total", ()] == 65_536
    assert samples["kvtrio_cold_deduplicated_bytes_total", ()] == 4096
    assert samples["kvtrio_cache_lookup_reasons_total", (("reason", "evicted"),)] == 2
    assert samples["kvtrio_cache_lookup_reasons_total", (("reason", "not-trimmable"),)] == 1
    assert samples["kvtrio_cache_lookup_reasons_total", (("reason", "none"),)] == 1
    for reason in MissReason:  # every reason is exported, zero or not
        assert ("kvtrio_cache_lookup_reasons_total", (("reason", reason.value),)) in samples
    assert samples["kvtrio_cold_reused_bytes_total", ()] == 100
    assert samples["kvtrio_cold_admissions_total", (("decision", "refused"),)] == 1
    assert samples["kvtrio_cache_pinned_bytes", (("tier", "hot"),)] == 50
    assert samples["kvtrio_cold_queue_depth", ()] == 2
    assert samples["kvtrio_cold_load_seconds_bucket", (("le", "0.005"),)] == 1
    assert samples["kvtrio_cold_load_seconds_bucket", (("le", "0.25"),)] == 3
    assert samples["kvtrio_cold_load_seconds_bucket", (("le", "30.0"),)] == 3
    assert samples["kvtrio_cold_load_seconds_bucket", (("le", "+Inf"),)] == 4
    assert samples["kvtrio_cold_load_seconds_count", ()] == 4
    assert samples["kvtrio_cold_load_seconds_sum", ()] == pytest.approx(45.403)
    assert samples["kvtrio_event_loop_lag_seconds_count", ()] == 0


def test_writes_that_did_not_land_are_exported_by_why() -> None:
    """TieredStatistics' unwritten_* (why a write did not land, issue 17's SIGTERM
    promise) reach /metrics, one series per reason, not only the exit line."""
    samples = _samples(_full_text())
    got = {
        reason: samples["kvtrio_cold_unwritten_total", (("reason", reason),)]
        for reason in ("dropped", "cancelled", "failed", "refused", "error")
    }
    assert got == {"dropped": 1, "cancelled": 2, "failed": 3, "refused": 4, "error": 5}


def test_every_family_follows_prometheus_naming() -> None:
    """kvtrio_ prefix; counters end _total; byte and second quantities name their unit;
    histograms carry buckets up to +Inf, a sum and a count; no family repeats."""
    seen = set()
    for family in text_string_to_metric_families(_full_text()):
        assert family.name.startswith("kvtrio_"), family.name
        assert family.name not in seen
        seen.add(family.name)
        names = {s.name for s in family.samples}
        if family.type == "counter":
            assert names == {family.name + "_total"}, family.name
        elif family.type == "histogram":
            assert family.name.endswith("_seconds")
            assert names == {family.name + x for x in ("_bucket", "_sum", "_count")}
            assert family.samples[-3].labels == {"le": "+Inf"}
        else:
            assert family.type == "gauge", family.name
        assert family.documentation, family.name
        if "bytes" in family.name:
            assert family.name.endswith(("_bytes", "_bytes_total")), family.name
    assert len(seen) == 23  # with the two prefetch families and the unwritten writes


def test_help_and_label_values_are_escaped() -> None:
    text = render([
        MetricFamily("kvtrio_x", "gauge", 'a \\ back\nslash', (("", (("k", 'q"u\\o\nte'),), 1.5),)),
    ])
    (family,) = text_string_to_metric_families(text)
    assert family.documentation == "a \\ back\nslash"
    assert family.samples[0].labels == {"k": 'q"u\\o\nte'}
    assert family.samples[0].value == 1.5


def test_histogram_rejects_unordered_bounds() -> None:
    with pytest.raises(ValueError, match=r"^histogram bounds must be finite"):
        Histogram((1.0, 0.5))


async def test_loop_lag_is_seen_when_a_step_holds_the_loop() -> None:
    lag = Histogram(LAG_BUCKETS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(watch_loop_lag, lag, interval=0.01))
        await trio.sleep(0.05)
        time.sleep(0.2)  # a step that blocks the event loop
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    snapshot = lag.statistics()
    assert snapshot.count >= 3
    assert snapshot.sum >= 0.15
    assert snapshot.cumulative[LAG_BUCKETS.index(0.1)] < snapshot.count  # one late wake-up


def test_docs_list_every_family_and_reason() -> None:
    """docs/metrics.md's tables name exactly the families tiered_metrics writes, and every
    miss reason."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(kvtrio_[a-z_]+)` \|", doc, re.M))
    written = set()
    for family in text_string_to_metric_families(_full_text()):
        written.add(family.name + "_total" if family.type == "counter" else family.name)
    assert listed == written
    reasons = set(re.findall(r"^\| `([a-z-]+)` \|", doc, re.M))
    assert reasons == {r.value for r in MissReason}
