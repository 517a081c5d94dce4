# mypy: ignore-errors
"""Issue 14, Deliver 4: RSS under a burst of write-back inserts, capped pending queue
against an uncapped one (the bench's burst prints disk bytes, not RSS).

    .venv/bin/python docs/audit13/burst_rss.py --inserts 200 --cap-mib 32 [--uncapped]

hot_budget 0 (every insert is evicted to the pending queue at once), entries of 2 MiB
(2 layers, 2 heads, 1,024 tokens, 64 dims, float32), a cold budget of 40 entries; the
process's RSS is sampled after every insert and every 5 ms. Prints JSON: peak RSS growth
over the RSS before the burst, against the pending cap + one entry."""

import argparse
import json
import os
import tempfile
from pathlib import Path

import trio

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


async def main(args: argparse.Namespace) -> dict:
    import mlx.core as mx
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import open_tiered_cache
    from mlx_lm.models.cache import KVCache

    tokens = 1024

    def make(seed: int) -> list:
        mx.random.seed(seed)
        caches = []
        for _ in range(2):
            cache = KVCache()
            k = mx.random.normal((1, 2, tokens, 64))
            v = mx.random.normal((1, 2, tokens, 64))
            cache.update_and_fetch(k, v)
            mx.eval(cache.keys, cache.values)
            caches.append(cache)
        return caches

    entry = 2 * 2 * 2 * tokens * 64 * 4
    cap = 10**12 if args.uncapped else args.cap_mib << 20
    directory = Path(tempfile.mkdtemp(prefix="a13-burst-"))
    async with MlxOwner.inline() as owner:
        async with open_tiered_cache(
            directory, ModelKey("burst", "fp"), owner=owner, hot_budget=0,
            cold_budget=40 * entry, min_free_bytes=0, pending_budget=cap,
        ) as cache:
            await cache.insert([0, *range(1, tokens)], await owner.run(make, 0))
            await cache.wait_writes_settled()
            base = rss()
            peak = base
            done = trio.Event()

            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss())
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample)
                for i in range(1, args.inserts + 1):
                    await cache.insert([i // 1000 + 1, i % 1000, *range(tokens - 2)],
                                       await owner.run(make, i))
                    peak = max(peak, rss())
                await cache.wait_writes_settled()
                done.set()
            stats = cache.statistics()
    return {
        "inserts": args.inserts, "entry_bytes": entry,
        "pending_cap": None if args.uncapped else cap,
        "rss_growth_peak": peak - base, "cap_plus_entry": None if args.uncapped else cap + entry,
        "pending_dropped": stats.pending_dropped, "cold_entries": stats.cold_entries,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--inserts", type=int, default=200)
    parser.add_argument("--cap-mib", type=int, default=32)
    parser.add_argument("--uncapped", action="store_true")
    print(json.dumps(trio.run(main, parser.parse_args())))
