"""The `kvtrio drill shutdown` program at CI size (one graceful and one forced round).

The server stand-in is tests/actors/shutdown_child.py (the actors engineer's); this test
checks the program's figures and verdict rather than repeating the actors' own test.
"""

from __future__ import annotations

from pathlib import Path

from kvtrio.tests.drills.helpers import run_drill_cli


def test_sigterm_once_drains_and_twice_cancels_within_a_second(tmp_path: Path) -> None:
    """Graceful shutdown: once drains within the deadline and loses nothing acknowledged;
    twice exits within 1 s; either way nothing under a final name is torn."""
    figures = run_drill_cli("shutdown", tmp_path)
    assert figures["graceful rounds"] == figures["forced rounds"] == 1
    assert figures["slowest drain after SIGTERM (s)"] <= figures["drain deadline (s)"]
    assert figures["slowest exit after the second SIGTERM (s)"] <= 1.0
    assert figures["acknowledged saves"] >= 3
    assert figures["entries verified"] >= figures["acknowledged saves"]
    assert figures["losses"] == 0
