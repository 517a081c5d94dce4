"""`kvtrio bench reuse` runs end to end (a smoke run: figures, not timings, are checked)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_reuse_prints_cold_and_recompute_times_and_their_ratio() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "reuse", "--json",
         "--entry-tokens", "96", "--reuse", "1", "64", "--repeats", "1"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    assert [(r["entry_tokens"], r["reuse"]) for r in figures["rows"]] == [(96, 1), (96, 64)]
    for row in figures["rows"]:
        assert row["cold_load_s"] > 0 and row["recompute_s"] > 0
        assert row["ratio_cold_over_recompute"] == row["cold_load_s"] / row["recompute_s"]
    assert set(figures["crossover"]) == {"96"}
