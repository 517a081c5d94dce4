"""When each save ran: ``kvtrio serve --save-trace FILE``'s record, one JSON line per entry.

What a save costs the other streams of a server is read from their token arrivals while
the save is in progress. The server knows when that is; a client does not. With
``--save-trace FILE`` the adapter appends, for each entry it hands to the cold tier, one
line once the tier's writes have settled after it::

    {"start": 812.0312, "end": 814.1577, "tokens": 4127,
     "write_start": 814.0311, "write_end": 814.1498}

``start`` is when RAM's eviction handed the entry over (on the generation thread),
``end`` when every cold write queued or started by then had settled (written, shed or
failed): an upper bound of the entry's own write, the deferral of a write-back while
requests decode included. ``write_start`` and ``write_end`` bound the entry's own store
(its snapshot's owner jobs, hashing and file writes; the tier's
``TieredPromptCache.on_written``), null when it was not written (admission refused it,
the byte cap shed it, the write failed, or it was on disk already). All are
:func:`time.perf_counter` readings, which on Linux
and macOS read a clock every process shares (``CLOCK_MONOTONIC``; ``mach_absolute_time``),
so a client's arrival times can be set against them. ``kvtrio bench serve``'s spill
phase reads them with :func:`read_save_trace`, and its naive baseline writes the same
lines around its synchronous ``save_prompt_cache``.

Costs: nothing without the flag; with it, one wait for the writes to settle per spill
(on the tier's loop) and one small append on a worker thread.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import attrs

__all__ = ["SaveSpan", "SaveTrace", "read_save_trace"]


@attrs.frozen
class SaveSpan:
    """One save: handed over at ``start``, settled at ``end``, its own store from
    ``write_start`` to ``write_end`` if it was written (perf_counter seconds)."""

    start: float
    end: float
    tokens: int
    write_start: float | None = None
    write_end: float | None = None

    def overlaps(self, lo: float, hi: float) -> bool:
        """Whether the closed interval [lo, hi] meets this span."""
        return lo <= self.end and self.start <= hi

    def write_overlaps(self, lo: float, hi: float) -> bool:
        """Whether [lo, hi] meets the entry's own store (never when it was not written)."""
        if self.write_start is None or self.write_end is None:
            return False
        return lo <= self.write_end and self.write_start <= hi


@attrs.frozen
class SaveTrace:
    """Appends :class:`SaveSpan` lines to ``path`` (from any one thread at a time)."""

    path: Path
    #: Stores that landed, by entry key (:meth:`note_written`, on the tier's loop).
    written: dict[str, tuple[float, float]] = attrs.field(factory=dict, eq=False)

    @classmethod
    def at(cls, path: str | os.PathLike[str] | None) -> SaveTrace | None:
        """The trace at ``path``, or None without one; OSError if it cannot be appended to."""
        if path is None:
            return None
        trace = cls(Path(path))
        _append(trace.path, b"")  # fail at start, not at the first save
        return trace

    def note_written(self, key: str, start: float, end: float) -> None:
        """The tier's ``on_written``: entry ``key``'s store ran from ``start`` to ``end``."""
        self.written[key] = (start, end)

    def record(
        self, start: float, end: float, tokens: int, written: tuple[float, float] | None = None
    ) -> None:
        write_start, write_end = written or (None, None)
        line = json.dumps(
            {
                "start": start,
                "end": end,
                "tokens": tokens,
                "write_start": write_start,
                "write_end": write_end,
            }
        )
        _append(self.path, (line + "\n").encode())


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` to the regular file ``path`` (created if missing). A FIFO, a
    device or a directory there is an OSError, at once: never a wait for a reader."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.write(fd, data)
    finally:
        os.close(fd)


def read_save_trace(path: Path) -> list[SaveSpan]:
    """The spans in ``path`` (none if it does not exist). A line that is not a complete
    span (a writer cut mid-line) is skipped; a span ending before it starts is refused
    with ValueError."""
    if not path.exists():
        return []
    spans: list[SaveSpan] = []
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
            written = [item.get("write_start"), item.get("write_end")]
            start, end = float(item["start"]), float(item["end"])
            span = SaveSpan(
                start,
                end,
                int(item["tokens"]),
                *(None if w is None else float(w) for w in written),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if span.end < span.start or (
            span.write_start is not None
            and (span.write_end is None or span.write_end < span.write_start)
        ):
            raise ValueError(f"{path}: a save span ends before it starts: {line!r}")
        spans.append(span)
    return spans
