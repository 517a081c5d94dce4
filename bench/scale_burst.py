"""``kvtrio bench scale``'s burst: write-back inserts against a cold budget of about
``fit`` entries, nobody waiting for the disk, printing the most bytes ever on disk over
the budget and the entries kept over those that fit (issue 14's "budget + one entry" and
"entries kept >= 90% of those that fit"). Split from :mod:`kvtrio.bench.scale`, whose
``_burst`` calls :func:`burst`.

Then the burst's memory (:func:`burst_rss`, issue 14's Deliver 4: pending write-backs are
capped by bytes, so RSS under a burst stays near the hot budget + the cap): write-back
inserts of 2 MiB entries with a hot budget of 0, so every insert waits in the pending
queue, once with a pending cap of ``--burst-cap-mib`` and once uncapped (the reference,
in the same run), each in a fresh process (``python -m kvtrio.bench.scale_burst``): the
process's peak RSS growth over its RSS before the burst, against the cap + one entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Issue 14: entries kept >= this share of those that fit.
TARGET_KEPT = 0.9

__all__ = ["RSS_ENTRY_BYTES", "burst", "burst_rss", "rows"]

#: :func:`burst_rss`'s entries: 2 layers of keys and values, 2 heads, 1,024 tokens, 64
#: dims, float32.
RSS_TOKENS = 1024
RSS_ENTRY_BYTES = 2 * 2 * 2 * RSS_TOKENS * 64 * 4


def burst(directory: Path, inserts: int, fit: int) -> dict[str, Any]:
    """The burst, in this process: see :func:`_burst_async`."""
    import trio

    return trio.run(_burst_async, directory, inserts, fit)


def _caches(seed: int, *, tokens: int) -> list[Any]:
    """Owner thread: a distinct entry (random keys and values, ``seed``): 2 KVCache layers
    of 2 heads, ``tokens`` tokens, 64 dims, float32."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    caches = []
    for _ in range(2):
        cache = KVCache()  # type: ignore[no-untyped-call]
        keys = mx.random.normal((1, 2, tokens, 64))
        values = mx.random.normal((1, 2, tokens, 64))
        cache.update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches


async def _peak_while_inserting(
    cache: Any,
    owner: Any,
    make: Callable[[int], list[Any]],
    measure: Callable[[], int],
    indices: range,
    tokens: int,
    *,
    seed_shift: int,
) -> int:
    """Write-back inserts of distinct entries (entry ``i`` of ``indices``: its tokens from
    ``i``, its caches from seed ``i + seed_shift``), nobody waiting for the disk, until
    the writes settle; the most ``measure`` gave, sampled after every insert, every 5 ms
    and once at the end."""
    import trio

    peak = measure()
    done = trio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, measure())
            await trio.sleep(0.005)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        for i in indices:
            key = [i // 1000 + 1, i % 1000, *range(tokens - 2)]
            await cache.insert(key, await owner.run(make, i + seed_shift))
            peak = max(peak, measure())
        await cache.wait_writes_settled()
        done.set()
    return max(peak, measure())


def _tree_bytes(directory: Path) -> int:
    """Bytes under caches/ and blocks/ now (tmp files included: they are on disk too)."""
    total = 0
    for sub in ("caches", "blocks"):
        with os.scandir(directory / sub) as it:
            for entry in it:
                try:
                    total += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # renamed or removed since the listing
    return total


async def _burst_async(directory: Path, inserts: int, fit: int) -> dict[str, Any]:
    """Write-back inserts of distinct caches (random keys and values: no two share a
    block), one hot entry at a time, nobody waiting for the disk; the directory's size
    is sampled after every insert and every 5 ms."""
    import functools

    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import open_tiered_cache

    tokens_per = 96
    make = functools.partial(_caches, tokens=tokens_per)

    model = ModelKey("bench-burst", "fp")
    directory.mkdir(parents=True)
    async with MlxOwner.inline() as owner:
        # One entry alone first: its size on disk sizes the budget.
        async with open_tiered_cache(
            directory / "probe", model, owner=owner, hot_budget=0, cold_budget=1 << 40,
            min_free_bytes=0,
        ) as probe:  # fmt: skip
            await probe.insert(list(range(tokens_per)), await owner.run(make, 0))
            await probe.flush()
        one = _tree_bytes(directory / "probe")
        budget = fit * one
        start = time.perf_counter()
        async with open_tiered_cache(
            directory / "tier", model, owner=owner, hot_budget=0, cold_budget=budget,
            min_free_bytes=0,
        ) as cache:  # fmt: skip
            peak = await _peak_while_inserting(
                cache, owner, make, functools.partial(_tree_bytes, directory / "tier"),
                range(inserts), tokens_per, seed_shift=1,
            )  # fmt: skip
            stats = cache.statistics()
        elapsed = time.perf_counter() - start
    return {
        "inserts": inserts,
        "entry_bytes": one,
        "budget": budget,
        "fit": fit,
        "max_disk_bytes": peak,
        "kept": stats.cold_entries,
        "pending_dropped": stats.pending_dropped,
        "cold_evictions": stats.cold_evictions,
        "seconds": elapsed,
    }


def burst_rss(directory: Path, inserts: int, cap_mib: int) -> dict[str, Any]:
    """Peak RSS growth under a burst of ``inserts`` write-backs with the pending queue
    capped at ``cap_mib`` MiB and uncapped, each in a fresh process (module docstring)."""
    out: dict[str, Any] = {"inserts": inserts, "entry_bytes": RSS_ENTRY_BYTES}
    for name, cap in (("capped", cap_mib << 20), ("uncapped", 0)):
        run = subprocess.run(
            [sys.executable, "-m", "kvtrio.bench.scale_burst", str(directory / name),
             str(inserts), str(cap)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        out[name] = json.loads(run.stdout)
    out["pending_cap"] = cap_mib << 20
    out["rss_growth_over_cap_plus_entry"] = out["capped"]["rss_growth_peak"] / (
        out["pending_cap"] + RSS_ENTRY_BYTES
    )
    out["rss_growth_capped_over_uncapped"] = (
        out["capped"]["rss_growth_peak"] / out["uncapped"]["rss_growth_peak"]
    )
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _rss_child(directory: Path, inserts: int, cap: int) -> dict[str, Any]:
    """One burst of :func:`burst_rss` (``cap`` 0: uncapped), the RSS sampled after every
    insert and every 5 ms; the cold budget holds 40 entries."""
    import functools

    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import open_tiered_cache

    make = functools.partial(_caches, tokens=RSS_TOKENS)

    directory.mkdir(parents=True)
    async with MlxOwner.inline() as owner:
        async with open_tiered_cache(
            directory, ModelKey("bench-burst-rss", "fp"), owner=owner, hot_budget=0,
            cold_budget=40 * RSS_ENTRY_BYTES, min_free_bytes=0,
            pending_budget=cap if cap else 1 << 50,
        ) as cache:  # fmt: skip
            await cache.insert(list(range(RSS_TOKENS)), await owner.run(make, 0))
            await cache.wait_writes_settled()
            base = _rss()
            peak = await _peak_while_inserting(
                cache, owner, make, _rss, range(1, inserts + 1), RSS_TOKENS, seed_shift=0
            )
            stats = cache.statistics()
    return {
        "rss_growth_peak": peak - base,
        "pending_dropped": stats.pending_dropped,
        "cold_entries": stats.cold_entries,
    }


def rows(figures: dict[str, Any], met: Callable[[bool], str]) -> list[tuple[str, str, str]]:
    """The burst's rows of ``kvtrio bench scale``'s ratio table: figure, value, target."""
    burst = figures["burst"]
    over = burst["max_disk_bytes"] / (burst["budget"] + burst["entry_bytes"])
    limit = (burst["budget"] + burst["entry_bytes"]) / burst["budget"]
    kept = figures["burst_kept_over_fit"]
    out = [
        ("burst max disk / budget", f"{figures['burst_max_disk_over_budget']:.3f}x",
         f"<= budget + one entry ({limit:.3f}x) {met(over <= 1.0)}"),
        ("burst entries kept / fit", f"{kept:.2f}", f">= {TARGET_KEPT} {met(kept >= TARGET_KEPT)}"),
    ]  # fmt: skip
    rss = figures.get("burst_rss")
    if rss is not None:
        out.append((
            "burst RSS growth / (pending cap + one entry); uncapped in the same run",
            f"{rss['rss_growth_over_cap_plus_entry']:.2f}x "
            f"({rss['capped']['rss_growth_peak'] / 1e6:.1f} MB; uncapped "
            f"{rss['uncapped']['rss_growth_peak'] / 1e6:.1f} MB)",
            "near 1 (hot budget 0)",
        ))  # fmt: skip
    return out


if __name__ == "__main__":  # one run of burst_rss, in its fresh process
    import trio

    _dir, _inserts, _cap = sys.argv[1:4]
    print(json.dumps(trio.run(_rss_child, Path(_dir), int(_inserts), int(_cap))))
