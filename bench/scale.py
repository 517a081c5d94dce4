"""``kvtrio bench scale``: the cold store at N = 1k, 10k, 100k entries (1M with --million).

Per N, over a directory of N small entries (blocks layout; the entries differ in their
tokens and share their blocks, so populating costs N manifest files):

- the first child process (``--child``) opens the directory, which has no catalogue yet:
  that first open builds the catalogue from the manifests and is the "rebuild"
  (``rebuild_s``, ``rebuild_cpu_s``, ``rebuild_stall_s``: its wall and CPU seconds and
  its longest loop stall), timed after the imports of :data:`OPEN_IMPORTS` as the timed
  opens are (``rebuild_new_modules``: any module it still imported; before branch open10
  it imported 30, the tiered cache's, inside the timing: most of its stall at 1k). The
  same child then opens the cache again, untimed, for the lookups: latency p50/p99 of a
  miss (``fetch_nearest``) and of a hit (the index lookup alone, the part that could
  grow with N); then ``kvtrio gc``'s pass (from the catalogue) and ``kvtrio verify``'s
  (every file read), with their time per entry and their ratios between sizes (linear:
  about the ratio of the sizes);
- the open after a clean close, which reads the catalogue ("open"), is measured
  ``--repeat`` times (default 5 up to 100,000 entries, 1 above), the N's taking turns
  (:func:`~kvtrio.bench.scale_opens.interleaved_opens`: round by round, so a drift of
  the machine's load reaches every N alike; each sample records its ``round``), every
  time as the FIRST open of the cold tier in a fresh process (``--child-open``), as a
  restarted server opens it: that process first imports, explicitly and untimed, the
  modules the open uses (:data:`OPEN_IMPORTS`; the sample's ``open_new_modules`` counts
  any module the open still imported, 0 when none), starts the MLX owner, runs one full
  collection (``full_gc_base_s``: the process without an index) and reads its RSS; then
  the timed open: its wall and CPU seconds (``open_s``, ``open_cpu_s``; CPU of all the
  process's threads), its longest loop stall (``open_stall_s``: a 1 ms heartbeat's worst
  lateness), its minor page faults (``open_minor_faults``, the process's, during the
  open); then, with the cache open, one full collection (``full_gc_s``: what the index
  costs a process that does not ``gc.freeze``) and RSS again: ``rss_per_entry`` is (RSS
  with the cache open - RSS just before the open, after the imports) / N, from that same
  fresh process. ``prior_opens`` is the number of opens the process made before the
  timed one (always 0). Every sample is kept ("opens"); the median of each figure is the
  figure itself (what the ratios divide), with ``<key>_min``/``<key>_max`` beside it;
  beside each ratio of medians, the min and max of the same ratio within one round
  (``open_<big>_over_<small>_rounds_min``/``_max``: the pairs measured minutes apart at
  most), shown, never used for the target.

Before branch bench9 the timed open was the process's second open (after the rebuild,
or after an untimed open), which reused memory the first had freed: its RSS per entry
and its CPU seconds were not a restart's.

For the miss ratio the target bounds, every N's misses again in one more fresh process
that opens every N's cache and interleaves their misses round by round (``misses``: the
same moment of the machine for every N, each share timed after a full collection with
the collector off, the same for every N).
Then a burst: write-back inserts with nobody waiting for the disk, against a cold budget
of about ``--burst-fit`` entries, printing the most bytes ever on disk over the budget
and the entries kept over those that fit; and the burst's memory, peak RSS growth with
the pending queue capped against uncapped (:mod:`kvtrio.bench.scale_burst`).

Targets (issue 14), printed as ratios measured in the same run:
open(10k)/open(1k) <= 11 and open(100k)/open(10k) <= 11; open(100k) <= 5 s and <= 2 KB
RSS per entry; longest loop stall during open <= 20 ms; miss(100k) <= 2 x miss(1k) and
<= 2 ms; burst max disk use <= budget + one entry, entries kept >= 90% of those that fit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtrio.bench.argtypes import whole, wholes
from kvtrio.bench.scale_burst import burst_rss
from kvtrio.bench.scale_burst import rows as burst_rows
from kvtrio.bench.scale_opens import (
    DEFAULT_REPEAT,
    interleaved_opens,
    repeats,
    round_ratios,
    summarise_opens,
)

__all__ = ["add_arguments", "measure", "render"]

TOKENS = 48  # tokens per entry by default: below one index block, the cheapest entry there is
BLOCK = 64
TARGET_LINEAR = 11.0
TARGET_OPEN_S = 5.0
TARGET_RSS_PER_ENTRY = 2048
TARGET_STALL_S = 0.020
TARGET_MISS_RATIO = 2.0
TARGET_MISS_S = 0.002


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", type=wholes, default="1000,10000,100000", help="entry counts, comma-separated"
    )
    parser.add_argument("--million", action="store_true", help="add N = 1,000,000")
    parser.add_argument("--lookups", type=whole, default=2000, help="lookups per kind and N")
    parser.add_argument("--burst", type=int, default=600, help="inserts in the burst run")
    parser.add_argument(
        "--burst-fit", type=int, default=40, help="entries the burst's cold budget holds"
    )
    parser.add_argument(
        "--burst-rss", type=int, default=200, help="2 MiB inserts in each burst RSS run"
    )
    parser.add_argument(
        "--burst-cap-mib", type=int, default=32, help="the pending cap of the burst RSS run"
    )
    parser.add_argument(
        "--tokens",
        type=whole,
        default=TOKENS,
        help=f"tokens per entry (default {TOKENS}, below one index block of {BLOCK}; longer"
        " entries show the chain hashing of the index build)",
    )
    parser.add_argument(
        "--repeat",
        type=whole,
        default=None,
        help="opens per N, each in a fresh process over the same directory, the N's taking"
        f" turns (default: {DEFAULT_REPEAT} for N <= 100,000, 1 above); the median is the figure"
        " the ratios use",
    )
    parser.add_argument("--no-maintenance", action="store_true", help="skip gc and verify")
    parser.add_argument(
        "--dir", default=None, help="work directory, made if missing (default: a tmp dir)"
    )
    parser.add_argument("--child", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--child-open", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--child-misses", nargs="+", metavar="DIR", help=argparse.SUPPRESS)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.child_open is not None:  # one more open, in the fresh process _child_open started
        return child_open_main(Path(args.child_open))
    if args.child_misses is not None:  # every N's misses, interleaved, in one fresh process
        return child_misses_main([Path(d) for d in args.child_misses], args.lookups, args.tokens)
    if args.child is not None:  # one N, in the fresh process _child started
        return child_main(
            Path(args.child[0]),
            int(args.child[1]),
            args.lookups,
            not args.no_maintenance,
            args.tokens,
        )
    sizes = [int(n) for n in args.sizes.split(",") if n]
    if args.million:
        sizes.append(1_000_000)
    if args.dir is not None:  # a work directory named but not there yet: made
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        runs = {}
        directories = {n: Path(work) / f"n{n}" for n in sizes}
        for n, directory in directories.items():
            populate = _populate(directory, n, args.tokens)
            figures = _child(directory, n, args.lookups, not args.no_maintenance, args.tokens)
            runs[str(n)] = {"populate_s": populate, **figures}
        counts = {n: repeats(n, args.repeat) for n in sizes}
        opens = interleaved_opens(directories, counts, _child_open)
        for n in sizes:
            runs[str(n)].update(summarise_opens(opens[n]))
            print(json.dumps({str(n): runs[str(n)]}), file=sys.stderr, flush=True)
        misses = _child_misses([Path(work) / f"n{n}" for n in sizes], args.lookups, args.tokens)
        burst = _burst(Path(work) / "burst", args.burst, args.burst_fit)
        rss = burst_rss(Path(work) / "burst-rss", args.burst_rss, args.burst_cap_mib)
    ratios = _ratios(sizes, runs, burst, misses)
    return {
        "sizes": sizes, "tokens": args.tokens, "runs": runs, "misses": misses, "burst": burst,
        "burst_rss": rss, **ratios,
    }  # fmt: skip


def _ratios(
    sizes: list[int], runs: dict[str, Any], burst: dict[str, Any], misses: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_n = {int(n): run for n, run in runs.items()}
    for small, big in itertools.pairwise(sizes):
        out[f"open_{big}_over_{small}"] = by_n[big]["open_s"] / by_n[small]["open_s"]
        paired = round_ratios(by_n[small]["opens"], by_n[big]["opens"])
        if paired:
            out[f"open_{big}_over_{small}_rounds_min"] = min(paired)
            out[f"open_{big}_over_{small}_rounds_max"] = max(paired)
        out[f"open_cpu_{big}_over_{small}"] = by_n[big]["open_cpu_s"] / by_n[small]["open_cpu_s"]
        for step in ("gc", "verify"):
            if f"{step}_s" in by_n[big] and f"{step}_s" in by_n[small]:
                out[f"{step}_{big}_over_{small}"] = (
                    by_n[big][f"{step}_s"] / by_n[small][f"{step}_s"]
                )
    if sizes:
        # The target's figure: every N's misses measured in one process, interleaved
        # (misses_interleaved), so the two medians share the machine's moment.
        small, large = misses[str(sizes[0])], misses[str(sizes[-1])]
        out["miss_p50_largest_over_smallest"] = large["p50_s"] / small["p50_s"]
        per_round = [a / b for a, b in zip(large["round_p50s"], small["round_p50s"], strict=True)]
        out["miss_ratio_rounds_min"], out["miss_ratio_rounds_max"] = min(per_round), max(per_round)
        # The same from each N's own child (minutes apart, as before): for comparison.
        out["miss_p50_largest_over_smallest_separate"] = (
            by_n[sizes[-1]]["miss_p50_s"] / by_n[sizes[0]]["miss_p50_s"]
        )
    out["burst_max_disk_over_budget"] = burst["max_disk_bytes"] / burst["budget"]
    out["burst_kept_over_fit"] = burst["kept"] / burst["fit"]
    return out


# -- populating ------------------------------------------------------------------------


def _seed_manifest(directory: Path, n_tokens: int) -> tuple[bytes, Any, str]:
    """One real entry written through the tier; its manifest bytes, header and model."""
    import trio
    from kvtrio.actors.tier import ColdTier
    from kvtrio.storage.reader import read_header
    from kvtrio.tinymodel import build_tiny_model, make_caches, prefill

    tiny = build_tiny_model(seed=5)
    caches = make_caches(tiny)
    tokens = list(range(n_tokens))
    prefill(tiny, caches, tokens)

    async def save() -> None:
        async with ColdTier.open(directory, layout="blocks", block_tokens=BLOCK, inline=True) as t:
            meta = {"model_id": tiny.model_id, "config_fingerprint": tiny.fingerprint}
            result = await (await t.save("seed", tokens, caches, meta=meta)).wait()
            assert result.written, result

    trio.run(save)
    path = directory / "caches" / "seed.kvc"
    header = read_header(str(path)).header
    return path.read_bytes(), header, tiny.fingerprint


def _populate(directory: Path, n: int, n_tokens: int = TOKENS) -> float:
    """N manifests differing in their tokens (keys as the tiered cache names them),
    sharing the seed's blocks; written without fsync (a bench fixture, not a save)."""
    import attrs
    from kvtrio.actors.prefix import ModelKey, entry_key
    from kvtrio.storage.format import PREAMBLE, encode_header, encode_preamble

    start = time.perf_counter()
    data, header, _ = _seed_manifest(directory, n_tokens)
    padded = len(data) > PREAMBLE.size + len(encode_header(header))
    (directory / "caches" / "seed.kvc").unlink()
    model = ModelKey(header.model_id or "", header.config_fingerprint or "")
    rng = random.Random(n)
    caches_dir = directory / "caches"
    for i in range(n):
        tokens = (i // 1000 + 1000, i % 1000, *(rng.randrange(50_000) for _ in range(n_tokens - 2)))
        body = encode_header(attrs.evolve(header, tokens=tokens))
        blob = encode_preamble(body, header.format_version) + body
        if padded:
            blob += bytes(-len(blob) % 16384)
        name = entry_key(model, tokens, BLOCK) + ".kvc"
        fd = os.open(caches_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, blob)
        finally:
            os.close(fd)
    # The kernel's writeback of the fixture (N files) would otherwise run during the
    # measured opens, competing for the CPU: it is done before them.
    os.sync()
    return time.perf_counter() - start


# -- one N, in a child process ---------------------------------------------------------


def _child(
    directory: Path, n: int, lookups: int, maintenance: bool, n_tokens: int
) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtrio",
            "bench",
            "scale",
            "--json",
            "--child",
            str(directory),
            str(n),
            "--lookups",
            str(lookups),
            "--tokens",
            str(n_tokens),
            *(["--no-maintenance"] if not maintenance else []),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    figures: dict[str, Any] = json.loads(out.stdout)
    return figures


def _child_open(directory: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "scale", "--json", "--child-open",
         str(directory)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    sample: dict[str, float] = json.loads(out.stdout)
    return sample


# The modules a first open of the cold tier uses, imported before it is timed: a restarted
# server has imported them (to serve at all) before it opens its cache. The open's sample
# counts whatever it still imported (``open_new_modules``), so a module missing here shows.
OPEN_IMPORTS = (
    "trio",
    "mlx.core",
    "kvtrio.actors.factory",
    "kvtrio.actors.owner",
    "kvtrio.actors.prefix",
    "kvtrio.actors.tier",
    "kvtrio.actors.tiered",
    "kvtrio.storage.catalogue",
    "kvtrio.storage.reader",
)

_opens_in_process = 0  # opens of the tiered cache this bench made in this process


def _open_cache(directory: Path, model: Any, owner: Any) -> Any:
    """The bench's open of a directory's tiered cache (all of it held: no budget evicts,
    no free-space floor), counted in ``_opens_in_process``."""
    from kvtrio.actors.tiered import open_tiered_cache

    global _opens_in_process
    _opens_in_process += 1
    return open_tiered_cache(
        directory, model, owner=owner, hot_budget=1 << 30, cold_budget=1 << 50,
        block_size=BLOCK, min_free_bytes=0,
    )  # fmt: skip


def child_open_main(directory: Path) -> dict[str, Any]:
    """One measured open of a directory whose catalogue exists, as a restart's: the first
    open of the cold tier in this fresh process, after the imports it uses."""
    import importlib

    for name in OPEN_IMPORTS:
        importlib.import_module(name)
    import trio

    return trio.run(_child_open_async, directory)


async def _child_open_async(directory: Path) -> dict[str, Any]:
    import gc

    from kvtrio.actors.owner import MlxOwner

    model = _model_of(directory)
    prior_opens = _opens_in_process
    async with MlxOwner.inline() as owner:
        start = time.perf_counter()
        gc.collect()
        full_gc_base_s = time.perf_counter() - start  # the process, no index
        before = _rss()
        modules = set(sys.modules)
        sample: dict[str, Any] = {}

        def with_open(cache: Any) -> None:
            sample["open_new_modules"] = sorted(set(sys.modules) - modules)
            start = time.perf_counter()
            gc.collect()  # the one full pass the index costs the process (no gc.freeze)
            sample["full_gc_s"] = time.perf_counter() - start
            sample["rss_per_entry"] = (_rss() - before) / cache.statistics().cold_entries

        opened = await _timed_open(directory, model, owner, with_open)
    new_modules = sample.pop("open_new_modules")
    return {
        "open_s": opened["seconds"], "open_cpu_s": opened["cpu_s"],
        "open_stall_s": opened["stall_s"], "open_minor_faults": opened["minor_faults"],
        "rss_per_entry": sample["rss_per_entry"], "full_gc_s": sample["full_gc_s"],
        "full_gc_base_s": full_gc_base_s, "entries": opened["entries"],
        "prior_opens": prior_opens, "open_new_modules": len(new_modules),
        "open_new_module_names": new_modules, "load_1m": os.getloadavg()[0],
    }  # fmt: skip


MISS_ROUNDS = 20  # rounds of the interleaved misses (each N's share of a round in turn)


def _child_misses(directories: list[Path], lookups: int, n_tokens: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "scale", "--json", "--lookups", str(lookups),
         "--tokens", str(n_tokens), "--child-misses", *map(str, directories)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    figures: dict[str, Any] = json.loads(out.stdout)
    return figures


def child_misses_main(directories: list[Path], lookups: int, n_tokens: int) -> dict[str, Any]:
    import trio

    return trio.run(_child_misses_async, directories, lookups, n_tokens)


async def _child_misses_async(
    directories: list[Path], lookups: int, n_tokens: int
) -> dict[str, Any]:
    """Every N's cache open at once in this one process, and their misses interleaved:
    :data:`MISS_ROUNDS` rounds, each taking ``lookups / rounds`` misses of every cache in
    turn (the first cache of a round rotating), each share timed after a full collection
    with the collector off (the same for every N), so no N's figure holds a collection
    another's does not, and every N's samples spread over the same minutes. Per N: the
    median and p99 of all its samples, and its median in each round."""
    import gc
    from contextlib import AsyncExitStack

    from kvtrio.actors.owner import MlxOwner

    per_round = max(1, lookups // MISS_ROUNDS)
    rng = random.Random(7)
    async with MlxOwner.inline() as owner, AsyncExitStack() as stack:
        caches = []
        for directory in directories:
            opened = _open_cache(directory, _model_of(directory), owner)
            caches.append(await stack.enter_async_context(opened))
        samples: list[list[float]] = [[] for _ in caches]
        rounds: list[list[float]] = [[] for _ in caches]
        for r in range(MISS_ROUNDS):
            for step in range(len(caches)):
                i = (r + step) % len(caches)
                cache = caches[i]
                gc.collect()
                gc.disable()
                try:
                    mine = await _time_misses(cache, rng, per_round, n_tokens)
                finally:
                    gc.enable()
                samples[i] += mine
                rounds[i].append(statistics.median(mine))
        sizes = [cache.statistics().cold_entries for cache in caches]
    out: dict[str, Any] = {}
    for n, mine, medians in zip(sizes, samples, rounds, strict=True):
        figures = _percentiles("miss", mine)
        out[str(n)] = {
            "p50_s": figures["miss_p50_s"], "p99_s": figures["miss_p99_s"],
            "samples": len(mine), "round_p50s": medians,
        }  # fmt: skip
    return out


async def _time_misses(cache: Any, rng: random.Random, count: int, n_tokens: int) -> list[float]:
    """Seconds of each of `count` misses: a first token no entry starts with, then the
    entries' own tokens, so the lookup walks as far as a miss can."""
    times = []
    for _ in range(count):
        query = [2_000_000 + rng.randrange(1000), *range(n_tokens)]
        start = time.perf_counter()
        found = await cache.fetch_nearest(query)
        times.append(time.perf_counter() - start)
        assert found.caches is None
    return times


def _model_of(directory: Path) -> Any:
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.storage.reader import read_header

    first = next((directory / "caches").iterdir())
    header = read_header(str(first)).header
    return ModelKey(header.model_id or "", header.config_fingerprint or "")


def child_main(
    directory: Path, n: int, lookups: int, maintenance: bool, n_tokens: int = TOKENS
) -> dict[str, Any]:
    """The rebuild and the lookups of one N, in this fresh process: after the imports of
    :data:`OPEN_IMPORTS`, as :func:`child_open_main` (a server imports them before it
    opens its cache), so the rebuild's time and loop stall are the rebuild's, not those of
    importing the modules it uses (``rebuild_new_modules`` counts any it still imported)."""
    import importlib

    for name in OPEN_IMPORTS:
        importlib.import_module(name)
    import trio

    return trio.run(_child_async, directory, n, lookups, maintenance, n_tokens)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _heartbeat(worst: list[float], stop: Any) -> None:
    """A 1 ms tick's worst lateness in ``worst[0]``; ``worst[1]`` is when the pending tick
    began, so that the caller can count the lateness up to the moment it stops the
    heartbeat (:func:`_stop_heartbeat`): a wake after that is not the open's."""
    import trio

    while not stop.is_set():
        worst[1] = before = time.perf_counter()
        await trio.sleep(0.001)
        if stop.is_set():
            break
        worst[0] = max(worst[0], time.perf_counter() - before - 0.001)


def _stop_heartbeat(worst: list[float], stop: Any) -> float:
    """Stop the heartbeat now; the worst lateness up to now, the pending tick's included."""
    stop.set()
    return max(worst[0], time.perf_counter() - worst[1] - 0.001)


async def _timed_open(
    directory: Path, model: Any, owner: Any, with_open: Any = None
) -> dict[str, Any]:
    """Open (and close) the tiered cache, timing the open and its worst loop stall; also
    the process's CPU seconds during the open (all threads: on a shared machine, the
    figure that other processes' load does not stretch) and its minor page faults.
    ``with_open(cache)``, where given, runs with the cache open, after the timing."""
    import resource

    import trio

    worst = [0.0, time.perf_counter()]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_heartbeat, worst, stop)
        await trio.sleep(0.01)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, cpu = time.perf_counter(), time.process_time()
        async with _open_cache(directory, model, owner) as cache:
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            stall = _stop_heartbeat(worst, stop)
            entries = cache.statistics().cold_entries
            if with_open is not None:
                with_open(cache)
    return {
        "seconds": elapsed, "stall_s": stall, "entries": entries, "cpu_s": cpu,
        "minor_faults": faults,
    }  # fmt: skip


async def _child_async(
    directory: Path, n: int, lookups: int, maintenance: bool, n_tokens: int
) -> dict[str, Any]:
    """The rebuild (this process's first open, of a directory without catalogue), then
    the lookups in a second, untimed open. The timed open is not here: every one is a
    fresh process's first (:func:`child_open_main`)."""
    from kvtrio.actors.owner import MlxOwner

    model = _model_of(directory)
    figures: dict[str, Any] = {"n": n}
    async with MlxOwner.inline() as owner:
        modules = set(sys.modules)
        rebuild = await _timed_open(directory, model, owner)
        assert rebuild["entries"] == n, (rebuild["entries"], n)
        figures.update(
            rebuild_s=rebuild["seconds"], rebuild_cpu_s=rebuild["cpu_s"],
            rebuild_stall_s=rebuild["stall_s"], rebuild_minor_faults=rebuild["minor_faults"],
            rebuild_load_1m=os.getloadavg()[0],
            rebuild_new_modules=sorted(set(sys.modules) - modules),
        )  # fmt: skip
        async with _open_cache(directory, model, owner) as cache:
            rng = random.Random(7)
            misses = await _time_misses(cache, rng, lookups, n_tokens)
            stored = [entry.tokens for _, entry in zip(range(lookups), cache._index, strict=False)]
            hits = []
            for tokens in stored:
                start = time.perf_counter()
                match = cache._index.lookup(model, [*tokens, 1])
                hits.append(time.perf_counter() - start)
                assert match is not None
    figures.update(_percentiles("miss", misses), **_percentiles("hit", hits))
    if maintenance:
        figures.update(_maintenance(directory, n))
    return figures


def _percentiles(name: str, samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        f"{name}_p50_s": statistics.median(ordered),
        f"{name}_p99_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def _maintenance(directory: Path, n: int) -> dict[str, float]:
    """``kvtrio gc``'s pass (from the catalogue, as the command runs it) and ``kvtrio
    verify``'s (which reads every file: that is its job), with their time per entry."""
    from kvtrio.storage.blockstore import LocalBlockStore
    from kvtrio.storage.maintenance import collect_garbage, verify_tree

    store = LocalBlockStore(str(directory / "blocks"))
    start = time.perf_counter()
    gc_report = collect_garbage(
        str(directory / "caches"), store, grace_s=3600, catalogue_dir=str(directory)
    )
    gc_s = time.perf_counter() - start
    assert gc_report.catalogued == n, gc_report
    start = time.perf_counter()
    report = verify_tree(str(directory / "caches"), store)
    assert report.ok, report
    verify_s = time.perf_counter() - start
    return {
        "gc_s": gc_s,
        "gc_per_entry_s": gc_s / n,
        "verify_s": verify_s,
        "verify_per_entry_s": verify_s / n,
    }


# -- the burst ---------------------------------------------------------------------------


def _burst(directory: Path, inserts: int, fit: int) -> dict[str, Any]:
    from kvtrio.bench.scale_burst import burst

    return burst(directory, inserts, fit)


# -- printing ------------------------------------------------------------------------------


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def met(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]missed[/]"

    console = Console()
    nan = float("nan")
    tokens = figures.get("tokens", TOKENS)
    table = Table(
        title=f"kvtrio cold store at scale ({tokens}-token entries; per N, a fresh process;"
        " open: the median of K opens, each a fresh process's first)"
    )
    for column in ("N", "rebuild s", "open s (cpu s)", "opens: s min-max (K)",
                   "open stall ms (max)", "RSS/entry B",
                   "full gc ms (none)", "miss p50/p99 ms", "hit p50/p99 ms", "gc s (us/entry)",
                   "verify s (us/entry)"):  # fmt: skip
        table.add_column(column, justify="right")
    for n, run in figures["runs"].items():
        stall_max = run.get("open_stall_s_max", run["open_stall_s"])  # the target bounds every open
        table.add_row(
            f"{int(n):,}",
            f"{run['rebuild_s']:.2f}",
            f"{run['open_s']:.2f} ({run['open_cpu_s']:.2f}) "
            f"{met(int(n) < 100_000 or run['open_s'] <= TARGET_OPEN_S)}",
            f"{run.get('open_s_min', run['open_s']):.3f}-{run.get('open_s_max', run['open_s']):.3f}"
            f" ({run.get('repeat', 1)})",
            f"{run['open_stall_s'] * 1e3:.1f} ({stall_max * 1e3:.1f}) "
            f"{met(stall_max <= TARGET_STALL_S)}",
            f"{run['rss_per_entry']:,.0f}",
            f"{run['full_gc_s'] * 1e3:.0f} ({run['full_gc_base_s'] * 1e3:.0f})",
            f"{run['miss_p50_s'] * 1e3:.3f}/{run['miss_p99_s'] * 1e3:.3f}",
            f"{run['hit_p50_s'] * 1e3:.3f}/{run['hit_p99_s'] * 1e3:.3f}",
            f"{run.get('gc_s', nan):.2f} ({run.get('gc_per_entry_s', nan) * 1e6:.1f})",
            f"{run.get('verify_s', nan):.2f} ({run.get('verify_per_entry_s', nan) * 1e6:.1f})",
        )
    console.print(table)
    ratios = Table(title="ratios (same run) and targets", show_header=False)
    ratios.add_column("figure")
    ratios.add_column("value", justify="right")
    ratios.add_column("target")
    for key, value in figures.items():
        if key.startswith("open_") and "_over_" in key and not key.endswith(("_min", "_max")):
            low, high = figures.get(f"{key}_rounds_min"), figures.get(f"{key}_rounds_max")
            rounds = "" if low is None else f" (rounds {low:.2f}-{high:.2f}x)"
            ratios.add_row(
                key,
                f"{value:.2f}x{rounds}",
                f"<= {TARGET_LINEAR}x {met(value <= TARGET_LINEAR)}",
            )
    for key, value in figures.items():
        if (key.startswith("gc_") or key.startswith("verify_")) and "_over_" in key:
            ratios.add_row(key, f"{value:.2f}x", "linear: about N's ratio")
    miss = figures.get("miss_p50_largest_over_smallest")
    if miss is not None:
        ratios.add_row(
            "miss p50 largest N / smallest N (interleaved in one process; per round min-max)",
            f"{miss:.2f}x ({figures['miss_ratio_rounds_min']:.2f}-"
            f"{figures['miss_ratio_rounds_max']:.2f}x)",
            f"<= {TARGET_MISS_RATIO}x {met(miss <= TARGET_MISS_RATIO)}",
        )
        for n, interleaved in figures.get("misses", {}).items():
            ok = interleaved["p50_s"] <= TARGET_MISS_S
            ratios.add_row(
                f"miss p50/p99 at {int(n):,} (interleaved)",
                f"{interleaved['p50_s'] * 1e3:.3f}/{interleaved['p99_s'] * 1e3:.3f} ms",
                f"p50 <= {TARGET_MISS_S * 1e3:.0f} ms {met(ok)}",
            )
    for row in burst_rows(figures, met):
        ratios.add_row(*row)
    console.print(ratios)
