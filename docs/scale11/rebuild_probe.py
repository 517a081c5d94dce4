# mypy: ignore-errors
"""Where the rebuild's loop stall comes from (eleventh session, issue 14).

``.venv/bin/python docs/scale11/rebuild_probe.py N DIR [SWITCH_INTERVAL_S]`` populates
``DIR/nN`` with N entries (once, as ``kvtrio bench scale`` does), deletes its catalogue,
imports what the bench's rebuild child imports (``OPEN_IMPORTS``), then times the open
(the rebuild) as the bench does, with: a trio instrument recording every task step over
5 ms (where it resumed and where it suspended), a 2 ms sampler of the event loop
thread's stack (printed for steps over 12 ms), and every garbage collection over 5 ms
with its thread. A long heartbeat lateness with no long task step and no long collection
is the loop thread waiting for the GIL (worker threads holding it), not work on the loop.
The optional third argument sets ``sys.setswitchinterval`` first."""

import gc
import importlib
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import trio
from kvtrio.bench import scale

for _name in scale.OPEN_IMPORTS:
    importlib.import_module(_name)

N = int(sys.argv[1])
BASE = Path(sys.argv[2])
if len(sys.argv) > 3:
    sys.setswitchinterval(float(sys.argv[3]))


def _frames(task):
    return [
        f"{f.f_code.co_filename.split('/')[-1]}:{line} {f.f_code.co_name}"
        for f, line in task.iter_await_frames()
    ][-4:]


class Steps(trio.abc.Instrument):
    def __init__(self):
        self.started = {}
        self.long = []

    def before_task_step(self, task):
        self.started[task] = (time.perf_counter(), _frames(task))

    def after_task_step(self, task):
        t0, where = self.started.pop(task, (None, None))
        if t0 is not None and time.perf_counter() - t0 > 0.005:
            self.long.append((time.perf_counter() - t0, t0, task.name, where, _frames(task)))


SAMPLES = []
COLLECTIONS = []


def _sampler(stop, loop_thread):
    while not stop.is_set():
        frame, stack = sys._current_frames().get(loop_thread), []
        while frame is not None and len(stack) < 12:
            stack.append(f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno}")
            frame = frame.f_back
        SAMPLES.append((time.perf_counter(), " <- ".join(stack)))
        time.sleep(0.002)


def _on_gc(phase, info):
    if phase == "start":
        _on_gc.t0 = time.perf_counter()
    elif time.perf_counter() - _on_gc.t0 > 0.005:
        took = time.perf_counter() - _on_gc.t0
        thread = threading.current_thread().name
        COLLECTIONS.append((round(took * 1e3, 1), info["generation"], thread))


async def main():
    from kvtrio.actors.owner import MlxOwner

    directory = BASE / f"n{N}"
    if not directory.exists():
        directory.mkdir(parents=True)
        print("populated in", round(scale._populate(directory, N), 2), "s", flush=True)
    for catalogue in directory.glob(".kvtrio-catalogue*"):
        catalogue.unlink()
    model = scale._model_of(directory)
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    gc.callbacks.append(_on_gc)
    stop = threading.Event()
    threading.Thread(target=_sampler, args=(stop, threading.get_ident()), daemon=True).start()
    async with MlxOwner.inline() as owner:
        figures = await scale._timed_open(directory, model, owner)
    stop.set()
    print("rebuild", {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()})
    for took, t0, name, where, to in sorted(steps.long, key=lambda s: s[0], reverse=True)[:6]:
        print(f"step {took * 1e3:.1f} ms, task {name[:50]}: from {where} to {to}")
        if took > 0.012:
            seen = Counter(s for t, s in SAMPLES if t0 <= t <= t0 + took)
            for stack, count in seen.most_common(4):
                print("   ", count, stack[:400])
    print("collections over 5 ms (ms, generation, thread):", COLLECTIONS)


trio.run(main)
