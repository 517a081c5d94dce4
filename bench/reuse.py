"""``kvtrio bench reuse``: when is a cold hit worth loading? (TieredPromptCache's
``min_reuse_tokens``)

On the demo's model (:mod:`kvtrio.tinymodel`), for an entry of ``--entry-tokens`` tokens
on disk, and each reuse ``R`` of it: the time to get caches for a prompt's first ``R``
tokens from the cold tier (a lookup that loads the entry cold, its pages dropped first,
and trims it back to ``R``) against recomputing them (prefill of ``R`` tokens from empty
caches), median of ``--repeats``. The ratio ``cold / recompute`` below 1 means the load
wins; ``crossover`` is the smallest ``R`` measured where it does.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import Tier, open_tiered_cache
from kvtrio.bench.argtypes import whole
from kvtrio.tinymodel import build_tiny_model, make_caches, prefill

__all__ = ["add_arguments", "measure", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entry-tokens", type=whole, nargs="+", default=[1024, 4096])
    parser.add_argument("--reuse", type=whole, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=whole, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the tier lives")


def _drop_pages(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file() and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def _measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(build_tiny_model)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        options: dict[str, Any] = {
            "owner": owner,
            "hot_budget": 1 << 30,
            "cold_budget": 1 << 40,
            "min_reuse_tokens": 0,  # every cold match is loaded: that is what is measured
        }
        for entry_tokens in args.entry_tokens:
            rng = random.Random(entry_tokens)
            tokens = [rng.randrange(2, 512) for _ in range(entry_tokens)]
            directory = root / f"entry-{entry_tokens}"
            caches = await owner.run(make_caches, tiny)
            await owner.run(prefill, tiny, caches, tokens)
            async with open_tiered_cache(directory, model, **options) as cache:
                await cache.insert(tokens, caches)
            for reuse in (r for r in args.reuse if r < entry_tokens):
                query = [*tokens[:reuse], 1]  # differs right after the reused prefix
                cold: list[float] = []
                recompute: list[float] = []
                for _ in range(args.repeats):
                    async with open_tiered_cache(directory, model, **options) as cache:
                        await trio.to_thread.run_sync(_drop_pages, directory)
                        start = time.perf_counter()
                        found = await cache.fetch_nearest(query)
                        cold.append(time.perf_counter() - start)
                        assert found.tier is Tier.COLD and found.match is not None
                        assert found.match.reuse == reuse
                    fresh = await owner.run(make_caches, tiny)
                    start = time.perf_counter()
                    await owner.run(prefill, tiny, fresh, tokens[:reuse])
                    recompute.append(time.perf_counter() - start)
                cold_s, recompute_s = statistics.median(cold), statistics.median(recompute)
                rows.append(
                    {
                        "entry_tokens": entry_tokens,
                        "reuse": reuse,
                        "cold_load_s": cold_s,
                        "recompute_s": recompute_s,
                        "ratio_cold_over_recompute": cold_s / recompute_s,
                    }
                )
    crossover = {
        str(e): min(
            (
                r["reuse"]
                for r in rows
                if r["entry_tokens"] == e and r["ratio_cold_over_recompute"] < 1
            ),
            default=None,
        )
        for e in args.entry_tokens
    }
    return {"rows": rows, "crossover": crossover, "repeats": args.repeats}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        return trio.run(_measure, args, args.dir)
    with tempfile.TemporaryDirectory(prefix="kvtrio-bench-reuse-") as tmp:
        return trio.run(_measure, args, Path(tmp))


def render(figures: dict[str, Any]) -> None:
    print(f"{'entry':>6} {'reuse':>6} {'cold load ms':>13} {'recompute ms':>13} {'ratio':>7}")
    for row in figures["rows"]:
        print(
            f"{row['entry_tokens']:>6} {row['reuse']:>6} {row['cold_load_s'] * 1e3:>13.2f} "
            f"{row['recompute_s'] * 1e3:>13.2f} {row['ratio_cold_over_recompute']:>7.2f}"
        )
    for entry, reuse in figures["crossover"].items():
        print(f"entry of {entry} tokens: the cold load wins from a reuse of {reuse} tokens")
