"""Pre-fault memory before I/O fills it: MADV_POPULATE_WRITE, optionally huge pages.

CPU only (no MLX, no trio); called on worker threads. The first touch of fresh anonymous
memory costs a page fault per 4 KiB page. An O_DIRECT read into such memory pays it
inside the kernel's page pinning, one page at a time (about 0.6 GB/s on the development
VM, against 2 GB/s for the device). Advising the 2 MiB-aligned interior of the range
``MADV_HUGEPAGE`` and then populating it with ``MADV_POPULATE_WRITE`` (Linux >= 5.14)
faults it in 2 MiB at a time (about 7 GB/s there, when the host has those pages
backed) before the read.

On the development VM neither helped the cold load as measured (docs/benchmarks.md):
the reader uses this only when asked (``IoOptions.prefault_ahead``), and huge pages only
with ``huge=True`` (``IoOptions.prefault_huge``); ``IoOptions.prefault=False`` keeps the
reader from calling it at all.

Both advices leave the bytes as they are (populating a page that is already present
does nothing; a fresh one reads as zeros either way), so :func:`prefault` is safe on
any writable range, including pages shared with neighbouring allocations. Where the
kernel or the platform does not support them (EINVAL on kernels before 5.14, THP
disabled, not Linux), it does nothing, silently, and stops asking.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Sequence

import attrs
import numpy as np

__all__ = [
    "HUGE_PAGE",
    "MADV_HUGEPAGE",
    "MADV_POPULATE_WRITE",
    "PrefaultAhead",
    "PrefaultStats",
    "buffer_address",
    "prefault",
    "prefault_address",
    "statistics",
]

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
HUGE_PAGE = 2 * 1024 * 1024
_PAGE = 4096
# Ranges shorter than this are not worth two system calls.
_MIN_BYTES = 256 * 1024


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


# Huge pages are opt-in (``huge=True``): on a VM with free page reporting (virtio-balloon,
# Firecracker) freed 2 MiB blocks are handed back to the host, so a huge page is usually
# host-cold and populating it ran at 0.4 GB/s instead of 7 (measured).


@attrs.define
class _State:
    # What the kernel accepts (an advice refused with EINVAL is not asked again).
    hugepage: bool = _madvise is not None
    populate: bool = _madvise is not None
    calls: int = 0
    populated_bytes: int = 0
    failures: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)


_state = _State()


@attrs.frozen
class PrefaultStats:
    """What :func:`prefault` has done in this process."""

    hugepage_supported: bool
    populate_supported: bool
    calls: int
    populated_bytes: int
    failures: int


def statistics() -> PrefaultStats:
    """A snapshot of the process-wide counters (tests, benchmarks)."""
    s = _state
    return PrefaultStats(s.hugepage, s.populate, s.calls, s.populated_bytes, s.failures)


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of a C-contiguous buffer (0 when empty)."""
    if not view.nbytes:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _advise(address: int, length: int, advice: int) -> bool:
    assert _madvise is not None
    if _madvise(address, length, advice) == 0:
        return True
    err = ctypes.get_errno()
    with _state.lock:
        _state.failures += 1
        if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this kernel cannot; stop asking
            if advice == MADV_HUGEPAGE:
                _state.hugepage = False
            else:
                _state.populate = False
    return False


def prefault_address(address: int, length: int, *, huge: bool = False) -> int:
    """Advise and populate the whole pages inside ``[address, address + length)`` (its
    2 MiB-aligned interior advised ``MADV_HUGEPAGE`` first when ``huge``).

    Returns the bytes populated (0 where unsupported or refused). Never raises: a
    refusal leaves the range as it was, and the I/O that follows faults it in itself.
    """
    if _madvise is None or length < _MIN_BYTES or address <= 0:
        return 0
    start = -(-address // _PAGE) * _PAGE
    stop = (address + length) // _PAGE * _PAGE
    if stop <= start:
        return 0
    huge_start = -(-address // HUGE_PAGE) * HUGE_PAGE
    huge_stop = (address + length) // HUGE_PAGE * HUGE_PAGE
    if huge and _state.hugepage and huge_stop > huge_start:
        _advise(huge_start, huge_stop - huge_start, MADV_HUGEPAGE)
    done = 0
    if _state.populate and _advise(start, stop - start, MADV_POPULATE_WRITE):
        done = stop - start
    with _state.lock:
        _state.calls += 1
        _state.populated_bytes += done
    return done


def prefault(view: memoryview, *, huge: bool = False) -> int:
    """:func:`prefault_address` over a writable C-contiguous buffer; see there."""
    if view.readonly or not view.c_contiguous or view.nbytes < _MIN_BYTES:
        return 0
    return prefault_address(buffer_address(view), view.nbytes, huge=huge)


class PrefaultAhead:
    """Pre-fault ``views`` in order on one helper thread, ahead of the I/O that fills them.

    The caller calls :meth:`ready` (index ``k``) just before filling ``views[k]``: it
    returns once that range has been pre-faulted (or at once where pre-faulting is not
    supported), while the helper goes on with the next ranges, so page faults overlap
    with the device instead of preceding each read. :meth:`close` (or leaving the
    ``with`` block) stops the helper and waits for it: it never outlives the call that
    owns the buffers.
    """

    def __init__(self, views: Sequence[memoryview], *, huge: bool = False) -> None:
        self._views = [v for v in views]
        self._huge = huge
        self._done = [threading.Event() for _ in self._views]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if (
            _madvise is not None
            and _state.populate
            and any(v.nbytes >= _MIN_BYTES for v in self._views)
        ):
            self._thread = threading.Thread(target=self._run, name="kvtrio-prefault", daemon=True)
            self._thread.start()
        else:
            for event in self._done:
                event.set()

    def _run(self) -> None:
        try:
            for view, done in zip(self._views, self._done, strict=True):
                if self._stop.is_set():
                    break
                try:
                    prefault(view, huge=self._huge)
                finally:
                    done.set()
        finally:
            for event in self._done:  # never leave a waiter behind
                event.set()

    def ready(self, index: int) -> None:
        """Wait until ``views[index]`` is pre-faulted (or skipped)."""
        self._done[index].wait()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PrefaultAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
