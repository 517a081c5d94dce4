"""Python's cyclic collector while open builds the cold tier's tables and index.

A full collection traverses every tracked object while holding the GIL, and the
collector starts one each time the tracked objects have grown by a quarter: an open of
100,000 entries (three tracked objects each, docs/tiered.md) would run several, each
holding the event loop for 0.3-0.5 s on a loaded 2-core machine. So open pauses the
automatic collections while it builds (:func:`collector_paused`) and collects the young
generations itself between batches (:class:`YoungCollections`), a bounded cost each.
The full pass then comes at the collector's own moment after open (``kvtrio bench scale``
prints its length). Nothing stays changed: no ``gc.freeze``, no thresholds; the
embedding process's collector is left as it was found.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

__all__ = ["YoungCollections", "collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's automatic cyclic collections while open builds (the previous state
    restored after, whatever it was); :class:`YoungCollections` runs between batches."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@attrs.define
class YoungCollections:
    """Between open's batches, with automatic collections paused: a collection of the two
    young generations together after each batch, so each object a batch allocated is
    traversed once (with the batch's other objects: bounded work per call), then is old,
    and nothing piles up for one long pass after open."""

    batches: int = 0

    def after_batch(self) -> None:
        self.batches += 1
        gc.collect(1)
