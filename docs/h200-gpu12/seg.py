# mypy: ignore-errors
"""Summary of ``ab.py``'s JSON lines (gpu12; docs/start11/seg.py for any server names):
median seconds of each start segment per server, per-round ratios against the naive
baseline (and against REF, if given, for every other kvtrio server), and which thread made
the first ``mx.device_info``. Usage: python3 seg.py [--ref NAME] FILE..."""

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
    "model load": lambda d: span(d, "load"),
    "listen": lambda d: d["listen"],
    "first answer": lambda d: d["answer"],
    "answer - listen": lambda d: d["answer"] - d["listen"],
    "cold tier ready": lambda d: d["cold"],
    "cold open starts - answer": lambda d: at(d, "start:ColdOpening._open") - d["answer"],
    "CPU at listen (process)": lambda d: at(d, "listen", 1),
    "CPU at first answer (process)": lambda d: d["cpu"],
    "mx.device_info (first call)": lambda d: span(d, "mx.device_info"),
    "mx.distributed.init (first call)": lambda d: span(d, "mx.distributed.init"),
    "mx.default_stream (first call)": lambda d: span(d, "mx.default_stream"),
    "entries on disk at start": lambda d: d.get("entries", float("nan")),
}


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def ratios(by: dict, rounds: list[int], kind: str, ref: str, key: str) -> str:
    rs = [by[r, kind][key] / by[r, ref][key] for r in rounds if (r, kind) in by and (r, ref) in by]
    if not rs:
        return f"{kind}/{ref} {key}: no rounds"
    lower = sum(1 for x in rs if x < 1)
    return (
        f"{kind}/{ref} {key}: round median {statistics.median(rs):.3f}, lower in {lower} of "
        f"{len(rs)} ({' '.join(f'{x:.2f}' for x in rs)})"
    )


def main() -> None:
    args = sys.argv[1:]
    ref = None
    if args[:1] == ["--ref"]:
        ref, args = args[1], args[2:]
    runs = [json.loads(line) for f in args for line in open(f) if line.startswith('{"round"')]
    kinds: list[str] = []
    for d in runs:
        if d["kind"] not in kinds:
            kinds.append(d["kind"])
    print(
        f"{len(runs)} starts, {len({d['round'] for d in runs})} rounds; load average "
        f"{min(d['load'] for d in runs):.2f}-{max(d['load'] for d in runs):.2f}"
    )
    print(f"{'median, s':40}" + "".join(f"{k:>10}" for k in kinds))
    for name, f in SEGMENTS.items():
        cells = [med([f(d) for d in runs if d["kind"] == k]) for k in kinds]
        print(f"{name:40}" + "".join(f"{c:10.3f}" for c in cells))
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
        for other in ("naive", ref):
            if other is None or other == kind or other not in kinds:
                continue
            if other == ref and kind in ("mlx_lm", "naive"):
                continue
            for key in ("listen", "answer", "cpu", "cold"):
                if key == "cold" and other == "naive":
                    continue
                print(ratios(by, rounds, kind, other, key))


if __name__ == "__main__":
    main()
