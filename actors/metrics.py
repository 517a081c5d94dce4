"""Prometheus metrics of the tiered cache, as text: the exposition format, made here.

:func:`tiered_metrics` turns the cache's statistics records (and, when the caller has
them, its miss reasons, wear, queue depth, latency histograms and event-loop lag) into
Prometheus's text exposition format (version 0.0.4), for a ``/metrics`` endpoint of any
server; :data:`CONTENT_TYPE` is the header to serve it with. No client library is needed
at run time: the format is a few lines per family (the tests parse it with
prometheus_client's own parser). docs/metrics.md lists every name.

Conventions (prometheus.io, "Metric and label naming"): every name starts ``kvtrio_``;
base units (bytes, seconds); counters end ``_total`` and never go down; a quantity split
by a label (``tier``, ``reason``, ``decision``) is one family with that label, so a
``sum()`` over it is meaningful.

:class:`Histogram` is a cumulative histogram with fixed bucket bounds (O(buckets) per
observation; a handful of bounds); :func:`watch_loop_lag` feeds one with how late a
periodic ``trio.sleep`` wakes up (the event loop's lag, on trio's clock).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs
import trio
from kvtrio.actors.misses import MissReason, MissStatistics
from kvtrio.actors.policy import EvictionStatistics
from kvtrio.actors.wear import WearStatistics

__all__ = [
    "CONTENT_TYPE",
    "LAG_BUCKETS",
    "LATENCY_BUCKETS",
    "CacheCounters",
    "Histogram",
    "HistogramSnapshot",
    "MetricFamily",
    "render",
    "tiered_metrics",
    "watch_loop_lag",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: a cold load or save takes milliseconds to tens of seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Seconds: the loop should wake within a millisecond or two of when it asked.
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@attrs.frozen
class HistogramSnapshot:
    """Bucket bounds, cumulative counts per bound (then +Inf: ``count``), sum and count."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float
    count: int


@attrs.define
class Histogram:
    """A cumulative histogram with fixed bounds (Prometheus's ``le`` buckets)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    _counts: list[int] = attrs.field(init=False)
    _sum: float = attrs.field(init=False, default=0.0)
    _count: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not all(
            math.isfinite(b) for b in self.bounds
        ):
            raise ValueError("histogram bounds must be finite, distinct and increasing")
        self._counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self._counts):
            self._counts[i] += 1
        self._sum += value
        self._count += 1

    def statistics(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for n in self._counts:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self._sum, self._count)


async def watch_loop_lag(histogram: Histogram, *, interval: float = 0.05) -> None:
    """Forever: sleep ``interval`` seconds and observe how late the wake-up was (the event
    loop's lag: a step that holds the loop shows as lateness). Run it in a nursery."""
    while True:
        due = trio.current_time() + interval
        await trio.sleep_until(due)
        histogram.observe(max(0.0, trio.current_time() - due))


class CacheCounters(Protocol):
    """The fields of :class:`~kvtrio.actors.tiered.TieredStatistics` the metrics read."""

    @property
    def hot_entries(self) -> int: ...
    @property
    def hot_bytes(self) -> int: ...
    @property
    def hot_budget(self) -> int: ...
    @property
    def cold_entries(self) -> int: ...
    @property
    def cold_bytes(self) -> int: ...
    @property
    def cold_budget(self) -> int: ...
    @property
    def hits_hot(self) -> int: ...
    @property
    def hits_cold(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def bytes_written(self) -> int: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def bytes_deduplicated(self) -> int: ...
    @property
    def hot_evictions(self) -> int: ...
    @property
    def cold_evictions(self) -> int: ...
    @property
    def drops(self) -> int: ...
    @property
    def unwritten_dropped(self) -> int: ...
    @property
    def unwritten_cancelled(self) -> int: ...
    @property
    def unwritten_failed(self) -> int: ...
    @property
    def unwritten_refused(self) -> int: ...
    @property
    def unwritten_error(self) -> int: ...


Labels = tuple[tuple[str, str], ...]


@attrs.frozen
class MetricFamily:
    """One metric family: its name, type, help line and samples (suffix, labels, value)."""

    name: str
    type: str  # counter, gauge or histogram
    help: str
    samples: tuple[tuple[str, Labels, float], ...]


def _counter(name: str, help: str, value: float, labels: Labels = ()) -> MetricFamily:
    return MetricFamily(name, "counter", help, (("", labels, value),))


def _labelled(
    name: str, type: str, help: str, label: str, values: Iterable[tuple[str, float]]
) -> MetricFamily:
    return MetricFamily(name, type, help, tuple(("", ((label, k),), v) for k, v in values))


def _histogram(name: str, help: str, snapshot: HistogramSnapshot) -> MetricFamily:
    samples: list[tuple[str, Labels, float]] = [
        ("_bucket", (("le", repr(float(bound))),), n)
        for bound, n in zip(snapshot.bounds, snapshot.cumulative, strict=True)
    ]
    samples += [
        ("_bucket", (("le", "+Inf"),), snapshot.count),
        ("_sum", (), snapshot.sum),
        ("_count", (), snapshot.count),
    ]
    return MetricFamily(name, "histogram", help, tuple(samples))


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(families: Iterable[MetricFamily]) -> str:
    """The text exposition of ``families`` (version 0.0.4), ending in a newline."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for suffix, labels, value in family.samples:
            text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
            labelled = f"{family.name}{suffix}{'{' + text + '}' if text else ''}"
            lines.append(f"{labelled} {_number(value)}")
    return "\n".join(lines) + "\n"


def tiered_metrics(
    stats: CacheCounters,
    *,
    misses: MissStatistics | None = None,
    wear: WearStatistics | None = None,
    eviction: Mapping[str, EvictionStatistics] | None = None,
    queue_depth: int | None = None,
    prefetch: tuple[int, int, int] | None = None,
    load_seconds: HistogramSnapshot | None = None,
    save_seconds: HistogramSnapshot | None = None,
    loop_lag_seconds: HistogramSnapshot | None = None,
) -> str:
    """The Prometheus text of a tiered cache's ``statistics()`` and what else is given.

    ``eviction``: each tier's (``"hot"``, ``"cold"``) eviction-policy statistics (pins,
    TTL expiries); ``queue_depth``: cold writes waiting to start; ``prefetch``: prefetches
    started, bytes prefetched that a lookup used, and bytes wasted.
    """
    families = [
        _labelled(
            "kvtrio_cache_hits_total",
            "counter",
            "Lookups that reused a cached prefix, by the tier that served it.",
            "tier",
            [("hot", stats.hits_hot), ("cold", stats.hits_cold)],
        ),
        _counter("kvtrio_cache_misses_total", "Lookups that reused nothing.", stats.misses),
        _labelled(
            "kvtrio_cache_entries",
            "gauge",
            "Entries held, by tier.",
            "tier",
            [("hot", stats.hot_entries), ("cold", stats.cold_entries)],
        ),
        _labelled(
            "kvtrio_cache_bytes",
            "gauge",
            "Bytes held, by tier (RAM: caches; disk: files and blocks).",
            "tier",
            [("hot", stats.hot_bytes), ("cold", stats.cold_bytes)],
        ),
        _labelled(
            "kvtrio_cache_budget_bytes",
            "gauge",
            "Byte budget, by tier.",
            "tier",
            [("hot", stats.hot_budget), ("cold", stats.cold_budget)],
        ),
        _labelled(
            "kvtrio_cache_evictions_total",
            "counter",
            "Entries evicted by a tier's byte budget.",
            "tier",
            [("hot", stats.hot_evictions), ("cold", stats.cold_evictions)],
        ),
        _counter(
            "kvtrio_cold_written_bytes_total",
            "Bytes written to the cold tier (new blocks and files).",
            stats.bytes_written,
        ),
        _counter(
            "kvtrio_cold_read_bytes_total", "Bytes loaded from the cold tier.", stats.bytes_read
        ),
        _counter(
            "kvtrio_cold_deduplicated_bytes_total",
            "Bytes not written because the cold tier already held them (shared blocks).",
            stats.bytes_deduplicated,
        ),
        _counter(
            "kvtrio_cold_drops_total",
            "Cold writes dropped or failed and cold entries found missing or corrupt.",
            stats.drops,
        ),
        _labelled(
            "kvtrio_cold_unwritten_total",
            "counter",
            "Cold writes begun that did not land (each also a drop), by why: shed by the "
            "tier's queue, cancelled, failed, refused by the tier, or a disk error.",
            "reason",
            [
                ("dropped", stats.unwritten_dropped),
                ("cancelled", stats.unwritten_cancelled),
                ("failed", stats.unwritten_failed),
                ("refused", stats.unwritten_refused),
                ("error", stats.unwritten_error),
            ],
        ),
    ]
    if misses is not None:
        families.append(
            _labelled(
                "kvtrio_cache_lookup_reasons_total",
                "counter",
                "Lookups by why they did not reuse more of the prompt (none: nothing cached "
                "could have).",
                "reason",
                [("none", misses.best_possible), *((r.value, misses.count(r)) for r in MissReason)],
            )
        )
    if wear is not None:
        families += [
            _counter(
                "kvtrio_cold_reused_bytes_total",
                "Written bytes read back at least once (each write counted once).",
                wear.bytes_reused,
            ),
            _labelled(
                "kvtrio_cold_admissions_total",
                "counter",
                "Entries leaving RAM offered to the disk, by the admission decision.",
                "decision",
                [("admitted", wear.admitted), ("refused", wear.refused)],
            ),
            _counter(
                "kvtrio_cold_refused_bytes_total",
                "Bytes of entries the admission policy kept off the disk.",
                wear.bytes_refused,
            ),
        ]
    if eviction is not None:
        families += [
            _labelled(
                "kvtrio_cache_pinned_bytes",
                "gauge",
                "Bytes of pinned entries, by tier.",
                "tier",
                [(t, s.pinned_bytes) for t, s in sorted(eviction.items())],
            ),
            _labelled(
                "kvtrio_cache_expired_total",
                "counter",
                "Entries whose TTL ran out, by tier.",
                "tier",
                [(t, s.expired) for t, s in sorted(eviction.items())],
            ),
        ]
    if queue_depth is not None:
        families.append(
            MetricFamily(
                "kvtrio_cold_queue_depth",
                "gauge",
                "Cold writes waiting to start.",
                (("", (), queue_depth),),
            )
        )
    if prefetch is not None:
        started, used, wasted = prefetch
        families += [
            _counter(
                "kvtrio_cold_prefetches_total",
                "Cold loads started ahead of their lookup (prefetch).",
                started,
            ),
            _labelled(
                "kvtrio_cold_prefetch_bytes_total",
                "counter",
                "Bytes prefetched, by outcome (used by a lookup, or wasted: superseded or "
                "unused by the deadline).",
                "outcome",
                [("used", used), ("wasted", wasted)],
            ),
        ]
    for name, help, snapshot in (
        ("kvtrio_cold_load_seconds", "Seconds per cold load (read, verify, adopt).", load_seconds),
        ("kvtrio_cold_save_seconds", "Seconds per cold save (snapshot to durable).", save_seconds),
        (
            "kvtrio_event_loop_lag_seconds",
            "How late a periodic wake-up of the trio loop came (the loop's lag).",
            loop_lag_seconds,
        ),
    ):
        if snapshot is not None:
            families.append(_histogram(name, help, snapshot))
    return render(families)
