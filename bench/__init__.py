"""``kvtrio bench NAME``: benchmark programs that print figures, never timed tests.

Every benchmark is one module here with the same three functions, run by one runner:

- ``add_arguments(parser)``: its flags (the runner adds ``--json`` to every one);
- ``measure(args) -> dict``: runs it and returns the figures, JSON-serialisable, each
  headline figure a ratio against a reference measured in the same run on the same bytes;
- ``render(figures)``: prints them for a person.

``kvtrio bench NAME --json`` prints ``measure``'s dict instead of ``render``'s table, so
scripts and docs/benchmarks.md quote the same numbers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

__all__ = ["add_runner_arguments", "runner_for"]


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark has."""
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def runner_for(module: ModuleType) -> Callable[[argparse.Namespace], int]:
    """The ``run(args)`` of a benchmark module: measure, then JSON or the module's render."""
    measure = cast(Callable[[argparse.Namespace], dict[str, Any]], module.measure)
    render = cast(Callable[[dict[str, Any]], None], module.render)

    def run(args: argparse.Namespace) -> int:
        figures = measure(args)
        if args.json:
            print(json.dumps(figures, indent=2))
        else:
            render(figures)
        return 0

    return run
