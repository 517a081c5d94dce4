# mypy: ignore-errors
# ruff: noqa: E501
"""Tables of the eleventh session's spill runs (results/s{4,8}{old,new}{1,2,3}.json):
per run and server the round's largest and second-largest gap of S during the window,
the bench's p99, samples, the quiet stream's p99; where the two largest gaps fell (s after
C's headers); then per version the medians over the runs and the checks' ratios."""

import json
import statistics as st
import sys
from pathlib import Path

R = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results")
S = ("mlx_lm", "naive", "kvtrio", "kvtrio_nosave")


def rows(length, ver):
    out = []
    for i in (1, 2, 3):
        f = R / f"s{length}{ver}{i}.json"
        if not f.exists():
            continue
        d = json.load(open(f))
        run = {}
        for s in S:
            (r,) = d["spill"][s]["rounds"]
            g = r["gaps_ms_during"]
            order = sorted(range(len(g)), key=lambda k: -g[k])[:2]
            at = [round(sum(g[:k]) / 1e3, 2) for k in order]  # s from C's headers to gap start
            run[s] = dict(
                max=r["top5_ms_during"][0],
                second=r["top5_ms_during"][1],
                p99=r["itl_p99_ms_during"],
                n=r["samples"],
                pos=r["position"],
                qp99=r["itl_p99_ms_quiet_round"],
                qmax=r["itl_max_ms_quiet"],
                at=at,
                p50=st.median(g),
                cached=r["continued_cached_tokens"],
                spilled=r["spilled_while_streaming"],
            )
        out.append((f.stem, run))
    return out


for length in ("8", "4"):
    for ver in ("old", "new"):
        rs = rows(length, ver)
        print(f"\n## {length}k {ver}")
        print(
            "run | "
            + " | ".join(S)
            + " | kv/nosave max | naive/kv max | kv/nosave p99 | naive/kv p99"
        )
        for name, run in rs:
            cells = [
                f"{run[s]['max']:.0f} / {run[s]['second']:.0f} / {run[s]['p99']:.0f} ({run[s]['n']}) @{run[s]['at']}"
                for s in S
            ]
            kv, ns, nv = run["kvtrio"], run["kvtrio_nosave"], run["naive"]
            print(
                name,
                "|",
                " | ".join(cells),
                f"| {kv['max'] / ns['max']:.2f} | {nv['max'] / kv['max']:.2f}"
                f" | {kv['p99'] / ns['p99']:.2f} | {nv['p99'] / kv['p99']:.2f}",
            )
        for s in S:
            mx = [run[s]["max"] for _, run in rs]
            sec = [run[s]["second"] for _, run in rs]
            print(
                f"  {s}: max {mx} median {st.median(mx):.1f}; second {sec} median {st.median(sec):.1f};"
                f" quiet p99 {[round(run[s]['qp99'], 1) for _, run in rs]} p50 during {[round(run[s]['p50'], 1) for _, run in rs]}"
                f" cached {[run[s]['cached'] for _, run in rs]} spilled {[run[s]['spilled'] for _, run in rs]}"
            )
        m = {s: st.median([run[s]["max"] for _, run in rs]) for s in S}
        print(
            f"  medians of maxima: kvtrio/nosave {m['kvtrio'] / m['kvtrio_nosave']:.2f}x, naive/kvtrio"
            f" {m['naive'] / m['kvtrio']:.2f}x, kvtrio/mlx_lm {m['kvtrio'] / m['mlx_lm']:.2f}x;"
            f" per run kvtrio/nosave {[round(run['kvtrio']['max'] / run['kvtrio_nosave']['max'], 2) for _, run in rs]}"
            f" naive/kvtrio {[round(run['naive']['max'] / run['kvtrio']['max'], 2) for _, run in rs]}"
            f" kvtrio max/quiet p99 {[round(run['kvtrio']['max'] / run['kvtrio']['qp99'], 1) for _, run in rs]}"
        )
