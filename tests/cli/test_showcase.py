"""`kvtrio showcase` / `kvtrio demo` really runs and reports a clean outcome."""

from __future__ import annotations

import io

import pytest
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


@pytest.mark.parametrize(
    "argv",
    [
        ["--records", "-1"],
        ["--records", "5"],  # the hasher holds 5: no tell would wait
        ["--grace", "-1"],
        ["--grace", "0"],
        ["--grace", "nan"],
    ],
)
def test_a_showcase_value_that_cannot_show_its_outcome_is_a_usage_error(argv: list[str]) -> None:
    """Before, ``kvtrio showcase --records -1`` (or ``--grace -1``) ran and ended with
    "unexpected outcome: -1 records lost" and exit 1, as if the runtime had failed."""
    from kvtrio.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["showcase", *argv])
    assert exited.value.code == 2


async def test_the_showcases_verdict_names_the_check_that_failed() -> None:
    """A failed check is named: before, the verdict said "0 records lost" when no tell
    had waited for mailbox space."""
    out = io.StringIO()
    status = await run_showcase(Console(file=out, width=120), records=3, grace=5.0)
    assert status == 1
    assert "unexpected outcome: no tell waited for mailbox space" in out.getvalue()
