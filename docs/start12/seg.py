# mypy: ignore-errors
"""Summary of ``ab.py``'s JSON lines (start12 marks): median seconds from the spawn to
each start step, each step's span, per server; per-round ratios against the naive
baseline. Usage: python3 seg.py FILE..."""

import json
import math
import statistics
import sys


def at(run, name, field=0):
    mark = run["marks"].get(name)
    return float("nan") if mark is None else float(mark[field])


def span(run, label, field=0):
    return at(run, "done:" + label, field) - at(run, "start:" + label, field)


POINTS = [
    "interp",
    "import_start:kvtrio.cli",
    "import_start:mlx.core",
    "import_done:mlx.core",
    "import_start:transformers",
    "import_done:transformers",
    "import_done:mlx_lm.server",
    "start:parse_args",
    "start:wired_limit",
    "start:ModelProvider.__init__",
    "start:load",
    "done:weights",
    "done:tokenizer",
    "done:load",
    "listen",
    "start:do_POST",
    "start:ResponseGenerator.generate",
    "start:ResponseGenerator._tokenize",
    "done:ResponseGenerator._tokenize",
    "done:do_POST",
]
SPANS = ["parse_args", "wired_limit", "load", "weights", "tokenizer", "gc.collect", "fingerprint"]


def rows(runs):
    out = {}
    for p in POINTS:
        out[p] = lambda d, p=p: at(d, p)
    out["first answer (client)"] = lambda d: d["answer"]
    out["listen (client)"] = lambda d: d["listen"]
    for s in SPANS:
        out["span " + s] = lambda d, s=s: span(d, s)
    out["CPU at listen"] = lambda d: at(d, "listen", 1)
    out["CPU at load done"] = lambda d: at(d, "done:load", 1)
    out["CPU at first answer"] = lambda d: d["cpu"]
    out["GC passes before answer, s"] = lambda d: d.get("gc_s", float("nan"))
    out["cold open start - answer"] = lambda d: at(d, "start:ColdOpening._open") - d["answer"]
    return out


def med(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def main():
    runs = [json.loads(line) for f in sys.argv[1:] for line in open(f) if line.startswith("{")]
    kinds = [
        k for k in ("mlx_lm", "naive", "kvmain", "kvtrio") if any(d["kind"] == k for d in runs)
    ]
    loads = [d["load"] for d in runs]
    print(f"{len(runs)} starts; load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'median, s from spawn':40}" + "".join(f"{k:>9}" for k in kinds))
    for name, f in rows(runs).items():
        cells = [med(f(d) for d in runs if d["kind"] == k) for k in kinds]
        print(f"{name:40}" + "".join(f"{c:9.3f}" for c in cells))
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
            n = len(ratios)
            p = sum(math.comb(n, k) for k in range(lower, n + 1)) / (1 << n)
            print(
                f"{kind}/naive {key}: round median {med(ratios):.3f}, "
                f"lower in {lower} of {n} (p={p:.3g})"
            )
    if "kvmain" in kinds:
        for key in ("listen", "answer", "cpu"):
            ratios = [
                (by[r, "kvtrio"][key] / by[r, "naive"][key])
                / (by[r, "kvmain"][key] / by[r, "naive"][key])
                for r in rounds
                if all((r, k) in by for k in ("kvtrio", "kvmain", "naive"))
            ]
            lower = sum(1 for x in ratios if x < 1)
            n = len(ratios)
            p = sum(math.comb(n, k) for k in range(lower, n + 1)) / (1 << n)
            print(
                f"branch/main {key}: round median {med(ratios):.3f}, "
                f"lower in {lower} of {n} (p={p:.3g})"
            )


if __name__ == "__main__":
    main()
