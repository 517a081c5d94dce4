"""``kvtrio bench scale``'s burst: write-back inserts against a cold budget of about
``fit`` entries, nobody waiting for the disk, printing the most bytes ever on disk over
the budget and the entries kept over those that fit (issue 14's "budget + one entry" and
"entries kept >= 90% of those that fit"). Split from :mod:`kvtrio.bench.scale`, whose
``_burst`` calls :func:`burst`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["burst"]


def burst(directory: Path, inserts: int, fit: int) -> dict[str, Any]:
    """The burst, in this process: see :func:`_burst_async`."""
    import trio

    return trio.run(_burst_async, directory, inserts, fit)


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
    import mlx.core as mx
    import trio
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import open_tiered_cache
    from mlx_lm.models.cache import KVCache

    tokens_per = 96

    def make(seed: int) -> list[Any]:
        mx.random.seed(seed)
        caches = []
        for _ in range(2):
            cache = KVCache()  # type: ignore[no-untyped-call]
            k = mx.random.normal((1, 2, tokens_per, 64))
            values = mx.random.normal((1, 2, tokens_per, 64))
            cache.update_and_fetch(k, values)  # type: ignore[no-untyped-call]
            mx.eval(cache.keys, cache.values)
            caches.append(cache)
        return caches

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
        peak = 0
        start = time.perf_counter()
        async with open_tiered_cache(
            directory / "tier", model, owner=owner, hot_budget=0, cold_budget=budget,
            min_free_bytes=0,
        ) as cache:  # fmt: skip
            done = trio.Event()

            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, _tree_bytes(directory / "tier"))
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample)
                for i in range(inserts):
                    tokens = [i // 1000 + 1, i % 1000, *range(tokens_per - 2)]
                    await cache.insert(tokens, await owner.run(make, i + 1))
                    peak = max(peak, _tree_bytes(directory / "tier"))
                await cache.wait_writes_settled()
                done.set()
            peak = max(peak, _tree_bytes(directory / "tier"))
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
