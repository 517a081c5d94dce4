"""Overload soak at CI size: the actors' Spill fed at twice the disk's write rate."""

from __future__ import annotations

from pathlib import Path

from kvtrio.tests.drills.helpers import run_drill_cli


def test_spill_at_twice_the_disk_rate_holds_the_cap_and_settles_every_ticket(
    tmp_path: Path,
) -> None:
    """docs/design.md invariants 2 and 3 under overload: pending bytes never exceed the cap plus
    one item,
    RSS growth stays bounded, every ticket settles and each item is released once."""
    figures = run_drill_cli("soak", tmp_path)
    assert figures["soak seconds"] >= 3.0
    assert figures["offered bytes/s"] > 1.5 * figures["disk write rate (bytes/s)"]
    assert figures["peak pending bytes"] <= figures["cap bytes"] + figures["item bytes"]
    assert figures["dropped"] > 0
    assert figures["unsettled tickets"] == 0
    assert (
        figures["items submitted"]
        == figures["released"]
        == (figures["written"] + figures["dropped"] + figures["cancelled"] + figures["failed"])
    )
