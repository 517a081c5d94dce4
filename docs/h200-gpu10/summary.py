# mypy: ignore-errors
"""Print the short table of one `bench serve --json` output (restart and spill phases)."""

import json
import sys

try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e)
    sys.exit()
for length, by_kind in d.get("restart", {}).items():
    for kind, f in by_kind.items():
        runs = f["runs"]
        print(
            length,
            kind,
            "ttft",
            [round(r["ttft_s"], 3) for r in runs],
            "pos",
            [r["position"] for r in runs],
            "cached",
            [r["cached_tokens"] for r in runs],
            "warm",
            [r.get("warmup_s") and round(r["warmup_s"], 3) for r in runs],
            "start",
            round(f["restart_s"], 2),
        )
    kv = by_kind["kvtrio"]
    print("turn1_exit", json.dumps(kv.get("turn1_exit"))[:600])
    for r in kv["runs"]:
        t = r.get("tier", {})
        print("tier", t.get("cache_header"), json.dumps(t.get("after"))[:400])
r = d.get("ratios", {})
print(json.dumps(r)[:2500])
sp = d.get("spill")
if sp:
    for k, v in sp.items():
        keys = ("itl_p50_ms_quiet", "itl_p99_ms_quiet", "itl_p99_ms_during", "itl_max_ms_during")
        print(
            k,
            {x: round(v[x], 2) for x in keys if x in v},
            "samples",
            v.get("samples_during"),
            [
                (
                    r["itl_p99_ms_during"],
                    r.get("itl_max_ms_during"),
                    r["continued_cached_tokens"],
                    r["spilled_while_streaming"],
                    r["samples"],
                )
                for r in v["rounds"]
            ],
        )
