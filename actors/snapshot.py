"""Owned snapshots: lazy views of a conversation's caches, released exactly once.

A :class:`Snapshot` is what the owner's ``snapshot`` returns: the storage codec's
:class:`~kvtrio.storage.cacheio.CacheSnapshot` (the planned header, no placement yet, and
the lazy MLX views of every tensor slot in ``header.slots()`` order) and the byte count
the views pin. It is immutable (docs/design.md invariant 1: the views were made
by the owner at snapshot time, so later appends, trims or ``__setitem__`` on the live
cache cannot change them). Its owner must call :meth:`Snapshot.release` exactly once,
on every settle path (invariant 2); the :class:`SnapshotLedger` counts live snapshots so
tests and shutdown can require zero, and a second release raises.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs
from kvtrio.storage.cacheio import CacheSnapshot
from kvtrio.storage.format import Header

__all__ = ["Snapshot", "SnapshotLedger", "SnapshotLedgerStatistics"]


@attrs.frozen
class SnapshotLedgerStatistics:
    """Snapshots made, released, and still live (made minus released)."""

    created: int
    released: int
    live: int
    live_bytes: int


@attrs.define(eq=False)
class SnapshotLedger:
    """Counts snapshots so leaks and double releases are visible."""

    created: int = 0
    released: int = 0
    live_bytes: int = 0

    @property
    def live(self) -> int:
        return self.created - self.released

    def statistics(self) -> SnapshotLedgerStatistics:
        return SnapshotLedgerStatistics(self.created, self.released, self.live, self.live_bytes)


@attrs.define(eq=False)
class Snapshot:
    """A planned header and the lazy views its tensors come from (see the module doc)."""

    key: Hashable
    plan: Header
    _views: CacheSnapshot | None
    ledger: SnapshotLedger
    nbytes: int = attrs.field(init=False)
    _released: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self.nbytes = self.plan.nbytes
        self.ledger.created += 1
        self.ledger.live_bytes += self.nbytes

    @classmethod
    def own(cls, key: Hashable, snap: CacheSnapshot, ledger: SnapshotLedger) -> Snapshot:
        """Take ownership of the codec's snapshot ``snap``."""
        return cls(key, snap.header, snap, ledger)

    @property
    def views(self) -> CacheSnapshot:
        """The codec snapshot holding the lazy views (RuntimeError once released)."""
        if self._views is None:
            raise RuntimeError(f"snapshot {self.key!r} was released")
        return self._views

    @property
    def released(self) -> bool:
        return self._released

    def drop_views(self) -> None:
        """Drop the views now (call it on the owner thread, so the MLX memory they may hold
        last is freed there). The snapshot still counts as live until :meth:`release`."""
        self._views = None

    def release(self) -> None:
        """Drop the views. Exactly once: a second call raises RuntimeError."""
        if self._released:
            raise RuntimeError(f"snapshot {self.key!r} released twice")
        self._released = True
        self._views = None
        self.ledger.released += 1
        self.ledger.live_bytes -= self.nbytes
