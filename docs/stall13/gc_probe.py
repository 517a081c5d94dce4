# mypy: ignore-errors
"""Which of ``kvtrio bench scale``'s timed opens stall the loop > 20 ms, and why.

One open as the bench's ``--child-open`` makes it (:func:`kvtrio.bench.scale.child_open_main`,
unchanged), with two recorders added in this process only: ``gc.callbacks`` (each
collection's generation, start and length, and the tracked objects it examined) and the
bench's own heartbeat with every late tick kept (its start, its lateness), plus the
moments the timed open began and its heartbeat stopped. Production code is untouched.

    python docs/stall13/gc_probe.py populate DIR N       # N manifests, then the rebuild
    python docs/stall13/gc_probe.py open DIR             # one open (JSON on stdout)
    python docs/stall13/gc_probe.py loop DIR K [PYTHONPATH_ALT]   # K fresh-process opens

``loop`` prints one line per open: the stall, the collections inside the timed window
(generation:ms) and whether the worst tick overlapped a full (generation 2) collection;
then the count of opens over 20 ms. With PYTHONPATH_ALT (another tree's root's parent,
holding a ``kvtrio`` package) the opens alternate between this tree and that one; with
``nice`` instead, between plain opens and opens whose ``trio.to_thread.run_sync`` jobs
run at nice 10 (``STALL13_NICE=1``, the experiment docs/bench/scale.md reports).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LATE = 0.004  # a tick later than this is kept


_FDS: dict = {}
MAIN = None


def _sched():
    """Per thread: its time on a CPU and its run-queue wait so far (ns, /proc schedstat);
    the process's involuntary context switches; the machine's stolen time (jiffies)."""
    import resource

    out = {}
    for tid in os.listdir("/proc/self/task"):
        fd = _FDS.get(tid)
        if fd is None:
            try:
                fd = _FDS[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue
        try:
            run, wait = os.pread(fd, 128, 0).split()[:2]
            out[tid] = (int(run), int(wait))
        except OSError:
            pass
    with open("/proc/stat", "rb") as f:
        steal = int(f.readline().split()[8])
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw, steal


def _sched_delta(a, b):
    """During the tick (ms): the loop thread's CPU and run-queue wait, the other threads'
    CPU and run-queue wait; the process's involuntary switches; stolen jiffies."""
    main = str(os.getpid())
    d = {
        t: [(x - y) / 1e6 for x, y in zip(b[0][t], a[0].get(t, b[0][t]), strict=True)] for t in b[0]
    }
    loop = d.get(main, [0.0, 0.0])
    others = [sum(v[i] for t, v in d.items() if t != main) for i in (0, 1)]
    return [round(v, 2) for v in (*loop, *others)] + [b[1] - a[1], b[2] - a[2]]


def _install() -> dict:
    rec = {"gcs": [], "late": [], "window": [None, None], "pauses": []}
    pending = {}

    def callback(phase, info):
        if phase == "start":
            pending["t"] = time.perf_counter()
        else:
            t0 = pending.pop("t", None)
            if t0 is not None:
                took = time.perf_counter() - t0
                where = None
                if took > 0.002:  # a long one: which thread, called from where
                    import threading
                    import traceback

                    frames = traceback.extract_stack(limit=6)[:-1]
                    where = [threading.current_thread().name] + [
                        f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames
                    ]
                rec["gcs"].append([info["generation"], t0, took, info.get("collected", 0), where])

    gc.callbacks.append(callback)
    from kvtrio.bench import scale

    async def heartbeat(worst, stop):
        import trio

        rec["window"][0] = time.perf_counter()
        while not stop.is_set():
            sched = _sched()
            worst[1] = before = time.perf_counter()
            await trio.sleep(0.001)
            if stop.is_set():
                break
            late = time.perf_counter() - before - 0.001
            worst[0] = max(worst[0], late)
            if late > LATE:
                rec["late"].append([before, late, *_sched_delta(sched, _sched())])

    stop_heartbeat = scale._stop_heartbeat

    def stop_and_record(worst, stop):
        rec["window"][1] = time.perf_counter()
        late = time.perf_counter() - worst[1] - 0.001
        if late > LATE:
            rec["late"].append([worst[1], late])
        return stop_heartbeat(worst, stop)

    from contextlib import contextmanager

    from kvtrio.actors import coldstore, collector, tieredload

    paused = collector.collector_paused

    @contextmanager
    def recorded_pause():
        # the collector's counts (gen 0, 1, 2) where open pauses it and where it resumes
        rec["pauses"].append(["enter", time.perf_counter(), gc.get_count()])
        with paused():
            yield
            rec["pauses"].append(["exit", time.perf_counter(), gc.get_count()])

    coldstore.collector_paused = tieredload.collector_paused = recorded_pause
    if os.environ.get("STALL13_NICE"):  # the experiment: worker threads at nice 10
        import threading

        import trio

        run_sync = trio.to_thread.run_sync

        def niced(fn, *args):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            return fn(*args)

        async def run_sync_niced(fn, *args, **kwargs):
            return await run_sync(niced, fn, *args, **kwargs)

        trio.to_thread.run_sync = run_sync_niced
    scale._heartbeat = heartbeat
    scale._stop_heartbeat = stop_and_record
    return rec


def open_main(directory: str) -> None:
    rec = _install()
    from kvtrio.bench import scale

    sample = scale.child_open_main(Path(directory))
    sample.pop("open_new_module_names", None)
    json.dump({"sample": sample, **rec, "thresholds": gc.get_threshold()}, sys.stdout)


def populate_main(directory: str, n: int) -> None:
    from kvtrio.bench import scale

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    print("populate_s", scale._populate(path, n))
    print(json.dumps(scale._child(path, n, 100, False, scale.TOKENS))[:300])


def summarise(out: dict) -> dict:
    lo, hi = out["window"]
    stall = out["sample"]["open_stall_s"]
    inside = [g for g in out["gcs"] if g[1] + g[2] >= lo and g[1] <= hi]
    worst = max(out["late"], key=lambda t: t[1], default=None)
    culprit = None
    if worst is not None:
        a, b = worst[0], worst[0] + worst[1] + 0.001
        over = [g for g in inside if g[1] < b and g[1] + g[2] > a and (g[0] == 2 or g[2] > 1e-3)]
        culprit = [[f"{g[0]}:{g[2] * 1e3:.1f}", g[4] if len(g) > 4 else None] for g in over]
    return {
        "stall_ms": round(stall * 1e3, 1),
        "open_s": round(out["sample"]["open_s"], 3),
        "gcs_in_window": [
            f"{g[0]}:{g[2] * 1e3:.1f}@{(g[1] - lo) * 1e3:.0f}"
            for g in inside
            if g[0] == 2 or g[2] > 0.004
        ],
        "worst_tick_at_ms": None if worst is None else round((worst[0] - lo) * 1e3),
        "window_start": lo,
        "late_over_10ms": [
            [t[0], round(t[1] * 1e3, 1), *t[2:]] for t in out["late"] if t[1] > 0.01
        ],
        "window_ms": round((hi - lo) * 1e3),
        "gcs_over_worst_tick": culprit,
        "worst_tick_sched": None if worst is None else worst[2:],
        "pauses": [[p[0], round((p[1] - lo) * 1e3), p[2]] for p in out.get("pauses", [])],
        "full_gc_ms": round(out["sample"]["full_gc_s"] * 1e3, 1),
        "load_1m": out["sample"]["load_1m"],
    }


def loop_main(directory: str, k: int, alt: str | None) -> None:
    trees = [("this", None)] + ([("alt", alt)] if alt else [])
    if alt == "nice":  # the experiment: this tree, its open's worker threads at nice 10
        trees = [("this", None), ("nice", None)]
    over: dict[str, list[int]] = {name: [0, 0] for name, _ in trees}
    for i in range(k):
        name, path = trees[i % len(trees)]
        env = dict(os.environ)
        if name == "nice":
            env["STALL13_NICE"], path = "1", None
        elif path:
            env["PYTHONPATH"] = path
        out = subprocess.run(
            [sys.executable, __file__, "open", directory],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            cwd="/" if path else None,
        )
        line = summarise(json.loads(out.stdout))
        over[name][1] += 1
        over[name][0] += line["stall_ms"] > 20
        print(json.dumps({"i": i, "tree": name, **line}), flush=True)
    for name, (n_over, n) in over.items():
        print(f"{name}: {n_over} of {n} opens stalled > 20 ms", flush=True)


def report_main(directory: str) -> None:
    """The records :mod:`sitecustomize` wrote during a bench run (one file per timed open):
    per 100,000-entry open, one line as ``loop`` prints (the stall: the worst late tick)."""
    files = sorted(Path(directory).glob("*.json"), key=lambda p: p.stat().st_mtime)
    over = total = 0
    for path in files:
        out = json.loads(path.read_text())
        n = Path(out["argv"][-1]).name
        worst = max((t[1] for t in out["late"]), default=0.0)
        out["sample"] = {"open_stall_s": worst, "open_s": 0.0, "full_gc_s": 0.0, "load_1m": 0}
        line = summarise(out)
        for key in ("open_s", "full_gc_ms", "load_1m"):
            line.pop(key)
        total += n == "n100000"
        over += n == "n100000" and worst > 0.020
        print(json.dumps({"n": n, **line}))
    print(f"{over} of {total} opens of 100,000 entries stalled > 20 ms")


if __name__ == "__main__":
    if sys.argv[1] == "report":
        report_main(sys.argv[2])
    elif sys.argv[1] == "open":
        open_main(sys.argv[2])
    elif sys.argv[1] == "populate":
        populate_main(sys.argv[2], int(sys.argv[3]))
    else:
        loop_main(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
