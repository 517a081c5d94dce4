# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
import json
import statistics as st
import sys

rows = [json.loads(l) for l in open(sys.argv[1])]
for side in ("old", "new"):
    c = {
        n: [r["cpu_s"] for r in rows if r["side"] == side and r["n"] == n] for n in (10000, 100000)
    }
    w = {
        n: [r["open_s"] for r in rows if r["side"] == side and r["n"] == n] for n in (10000, 100000)
    }
    per_round = [b / a for a, b in zip(c[10000], c[100000], strict=False)]
    steps = {}
    for r in rows:
        if r["side"] == side:
            for k, v in r["steps_cpu_ms"].items():
                steps.setdefault((k, r["n"]), []).append(v)
    print(
        side,
        f"cpu med 10k {st.median(c[10000]):.4f} 100k {st.median(c[100000]):.4f} ratio {st.median(c[100000]) / st.median(c[10000]):.2f} | min 10k {min(c[10000]):.4f} 100k {min(c[100000]):.4f} ratio {min(c[100000]) / min(c[10000]):.2f} | per-round {[round(x, 2) for x in per_round]} | wall med ratio {st.median(w[100000]) / st.median(w[10000]):.2f}",
    )
    print(
        "   steps (median ms 10k / 100k / ratio):",
        "; ".join(
            f"{k} {st.median(steps[(k, 10000)]):.1f}/{st.median(steps[(k, 100000)]):.1f}/{st.median(steps[(k, 100000)]) / max(st.median(steps[(k, 10000)]), 0.01):.1f}"
            for k in sorted({k for k, _ in steps})
            if (k, 100000) in steps
        ),
    )
print("loads", [round(r["load"], 2) for r in rows][::4])
