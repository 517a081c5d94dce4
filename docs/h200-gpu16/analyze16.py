# mypy: ignore-errors
# ruff: noqa: E501
"""Tables of gpu16's results (issue 17), from the files batch16.sh writes:

    python3 analyze16.py FILE...

``restart-K.json`` and ``decode-K.json`` (one `kvtrio bench serve` run each, the real
SmolLM2-135M-Instruct GGUF; ``.meta`` beside each: rounds, wall time, load),
``spill-LEN-R.json`` (one bench spill round each, the float16 model; pooled by LEN, in
round order; as analyze15.py). Every ratio is against a reference of the same run (and
the same round where it says per round).
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


def _load(p):
    text = Path(p).read_text().strip()
    if not text:
        print(f"\n{p}: empty (the run did not finish)")
        return None
    meta = Path(str(p)[: -len(".json")] + ".meta")
    return json.loads(text), (json.loads(meta.read_text()) if meta.exists() else {})


def _label(p, meta):
    extra = (
        f"; wall {meta['wall_s']} s, load at its end {meta['load']}, ended {meta['utc_end']} UTC"
        if meta
        else ""
    )
    return f"{Path(p).parent.name}/{Path(p).name}{extra}"


KINDS = ("mlx_lm", "naive", "kvtrio")


def _setting(command):
    """A run's command less its round count and directory: runs of one setting pool."""
    return re.sub(r" --(restart-rounds|rounds|dir) \S+", "", command or "")


FLOOR = "mlx_lm_never_restarted"


def restart(paths):
    pooled = defaultdict(lambda: defaultdict(list))
    for p in paths:
        got = _load(p)
        if got is None:
            continue
        d, meta = got
        setting = _setting(d.get("command"))
        print(f"\n## turn 2 after a restart, {_label(p, meta)}")
        print(f"command: {d.get('command')}")
        for length, by in d["restart"].items():
            ratios = d["ratios"][length]
            kinds = KINDS + ((FLOOR,) if FLOOR in by else ())
            runs = {k: by[k]["runs"] for k in kinds}
            n = len(runs["kvtrio"])
            floor = FLOOR in by
            print(
                f"{length} tokens, {n} rounds; turn-2 prompt {by['kvtrio']['prompt_tokens']} tokens; warm-up request first: {runs['kvtrio'][0].get('warmup_s') is not None}"
            )
            print(
                "| round | mlx_lm TTFT s (pos) | naive s (pos) | kvtrio s (pos) |"
                + (" never restarted s (pos) |" if floor else "")
                + " kvtrio / mlx_lm | kvtrio / naive |"
                + (" kvtrio / never restarted |" if floor else "")
                + " same answer as mlx_lm | kvtrio header, cached (naive cached) | restart s mlx_lm / naive / kvtrio |"
            )
            print("|---|" + "---|" * (9 + 2 * floor - 1))
            same = ratios["same_answer_as_mlx_lm_per_round"]
            for r in range(n):
                m, v, k = (runs[x][r] for x in KINDS)
                hdr = (k.get("tier") or {}).get("cache_header")
                a, b = k["ttft_s"] / m["ttft_s"], k["ttft_s"] / v["ttft_s"]
                pooled[setting]["kvtrio/mlx_lm"].append(a)
                pooled[setting]["kvtrio/naive"].append(b)
                pooled[setting]["same"].append(same[r])
                f_cells = f_ratio = ""
                if floor:
                    f = runs[FLOOR][r]
                    c = k["ttft_s"] / f["ttft_s"]
                    pooled[setting]["kvtrio/never restarted"].append(c)
                    f_cells, f_ratio = f" {f['ttft_s']:.4f} ({f['position']}) |", f" {c:.3f} |"
                print(
                    f"| {r} | {m['ttft_s']:.3f} ({m['position']}) | {v['ttft_s']:.4f} ({v['position']}) | {k['ttft_s']:.4f} ({k['position']}) |{f_cells}"
                    f" {a:.4f} | {b:.3f} |{f_ratio} {same[r]} | {hdr}, {k['cached_tokens']} ({v['cached_tokens']}) "
                    f"| {m['restart_s']:.2f} / {v['restart_s']:.2f} / {k['restart_s']:.2f} |"
                )
            f_med = f" {by[FLOOR]['ttft_s']:.4f} |" if floor else ""
            f_rat = f" {ratios['ttft_kvtrio_vs_never_restarted']:.3f} |" if floor else ""
            print(
                f"| median | {by['mlx_lm']['ttft_s']:.3f} | {by['naive']['ttft_s']:.4f} | {by['kvtrio']['ttft_s']:.4f} |{f_med}"
                f" {ratios['ttft_kvtrio_vs_mlx_lm']:.4f} | {ratios['ttft_kvtrio_vs_naive']:.3f} |{f_rat} {ratios['same_answer_as_mlx_lm']} | | |"
            )
            print(per_round("kvtrio/mlx_lm", ratios["ttft_kvtrio_vs_mlx_lm_per_round"], 0.1))
            print(per_round("kvtrio/naive", ratios["ttft_kvtrio_vs_naive_per_round"], 1.05))
            if floor:
                print(
                    per_round(
                        "kvtrio/never restarted",
                        ratios["ttft_kvtrio_vs_never_restarted_per_round"],
                        1.05,
                    )
                )
                fl = [
                    f["ttft_s"] / m["ttft_s"]
                    for f, m in zip(runs[FLOOR], runs["mlx_lm"], strict=True)
                ]
                print(per_round("never restarted/mlx_lm (what no cache can beat)", fl, 0.1))
            hot = [
                runs["kvtrio"][r]["ttft_s"]
                for r in range(n)
                if (runs["kvtrio"][r].get("tier") or {}).get("cache_header") == "hot"
            ]
            cold = [
                runs["kvtrio"][r]["ttft_s"]
                for r in range(n)
                if (runs["kvtrio"][r].get("tier") or {}).get("cache_header") == "cold"
            ]
            print(
                f"kvtrio's turn 2 a RAM hit (warm restart) in {len(hot)} rounds, median {med(hot):.4f} s;"
                f" read from disk in {len(cold)}, median {med(cold):.4f} s"
            )
            print(
                "restart s (spawn to listening), medians: "
                + ", ".join(f"{x} {by[x]['restart_s']:.2f}" for x in kinds)
                + f"; kvtrio / mlx_lm {by['kvtrio']['restart_s'] / by['mlx_lm']['restart_s']:.3f}"
            )
            t1 = by["kvtrio"].get("turn1_exit") or {}
            if t1:
                print("kvtrio turn 1 exit: " + ", ".join(f"{k2} {v2}" for k2, v2 in t1.items()))
            for r in range(n):
                tier = runs["kvtrio"][r].get("tier") or {}
                print(
                    f"  round {r} kvtrio before: {tier.get('before')}; after: {tier.get('after')}"
                )
    for setting, got in pooled.items():
        print(
            f"\n## turn 2 after a restart, every round of the runs of `{setting}` ({len(got['same'])} rounds)"
        )
        print(per_round("kvtrio/mlx_lm", got["kvtrio/mlx_lm"], 0.1))
        print(per_round("kvtrio/naive", got["kvtrio/naive"], 1.05))
        if got["kvtrio/never restarted"]:
            print(per_round("kvtrio/never restarted", got["kvtrio/never restarted"], 1.05))
        print(f"same answer as mlx_lm: {sum(got['same'])} of {len(got['same'])}")


DECODE_KEYS = ("tok_s_1", "tok_s_8", "tok_s_8_steady", "itl_p99_ms_1", "itl_p99_ms_8")


def decode(paths):
    pooled = defaultdict(list)
    for p in paths:
        got = _load(p)
        if got is None:
            continue
        d, meta = got
        dec = d["decode"]
        n = len(dec["kvtrio"]["runs"])
        print(f"\n## decode, {_label(p, meta)}: {n} rounds")
        print(f"command: {d.get('command')}")
        print(
            "| round | server (position) | "
            + " | ".join(DECODE_KEYS)
            + " | kvtrio / mlx_lm tok_s_1 | tok_s_8 | tok_s_8_steady |"
        )
        print("|---|---|" + "---|" * (len(DECODE_KEYS) + 3))
        for r in range(n):
            for kind in KINDS:
                x = dec[kind]["runs"][r]
                cells = " | ".join(f"{x[k]:.1f}" for k in DECODE_KEYS)
                tail = ""
                if kind == "kvtrio":
                    m = dec["mlx_lm"]["runs"][r]
                    rs = [
                        x[k] / m[k] if m[k] else float("nan")
                        for k in ("tok_s_1", "tok_s_8", "tok_s_8_steady")
                    ]
                    for k, val in zip(("tok_s_1", "tok_s_8", "tok_s_8_steady"), rs, strict=True):
                        pooled[k].append(val)
                    tail = " | ".join(f"{val:.3f}" for val in rs)
                else:
                    tail = " |  | "
                print(f"| {r} | {kind} ({x['position']}) | {cells} | {tail} |")
        print(
            "medians: "
            + "; ".join(
                f"{kind} " + " ".join(f"{k} {dec[kind][k]:.1f}" for k in DECODE_KEYS)
                for kind in KINDS
            )
        )
        rat = d["ratios"]["decode"]
        for k in ("tok_s_1", "tok_s_8", "tok_s_8_steady"):
            print(
                f"{k}: kvtrio / mlx_lm of medians {rat[f'{k}_kvtrio_vs_mlx_lm']:.3f}, naive / mlx_lm {rat[f'{k}_naive_vs_mlx_lm']:.3f}; "
                + per_round("kvtrio/mlx_lm per round", rat[f"{k}_kvtrio_vs_mlx_lm_per_round"], 0.95)
                + f"; started first / last: mlx_lm {rat[f'{k}_mlx_lm_started_first_vs_last']:.3f}, kvtrio {rat[f'{k}_kvtrio_started_first_vs_last']:.3f}"
            )
        print(
            f"kvtrio entries handed to disk during the rounds: {dec['kvtrio'].get('spilled_during_rounds')}"
        )
    if len(paths) > 1 and pooled:
        print(f"\n## decode, every round of {len(paths)} runs")
        for k, xs in pooled.items():
            print(per_round(f"{k} kvtrio/mlx_lm", xs, 0.95))


def main(paths):
    groups = defaultdict(list)
    for p in paths:
        name = Path(p).name
        for kind in ("spill", "restart", "decode"):
            if name.startswith(kind):
                groups[kind].append(p)
    for kind, fn in (("restart", restart), ("decode", decode), ("spill", spill)):
        if groups[kind]:
            fn(sorted(groups[kind]) if kind != "spill" else groups[kind])


if __name__ == "__main__":
    main(sys.argv[1:])
