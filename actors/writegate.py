"""WriteGate: write-behind that yields to a server's foreground work (its decoding).

A server that decodes on the thread that is also the tier's MLX owner pays every cold
write in owner jobs between its decode steps, and in worker threads hashing and writing
beside them; on a small machine, in CPU time too. An entry that RAM evicted does not have
to be written at once: the pending queue holds it (bounded by its byte cap) until the
server is idle. The gate is that wait.

Theory of operation:

1. The server says when it is busy (:meth:`WriteGate.set_busy`, on the tier's loop;
   ``TieredPromptCache.set_foreground``). While it is, the writer task does not *start* a
   write-back. A write already started runs on (its owner jobs still run between steps).
2. A write-back waits at most ``defer`` seconds (trio's clock, from when the writer first
   held it back), so a server that never idles still writes; it goes at once when the
   pending bytes reach half of their cap (the cap, which sheds the oldest, is then not
   approached by waiting), when the server is no longer busy, or once the cache is
   closing or flushing (:meth:`WriteGate.hurry`): nothing is held past a close.
3. Loads, removals and the recording of last uses are not held: only the start of a
   write.

The gate is pure state on the loop (no clock read but trio's, no I/O); the writer task
asks :meth:`WriteGate.holds` and waits in :meth:`WriteGate.wait_changed`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import trio

__all__ = ["DEFAULT_WRITE_DEFER", "WriteGate"]

#: Seconds a write-back waits for a busy server to go idle before it starts anyway.
DEFAULT_WRITE_DEFER = 2.0


@attrs.define(eq=False)
class WriteGate:
    """When the writer task may start a write-back (see the module doc)."""

    defer: float = DEFAULT_WRITE_DEFER
    busy: bool = False
    closing: bool = False
    _hurrying: int = 0
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def set_busy(self, busy: bool, *, defer: float | None = None) -> None:
        """Rule 1: the server is busy (decoding) or not; ``defer`` replaces the bound of
        rule 2 (seconds)."""
        if defer is not None:
            if not defer >= 0:
                raise ValueError(f"defer must be >= 0 seconds, got {defer!r}")
            self.defer = defer
        if busy != self.busy:
            self.busy = busy
            self.poke()

    def close(self) -> None:
        """Rule 2: the cache is closing; nothing waits any more."""
        self.closing = True
        self.poke()

    @contextmanager
    def hurry(self) -> Iterator[None]:
        """Rule 2: nothing waits while the block runs (a flush)."""
        self._hurrying += 1
        self.poke()
        try:
            yield
        finally:
            self._hurrying -= 1

    def poke(self) -> None:
        """Something the gate depends on changed (the pending bytes, too): wake the
        writer to ask again."""
        self._changed.set()
        self._changed = trio.Event()

    def holds(self, *, held_since: float, pressed: bool) -> bool:
        """Whether the writer waits before starting the write it holds since
        ``held_since`` (trio's clock); ``pressed``: the pending bytes are at half of
        their cap or more (rule 2)."""
        if not self.busy or self.closing or self._hurrying or pressed:
            return False
        return trio.current_time() < held_since + self.defer

    async def wait_changed(self, *, held_since: float) -> None:
        """Wait until the gate changes (:meth:`poke`) or the bound of rule 2 passes."""
        with trio.move_on_at(held_since + self.defer):
            await self._changed.wait()
