"""``kvtrio drill``: the reliability and security drills, as programs that print figures.

Each drill proves one promise with counts (see docs/reliability.md):

- ``crash``: kill -9 at random points of save, publish, block writes and GC, and
  simulated loss of unsynced data; then reopen and check nothing acknowledged is lost
  and nothing torn is visible.
- ``faults``: an I/O error at every open, write, fsync, rename, directory fsync and read.
- ``hostile``: a corpus of crafted files plus mutation cases: only CorruptCacheError (or a
  clean miss, or UnknownCacheKindError for an unknown kind).
- ``gcrace``: deterministic interleavings of writers and GC: no referenced block deleted.
- ``soak``: spill at twice the disk's write rate: the byte cap holds, every ticket settles.
- ``shutdown``: SIGTERM during a flush, and SIGTERM twice.

The exit status is non-zero when any drill saw a violation. ``--full`` runs the big sizes.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import time
from pathlib import Path
from typing import Protocol

from kvtrio.drills.report import DrillResult, Tally, print_results

__all__ = ["DRILLS", "add_arguments", "run", "run_drill"]


class DrillFn(Protocol):
    def __call__(self, *, full: bool, seed: int, workdir: Path) -> DrillResult: ...


# name -> module defining ``run_<name>_drill(full=, seed=, workdir=)``; imported lazily so
# one drill's heavy imports (MLX, trio) stay out of the others.
DRILLS: dict[str, str] = {
    "crash": "kvtrio.drills.crash",
    "faults": "kvtrio.drills.faults",
    "hostile": "kvtrio.drills.hostile",
    "gcrace": "kvtrio.drills.gcrace",
    "soak": "kvtrio.drills.soak",
    "shutdown": "kvtrio.drills.shutdown",
}


def run_drill(name: str, *, full: bool, seed: int, workdir: Path) -> DrillResult:
    """Run one drill in its own subdirectory of ``workdir``.

    A drill that raises (a bug in the drill or in what it drives) is reported as a result
    with that one violation, so ``drill all`` still runs and prints the others.
    """
    sub = workdir / name
    sub.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        module = importlib.import_module(DRILLS[name])
        runner: DrillFn = getattr(module, f"run_{name}_drill")
        return runner(full=full, seed=seed, workdir=sub)
    except Exception as exc:
        tally = Tally(name)
        tally.violation(f"the drill raised {type(exc).__name__}: {exc}")
        return tally.result(time.perf_counter() - started)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", choices=[*DRILLS, "all"], help="the drill to run")
    parser.add_argument("--full", action="store_true", help="the big sizes (minutes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: tmp)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    names = list(DRILLS) if args.which == "all" else [args.which]
    results: list[DrillResult] = []
    with tempfile.TemporaryDirectory(prefix="kvtrio-drill-", dir=args.dir) as tmp:
        for name in names:
            result = run_drill(name, full=args.full, seed=args.seed, workdir=Path(tmp))
            results.append(result)
            if not args.json:
                print_results([result], as_json=False)
    if args.json:
        print_results(results, as_json=True)
    return 0 if all(r.ok for r in results) else 1
