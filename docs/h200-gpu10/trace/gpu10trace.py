# mypy: ignore-errors
"""Per-process timings of a `bench serve` server (H200 tenth session, spill probe).

install() (from sitecustomize, KVTRIO_TRACE_DIR set, server processes only) writes
$KVTRIO_TRACE_DIR/trace-PID.jsonl, one JSON object a line: {"k": kind, "t": start
(perf_counter), "d": seconds, "th": thread, ...}. Kinds:
  step    mlx-lm BatchGenerator.next() on the generation thread (every server)
  insert  BatchGenerator.insert_segments: a request joins ("new" tokens, "cached")
  job     one kvtrio owner job on the generation thread ("fn": its function)
  pump    ExternalThreadExecutor.pump (its jobs included), when > 0.2 ms
  zc      hostbuffers._zero_copy_segments (the memoryview: MLX's raw_ptr, CUDA's move
          to unified memory), inside a materialize job
  spill   TieredPromptCache.spill (trio thread, await to return)
  write   a writer job (worker thread): write_single / write_blocks
  stall   (KVTRIO_TRACE_STALLS set) the generation thread out of next() for > 20 ms: its
          stack ("gen") and every other thread's top frames ("others"), every 2 ms
  gil     a probe thread that sleeps 1 ms: a wake-up later than 3 ms (the GIL or the
          CPU was held that long)
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_lock = threading.Lock()
_out = None
_now = time.perf_counter


def _rec(kind, t0, d, **extra):
    line = {"k": kind, "t": round(t0, 6), "d": round(d, 6), "th": threading.current_thread().name}
    line.update(extra)
    s = json.dumps(line)
    with _lock:
        _out.write(s + "\n")


def _name(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _timed(kind, func, min_d=0.0, **extra):
    @functools.wraps(func)
    def wrapper(*a, **k):
        t0 = _now()
        try:
            return func(*a, **k)
        finally:
            d = _now() - t0
            if d >= min_d:
                _rec(kind, t0, d, **extra)

    return wrapper


def _patch_external(mod):
    cls = mod.ExternalThreadExecutor
    run = cls.run

    async def traced_run(self, fn, *args):
        name = _name(fn)
        return await run(self, _timed("job", fn, fn=name), *args)

    cls.run = traced_run
    cls.pump = _timed("pump", cls.pump, min_d=0.0002)


_gen = {"ident": None, "in_step": False, "end": None}


def _step(func):
    @functools.wraps(func)
    def wrapper(*a, **k):
        _gen["ident"] = threading.get_ident()
        _gen["in_step"] = True
        t0 = _now()
        try:
            return func(*a, **k)
        finally:
            d = _now() - t0
            _gen["in_step"] = False
            _gen["end"] = t0 + d
            _rec("step", t0, d)

    return wrapper


def _stack(frame, depth):
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    return out


def _stall_sampler():
    """While the generation thread has been out of BatchGenerator.next() for more than
    20 ms (and stepped before), record its stack and the top frames of every other
    thread, every 2 ms (when this thread gets the GIL)."""
    names = {}
    while True:
        time.sleep(0.002)
        end, ident = _gen["end"], _gen["ident"]
        if ident is None or end is None or _gen["in_step"]:
            continue
        now = _now()
        if now - end < 0.02:
            continue
        frames = sys._current_frames()
        if len(names) != threading.active_count():
            names = {t.ident: t.name for t in threading.enumerate()}
        gen = frames.get(ident)
        others = {
            names.get(i, str(i)): _stack(f, 4)
            for i, f in frames.items()
            if i not in (ident, threading.get_ident())
        }
        _rec("stall", now, now - end, gen=_stack(gen, 14), others=others)


def _patch_generate(mod):
    cls = getattr(mod, "BatchGenerator", None)
    if cls is not None and hasattr(cls, "next"):
        cls.next = _step(cls.next)
    if cls is not None and hasattr(cls, "insert_segments"):
        insert = cls.insert_segments

        def traced_insert(self, *a, **k):
            t0 = _now()
            try:
                return insert(self, *a, **k)
            finally:
                segs = k.get("segments") or (a[0] if a else [[]])
                cached = k.get("all_tokens") or [[]]
                _rec(
                    "insert",
                    t0,
                    _now() - t0,
                    new=sum(len(x) for x in segs[0]),
                    cached=len(cached[0]),
                )

        cls.insert_segments = traced_insert


def _patch_hostbuffers(mod):
    mod._zero_copy_segments = _timed("zc", mod._zero_copy_segments)


def _patch_tiered(mod):
    cls = mod.TieredPromptCache
    spill = cls.spill

    async def traced_spill(self, tokens, *a, **k):
        t0 = _now()
        try:
            return await spill(self, tokens, *a, **k)
        finally:
            _rec("spill", t0, _now() - t0, tokens=len(tokens))

    cls.spill = traced_spill


def _patch_writer(mod):
    cls = mod.Writer
    cls._single_job = _timed("write", cls._single_job, layout="single")
    cls._blocks_job = _timed("write", cls._blocks_job, layout="blocks")


PATCHES = {
    "kvtrio.runtime.external": _patch_external,
    "mlx_lm.generate": _patch_generate,
    "kvtrio.storage.hostbuffers": _patch_hostbuffers,
    "kvtrio.actors.tiered": _patch_tiered,
    "kvtrio.actors.writer": _patch_writer,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            try:
                patch(module)
                _rec("patched", _now(), 0.0, module=name)
            except Exception as exc:
                _rec("patch_failed", _now(), 0.0, module=name, error=repr(exc))

        loader.exec_module = exec_and_patch
        return spec


def _gil_probe():
    while True:
        t0 = _now()
        time.sleep(0.001)
        late = _now() - t0 - 0.001
        if late > 0.003:
            _rec("gil", t0, late)


def install():
    global _out
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return
    if b"--port" not in argv:
        return
    directory = os.environ["KVTRIO_TRACE_DIR"]
    os.makedirs(directory, exist_ok=True)
    _out = open(os.path.join(directory, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
    _rec("start", _now(), 0.0, argv=[a.decode(errors="replace") for a in argv if a])
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_gil_probe, name="gil-probe", daemon=True).start()
    if os.environ.get("KVTRIO_TRACE_STALLS"):
        threading.Thread(target=_stall_sampler, name="stall-sampler", daemon=True).start()
