# mypy: ignore-errors
# ruff: noqa: E501
"""Tables of the twelfth session's H200 turn-2 runs. Usage: python3 analyze.py FILE...
A ``.json`` file is ``kvtrio bench serve --phases restart --json`` output: per round each
server's TTFT (its position in the round), kvtrio / naive and kvtrio / mlx_lm per round,
cached tokens and kvtrio's cache header and cold bytes read; then medians. A ``.jsonl``
file is ``restart_ab.py``'s lines: the same per round for whatever servers it ran, each
kvtrio server against naive, and the last kvtrio server against the first."""

import json
import statistics as st
import sys
from pathlib import Path


def fmt(xs, spec=".3f"):
    return " ".join(format(x, spec) for x in xs)


def summary(label, ratios):
    rs = [x for x in ratios if x == x]
    if not rs:
        return f"  {label}: none"
    low = sum(1 for x in rs if x <= 1.05)
    below = sum(1 for x in rs if x < 1)
    q = st.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3
    return (
        f"  {label}: round median {st.median(rs):.3f}x, quartiles {q[0]:.2f}-{q[2]:.2f}, "
        f"range {min(rs):.2f}-{max(rs):.2f}, rounds <= 1.05x: {low}, < 1: {below} of {len(rs)}  ({fmt(rs, '.2f')})"
    )


def tier_line(run):
    t = run.get("tier") or {}
    after = t.get("after", {})
    read = after.get("kvtrio_cold_read_bytes_total", 0) / 1e6
    prefetched = sum(v for k, v in after.items() if k.startswith("kvtrio_cold_prefetch_bytes"))
    return f"{t.get('cache_header', '-')}/{read:.1f}MB/pf{prefetched / 1e6:.0f}MB"


def bench(path):
    d = json.load(open(path))
    for length, per in d["restart"].items():
        kinds = [k for k in ("mlx_lm", "naive", "kvtrio") if k in per]
        n = len(per["kvtrio"]["runs"])
        print(f"\n## {path.name}: turn 2 at {length} tokens, {n} rounds")
        print(
            "round | "
            + " | ".join(f"{k} TTFT s (pos)" for k in kinds)
            + " | kv/naive | kv/mlx_lm | cached kv/naive | kvtrio header/cold read"
        )
        for r in range(n):
            runs = {k: per[k]["runs"][r] for k in kinds}
            cells = [f"{runs[k]['ttft_s']:.3f} ({runs[k]['position']})" for k in kinds]
            kv, nv, ml = (runs[k]["ttft_s"] for k in ("kvtrio", "naive", "mlx_lm"))
            print(
                f"{r} | " + " | ".join(cells) + f" | {kv / nv:.2f} | {kv / ml:.2f} | "
                f"{runs['kvtrio']['cached_tokens']}/{runs['naive']['cached_tokens']} | {tier_line(runs['kvtrio'])}"
            )
        med = {k: st.median(run["ttft_s"] for run in per[k]["runs"]) for k in kinds}
        print("  medians: " + ", ".join(f"{k} {med[k]:.3f} s" for k in kinds))
        print(
            f"  ratio of medians: kvtrio/naive {med['kvtrio'] / med['naive']:.3f}x, kvtrio/mlx_lm {med['kvtrio'] / med['mlx_lm']:.3f}x, naive/mlx_lm {med['naive'] / med['mlx_lm']:.3f}x"
        )
        per_kn = [
            per["kvtrio"]["runs"][r]["ttft_s"] / per["naive"]["runs"][r]["ttft_s"] for r in range(n)
        ]
        per_km = [
            per["kvtrio"]["runs"][r]["ttft_s"] / per["mlx_lm"]["runs"][r]["ttft_s"]
            for r in range(n)
        ]
        print(summary("kvtrio/naive", per_kn))
        print(summary("kvtrio/mlx_lm", per_km))
        for k in kinds:
            starts = [run["restart_s"] for run in per[k]["runs"]]
            warm = [run.get("warmup_s") or float("nan") for run in per[k]["runs"]]
            print(
                f"  {k}: start s median {st.median(starts):.2f} ({fmt(starts, '.2f')}); warm-up s {fmt(warm)}"
            )
        same = d.get("ratios", {}).get(length, {}).get("same_answer_as_mlx_lm_per_round")
        print(
            f"  same answer as mlx_lm per round: {same}; turn-1 exit: {per['kvtrio'].get('turn1_exit', {}).get('stopped')}"
        )


def ab(path):
    lines = [json.loads(x) for x in open(path) if x.startswith("{")]
    runs = [x for x in lines if "round" in x]
    for x in lines:
        if "turn1" in x:
            print(f"turn 1 on {x['turn1']}: {x['s']:.1f} s, exit {x['exit'].get('stopped', {})}")
    kinds = []
    for x in runs:
        if x["kind"] not in kinds:
            kinds.append(x["kind"])
    by = {(x["round"], x["kind"]): x for x in runs}
    rounds = sorted({x["round"] for x in runs})
    kvs = [k for k in kinds if k not in ("mlx_lm", "naive")]
    print(
        f"\n## {path.name}: {len(rounds)} rounds, load {min(x['load'] for x in runs):.2f}-{max(x['load'] for x in runs):.2f}, {runs[0]['utc']}-{runs[-1]['utc']} UTC"
    )
    print(
        "round | "
        + " | ".join(f"{k} TTFT s (pos)" for k in kinds)
        + " | "
        + " | ".join(f"{k}/naive" for k in kvs)
        + " | cached | headers"
    )
    for r in rounds:
        cells = [
            f"{by[r, k]['ttft_s']:.3f} ({by[r, k]['position']})" if (r, k) in by else "-"
            for k in kinds
        ]
        rat = [
            f"{by[r, k]['ttft_s'] / by[r, 'naive']['ttft_s']:.2f}"
            if (r, k) in by and (r, "naive") in by
            else "-"
            for k in kvs
        ]
        cached = "/".join(str(by[r, k]["cached_tokens"]) for k in kinds if (r, k) in by)
        heads = " ".join(tier_line(by[r, k]) for k in kvs if (r, k) in by)
        print(f"{r} | " + " | ".join(cells) + " | " + " | ".join(rat) + f" | {cached} | {heads}")
    med = {k: st.median(by[r, k]["ttft_s"] for r in rounds if (r, k) in by) for k in kinds}
    print("  medians: " + ", ".join(f"{k} {med[k]:.3f} s" for k in kinds))
    for k in kvs if "naive" in kinds else ():
        print(f"  ratio of medians {k}/naive {med[k] / med['naive']:.3f}x")
        print(
            summary(
                f"{k}/naive",
                [
                    by[r, k]["ttft_s"] / by[r, "naive"]["ttft_s"]
                    for r in rounds
                    if (r, k) in by and (r, "naive") in by
                ],
            )
        )
    if len(kvs) >= 2:
        old, new = kvs[0], kvs[-1]
        print(f"  ratio of medians {new}/{old} {med[new] / med[old]:.3f}x")
        print(
            summary(
                f"{new}/{old}",
                [
                    by[r, new]["ttft_s"] / by[r, old]["ttft_s"]
                    for r in rounds
                    if (r, new) in by and (r, old) in by
                ],
            )
        )


for f in sys.argv[1:]:
    p = Path(f)
    (ab if p.suffix == ".jsonl" else bench)(p)
