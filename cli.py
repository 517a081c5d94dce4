"""The ``kvtrio`` command line.

Subcommands register themselves in :data:`COMMANDS` (name -> (help, add_arguments, run)).
Each ``run`` takes the parsed namespace and returns the exit status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["COMMANDS", "BENCHES", "main"]

AddArgs = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

# name -> (one-line help, add_arguments, run); filled by _register() below.
COMMANDS: dict[str, tuple[str, AddArgs, Run]] = {}
# `kvtrio bench NAME`: name -> (one-line help, add_arguments, run).
BENCHES: dict[str, tuple[str, AddArgs, Run]] = {}


def _register() -> None:
    """Import the modules that fill COMMANDS and BENCHES (heavy imports stay out of startup)."""
    from kvtrio import commands  # noqa: F401


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrio",
        description="kvtrio: a durable, non-blocking cold tier for MLX KV caches.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_args, run) in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    bench = sub.add_parser("bench", help="benchmark programs that print figures and ratios")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (help_text, add_args, run) in sorted(BENCHES.items()):
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print the figures as JSON")
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _register()
    args = _build_parser().parse_args(argv)
    run: Run = args._run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
