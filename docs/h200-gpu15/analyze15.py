# mypy: ignore-errors
# ruff: noqa: E501
"""Tables of gpu15's results (issue 17), from the files batch15.sh writes:

    python3 analyze15.py FILE...

``spill-LEN-R.json`` (one bench spill round each; pooled by LEN, in round order),
``start*.jsonl`` (start15.py), ``cudnn*.jsonl`` (cudnn15.py), ``cold*.jsonl``
(restart15.py). Every ratio is against a reference of the same round (or the same
pair of processes).
"""

import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SPILL = ("mlx_lm", "naive", "kvtrio", "kvtrio_nosave")


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def sign_p(lower, n):
    """One-sided sign test: the chance of >= lower of n rounds going one way by coin toss."""
    return sum(math.comb(n, k) for k in range(lower, n + 1)) / (1 << n) if n else 1.0


def spread(xs):
    xs = sorted(xs)
    return f"{xs[0]:.2f}-{xs[-1]:.2f}" if xs else "-"


def per_round(label, ratios, below=1.0, at_least=None):
    """Median and per-round ratios, with how many rounds are below ``below`` (or at least
    ``at_least``) and a sign test of that count."""
    if at_least is None:
        hits, what = sum(1 for x in ratios if x < below), f"below {below}"
    else:
        hits, what = sum(1 for x in ratios if x >= at_least), f">= {at_least}"
    return (
        f"{label}: median {med(ratios):.3f} (per round {' '.join(f'{x:.2f}' for x in ratios)};"
        f" {hits} of {len(ratios)} {what}; sign test p = {sign_p(hits, len(ratios)):.3g})"
    )


def spill(paths):
    by_len = defaultdict(list)
    for p in paths:
        m = re.search(r"spill-(\d+)-(\d+)\.json$", str(p))
        text = Path(p).read_text().strip()
        if not text:
            print(f"{p}: empty (the round did not finish)")
            continue
        by_len[int(m.group(1))].append((int(m.group(2)), json.loads(text)))
    for length, rounds in sorted(by_len.items()):
        rounds.sort(key=lambda x: x[0])
        print(f"\n## spill at {length} tokens: {len(rounds)} rounds (one bench process each)")
        print("Per round and server: max / p99 of S's gaps in the window, ms (samples; position);")
        print("C's cached tokens; kvtrio's entries spilled while S ran.")
        print(
            "| round | "
            + " | ".join(SPILL)
            + " | kvtrio / nosave (max) | naive / kvtrio (max) | kvtrio / mlx_lm (max) |"
        )
        print("|---|" + "---|" * (len(SPILL) + 3))
        ratios = defaultdict(list)
        for r, d in rounds:
            s = d["spill"]
            cells = []
            for name in SPILL:
                x = s[name]["rounds"][0]
                sp = x.get("spilled_while_streaming")
                cells.append(
                    f"{x['itl_max_ms_during']:.0f} / {x['itl_p99_ms_during']:.0f} ({x['samples']}; {x['position']})"
                    f" c{x['continued_cached_tokens']}" + (f" s{sp}" if sp is not None else "")
                )
            mx = {n: s[n]["rounds"][0]["itl_max_ms_during"] for n in SPILL}
            a = mx["kvtrio"] / mx["kvtrio_nosave"]
            b = mx["naive"] / mx["kvtrio"]
            c = mx["kvtrio"] / mx["mlx_lm"]
            ratios["kvtrio/nosave max"].append(a)
            ratios["naive/kvtrio max"].append(b)
            ratios["kvtrio/mlx_lm max"].append(c)
            p99 = {n: s[n]["rounds"][0]["itl_p99_ms_during"] for n in SPILL}
            ratios["kvtrio/nosave p99 (bench)"].append(p99["kvtrio"] / p99["kvtrio_nosave"])
            ratios["naive/kvtrio p99 (bench)"].append(p99["naive"] / p99["kvtrio"])
            print(f"| {r} | " + " | ".join(cells) + f" | {a:.2f} | {b:.2f} | {c:.2f} |")
        meds = {
            n: med([d["spill"][n]["rounds"][0]["itl_max_ms_during"] for _, d in rounds])
            for n in SPILL
        }
        print(
            "| median of maxima | "
            + " | ".join(f"{meds[n]:.0f}" for n in SPILL)
            + f" | {meds['kvtrio'] / meds['kvtrio_nosave']:.2f} | {meds['naive'] / meds['kvtrio']:.2f}"
            + f" | {meds['kvtrio'] / meds['mlx_lm']:.2f} |"
        )
        for label, xs in ratios.items():
            if label.startswith("naive/kvtrio"):
                print(per_round(label, xs, at_least=2.0))
            else:
                print(per_round(label, xs, 1.2 if label.startswith("kvtrio/nosave") else 1.0))
        quiet = {n: [d["spill"][n]["itl_p99_ms_quiet"] for _, d in rounds] for n in SPILL}
        print(
            "quiet stream p99 ms per round: "
            + "; ".join(f"{n} {' '.join(f'{x:.1f}' for x in quiet[n])}" for n in SPILL)
        )
        saving_table(rounds)


def _ms(x):
    return "-" if x != x else f"{x:.0f}"


def saving_table(rounds):
    """S's gaps while an entry is saved (overlapping a save span the server recorded) and
    while an entry's own store runs, per round; the save spans' lengths."""
    if "itl_max_ms_saving" not in rounds[0][1]["spill"]["naive"]["rounds"][0]:
        return
    print("\nWhile saving: max of S's gaps overlapping a save span, ms (samples); while writing:")
    print("the same over an entry's own store; save spans (hand-over to settled) and stores, ms.")
    print(
        "| round | naive saving | kvtrio saving | naive / kvtrio saving | naive writing | kvtrio writing | naive / kvtrio writing | kvtrio saving / nosave during | naive saves ms | kvtrio saves ms (stores ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = defaultdict(list)
    for r, d in rounds:
        n, v = d["spill"]["naive"]["rounds"][0], d["spill"]["kvtrio"]["rounds"][0]
        ns = d["spill"]["kvtrio_nosave"]["rounds"][0]
        a = n["itl_max_ms_saving"] / v["itl_max_ms_saving"]
        b = n["itl_max_ms_writing"] / v["itl_max_ms_writing"]
        c = v["itl_max_ms_saving"] / ns["itl_max_ms_during"]
        for label, x in (
            ("naive/kvtrio saving max", a),
            ("naive/kvtrio writing max", b),
            ("kvtrio saving max / nosave during max", c),
        ):
            if x == x:
                ratios[label].append(x)
        print(
            f"| {r} | {_ms(n['itl_max_ms_saving'])} ({n['samples_saving']}) | {_ms(v['itl_max_ms_saving'])} ({v['samples_saving']}) | {a:.2f} "
            f"| {_ms(n['itl_max_ms_writing'])} ({n['samples_writing']}) | {_ms(v['itl_max_ms_writing'])} ({v['samples_writing']}) | {b:.2f} | {c:.2f} "
            f"| {' '.join(f'{x:.0f}' for x in n['save_ms'])} | {' '.join(f'{x:.0f}' for x in v['save_ms'])} ({' '.join(f'{x:.0f}' for x in v.get('write_ms', []))}) |"
        )
    for label, xs in ratios.items():
        if label.startswith("naive/"):
            print(per_round(label, xs, at_least=2.0))
        else:
            print(per_round(label, xs, 1.2))
    stretched = [
        d["spill"][k]["rounds"][0].get("window_stretched_s", 0) for _, d in rounds for k in SPILL
    ]
    print(f"window stretched past its end by a save: max {max(stretched):.2f} s")


def start(paths):
    runs = [json.loads(x) for p in paths for x in open(p) if x.strip()]
    fills = [r for r in runs if "fill" in r]
    turns = [r for r in runs if "listen_s" in r]
    by = {(r["round"], r["kind"]): r for r in turns}
    rounds = sorted({k for k, kind in by if (k, "naive") in by and (k, "kvtrio") in by})
    print(f"\n## start with 1,000 entries: {len(rounds)} complete rounds (naive and kvtrio)")
    for f in fills:
        print(f"fill {f['fill']}: {f['s']:.1f} s")
    print(
        "| round | naive listen / answer s (position) | kvtrio listen / answer / cold ready s (position) | kvtrio / naive answer | listen | cpu | load |"
    )
    print("|---|---|---|---|---|---|---|")
    for k in rounds:
        n, v = by[k, "naive"], by[k, "kvtrio"]
        print(
            f"| {k} | {n['listen_s']:.2f} / {n['answer_s']:.2f} ({n['position']}) | {v['listen_s']:.2f} / "
            f"{v['answer_s']:.2f} / {v['cold_s']:.2f} ({v['position']}) | {v['answer_s'] / n['answer_s']:.3f} | "
            f"{v['listen_s'] / n['listen_s']:.3f} | {v['cpu_s'] / n['cpu_s']:.3f} | {min(n['load'], v['load']):.2f} |"
        )
    for key in ("answer_s", "listen_s", "cpu_s"):
        per = [by[k, "kvtrio"][key] / by[k, "naive"][key] for k in rounds]
        mk = med([by[k, "kvtrio"][key] for k in rounds])
        mn = med([by[k, "naive"][key] for k in rounds])
        print(
            per_round(f"kvtrio/naive {key}", per)
            + f"; of medians {mk / mn:.3f} ({mk:.2f} / {mn:.2f} s)"
        )
    cold = [by[k, "kvtrio"]["cold_s"] / by[k, "naive"]["answer_s"] for k in rounds]
    print(per_round("kvtrio cold tier open / naive first answer", cold))
    for pos in (0, 1):
        per = [
            by[k, "kvtrio"]["answer_s"] / by[k, "naive"]["answer_s"]
            for k in rounds
            if by[k, "kvtrio"]["position"] == pos
        ]
        if per:
            print(
                f"  kvtrio started {'first' if pos == 0 else 'second'}: answer ratio median {med(per):.3f} over {len(per)} rounds"
            )


def run_of(row, length, again):
    return next(x for x in row["runs"] if x["L"] == length and x["again"] == again)


def cudnn(paths):
    rows = [
        {**json.loads(x), "pair": (i, json.loads(x)["pair"])}  # pairs numbered per call
        for i, p in enumerate(paths)
        for x in open(p)
        if x.strip() and "setting" in x
    ]
    rows = [r for r in rows if r.get("runs") and r["pair"][1] >= 0]
    pairs = sorted({r["pair"] for r in rows})
    by = {(r["pair"], r["setting"]): r for r in rows}
    pairs = [p for p in pairs if (p, "on") in by and (p, "off") in by]
    print(
        f"\n## cuDNN attention on / off (MLX_CUDA_USE_CUDNN_SDPA=0): {len(pairs)} pairs of fresh processes"
    )
    if not pairs:
        return
    lengths = [x["L"] for x in by[pairs[0], "on"]["runs"] if not x["again"]]
    print(
        "| tokens | run | prefill ms on (median) | off (median) | off / on per pair | median | decode tok/s on | off | off / on (median) | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for again in (False, True):
        for n in lengths:
            on = [run_of(by[p, "on"], n, again) for p in pairs]
            off = [run_of(by[p, "off"], n, again) for p in pairs]
            pr = [b["prefill_s"] / a["prefill_s"] for a, b in zip(on, off, strict=True)]
            dr = [b["decode_tps"] / a["decode_tps"] for a, b in zip(on, off, strict=True)]
            same = all(a["tokens"] == b["tokens"] for a, b in zip(on, off, strict=True))
            print(
                f"| {n} | {'again' if again else 'first'} | {1e3 * med([x['prefill_s'] for x in on]):.1f} | "
                f"{1e3 * med([x['prefill_s'] for x in off]):.1f} | {' '.join(f'{x:.2f}' for x in pr)} | "
                f"**{med(pr):.2f}** | {med([x['decode_tps'] for x in on]):.0f} | {med([x['decode_tps'] for x in off]):.0f} | "
                f"{med(dr):.3f} ({spread(dr)}) | {same} |"
            )
    w = [(by[p, "off"]["warmup"]["prefill_s"] / by[p, "on"]["warmup"]["prefill_s"]) for p in pairs]
    print(f"warm-up (256 tokens, each process's first): off / on {' '.join(f'{x:.2f}' for x in w)}")
    print(
        "loads: "
        + " ".join(f"{r['load']:.2f}" for r in rows)
        + "; process wall s: "
        + " ".join(f"{r['wall_s']:.1f}" for r in rows)
    )


def cold(paths):
    runs = [json.loads(x) for p in paths for x in open(p) if x.strip()]
    turns = [r for r in runs if "ttft_s" in r]
    by = {(r["round"], r["name"]): r for r in turns}
    rounds = sorted({k for k, n in by if (k, "naive") in by and (k, "kvcold") in by})
    head = next((r for r in runs if "warmup" in r and "servers" in r), {})
    print(
        f"\n## turn 2 after a restart at 4k, the cold path (--restore-bytes=0): {len(rounds)} rounds; warm-up request first: {head.get('warmup')}"
    )
    print(
        "| round | naive ms (position) | kvtrio cold ms (position) | kvtrio cache header, cached tokens | kvtrio / naive | load |"
    )
    print("|---|---|---|---|---|---|")
    for k in rounds:
        n, v = by[k, "naive"], by[k, "kvcold"]
        hdr = (v.get("tier") or {}).get("cache_header")
        print(
            f"| {k} | {1e3 * n['ttft_s']:.1f} ({n['position']}) | {1e3 * v['ttft_s']:.1f} ({v['position']}) | {hdr}, {v['cached_tokens']} "
            f"| {v['ttft_s'] / n['ttft_s']:.3f} | {min(n['load'], v['load']):.2f} |"
        )
    hits = [k for k in rounds if (by[k, "kvcold"].get("tier") or {}).get("cache_header") == "cold"]
    for label, chosen in (
        ("every round", rounds),
        ("rounds with kvtrio's turn 2 a cold hit", hits),
    ):
        if not chosen:
            continue
        per = [by[k, "kvcold"]["ttft_s"] / by[k, "naive"]["ttft_s"] for k in chosen]
        mk = med([by[k, "kvcold"]["ttft_s"] for k in chosen])
        mn = med([by[k, "naive"]["ttft_s"] for k in chosen])
        print(f"{label} ({len(chosen)}): " + per_round("kvtrio/naive", per, 1.05))
        print(f"  of medians {mk / mn:.3f} ({1e3 * mk:.1f} / {1e3 * mn:.1f} ms)")
    if rounds:
        same = all(by[k, "kvcold"]["answer"] == by[k, "naive"]["answer"] for k in rounds)
        print(f"same answer as naive in every round: {same}")
    for r in runs:
        if "turn1" in r:
            print("turn 1:", r["turn1"], f"{r.get('s', 0):.1f} s")


def main(paths):
    groups = defaultdict(list)
    for p in paths:
        name = Path(p).name
        for kind in ("spill", "start", "cudnn", "cold"):
            if name.startswith(kind):
                groups[kind].append(p)
    for kind, fn in (("spill", spill), ("start", start), ("cudnn", cudnn), ("cold", cold)):
        if groups[kind]:
            fn(groups[kind])


if __name__ == "__main__":
    main(sys.argv[1:])
