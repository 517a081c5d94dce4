"""Fault injection at every file-operation site, storage level and through ColdTier."""

from __future__ import annotations

from pathlib import Path

from kvtrio.tests.drills.helpers import run_drill_cli


def test_an_io_error_at_every_site_is_typed_leaves_nothing_and_the_queue_serves_on(
    tmp_path: Path,
) -> None:
    """docs/design.md invariants 2, 4 and 5: EIO at each open, write, fsync, rename, fsync_dir,
    read (and
    unlink, listdir, mkdir) of every save, load and GC path: a typed error or a FAILED
    ticket, no final name, no tmp file, every snapshot released, the next save works."""
    figures = run_drill_cli("faults", tmp_path)
    for site in ("open", "write", "fsync", "rename", "fsync_dir", "read"):
        assert figures[f"faults injected: {site}"] > 0, site
    assert figures["paths covered"] == 6
    absorbed = figures.get("faults absorbed (result complete)", 0)
    assert figures["typed errors"] + absorbed == figures["faults injected"]
    assert figures["tier tickets FAILED"] > 0
    assert figures["losses"] == 0
