"""Warm restart: after a start, load the most recently used disk entries back into RAM
while the server is idle, so a conversation's next turn after a restart is a RAM hit.

Theory of operation:

1. Once the cold tier is open (``kvtrio serve`` opens it after the model, rule 6 of
   :mod:`kvtrio.serve.server`), :class:`Restore` asks the tier once for its model's
   entries on disk, most recently used first (the catalogue keeps the order across
   restarts: :meth:`TieredPromptCache.recent_entries`), as many as fit in
   ``--restore-bytes``, RAM's byte budget and its entry count (``--prompt-cache-size``).
2. Only while idle: one entry at a time, each started by :meth:`Restore.step` on the
   generation thread (the MLX owner) after it checks that no request is in flight,
   queued, or set aside (``idle()``). A request arriving meanwhile finds at most the one
   load already running; one for that same entry joins it (the adapter's rule 7: one
   read per entry, the request released by the load's admission); the restore goes
   on at the next idle moment, and the entries RAM has by then are skipped (the adapter's
   prefetch loads only what serves better than RAM).
3. The load is the adapter's :meth:`~kvtrio.serve.adapter.TieredLRUPromptCache.prefetch`
   (``restore=True``, its rule 10): no second load path; integrity checks as for any
   disk hit. It stops at the first entry that would push RAM past its budget: it never
   evicts anything to make room.
4. When it ends it prints ``kvtrio serve: restored K entries (B bytes) to RAM in S s``;
   ``kvtrio_serve_restored_total`` and ``kvtrio_serve_restored_bytes_total`` count it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from kvtrio.serve.adapter import TieredLRUPromptCache

__all__ = ["DEFAULT_RESTORE_BYTES", "Restore"]

logger = logging.getLogger(__name__)

#: ``--restore-bytes``'s default (further bounded by ``--hot-bytes`` and the entry count):
#: a start reads at most 1 GiB back (about a second of an SSD's reads, only while idle),
#: and RAM holds no more than that of entries nobody may ask for again.
DEFAULT_RESTORE_BYTES = 1 << 30


@attrs.define(eq=False)
class Restore:
    """The warm restart of one server's start (generation thread only)."""

    adapter: TieredLRUPromptCache
    cap: int  # --restore-bytes
    idle: Callable[[], bool]  # no request in flight, queued or set aside (rule 2)
    done: bool = False
    loading: bool = False
    restored: int = 0
    restored_bytes: int = 0
    _todo: list[tuple[tuple[int, ...], int]] | None = None
    _started: float = 0.0
    _listed_bytes: int = 0  # the restored entries' bytes on disk (rule 3's estimate)
    _loading_bytes: int = 0

    @classmethod
    def of(cls, adapter: TieredLRUPromptCache, cli_args: Any, idle: Callable[[], bool]) -> Restore:
        cap = getattr(cli_args, "restore_bytes", DEFAULT_RESTORE_BYTES)
        return cls(adapter, DEFAULT_RESTORE_BYTES if cap is None else cap, idle, done=cap == 0)

    def step(self) -> bool:
        """Start the next entry's load when idle and none is running (rule 2); whether one
        started. Cheap once done."""
        if self.done or self.loading or not self.idle():
            return False
        adapter = self.adapter
        tier = adapter.tier
        if tier is None or not tier.alive or tier.cache is None:
            if tier is not None and not tier.alive and self._todo is not None:
                self._finish()  # closed under it
            return False  # not open yet (rule 1)
        if self._todo is None:
            self._started = time.monotonic()
            try:
                self._todo = tier.peek(tier.cache.recent_entries, self.cap, adapter.max_size)
            except Exception:  # best effort: a tier out of reach restores nothing
                logger.exception("kvtrio serve: the warm restart could not list the entries")
                self._todo = []
            self._todo.reverse()  # taken from the end: newest first
        while self._todo:
            tokens, nbytes = self._todo.pop()
            if not self._fits(nbytes):
                break
            if adapter.prefetch(adapter.tier_model, list(tokens), self._loaded, restore=True):
                self.loading = True
                self._loading_bytes = nbytes
                return True
        self._finish()
        return False

    def _fits(self, stored: int) -> bool:
        """Rule 3: within the cap, RAM's byte budget and its entry count. ``stored`` is
        the entry's bytes on disk; its bytes in RAM are estimated from the loads so far
        (RAM bytes per stored byte: an entry may take more room in RAM than on disk)."""
        adapter = self.adapter
        nbytes = stored
        if self._listed_bytes:
            nbytes = stored * self.restored_bytes // self._listed_bytes
        return (
            self.restored_bytes + nbytes <= self.cap
            and adapter.nbytes + nbytes <= adapter.max_bytes
            and len(adapter) < adapter.max_size
        )

    def _loaded(self, loaded: bool) -> None:
        """The adapter's ``on_done``: in a pump on the generation thread; the next load
        starts here when still idle."""
        self.loading = False
        stats = self.adapter.statistics()
        self.restored, self.restored_bytes = stats.restored, stats.restored_bytes
        if loaded:
            self._listed_bytes += self._loading_bytes
        self.step()

    def _finish(self) -> None:
        self.done = True
        self._todo = []
        seconds = time.monotonic() - self._started
        print(
            f"kvtrio serve: restored {self.restored} entries ({self.restored_bytes} bytes) "
            f"to RAM in {seconds:.2f} s",
            flush=True,
        )
