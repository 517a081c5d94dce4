# mypy: ignore-errors
"""Tables of restart14.py's lines (gpu14): turn 2's TTFT per round and server, medians,
and each server's ratio to plain mlx_lm.server and to the floor, per round and of the
medians.

    python3 analyze14.py restart14.jsonl
"""

import json
import statistics
import sys


def main(path):
    runs = [json.loads(x) for x in open(path) if x.strip()]
    head = next((r for r in runs if "servers" in r), None)
    names = [s[0] for s in head["servers"]] if head else []
    turns = [r for r in runs if "ttft_s" in r]
    rounds = sorted({r["round"] for r in turns})
    by = {(r["round"], r["name"]): r for r in turns}
    print("turn 2 TTFT ms (position), cached tokens, cache header; load average at its start")
    print("round | " + " | ".join(names))
    for k in rounds:
        cells = []
        for n in names:
            r = by.get((k, n))
            if r is None:
                cells.append("-")
                continue
            hdr = (r.get("tier") or {}).get("cache_header") or ""
            cells.append(f"{r['ttft_s'] * 1e3:.1f} ({r['position']}) {r['cached_tokens']} {hdr}")
        load = min(r["load"] for r in turns if r["round"] == k)
        print(f"{k} | " + " | ".join(cells) + f" | load {load:.2f}")
    med = {
        n: statistics.median([by[k, n]["ttft_s"] for k in rounds if (k, n) in by])
        for n in names
        if any((k, n) in by for k in rounds)
    }
    print("median | " + " | ".join(f"{med[n] * 1e3:.1f}" if n in med else "-" for n in names))
    for ref in ("mlx_lm", "floor", "kvmain", "naive", "kvcold"):
        if ref not in med:
            continue
        print(f"vs {ref}: ")
        for n in names:
            if n == ref or n not in med:
                continue
            per = [
                by[k, n]["ttft_s"] / by[k, ref]["ttft_s"]
                for k in rounds
                if (k, n) in by and (k, ref) in by
            ]
            print(
                f"  {n}/{ref}: of medians {med[n] / med[ref]:.3f}; round median "
                f"{statistics.median(per):.3f}; per round " + " ".join(f"{x:.3f}" for x in per)
            )
    first = names[0]
    ref = {k: by[k, first]["answer"] for k in rounds if (k, first) in by}
    same = {n: all(by[k, n]["answer"] == ref[k] for k in ref if (k, n) in by) for n in names}
    print(f"same answer as {first} in every round:", same)
    for r in runs:
        if "turn1" in r:
            took = f"{r['s']:.1f} s" if "s" in r else f"copied from {r.get('copied_from')}"
            print("turn 1:", r["turn1"], took)


if __name__ == "__main__":
    main(sys.argv[1])
