"""What the disk was given and what it gave back: the tiered cache's wear account.

:class:`WearAccount` is told of every admission decision, write, read and removal of the
disk tier, in O(1) each; :class:`WearStatistics` is its snapshot (docs/metrics.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from kvtrio.actors.policy import AdmissionCandidate

__all__ = ["WearAccount", "WearStatistics"]


@attrs.frozen
class WearStatistics:
    """What the disk was given, and what it gave back.

    ``bytes_reused`` counts each written entry's bytes once, the first time it is read
    back; ``reuse_ratio`` is ``bytes_reused / bytes_written`` (0 before any write).
    """

    bytes_written: int
    bytes_read: int
    bytes_reused: int
    entries_written: int
    entries_read_back: int
    admitted: int
    refused: int
    bytes_refused: int

    @property
    def reuse_ratio(self) -> float:
        return self.bytes_reused / self.bytes_written if self.bytes_written else 0.0


@attrs.define
class WearAccount:
    """Counts disk writes, reads, and which written entries were ever read back.

    O(1) per event; it holds one integer per written entry not yet read back or removed.
    """

    _unread: dict[str, int] = attrs.field(init=False, factory=dict)
    _counts: dict[str, int] = attrs.field(init=False, factory=dict)

    def on_admission(self, candidate: AdmissionCandidate, admitted: bool) -> None:
        if admitted:
            self._add("admitted")
        else:
            self._add("refused")
            self._add("bytes_refused", candidate.nbytes)

    def on_written(self, key: str, nbytes: int) -> None:
        self._add("bytes_written", nbytes)
        self._add("entries_written")
        self._unread[key] = self._unread.get(key, 0) + nbytes

    def on_read(self, key: str, nbytes: int) -> None:
        self._add("bytes_read", nbytes)
        written = self._unread.pop(key, None)
        if written is not None:
            self._add("bytes_reused", written)
            self._add("entries_read_back")

    def on_removed(self, key: str) -> None:
        self._unread.pop(key, None)

    def statistics(self) -> WearStatistics:
        c = self._counts.get
        return WearStatistics(
            bytes_written=c("bytes_written", 0),
            bytes_read=c("bytes_read", 0),
            bytes_reused=c("bytes_reused", 0),
            entries_written=c("entries_written", 0),
            entries_read_back=c("entries_read_back", 0),
            admitted=c("admitted", 0),
            refused=c("refused", 0),
            bytes_refused=c("bytes_refused", 0),
        )

    def _add(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n
