"""Summary of ``ab.py``'s JSON lines: median seconds of each start segment per server,
per-round ratios against the naive baseline, and which thread made each probed MLX call
and for how long. Usage: python3 seg.py FILE..."""

import json
import statistics
import sys
from collections.abc import Callable
from typing import Any


def at(run: dict[str, Any], name: str, field: int = 0) -> float:
    mark = run["marks"].get(name)
    return float("nan") if mark is None else float(mark[field])


def span(run: dict[str, Any], label: str, field: int = 0) -> float:
    return at(run, "done:" + label, field) - at(run, "start:" + label, field)


SEGMENTS: dict[str, Callable[[dict[str, Any]], float]] = {
    "spawn -> interpreter": lambda d: at(d, "interp"),
    "interpreter -> mlx_lm.server imported": lambda d: (
        at(d, "import_done:mlx_lm.server") - at(d, "interp")
    ),
    "imported -> model load starts": lambda d: (
        at(d, "start:load") - at(d, "import_done:mlx_lm.server")
    ),
    "load starts -> listen": lambda d: at(d, "listen") - at(d, "start:load"),
    "listen": lambda d: d["listen"],
    "model load": lambda d: span(d, "load"),
    "first answer": lambda d: d["answer"],
    "answer - listen": lambda d: d["answer"] - d["listen"],
    "cold tier open starts - answer": lambda d: at(d, "start:ColdOpening._open") - d["answer"],
    "CPU at listen (process)": lambda d: at(d, "listen", 1),
    "CPU at first answer (process)": lambda d: d["cpu"],
    "mx.device_info (first call)": lambda d: span(d, "mx.device_info"),
    "mx.device_info thread CPU": lambda d: span(d, "mx.device_info", 2),
    "mx.distributed.init (first call)": lambda d: span(d, "mx.distributed.init"),
    "mx.default_stream (first call)": lambda d: span(d, "mx.default_stream"),
}


def main() -> None:
    runs = [json.loads(line) for f in sys.argv[1:] for line in open(f) if line.startswith("{")]
    kinds = [
        k for k in ("mlx_lm", "naive", "kvmain", "kvtrio") if any(d["kind"] == k for d in runs)
    ]
    print(
        f"{len(runs)} starts; load average {min(d['load'] for d in runs):.1f}-"
        f"{max(d['load'] for d in runs):.1f}"
    )
    print(f"{'median, s':40}" + "".join(f"{k:>9}" for k in kinds))
    for name, f in SEGMENTS.items():
        cells = [statistics.median(f(d) for d in runs if d["kind"] == k) for k in kinds]
        print(f"{name:40}" + "".join(f"{c:9.3f}" for c in cells))
    for kind in kinds:
        threads = {
            d["marks"].get("start:mx.device_info", [0, 0, 0, "-"])[3]
            for d in runs
            if d["kind"] == kind
        }
        print(f"{kind}: mx.device_info first called on {sorted(threads)}")
    by = {(d["round"], d["kind"]): d for d in runs}
    rounds = sorted({d["round"] for d in runs})
    for kind in kinds:
        if kind == "naive":
            continue
        for key in ("listen", "answer", "cpu"):
            ratios = [
                by[r, kind][key] / by[r, "naive"][key]
                for r in rounds
                if (r, kind) in by and (r, "naive") in by
            ]
            lower = sum(1 for x in ratios if x < 1)
            print(
                f"{kind}/naive {key}: round median {statistics.median(ratios):.3f}, lower in "
                f"{lower} of {len(ratios)} ({' '.join(f'{x:.2f}' for x in ratios)})"
            )


if __name__ == "__main__":
    main()
