# mypy: ignore-errors
"""Group gpu10trace "stall" samples (KVTRIO_TRACE_STALLS) by where the generation thread
was: per server process, per stall (consecutive samples), the generation thread's
innermost frames that are kvtrio's or mlx-lm's, counted, and the other threads found
outside a wait.

Usage: python3 stalls.py TRACE_DIR [MIN_MS]
"""

import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from analyze import label

WAITS = (
    "wait",
    "sleep",
    "select",
    "get",
    "poll",
    "_gil_probe",
    "_stall_sampler",
    "acquire",
    "epoll",
    "accept",
    "readinto",
    "recv_into",
    "_worker",
    "serve_forever",
    "handle_io",
    "_wait_for_tstate_lock",
    "join",
)


def main():
    min_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 50.0
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "trace-*.jsonl"))):
        ev = [json.loads(line) for line in open(path) if line.strip()]
        argv = next((e.get("argv", []) for e in ev if e["k"] == "start"), [])
        stalls = [e for e in ev if e["k"] == "stall"]
        print(f"=== {os.path.basename(path)} {label(argv)}: {len(stalls)} samples")
        groups, cur, last = [], [], None
        for e in stalls:
            if last is not None and e["d"] < last["d"]:
                groups.append(cur)
                cur = []
            cur.append(e)
            last = e
        if cur:
            groups.append(cur)
        for g in groups:
            longest = 1e3 * g[-1]["d"]
            if longest < min_ms:
                continue
            where = collections.Counter(" < ".join(e["gen"][:5]) for e in g)
            busy = collections.Counter()
            for e in g:
                for name, frames in e["others"].items():
                    if frames and not frames[0].split(":")[-1].startswith(WAITS):
                        busy[f"{name}: {' < '.join(frames[:3])}"] += 1
            print(f"  stall of >= {longest:.0f} ms at t={g[0]['t']:.3f} ({len(g)} samples)")
            for w, n in where.most_common(6):
                print(f"    gen {n:3d}x {w}")
            for w, n in busy.most_common(6):
                print(f"    other {n:3d}x {w}")


if __name__ == "__main__":
    main()
