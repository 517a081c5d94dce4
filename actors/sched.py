"""Thread time slices: kvtrio's own threads give way to the event loop's on the CPU.

Measured with ``kvtrio bench tier`` (a 1 ms heartbeat on the event loop) on a 2-CPU Linux
6.18 VM: while the tier loads, the heartbeat's lateness was almost all run-queue wait
(``/proc/self/task/<tid>/schedstat``), not GIL wait: the woken event-loop thread waited
for a worker (hashing, copying, or MLX's stream thread zero-filling) to finish its time
slice (1.4 ms by default there, several in a row). Since Linux 6.12 the scheduler (EEVDF)
lets a thread ask for its own slice (``sched_setattr(2)``, ``sched_runtime`` for normal
threads), and a thread waking with a shorter slice than the running one preempts it at
once (the PREEMPT_SHORT feature). So kvtrio's threads, which do long throughput work,
ask for a long slice (:data:`BACKGROUND_SLICE`) and the server's threads, left alone, win
every wake-up; the CPU shares do not change (weights are untouched). This module never
touches a thread it does not run on: :func:`background_slice` changes the calling thread
for the length of a block (kvtrio's I/O jobs run on shared worker threads) and the MLX
owner sets its own thread once, before its first MLX call, so MLX's stream threads inherit
it. Where the call does not exist (macOS, old kernels) all of it is a no-op.

An event loop may also ask for a *shorter* slice itself (:func:`set_thread_slice` on the
trio thread): that is the server's decision, never made by kvtrio (see docs/actors.md).
"""

from __future__ import annotations

import ctypes
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["BACKGROUND_SLICE", "background_slice", "set_thread_slice", "thread_slice"]

#: Scheduler time slice (seconds) kvtrio's own threads ask for. ``None`` wherever it is
#: accepted leaves the threads alone.
BACKGROUND_SLICE: float | None = 0.020

# sched_setattr(2) / sched_getattr(2): Python's os module has neither.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275)}
_SCHED_NORMAL, _SCHED_BATCH = 0, 3
_SCHED_FLAG_RESET_ON_FORK = 0x01


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


class _Sched:
    """The two syscalls, or None where they do not exist (not Linux, unknown machine)."""

    def __init__(self) -> None:
        self.calls: tuple[Any, int, int] | None = None
        numbers = _SYSCALLS.get(platform.machine())
        if sys.platform.startswith("linux") and numbers is not None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self.calls = (libc.syscall, *numbers)
            except (OSError, AttributeError):
                self.calls = None

    def get(self) -> _SchedAttr | None:
        if self.calls is None:
            return None
        syscall, _, getattr_nr = self.calls
        attr = _SchedAttr()
        if syscall(getattr_nr, 0, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
            return None
        return attr

    def set(self, attr: _SchedAttr) -> bool:
        if self.calls is None:
            return False
        syscall, setattr_nr, _ = self.calls
        attr.size = ctypes.sizeof(attr)
        return bool(syscall(setattr_nr, 0, ctypes.byref(attr), 0) == 0)


_SCHED = _Sched()


def thread_slice() -> float | None:
    """The calling thread's scheduler time slice in seconds (Linux; None where unknown)."""
    attr = _SCHED.get()
    if attr is None or attr.sched_policy not in (_SCHED_NORMAL, _SCHED_BATCH):
        return None
    return int(attr.sched_runtime) / 1e9


def set_thread_slice(seconds: float) -> bool:
    """Ask for a scheduler time slice of ``seconds`` for the calling thread (0: the
    kernel's default). Linux >= 6.12 honours it for normal threads (clamped to 0.1-100 ms)
    and threads the caller starts later inherit it; older kernels ignore it. Keeps the
    thread's policy and nice value. Returns False where it could not be set."""
    attr = _SCHED.get()
    if attr is None or attr.sched_policy not in (_SCHED_NORMAL, _SCHED_BATCH):
        return False
    attr.sched_runtime = max(0, int(seconds * 1e9))
    attr.sched_flags &= _SCHED_FLAG_RESET_ON_FORK  # the one flag a normal thread reports
    return _SCHED.set(attr)


@contextmanager
def background_slice(seconds: float | None = BACKGROUND_SLICE) -> Iterator[None]:
    """Run the block with the calling thread on a long time slice, then restore it.

    What it is for: a kvtrio worker copies, hashes or waits on the disk for a long while,
    and on a machine with few cores the event loop's thread, woken by its timer or a
    socket, otherwise waits in the run queue until a worker's slice ends (1.4 ms and more
    here, several times over: the heartbeat lateness the tier benchmark measures). A
    thread with a longer slice than the one waking is preempted at once (EEVDF's
    PREEMPT_SHORT); its CPU share does not change. ``None`` does nothing.
    """
    if seconds is None:
        yield
        return
    before = thread_slice()
    changed = before is not None and set_thread_slice(seconds)
    try:
        yield
    finally:
        if changed and before is not None:
            set_thread_slice(before)
