"""`kvtrio bench runtime` runs end to end (a smoke run: figures, not timings, are checked)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runtime_prints_json_figures_and_ratios() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "runtime", "--json",
         "--messages", "300", "--rounds", "1", "--clock", "cpu"],
        capture_output=True, text=True, check=True,
    )
    figures = json.loads(out.stdout)
    for name in ("raw_ping_pong", "ask", "raw_stream", "tell"):
        assert figures[name] > 0, name
    assert figures["ask_ratio"] == figures["ask"] / figures["raw_ping_pong"]
    assert figures["tell_ratio"] == figures["tell"] / figures["raw_stream"]
