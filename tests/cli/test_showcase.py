"""`kvtrio showcase` / `kvtrio demo` really runs and reports a clean outcome."""

from __future__ import annotations

import io

from kvtrio.cli.showcase import run_showcase
from rich.console import Console


async def test_showcase_runs_backpressure_restart_and_drain() -> None:
    """The showcase exits 0 only if tells waited, the validator restarted twice, and the
    shutdown drained everything; its printout names each phase."""
    out = io.StringIO()
    status = await run_showcase(Console(file=out, width=120), records=12, grace=5.0)
    text = out.getvalue()
    assert status == 0, text
    assert "every accepted record was hashed and recorded" in text
    assert text.count("validator  started") == 3
    assert "late tell refused" in text
