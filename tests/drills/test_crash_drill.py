"""The crash matrix at CI size: kill -9 at >= 200 points per layout, and power loss."""

from __future__ import annotations

from pathlib import Path

from kvtrio.tests.drills.helpers import run_drill_cli


def test_crash_matrix_loses_nothing_acknowledged_and_shows_nothing_torn(tmp_path: Path) -> None:
    """docs/design.md invariants 4 and 5: after kill -9 (at every file-operation site, at random
    times,
    and with unsynced data dropped), no final name is torn, every acknowledged save loads
    bit-exact, dangling references are clean misses and GC collects the debris."""
    figures = run_drill_cli("crash", tmp_path)
    assert figures["crash points (single)"] >= 200
    assert figures["crash points (blocks)"] >= 200
    assert figures["crash points (lossy)"] >= 100
    for site in ("open", "write", "fsync", "rename", "fsync_dir", "unlink"):
        assert figures[f"crash site: {site}"] > 0, site
    assert figures["acknowledged entries verified"] > figures["acknowledged saves"]
    assert figures["dangling references checked"] > 0
    assert figures["tmp debris files found"] > 0
    assert figures["losses"] == 0
