"""The records of :class:`~kvtrio.actors.tier.ColdTier`: what a save settles to, what an
entry is, and the tier's statistics."""

from __future__ import annotations

from typing import Protocol

import attrs
from kvtrio.actors.reader import ReaderStatistics
from kvtrio.actors.snapshot import Snapshot, SnapshotLedgerStatistics
from kvtrio.actors.spill import SpillOutcome, SpillStatistics, SpillTicket
from kvtrio.actors.writer import WriterStatistics
from kvtrio.runtime.system import SystemStatistics
from kvtrio.storage.format import Header
from kvtrio.storage.writer import WriteResult

__all__ = [
    "Expectation",
    "SaveResult",
    "SaveTicket",
    "TierEntry",
    "ColdTierStatistics",
]


class Expectation(Protocol):
    """What a load must match, e.g. :class:`kvtrio.Expect`: raises CacheMismatchError.
    A tier's load calls ``check`` on the worker thread that read the header (plain CPU
    work: no trio call, no MLX call)."""

    def check(self, header: Header) -> None: ...


@attrs.frozen
class SaveResult:
    """How a save settled; ``write`` says what was published when it was WRITTEN."""

    outcome: SpillOutcome
    error: BaseException | None = None
    write: WriteResult | None = None

    @property
    def written(self) -> bool:
        return self.outcome is SpillOutcome.WRITTEN


@attrs.define(eq=False)
class SaveTicket:
    """A queued save. ``await ticket.wait()`` returns its :class:`SaveResult`."""

    key: str
    nbytes: int
    _ticket: SpillTicket[Snapshot]

    @property
    def outcome(self) -> SpillOutcome | None:
        """None until the save settles."""
        return self._ticket.outcome

    @property
    def settled(self) -> bool:
        return self._ticket.settled

    async def wait(self) -> SaveResult:
        result = await self._ticket.wait()
        write = result.value if isinstance(result.value, WriteResult) else None
        return SaveResult(result.outcome, result.error, write)


@attrs.frozen
class TierEntry:
    """One stored cache: its key, validated header, and size and time on disk."""

    key: str
    header: Header
    disk_bytes: int
    mtime: float

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.header.tokens

    @property
    def nbytes(self) -> int:
        """Tensor bytes (what a load brings into memory)."""
        return self.header.nbytes


@attrs.frozen
class ColdTierStatistics:
    """The tier's parts, each as its own statistics record."""

    spill: SpillStatistics
    writer: WriterStatistics
    reader: ReaderStatistics
    snapshots: SnapshotLedgerStatistics
    actors: SystemStatistics | None
    loads: int
    load_misses: int
    load_failures: int
    debris_removed: int
