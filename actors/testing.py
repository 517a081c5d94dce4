"""Test kit for the cold tier: a guard that catches MLX calls made off the owner thread
(docs/design.md invariant 8).

``with mlx_thread_guard(owner.is_owner_thread) as guard:`` replaces the ``mlx.core``
entry points kvtrio and mlx-lm use (array construction, ``eval``, ``contiguous``,
concatenation, I/O, ...) with wrappers that, on any thread other than the owner, record
the call and raise ``AssertionError``. Calls made directly from a test module (a module
whose name contains ``test_`` or ``conftest``) on the thread that entered the guard (the
trio thread) are allowed, so a test may inspect results; worker threads never may.
Modules that did ``import mlx.core as mx`` see the wrappers, since they look the
function up on the module at call time.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

__all__ = ["GUARDED_MLX_FUNCTIONS", "MlxGuardReport", "mlx_thread_guard"]

GUARDED_MLX_FUNCTIONS = (
    "array",  # a class: replaced by a stand-in that still answers isinstance
    "async_eval",
    "concatenate",
    "contiguous",
    "eval",
    "from_dlpack",
    "full",
    "load",
    "ones",
    "save",
    "save_safetensors",
    "stack",
    "synchronize",
    "zeros",
    "zeros_like",
)


@attrs.define
class MlxGuardReport:
    """What the guard saw: every MLX call, and those made off the owner thread."""

    calls: int = 0
    violations: list[str] = attrs.field(factory=list)


def _from_test_module() -> bool:
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back  # type: ignore[assignment]
    name = "" if frame is None else str(frame.f_globals.get("__name__", ""))
    return "test_" in name or "conftest" in name


def _class_stand_in(cls: type, construct: Callable[..., Any]) -> Any:
    """A stand-in for ``cls`` whose calls go through ``construct`` and isinstance still works."""

    class StandInMeta(type):
        def __instancecheck__(self, obj: object) -> bool:
            return isinstance(obj, cls)

        def __subclasscheck__(self, sub: type) -> bool:
            return issubclass(sub, cls)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return construct(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(cls, name)

    return StandInMeta(cls.__name__, (), {})


@contextmanager
def mlx_thread_guard(is_owner_thread: Callable[[], bool]) -> Iterator[MlxGuardReport]:
    """Fail every guarded ``mlx.core`` call made off the owner thread (see the module doc)."""
    import mlx.core as mx

    report = MlxGuardReport()
    test_thread = threading.get_ident()
    lock = threading.Lock()
    originals: dict[str, Any] = {}

    def wrap(name: str, fn: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with lock:
                report.calls += 1
            allowed = threading.get_ident() == test_thread and _from_test_module()
            if not is_owner_thread() and not allowed:
                where = f"mx.{name} on thread {threading.current_thread().name!r}"
                with lock:
                    report.violations.append(where)
                raise AssertionError(f"MLX call off the owner thread: {where}")
            return fn(*args, **kwargs)

        if isinstance(fn, type):
            return _class_stand_in(fn, guarded)
        return guarded

    for name in GUARDED_MLX_FUNCTIONS:
        fn = getattr(mx, name, None)
        if fn is not None:
            originals[name] = fn
            setattr(mx, name, wrap(name, fn))
    try:
        yield report
    finally:
        for name, fn in originals.items():
            setattr(mx, name, fn)
