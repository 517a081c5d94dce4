"""Start probe (start11): one line per event to $START11_LOG (nothing without it).

``name wall process_cpu thread_cpu thread``: wall is time.time(), process_cpu
time.process_time(), thread_cpu time.thread_time() of the thread that marks. Put this
folder first on PYTHONPATH of every server. Marks: imports of mlx.core, transformers,
mlx_lm.server and kvtrio's serve modules; the listener (socketserver); mlx-lm's model load,
ModelProvider and ResponseGenerator; kvtrio's cold open; and, around each call, the MLX
calls a start makes outside the load (mx.distributed.init, mx.device_info,
mx.default_stream), so a GPU host shows which thread pays for which.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from typing import Any

_log = os.environ.get("START11_LOG")
_WATCH = {
    "mlx.core",
    "transformers",
    "socketserver",
    "mlx_lm.server",
    "kvtrio.serve.server",
    "kvtrio.serve.coldopen",
    "kvtrio.serve.bridge",
}


def mark(name: str) -> None:
    line = f"{name} {time.time():.6f} {time.process_time():.4f} {time.thread_time():.4f}"
    _f.write(f"{line} {threading.current_thread().name}\n")


def _wrap(owner: Any, fn: str, label: str | None = None, static: bool = False) -> None:
    inner = getattr(owner, fn)
    name = label or f"{getattr(owner, '__name__', '')}.{fn}"

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark("start:" + name)
        try:
            return inner(*args, **kwargs)
        finally:
            mark("done:" + name)

    setattr(owner, fn, staticmethod(wrapped) if static else wrapped)


def _patch(name: str, module: Any) -> None:
    if name == "mlx.core":
        _wrap(module.distributed, "init", "mx.distributed.init")
        _wrap(module, "device_info", "mx.device_info")
        _wrap(module, "default_stream", "mx.default_stream")
    elif name == "socketserver":
        activate = module.TCPServer.server_activate

        def server_activate(self: Any) -> None:
            activate(self)
            mark("listen")

        module.TCPServer.server_activate = server_activate
    elif name == "mlx_lm.server":
        _wrap(module.ModelProvider, "_load", "load")
        _wrap(module.ModelProvider, "__init__")
        _wrap(module.ResponseGenerator, "__init__")
        _wrap(module.ResponseGenerator, "generate")
    elif name == "kvtrio.serve.server":
        for fn in ("_http_server", "_generator_class", "_handler_class"):
            _wrap(module, fn)
    elif name == "kvtrio.serve.coldopen":
        _wrap(module.ColdOpening, "start")
        _wrap(module.ColdOpening, "_open")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in _WATCH:
            return None
        _WATCH.discard(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader.exec_module

        def exec_module(module: Any, inner: Any = inner, name: str = name) -> None:
            mark("import_start:" + name)
            inner(module)
            mark("import_done:" + name)
            _patch(name, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _log:
    _f = open(_log, "a", buffering=1)  # open for the process's life
    mark("interp")
    sys.meta_path.insert(0, _Finder())
