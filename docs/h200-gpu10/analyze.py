# mypy: ignore-errors
"""Summarise gpu10trace files (trace/gpu10trace.py): per server process, the spill
window's largest generation-thread gaps and what ran in them.

Usage: python3 analyze.py TRACE_DIR [WINDOW_S]
The window starts when the request C (a RAM hit of >= 1000 cached tokens) joins the batch
(its "insert") and lasts WINDOW_S seconds (2.0). A gap is the time between the ends of two
consecutive BatchGenerator.next() calls (what a streamed token waits on the generation
thread): "step" is the next() call, "off" the rest (owner jobs, pumps, mlx-lm's own work).
"""

import collections
import glob
import itertools
import json
import os
import sys


def label(argv):
    a = " ".join(argv)
    size = argv[argv.index("--prompt-cache-size") + 1] if "--prompt-cache-size" in argv else "-"
    if "serve_naive" in a:
        kind = "naive"
    elif "mlx_lm" in a and "server" in argv:
        kind = "mlx_lm"
    else:
        kind = "kvtrio"
    return f"{kind}(cache {size})"


def overlap(events, a, b):
    return [e for e in events if e["t"] < b and e["t"] + e["d"] > a]


def summary(events):
    by = collections.defaultdict(list)
    for e in events:
        key = e["k"] if e["k"] != "job" else "job:" + e.get("fn", "?").split(".")[-1]
        by[key].append(e["d"])
    return {
        k: (len(v), round(1e3 * sum(v), 1), round(1e3 * max(v), 1)) for k, v in sorted(by.items())
    }


def analyze(path, window):
    events = [json.loads(line) for line in open(path) if line.strip()]
    argv = next((e.get("argv", []) for e in events if e["k"] == "start"), [])
    name = label(argv)
    events.sort(key=lambda e: e["t"])
    steps = [e for e in events if e["k"] == "step"]
    others = [e for e in events if e["k"] not in ("step", "start", "patched")]
    print(f"=== {os.path.basename(path)} {name}: {len(steps)} steps")
    fails = [e for e in events if e["k"] == "patch_failed"]
    if fails:
        print("  patch failures:", fails)
    print(
        "  whole run (count, ms total, ms max):", summary([e for e in others if e["k"] != "insert"])
    )
    inserts = [e for e in events if e["k"] == "insert"]
    cs = [e for e in inserts if e.get("cached", 0) >= 1000]
    if not cs:
        print("  no RAM-hit insert (C): no window")
        return
    for n, c in enumerate(cs):
        t0, t1 = c["t"], c["t"] + window
        ws = [s for s in steps if t0 <= s["t"] + s["d"] <= t1]
        gaps = []
        for prev, cur in itertools.pairwise(steps):
            end0, end1 = prev["t"] + prev["d"], cur["t"] + cur["d"]
            if t0 <= end1 <= t1:
                gaps.append((end1 - end0, prev, cur))
        print(
            f"  window {n} (C insert {1e3 * c['d']:.1f} ms, new {c.get('new')}, "
            f"cached {c.get('cached')}): "
            f"{len(ws)} steps, step ms {1e3 * sum(s['d'] for s in ws):.0f}"
        )
        print("    in window:", summary(overlap(others, t0, t1)))
        gaps.sort(key=lambda g: -g[0])
        for gap, prev, cur in gaps[:6]:
            end0 = prev["t"] + prev["d"]
            inside = overlap(others, end0, cur["t"] + cur["d"])
            print(
                f"    gap {1e3 * gap:7.1f} ms at +{1e3 * (end0 - t0):6.0f} ms: "
                f"step {1e3 * cur['d']:6.1f},"
                f" off {1e3 * (cur['t'] - end0):6.1f}; {summary(inside)}"
            )


def main():
    window = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "trace-*.jsonl"))):
        try:
            analyze(path, window)
        except Exception as exc:
            print("  failed:", path, exc)


if __name__ == "__main__":
    main()
