# mypy: ignore-errors
"""Start probe (start12; start11's, with finer marks): one line per event to $START12_LOG.

``name wall process_cpu thread_cpu thread``. Put this folder first on PYTHONPATH of every
server. Marks (first occurrence counts): interpreter up; imports of mlx.core,
transformers, mlx_lm.server and kvtrio's start modules; argparse's parse_args; mlx-lm's
wired-limit call; ModelProvider and ResponseGenerator; the load (whole, weights,
tokenizer, the load's gc.collect); the listener; the first request's handler (do_POST),
its queueing (generate) and the generation thread's first take of it; kvtrio's cold open.
"""

import gc
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time

_log = os.environ.get("START12_LOG")
_WATCH = {
    "argparse",
    "mlx.core",
    "transformers",
    "socketserver",
    "http.server",
    "mlx_lm.utils",
    "mlx_lm.server",
    "kvtrio.cli",
    "kvtrio.serve.server",
    "kvtrio.serve.coldopen",
    "kvtrio.serve.bridge",
}


def mark(name):
    line = f"{name} {time.time():.6f} {time.process_time():.4f} {time.thread_time():.4f}"
    _f.write(f"{line} {threading.current_thread().name}\n")


def _wrap(owner, fn, label=None):
    inner = getattr(owner, fn)
    name = label or f"{getattr(owner, '__name__', '')}.{fn}"

    def wrapped(*args, **kwargs):
        mark("start:" + name)
        try:
            return inner(*args, **kwargs)
        finally:
            mark("done:" + name)

    setattr(owner, fn, wrapped)


def _patch(name, module):
    if name == "argparse":
        _wrap(module.ArgumentParser, "parse_args", "parse_args")
    elif name == "mlx.core":
        _wrap(module, "device_info", "mx.device_info")
    elif name == "socketserver":
        activate = module.TCPServer.server_activate

        def server_activate(self):
            activate(self)
            mark("listen")

        module.TCPServer.server_activate = server_activate
    elif name == "mlx_lm.utils":
        _wrap(module, "load_model", "weights")
        _wrap(module, "load_tokenizer", "tokenizer")
    elif name == "mlx_lm.server":
        _wrap(module.ModelProvider, "_load", "load")
        _wrap(module.ModelProvider, "__init__")
        _wrap(module.ResponseGenerator, "__init__")
        _wrap(module.ResponseGenerator, "generate")
        _wrap(module.ResponseGenerator, "_tokenize")
        _wrap(module.APIHandler, "do_POST")
        _wrap(module, "maybe_set_recommended_wired_limit", "wired_limit")
        _wrap(module, "get_system_fingerprint", "fingerprint")
    elif name == "kvtrio.serve.server":
        _wrap(module, "serve", "kvtrio.serve")
    elif name == "kvtrio.serve.coldopen":
        _wrap(module.ColdOpening, "start")
        _wrap(module.ColdOpening, "_open")


_collect = gc.collect


def collect(*args):
    mark("start:gc.collect")
    try:
        return _collect(*args)
    finally:
        mark("done:gc.collect")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _WATCH:
            return None
        _WATCH.discard(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader.exec_module

        def exec_module(module, inner=inner, name=name):
            mark("import_start:" + name)
            inner(module)
            mark("import_done:" + name)
            _patch(name, module)

        spec.loader.exec_module = exec_module
        return spec


_gc_start = [0.0]


def _gc_callback(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        spent = time.perf_counter() - _gc_start[0]
        _f.write(f"gc{info['generation']} {time.time():.6f} {spent:.6f} 0 -\n")


if _log:
    _f = open(_log, "a", buffering=1)  # open for the process's life
    mark("interp")
    gc.callbacks.append(_gc_callback)
    gc.collect = collect
    sys.meta_path.insert(0, _Finder())
