# mypy: ignore-errors
# ruff: noqa: E501
"""Tables of the thirteenth session's H200 runs. Usage: python3 analyze13.py FILE...

- ``*.jsonl`` from ``restart13.py``: turn 2 per round (TTFT, position, kvtrio's cache
  header and what its warm restart had loaded before turn 2), each kvtrio server against
  naive and against mlx_lm per round, medians, the <= 1.05x (naive) and <= 0.1x (mlx_lm)
  checks.
- ``*.json`` from ``kvtrio bench serve --json``: its restart phase (the same table), its
  start phase (listening, first answer, cold tier per round; kvtrio / naive per round), its
  spill phase (p99 during a save; naive / kvtrio per round).
- ``loadthreads*.json`` from ``loadthreads.py``: the cold load's medians per setting.
"""

import json
import statistics as st
import sys
from pathlib import Path


def fmt(xs, spec=".2f"):
    return " ".join(format(x, spec) for x in xs)


def summary(label, ratios, limit=1.05):
    rs = [x for x in ratios if x == x]
    if not rs:
        return f"  {label}: none"
    q = st.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3
    return (
        f"  {label}: round median {st.median(rs):.3f}x, quartiles {q[0]:.2f}-{q[2]:.2f}, "
        f"range {min(rs):.2f}-{max(rs):.2f}, rounds <= {limit}x: {sum(x <= limit for x in rs)} of {len(rs)}  ({fmt(rs)})"
    )


def tier_cell(run):
    t = run.get("tier") or {}
    before, after = t.get("before", {}), t.get("after", {})
    restored = before.get("kvtrio_serve_restored_total", 0)
    read = after.get("kvtrio_cold_read_bytes_total", 0) / 1e6
    return f"{t.get('cache_header', '-')} r{restored:.0f} {read:.0f}MB"


def restart_table(runs, title):
    kinds = []
    for x in runs:
        if x["kind"] not in kinds:
            kinds.append(x["kind"])
    by = {(x["round"], x["kind"]): x for x in runs}
    rounds = sorted({x["round"] for x in runs})
    kvs = [k for k in kinds if k not in ("mlx_lm", "naive")]
    loads = [x["load"] for x in runs if "load" in x]
    utc = [x["utc"] for x in runs if "utc" in x]
    head = f"\n## {title}: {len(rounds)} rounds"
    if loads:
        head += f", load {min(loads):.2f}-{max(loads):.2f}, {utc[0]}-{utc[-1]} UTC"
    print(head)
    print("round | " + " | ".join(f"{k} TTFT s (pos)" for k in kinds) + " | " + " | ".join(f"{k}/naive {k}/mlx_lm" for k in kvs) + " | kvtrio header, restored entries, disk read | cached")
    for r in rounds:
        cells = [f"{by[r, k]['ttft_s']:.3f} ({by[r, k]['position']})" if (r, k) in by else "-" for k in kinds]
        rat = []
        for k in kvs:
            a = by.get((r, k))
            n, m = by.get((r, "naive")), by.get((r, "mlx_lm"))
            rat.append(" ".join(f"{a['ttft_s'] / b['ttft_s']:.3f}" if a and b else "-" for b in (n, m)))
        tiers = "; ".join(f"{k} {tier_cell(by[r, k])}" for k in kvs if (r, k) in by)
        cached = "/".join(str(by[r, k]["cached_tokens"]) for k in kinds if (r, k) in by)
        print(f"{r} | " + " | ".join(cells) + " | " + " | ".join(rat) + f" | {tiers} | {cached}")
    med = {k: st.median(by[r, k]["ttft_s"] for r in rounds if (r, k) in by) for k in kinds}
    print("  medians: " + ", ".join(f"{k} {med[k]:.3f} s" for k in kinds))
    for k in kvs:
        for ref, limit in (("naive", 1.05), ("mlx_lm", 0.1)):
            if ref not in kinds:
                continue
            pr = [by[r, k]["ttft_s"] / by[r, ref]["ttft_s"] for r in rounds if (r, k) in by and (r, ref) in by]
            print(f"  {k}/{ref}: ratio of medians {med[k] / med[ref]:.3f}x")
            print(summary(f"{k}/{ref}", pr, limit))
    if "naive" in kinds and "mlx_lm" in kinds:
        print(f"  naive/mlx_lm: ratio of medians {med['naive'] / med['mlx_lm']:.3f}x")
    if len(kvs) >= 2:
        a, b = kvs[0], kvs[1]
        pr = [by[r, b]["ttft_s"] / by[r, a]["ttft_s"] for r in rounds if (r, a) in by and (r, b) in by]
        print(summary(f"{b}/{a}", pr, 1.0))
    for k in kinds:
        starts = [by[r, k]["restart_s"] for r in rounds if (r, k) in by]
        warm = [by[r, k].get("warmup_s") or float("nan") for r in rounds if (r, k) in by]
        print(f"  {k}: start s median {st.median(starts):.2f} ({fmt(starts)}); warm-up s {fmt(warm, '.3f')}")
    if "mlx_lm" in kinds:
        for k in [x for x in kinds if x != "mlx_lm"]:
            same = [by[r, k].get("answer") == by[r, "mlx_lm"].get("answer") for r in rounds if (r, k) in by and (r, "mlx_lm") in by]
            print(f"  {k}: same answer as mlx_lm in {sum(same)} of {len(same)} rounds")


def jsonl(path):
    lines = [json.loads(x) for x in open(path) if x.startswith("{")]
    for x in lines:
        if "turn1" in x:
            print(f"turn 1 on {x['turn1']}: " + (f"copied from {x['copied_from']}" if "copied_from" in x else f"{x['s']:.1f} s, exit {x['exit'].get('stopped', {})}, {x['exit'].get('RAM entries at exit', {})}"))
    restart_table([x for x in lines if "round" in x], path.name)


def bench(path):
    d = json.load(open(path))
    print(f"\n# {path.name}: {d.get('command')}")
    for length, per in d.get("restart", {}).items():
        runs = []
        for kind in ("mlx_lm", "naive", "kvtrio"):
            for r, run in enumerate(per[kind]["runs"]):
                runs.append({**run, "kind": kind, "round": r})
        runs.sort(key=lambda x: (x["round"], x["position"]))
        restart_table(runs, f"bench restart at {length} tokens")
        ratios = d.get("ratios", {}).get(length, {})
        print(f"  bench's ratios: kvtrio/naive {ratios.get('ttft_kvtrio_vs_naive', float('nan')):.3f}, kvtrio/mlx_lm {ratios.get('ttft_kvtrio_vs_mlx_lm', float('nan')):.3f}, same answer {ratios.get('same_answer_as_mlx_lm')}; turn-1 exit {per['kvtrio'].get('turn1_exit', {}).get('stopped')}")
    for key, per in d.items():
        if not key.startswith("start_with_"):
            continue
        print(f"\n## {key}")
        for kind in ("mlx_lm", "naive", "kvtrio"):
            p = per[kind]
            print(f"  {kind}: fill {p['fill_s']:.1f} s; medians listen {p['listen_s']:.3f} answer {p['answer_s']:.3f} cold {p['cold_s']:.3f} cpu {p['cpu_s']:.3f}")
            for fig in ("listen_s", "answer_s", "cold_s", "cpu_s"):
                print(f"    {fig}: {fmt([r[fig] for r in p['runs']], '.3f')} (positions {' '.join(str(r['position']) for r in p['runs'])})")
        for fig in ("listen_s", "answer_s", "cpu_s"):
            pr = [a[fig] / b[fig] for a, b in zip(per["kvtrio"]["runs"], per["naive"]["runs"], strict=True)]
            print(summary(f"kvtrio/naive {fig}", pr, 1.0))
            pr = [a[fig] / b[fig] for a, b in zip(per["kvtrio"]["runs"], per["mlx_lm"]["runs"], strict=True)]
            print(summary(f"kvtrio/mlx_lm {fig}", pr, 1.0))
        print(f"  bench's ratios: {json.dumps(d.get('ratios', {}).get(key, {}))[:600]}")
    if "spill" in d:
        sp = d["spill"]
        print("\n## spill")
        for label, p in sp.items():
            print(f"  {label}: p99 quiet {p['itl_p99_ms_quiet']:.1f} ms, during {p['itl_p99_ms_during']:.1f} ms, max {p['itl_max_ms_during']:.1f}, samples {p['samples_during']}; per round p99 {fmt([r['itl_p99_ms_during'] for r in p['rounds']], '.1f')}; cached {[r['continued_cached_tokens'] for r in p['rounds']]}")
        print(f"  bench's ratios: {json.dumps(d.get('ratios', {}).get('spill', {}))}")


def loadthreads(path):
    d = json.load(open(path))
    runs = d if isinstance(d, list) else [d]
    trees = []
    for run in runs:
        if run.get("tree") not in trees:
            trees.append(run.get("tree"))
    for tree in trees:
        mine = [run for run in runs if run.get("tree") == tree]
        print(f"\n## {path.name}: tree {tree}, {len(mine)} process(es) x {mine[0]['rounds']} rounds, {mine[0]['bytes']:,} bytes, open tiers' streams {mine[0].get('open_tiers_load_streams')}")
        for drop in mine[0]["load_s"]:
            per = {}
            for run in mine:
                for name, xs in run["load_s"][drop].items():
                    per.setdefault(name, []).extend(xs)
            base = st.median(per["naive"])
            one = st.median(per.get("kvtrio_1", per["naive"]))
            print(f"  page cache {'dropped' if drop == 'drop' else 'warm'}:")
            for name, xs in per.items():
                m = st.median(xs)
                print(f"    {name:10s} median {m * 1e3:7.1f} ms  x naive {m / base:5.2f}  x kvtrio_1 {m / one:5.2f}  ({fmt([x * 1e3 for x in xs], '.0f')})")
    trees.sort(key=lambda t: t != "main")
    if len(trees) == 2 and all(t for t in trees):
        a, b = trees
        for drop in runs[0]["load_s"]:
            for name in runs[0]["load_s"][drop]:
                xa = [x for run in runs if run.get("tree") == a for x in run["load_s"][drop][name]]
                xb = [x for run in runs if run.get("tree") == b for x in run["load_s"][drop][name]]
                print(f"  {drop} {name}: {b}/{a} ratio of medians {st.median(xb) / st.median(xa):.3f}x")


def tier(path):
    rows = [json.loads(x) for x in open(path) if x.startswith("{")]
    print(f"\n## {path.name}: kvtrio bench tier, {len(rows)} runs")
    by = {}
    for row in rows:
        by.setdefault(row["load_threads"], []).append(row)
    for n, rs in sorted(by.items()):
        g = [r["gb_per_s"] for r in rs]
        cells = []
        for key in ("kvtrio_load", "sync_core_load", "odirect_read", "mlx_lm_load", "kvtrio_save"):
            cells.append(f"{key} {fmt([x[key] for x in g])}")
        lag = [r["heartbeat_lateness"]["kvtrio_load"]["p99_ms"] for r in rs]
        print(f"  KVTRIO_LOAD_THREADS={n}: GB/s " + "; ".join(cells) + f"; heartbeat p99 during load ms {fmt(lag, '.1f')}")


for f in sys.argv[1:]:
    p = Path(f)
    if p.name.startswith("loadthreads"):
        loadthreads(p)
    elif p.name.startswith("tier"):
        tier(p)
    elif p.suffix == ".jsonl":
        jsonl(p)
    else:
        bench(p)
