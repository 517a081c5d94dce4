# mypy: ignore-errors
"""kvtrio serve's cold load of one ~94 MB entry with 1, 2, 4 and 8 read streams, against
mlx-lm's own load, alternated in one process (gpu13).

``kvtrio serve`` opens its tier with the default I/O options, so its loads use
``TIER_LOAD_STREAMS`` (1) streams and ``KVTRIO_LOAD_THREADS`` never reaches them (only the
CLI's ``kvtrio bench tier`` / ``gc`` / ``load`` read it). Here each setting gets its own
restarted tier (``kvtrio.bench.loadcost._Kvtrio``: the adapter's ``fetch_nearest_cache``
of the entry's tokens plus one, a cold hit on the calling thread, then ``mx.eval``), opened
while ``kvtrio.actors.tier.TIER_LOAD_STREAMS`` is N: the same path as a server's turn 2
with N streams. Each load is checked bit-exact against the saved arrays; MLX's buffer
cache is cleared before each; with the page cache warm and with it dropped
(``POSIX_FADV_DONTNEED`` on the entry's files) in alternated order round by round.

Also "kvtrio_default": a tier opened with the tree's own default (main: 1; load13: by the
CPU count). On main a tier's worker threads are ``io_threads`` = 2, so 4 and 8 streams
run at most 2 reads at once; load13 raises io_threads to the streams.

Usage: python3 loadthreads.py ROUNDS OUT.json [STREAMS,...] (from the tree on PYTHONPATH)
"""

import gc
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

from kvtrio.actors import tier as tier_module
from kvtrio.bench.loadcost import _arrays, _Kvtrio, _load_naive, _same, _timed, make_caches
from mlx_lm.models.cache import save_prompt_cache


def main() -> None:
    rounds, out = int(sys.argv[1]), sys.argv[2]
    streams = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8").split(",")]
    caches = make_caches(4096)
    tokens = list(range(2, 2 + 4096))
    nbytes = sum(a.nbytes for a in _arrays(caches))
    # main: the module's TIER_LOAD_STREAMS (1); load13: default_tier_load_streams() (by
    # the CPU count). "kvtrio_default" is opened with neither patched.
    old_style = hasattr(tier_module, "TIER_LOAD_STREAMS")
    name = "TIER_LOAD_STREAMS" if old_style else "default_tier_load_streams"
    default = getattr(tier_module, name)
    with tempfile.TemporaryDirectory(prefix="kvtrio-loadthreads-") as root:
        naive_path = os.path.join(root, "naive.safetensors")
        save_prompt_cache(naive_path, caches)
        tiers = {}
        tiers["kvtrio_default"] = _Kvtrio(os.path.join(root, "tier-default"), tokens, caches)
        for n in streams:
            setattr(tier_module, name, n if old_style else (lambda n=n: n))
            try:
                tiers[f"kvtrio_{n}"] = _Kvtrio(os.path.join(root, f"tier{n}"), tokens, caches)
            finally:
                setattr(tier_module, name, default)
        seen = [o.load_streams for o in gc.get_objects() if isinstance(o, tier_module.ColdTier)]
        print("open tiers' load_streams:", seen, flush=True)
        from pathlib import Path

        naive_files = [Path(naive_path)]
        times = {"warm": defaultdict(list), "drop": defaultdict(list)}
        names = ["naive", *tiers]
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for drop in ("warm", "drop") if r % 2 == 0 else ("drop", "warm"):
                for name in order:
                    if name == "naive":
                        took, got = _timed(
                            lambda: _load_naive(naive_path), naive_files, drop == "drop"
                        )
                    else:
                        t = tiers[name]
                        took, got = _timed(t.load, t.files, drop == "drop")
                    if not _same(got, caches):
                        raise AssertionError(f"{name}: the load is not bit-exact")
                    del got
                    times[drop][name].append(took)
            print(
                f"round {r}: "
                + " ".join(f"{d}/{n} {times[d][n][-1] * 1e3:.0f}" for d in times for n in names),
                flush=True,
            )
        for t in tiers.values():
            t.cache.close()
    report = {
        "bytes": nbytes,
        "rounds": rounds,
        "streams": streams,
        "open_tiers_load_streams": seen,
        "tree": os.environ.get("G13_TREE", ""),
        "load_s": {d: dict(v) for d, v in times.items()},
    }
    for d, per in times.items():
        print(
            f"page cache {d}: "
            + ", ".join(f"{n} {statistics.median(v) * 1e3:.1f} ms" for n, v in per.items())
        )
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
