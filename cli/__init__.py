"""The ``kvtrio`` command line.

Every command is declared in :data:`COMMANDS` and every benchmark in :data:`BENCHES`: a
name, a one-line help, and the module that implements it. A command's module is imported
only when that command runs (or its ``--help`` is asked for), so ``kvtrio --help`` and
``kvtrio gc`` never import MLX. A command module provides ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status); a table entry may name other attributes when one
module serves several commands. Benchmarks run through :mod:`kvtrio.bench`'s one runner.

The environment is read here and nowhere else: the ``KVTRIO_*`` tuning variables
(docs/tuning.md) become ``args.io_options``, an
:class:`~kvtrio.storage.options.IoOptions` that commands and benchmarks pass to the
library explicitly. A command that declares it does not use them (``io_options=False``:
``kvtrio serve``, whose start path stays as short as mlx_lm.server's) skips that, and
with it the import of :mod:`kvtrio.storage`.

Errors a user can act on (a missing directory, a bad flag value) are printed as one line
``kvtrio COMMAND: message`` with exit status 2 (see :class:`UsageError`), never as a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import attrs

if TYPE_CHECKING:
    from kvtrio.storage.options import IoOptions

__all__ = ["BENCHES", "COMMANDS", "Command", "UsageError", "main"]

AddArgs = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """The user's input to a command is unusable (shown as one line, exit status 2)."""


@attrs.frozen
class Command:
    """One subcommand: its help line and where its code lives (imported on use)."""

    help: str
    module: str
    add_arguments: str = "add_arguments"
    run: str = "run"
    #: Whether it uses ``args.io_options`` (the ``KVTRIO_*`` I/O tuning, read at start).
    io_options: bool = True
    #: A function of the module called with the command line's words before
    #: ``add_arguments`` (which may import what the command runs), or None.
    before_imports: str | None = None

    def load(self, argv: Sequence[str]) -> tuple[AddArgs, Run]:
        """Import the module, run its ``before_imports`` hook on ``argv`` if it names one,
        and return its two entry points."""
        module = importlib.import_module(self.module)
        if self.before_imports is not None:
            getattr(module, self.before_imports)(list(argv))
        return (
            cast(AddArgs, getattr(module, self.add_arguments)),
            cast(Run, getattr(module, self.run)),
        )


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "serve chat conversations with a tiered prompt cache (RAM, then disk) and check every hit",
        "kvtrio.cli.demo",
    ),
    "serve": Command(
        "mlx_lm.server with a prompt cache that survives restarts and spills to disk",
        "kvtrio.cli.serve",
        io_options=False,
        before_imports="before_imports",
    ),
    "showcase": Command(
        "the actor runtime, live: backpressure, supervision, shutdown", "kvtrio.cli.showcase"
    ),
    "inspect": Command(
        "show a cache file's header, layers, tensors and attachments",
        "kvtrio.cli.tools",
        "add_inspect_arguments",
        "run_inspect",
    ),
    "verify": Command(
        "recheck every cache file and block in a directory; exit 1 on corruption",
        "kvtrio.cli.tools",
        "add_tree_arguments",
        "run_verify",
    ),
    "gc": Command(
        "delete unreferenced blocks and crash debris older than a grace period",
        "kvtrio.cli.tools",
        "add_gc_arguments",
        "run_gc",
    ),
    "drill": Command(
        "reliability drills: crash, faults, hostile, gcrace, soak, shutdown, all (--full: big)",
        "kvtrio.drills",
    ),
}

# `kvtrio bench NAME`: each module provides add_arguments, measure and render
# (see kvtrio.bench); the runner adds --json to every one.
BENCHES: dict[str, Command] = {
    "runtime": Command(
        "actor ask/tell throughput vs raw trio memory channels, as ratios",
        "kvtrio.bench.runtime",
    ),
    "storage": Command(
        "storage: sync save and cold load GB/s vs O_DIRECT and mlx-lm on the same bytes",
        "kvtrio.bench.storage",
    ),
    "serve": Command(
        "kvtrio serve vs mlx_lm.server vs a naive save_prompt_cache baseline: TTFT after a "
        "restart, decode tokens/s",
        "kvtrio.bench.serve",
    ),
    "tier": Command(
        "cold tier: save/load GB/s vs O_DIRECT and mlx-lm; event-loop lag during both",
        "kvtrio.bench.tier",
    ),
    "redis": Command(
        "shared tier on Redis: block put/get GB/s vs raw SET/GET; dedup across hosts",
        "kvtrio.bench.redis",
    ),
    "policy": Command(
        "eviction and write admission replayed on a synthetic chat and document trace: "
        "prefill time saved and bytes written, cost-aware vs LRU",
        "kvtrio.bench.policy",
    ),
    "scale": Command(
        "cold store at 1k/10k/100k entries: open, loop stall, RSS/entry, lookups, gc; a burst",
        "kvtrio.bench.scale",
    ),
    "reuse": Command(
        "cold hit vs recompute on the demo model: the reuse from which a load wins",
        "kvtrio.bench.reuse",
    ),
    "attention": Command(
        "decode attention over a paged cache: direct kernel and gather+sdpa vs contiguous sdpa",
        "kvtrio.bench.attention",
    ),
}


def _version() -> str:
    from kvtrio import __version__

    return __version__


def _chosen(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The first word of ``argv`` that names one of ``names`` (the subcommand asked for)."""
    for word in argv:
        if word in names:
            return word
        if not word.startswith("-"):
            return None
    return None


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrio",
        description="kvtrio: a durable, non-blocking cold tier for MLX KV caches.",
    )
    parser.add_argument("--version", action="version", version=f"kvtrio {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen(argv, [*COMMANDS, "bench"])
    for name, command in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            add_args, run = command.load(argv)
            add_args(p)
            p.set_defaults(_run=run)
    bench = sub.add_parser("bench", help="benchmark programs that print figures and ratios")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    if chosen == "bench":
        rest = list(argv[argv.index("bench") + 1 :])
        chosen_bench = _chosen(rest, list(BENCHES))
        for name, command in sorted(BENCHES.items()):
            p = bench_sub.add_parser(name, help=command.help, description=command.help)
            if name == chosen_bench:
                from kvtrio.bench import add_runner_arguments, runner_for

                module = importlib.import_module(command.module)
                add_runner_arguments(p)
                module.add_arguments(p)
                p.set_defaults(_run=runner_for(module))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser(words).parse_args(words)
    run: Run = args._run
    try:
        command = COMMANDS.get(args.command)
        if command is None or command.io_options:  # every benchmark reads them
            args.io_options = _io_options()
        return run(args)
    except BaseException as exc:
        error = _user_facing(exc)
        if error is None:
            raise
        print(f"kvtrio {args.command}: {_one_line(error)}", file=sys.stderr)
        return 2


def _io_options() -> IoOptions:
    from kvtrio.storage.options import IoOptions

    try:
        return IoOptions.from_environ(os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _user_facing(exc: BaseException) -> BaseException | None:
    """The error to show as one line: a UsageError, a kvtrio error or an OSError (a
    missing directory, a refused permission), alone or as the one cause in a group.
    Anything else is a bug and keeps its traceback."""
    from kvtrio.errors import KvtrioError

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, UsageError | KvtrioError | OSError) else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
