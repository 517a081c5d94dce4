"""Run a ``kvtrio drill`` in a fresh process (the crash drill forks; a fresh interpreter
has no threads to fork with) and return its figures.

``KNOWN_FINDINGS`` lists violations the drills found in other areas that are reported
and not yet fixed (docs/reliability.md, "Findings"). A test fails on any other
violation; when only known findings remain it is marked xfail, naming them, so the
suite stays green without hiding them. A pattern is removed as soon as its fix lands,
so a regression fails loudly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

__all__ = ["KNOWN_FINDINGS", "run_drill_cli"]

#: Open findings (pattern per finding); empty: every finding so far is fixed (see
#: docs/reliability.md, "Findings").
KNOWN_FINDINGS: dict[str, re.Pattern[str]] = {}


def run_drill_cli(
    name: str,
    tmp_path: Path,
    *extra: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``kvtrio drill NAME --json``: fails on any unknown violation, returns the figures.
    ``env`` adds variables to the child's environment (the drills' size knobs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrio", "drill", name, "--json", "--dir", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.stdout, proc.stderr[-4000:]
    (record,) = json.loads(proc.stdout)
    violations: list[str] = record["violations"]
    known = {key for v in violations for key, pattern in KNOWN_FINDINGS.items() if pattern.match(v)}
    unknown = [v for v in violations if not any(p.match(v) for p in KNOWN_FINDINGS.values())]
    assert unknown == [], "\n".join(unknown)
    if known:
        pytest.xfail(
            f"{record['violation_count']} violations, the {len(violations)} kept all known "
            f"findings, reported, not yet fixed: {sorted(known)}"
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures: dict[str, Any] = record["figures"]
    return figures
