"""What the tiered cache asks of its cold store (:class:`ColdStore`), what a shared one
adds (:class:`SharedColdStore`), and the records they exchange. The store over the
actors' ColdTier is :class:`~kvtrio.actors.coldstore.ColdTierStore`; the test fake
(tests/actors/fakes.py) implements the same protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, overload

import attrs
from kvtrio.actors.prefix import ModelKey, PackedTokens
from kvtrio.errors import CacheMismatchError
from kvtrio.storage.catalogue import CompactRow, ScannedRows, conversations_of
from kvtrio.storage.format import Header

__all__ = [
    "CONVERSATIONS_META",
    "SHARED_CANDIDATES",
    "ColdEntryInfo",
    "ColdStore",
    "FoundRows",
    "SameModel",
    "SharedColdStore",
    "StoreResult",
]

# At most this many names are fetched per index key (the chain hashes of a prefix that
# many entries share, a system prompt, name them all; any of them covers that prefix).
SHARED_CANDIDATES = 8

# Header meta key holding the JSON list of conversations an entry is the checkpoint of, so
# supersession keeps working after a restart.
CONVERSATIONS_META = "kvtrio.conversations"


@attrs.frozen
class ColdEntryInfo:
    """What the cold tier knows of one stored entry (from its header and file)."""

    key: str
    model: ModelKey
    tokens: tuple[int, ...] | PackedTokens  # packed: as the catalogue stores them
    trimmable: bool
    min_reusable_offset: int
    mtime: float
    conversations: tuple[str, ...] = ()  # whose checkpoint it is (see CONVERSATIONS_META)
    pinned: bool = False  # recorded by ColdStore.pin (survives a restart)
    # Its rank in token order among the entries listed with it (None: not known), so the
    # index can be filled in that order without sorting (kvtrio.actors.prefix).
    order: int | None = None


@attrs.frozen
class FoundRows(Sequence[ColdEntryInfo]):
    """A batch of entries as a local store's catalogue scan yields them
    (:class:`~kvtrio.storage.catalogue.ScannedRows`: sqlite's own
    :data:`~kvtrio.storage.catalogue.CompactRow` tuples, every field checked in bulk,
    and the table of their ranks in token order), least recently used first. A sequence
    of :class:`ColdEntryInfo` to any reader (made on access, one at a time); the tiered
    cache's open reads :attr:`scanned` as it is, making no info object per entry.

    ``keys``: the store's own key strs, in the order of its table of entries, shared by
    every batch of one scan, or None. Where the store used its catalogue as it was, that
    is the scan's order: the cache takes a row's key from there when it is equal (the
    store's str, with no probe of a table of every key; any other row's key is looked up
    as ever)."""

    scanned: ScannedRows
    keys: Iterator[str] | None = None

    def __len__(self) -> int:
        return len(self.scanned)

    @overload
    def __getitem__(self, index: int) -> ColdEntryInfo: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ColdEntryInfo]: ...
    def __getitem__(self, index: int | slice) -> ColdEntryInfo | Sequence[ColdEntryInfo]:
        scanned = self.scanned
        if isinstance(index, slice):
            return FoundRows(ScannedRows(scanned.rows[index], scanned.ranks))
        return found_info(scanned.rows[index], scanned.rank(scanned.rows[index]))


def found_info(row: CompactRow, rank: int) -> ColdEntryInfo:
    """One scanned row as a :class:`ColdEntryInfo` (``rank``: its rank in token order)."""
    key, model_id, fingerprint, tokens, trimmable, min_offset, _, used, pinned, _ = row
    return ColdEntryInfo(
        key,
        ModelKey(model_id, fingerprint),
        PackedTokens(tokens),
        bool(trimmable),
        min_offset,
        used,
        conversations_of(row),
        bool(pinned),
        rank,
    )


@attrs.frozen
class StoreResult:
    """A cold write that settled: durable (``written``) or not (dropped or superseded)."""

    written: bool
    disk_bytes: int = 0  # net change of the bytes on disk (a rewrite frees the old file)
    bytes_written: int = 0
    bytes_deduplicated: int = 0
    no_space: bool = False  # not written: the volume was full (ENOSPC); evict and retry
    # Not written, why: "dropped" (the tier's queue shed it), "cancelled" (superseded,
    # cut by the shutdown grace, aborted), "failed" (the write raised), "refused" (the
    # tier's ``save`` raised: closing, or the input refused), "error" (an OSError).
    unwritten: str | None = None


class ColdStore(Protocol):
    """The cold tier as the tiered cache uses it (an adapter over the actors' ColdTier)."""

    @property
    def directory(self) -> Path | None:
        """The volume the store writes to (its free space bounds the cold budget); None
        for a store with no local volume (Redis)."""
        ...

    def shared_lookups(self) -> SharedColdStore | None:
        """Declared, not probed: the store's :class:`SharedColdStore` side when other
        hosts write to it too (rule 8), else None."""
        ...

    async def store(
        self,
        key: str,
        model: ModelKey,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        meta: Mapping[str, str],
    ) -> StoreResult:
        """Write ``caches`` under ``key``; return once it is durable or settled otherwise."""
        ...

    def write_plan(
        self, model: ModelKey, tokens: Sequence[int], caches: list[Any], meta: Mapping[str, str]
    ) -> object:
        """Owner thread: the plan of what :meth:`store` of these arguments would write (from
        the caches' shapes and dtypes; no bytes moved), for :meth:`plan_size`."""
        ...

    def plan_size(self, plan: object) -> int:
        """Any thread (no MLX call): the bytes the write of ``plan`` (:meth:`write_plan`)
        would put on disk, none shared with what is there (the write's reservation: rule 2
        of the tiered cache's cold side)."""
        ...

    async def fetch(
        self, key: str, *, model: ModelKey, tokens: Sequence[int] | None = None
    ) -> tuple[list[Any], int]:
        """Restored caches (on the owner) and the bytes read; CacheMissError or
        CorruptCacheError when the entry is gone or bad, CacheMismatchError when what
        was read under ``key`` is not ``model``'s, or (given) does not hold ``tokens``."""
        ...

    async def remove(self, key: str) -> int:
        """Delete the entry (absent: nothing); return the disk bytes freed."""
        ...

    async def usage(self) -> int:
        """Bytes the cold tier occupies on disk now."""
        ...

    def entry_bytes(self, key: str) -> int | None:
        """Any thread, no I/O: the tensor bytes (what a load brings into memory) of the
        stored entry ``key`` as the store counts them (after a restart, the catalogue's
        block sizes), or None when it does not know them."""
        ...

    def entries(self) -> AsyncGenerator[Sequence[ColdEntryInfo], None]:
        """Every valid entry on disk, in batches, least recently used first; ``mtime`` is
        its last use (the cold LRU's order)."""
        ...

    async def touch(self, last_use: Mapping[str, float]) -> None:
        """Record when entries were last used (seconds since the epoch), so the cold LRU's
        order survives a restart; keys the store does not hold are ignored."""
        ...

    async def pin(self, pins: Mapping[str, bool]) -> None:
        """Record that entries are pinned (True) or not (False), so :meth:`entries` says
        so after a restart (``ColdEntryInfo.pinned``); keys the store does not hold are
        ignored, and removing an entry unpins it."""
        ...


class SharedColdStore(Protocol):
    """A cold store other hosts write to as well, with a prefix index (rule 8)."""

    async def find(self, model: ModelKey, tokens: Sequence[int]) -> list[tuple[str, int]]:
        """Keys of stored entries registered under the query's prefix-index keys, deepest
        first, each with a bound on the tokens of ``tokens`` it can cover (one round
        trip). StoreUnavailableError when the store is out of reach."""
        ...

    async def entry(self, key: str) -> ColdEntryInfo | None:
        """What the store holds under ``key`` (its manifest alone), None when gone."""
        ...

    async def forget(self, key: str, model: ModelKey, tokens: Sequence[int]) -> None:
        """Drop ``key`` from the index keys of ``tokens`` if its manifest is gone (a stale
        registration found by :meth:`find`), so no host reads it again."""
        ...


@attrs.frozen
class SameModel:
    """A load expectation (:class:`~kvtrio.actors.tierrecords.Expectation`): the header
    names this model id and config fingerprint, and (when ``tokens`` is given) holds
    exactly those tokens."""

    model: ModelKey
    tokens: tuple[int, ...] | None = None

    def check(self, header: Header) -> None:
        found = ModelKey(header.model_id or "", header.config_fingerprint or "")
        if found != self.model:
            raise CacheMismatchError(f"cache is for {found}, not {self.model}")
        if self.tokens is not None and header.tokens != self.tokens:
            raise CacheMismatchError(
                f"tokens: the entry read holds {len(header.tokens)} other tokens than the "
                f"{len(self.tokens)} its key names"
            )
