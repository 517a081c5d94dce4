"""The record every drill returns, and how ``kvtrio drill`` prints it.

A drill counts what it did (crash points, faults injected, hostile cases, ...)
in ``figures`` and lists every broken promise in ``violations``. A drill with
one violation fails: ``kvtrio drill`` exits non-zero and the tests assert the
list is empty, printing it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

__all__ = ["DrillResult", "Figure", "Tally", "print_results"]

Figure = int | float | str

# At most this many violations are kept verbatim; the rest are only counted.
_MAX_KEPT_VIOLATIONS = 50


@attrs.define
class Tally:
    """A drill's running counts and its violations, filled while it runs."""

    name: str
    figures: dict[str, Figure] = attrs.field(factory=dict)
    violations: list[str] = attrs.field(factory=list)
    violation_count: int = 0

    def add(self, figure: str, amount: int = 1) -> None:
        """Add ``amount`` to an integer figure (created at zero)."""
        current = self.figures.get(figure, 0)
        assert isinstance(current, int)
        self.figures[figure] = current + amount

    def peak(self, figure: str, value: int | float) -> None:
        """Keep the largest value seen of ``figure``."""
        current = self.figures.get(figure)
        if current is None or (isinstance(current, int | float) and value > current):
            self.figures[figure] = value

    def set(self, figure: str, value: Figure) -> None:
        self.figures[figure] = value

    def violation(self, text: str) -> None:
        """Record one broken promise."""
        self.violation_count += 1
        if len(self.violations) < _MAX_KEPT_VIOLATIONS:
            self.violations.append(text)

    def check(self, ok: bool, text: str) -> bool:
        """Record ``text`` as a violation unless ``ok``; return ``ok``."""
        if not ok:
            self.violation(text)
        return ok

    def result(self, seconds: float) -> DrillResult:
        return DrillResult(
            name=self.name,
            figures=dict(self.figures),
            violations=tuple(self.violations),
            violation_count=self.violation_count,
            seconds=seconds,
        )


@attrs.frozen
class DrillResult:
    """What one drill did (``figures``) and which promises it saw broken."""

    name: str
    figures: dict[str, Figure]
    violations: tuple[str, ...]
    violation_count: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    def describe(self) -> str:
        """One line per figure then per violation: what a failing test prints."""
        lines = [f"drill {self.name}: {self.violation_count} violation(s), {self.seconds:.1f} s"]
        lines += [f"  {key} = {value}" for key, value in self.figures.items()]
        lines += [f"  VIOLATION: {text}" for text in self.violations]
        return "\n".join(lines)

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "figures": self.figures,
            "violations": list(self.violations),
            "violation_count": self.violation_count,
            "seconds": round(self.seconds, 3),
        }


def print_results(results: Sequence[DrillResult], *, as_json: bool) -> None:
    """Print the figures of every drill: a rich table, or JSON with ``as_json``."""
    if as_json:
        print(json.dumps([r.as_json() for r in results], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for result in results:
        status = "[green]ok[/green]" if result.ok else "[red]FAILED[/red]"
        table = Table(title=f"drill {result.name}: {status} in {result.seconds:.1f} s")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for key, value in result.figures.items():
            table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
        table.add_row("violations", str(result.violation_count))
        console.print(table)
        for text in result.violations:
            console.print(f"[red]VIOLATION[/red] {text}")
