# mypy: ignore-errors
"""The rebuild's late loop ticks against the kernel's scheduler (twelfth session, issue 14).

    perf sched record -k CLOCK_MONOTONIC -o P -- \
        .venv/bin/python docs/scale12/sched_probe.py N DIR [rebuild|open]
    perf sched timehist -i P -w > T
    python3 docs/scale12/late_windows.py T FROM:TO ...

The probe runs the bench's timed open (the rebuild: catalogue deleted first) with a 1 ms
heartbeat of its own that prints every tick more than 8 ms late, its start and end in
CLOCK_MONOTONIC seconds (perf's clock with ``-k CLOCK_MONOTONIC``), and the native thread
ids of the loop and of the other threads, so that each late tick can be read against what
the scheduler did with each thread meanwhile (late_windows.py)."""

import importlib
import os
import sys
import threading
import time
from pathlib import Path

import trio
from kvtrio.bench import scale

for _name in scale.OPEN_IMPORTS:
    importlib.import_module(_name)

N = int(sys.argv[1])
BASE = Path(sys.argv[2])
MODE = sys.argv[3] if len(sys.argv) > 3 else "rebuild"
LATE = []


async def ticks(stop):
    while not stop.is_set():
        before = time.monotonic()
        await trio.sleep(0.001)
        late = time.monotonic() - before - 0.001
        if late > 0.008:
            LATE.append((before, late))


async def main():
    from kvtrio.actors.owner import MlxOwner

    directory = BASE / f"n{N}"
    if MODE == "rebuild":
        for catalogue in directory.glob(".kvtrio-catalogue*"):
            catalogue.unlink()
    model = scale._model_of(directory)
    stop = trio.Event()
    async with MlxOwner.inline() as owner, trio.open_nursery() as nursery:
        nursery.start_soon(ticks, stop)
        figures = await scale._timed_open(directory, model, owner)
        stop.set()
    print(
        MODE,
        {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()},
        "load",
        os.getloadavg()[0],
    )
    print(
        "pid",
        os.getpid(),
        "loop tid",
        threading.get_native_id(),
        "threads",
        [(t.name, t.native_id) for t in threading.enumerate()],
    )
    for before, late in sorted(LATE, key=lambda t: -t[1]):
        print(f"late {late * 1e3:.1f} ms from {before:.6f} to {before + 0.001 + late:.6f}")


trio.run(main)
