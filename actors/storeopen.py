"""A local cold store's open (:meth:`kvtrio.actors.coldstore.ColdTierStore.create`): its
tables from the catalogue's block lists, reconciled with the manifests on disk, the
catalogue rebuilt from the manifests where it must be (module docstring of
:mod:`kvtrio.storage.catalogue`, rule 2), and the blocks that exist.

All of it runs on one worker thread while the event loop waits (nothing else touches the
new store yet). That worker gives the loop a turn at least every
:data:`~kvtrio.actors.loopturns.TURN_PERIOD_S` while it reads manifests, writes their rows
and lists blocks (:class:`~kvtrio.actors.loopturns.LoopTurns`): each step there is Python
work between system calls, whose brief releases of the GIL would otherwise keep the loop
waiting for it (docs/design.md invariant 16). A clean open takes none: reading the
catalogue's rows leaves the GIL free most of the time (sqlite runs without it) or holds
it in C calls that the GIL's own switch interval interrupts, and a turn is a round trip
through the loop that the open would wait for.

Costs (N entries, B blocks): the catalogue's block lists (O(N + references)) or, when it
must be rebuilt, every manifest once (O(N) reads), and one listing of the block directory
(O(B)) when the catalogue was not closed cleanly.
"""

from __future__ import annotations

import collections
import itertools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator

import attrs
from kvtrio.actors.coldrecords import (
    DIGESTS,
    FILE_BYTES,
    digests,
    file_bytes,
    header_row,
    manifest_bytes,
    record_of,
)
from kvtrio.actors.collector import YoungCollections
from kvtrio.actors.loopturns import LoopTurns
from kvtrio.actors.tier import ColdTier
from kvtrio.errors import CacheMissError, CorruptCacheError, NewerFormatError
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.catalogue import SCAN_BATCH, Catalogue, CatalogueRow

__all__ = ["CatalogueOpen", "OpenReport"]

_log = logging.getLogger("kvtrio.coldstore")


@attrs.define
class OpenReport:
    """What opening a local tier's catalogue found (logged; counted in tests and benches)."""

    rebuilt: bool = False  # missing, truncated, corrupt or another schema: rebuilt whole
    dropped: int = 0  # rows whose manifest was gone
    parsed: int = 0  # manifests the catalogue lacked, read and added
    orphans_swept: int = 0  # blocks no manifest names (after an unclean close)
    newer_format: int = 0  # manifests of a newer kvtrio's format: kept, and no block swept
    clean: bool = False  # the catalogue was used as it was
    loop_turns: int = 0  # turns the open's worker gave the event loop (LoopTurns)


@attrs.define(eq=False)
class CatalogueOpen:
    """One open of a local store's catalogue, run by :meth:`run` on a worker thread. It
    fills the store's tables it is given (``refs``: reference count per block name;
    ``entry_blocks``: per entry, its record, :func:`~kvtrio.actors.coldrecords.entry_record`)
    and says what it found in ``report``."""

    tier: ColdTier
    blocks: LocalBlockStore
    pinned_keys: Callable[[Iterable[str]], set[str]]  # the store's (pins as recorded)
    refs: dict[str, int]
    entry_blocks: dict[str, bytes]
    turns: LoopTurns
    report: OpenReport = attrs.field(factory=OpenReport)

    def run(self) -> tuple[Catalogue, dict[str, int], int]:
        """Worker thread: the catalogue, the size of every block that exists, and the
        bytes on disk (manifests and blocks). The entries themselves are read later, in
        batches (:meth:`ColdTierStore.entries`)."""
        root = str(self.tier.root)
        report, turns = self.report, self.turns
        try:
            catalogue = Catalogue.open(root)
        except CorruptCacheError as exc:
            _log.warning("cold tier %s: catalogue unusable, rebuilt (%s)", root, exc)
            report.rebuilt = True
            Catalogue.remove(root)
            catalogue = Catalogue.open(root)
        keys = self.tier.list_keys()
        blocks: dict[str, int] = {}
        young = YoungCollections()  # the collector is paused by create (bounded passes)
        # Reference counts by digest. Each batch of rows is taken in whole by C loops (its
        # columns split by zip, the tables updated from them, its block lists joined, split
        # into digests and counted by a Counter): no Python step per row. Hex names only
        # once per distinct block, at the end.
        counts: collections.Counter[tuple[bytes]] = collections.Counter()
        entry_blocks = self.entry_blocks
        manifests = 0  # bytes of the manifests of the rows in entry_blocks
        try:
            for batch in catalogue.block_lists():
                keys_, sizes, lists = zip(*batch, strict=True)
                # Interned: the cache's open interns the scan's keys (_enter_rows), so
                # the store's tables and the cache's share one str per entry.
                names = map(sys.intern, keys_)
                # Each record (entry_record) made by C calls alone: no Python step per row.
                records = map(bytes.__add__, map(FILE_BYTES.pack, sizes), lists)
                entry_blocks.update(zip(names, records, strict=True))
                manifests += sum(sizes)
                counts.update(DIGESTS.iter_unpack(b"".join(lists)))
                young.after_batch()
            blocks = catalogue.block_sizes()
        except CorruptCacheError as exc:
            _log.warning("cold tier %s: catalogue rows unreadable, rebuilt (%s)", root, exc)
            report.rebuilt = True
            counts.clear()
            entry_blocks.clear()
            manifests = 0
        # Every catalogued key is in entry_blocks now. Differences by Python loops, not set
        # operators: one C call over 100,000 names would hold the GIL (and so the event
        # loop) for milliseconds in one piece.
        gone = [key for key in entry_blocks if key not in keys]  # rows whose manifest is gone
        report.dropped = len(gone)
        for key in gone:  # not entries of this store: their references go
            dropped = entry_blocks.pop(key)
            manifests -= file_bytes(dropped)
            counts.subtract(DIGESTS.iter_unpack(digests(dropped)))
        refs = self.refs
        for (digest,), count in counts.items():
            if count > 0:
                name = digest.hex()
                refs[name] = refs.get(name, 0) + count
        # Manifests the catalogue lacks (all of them after a rebuild): read a batch at a time
        # as the catalogue writes their rows, each batch freed once written (_rows_of).
        # Every key left in entry_blocks is listed: as many as the listing, none lacks
        # (no second pass over N names, each a probe of a table of every key).
        lacking = []
        if len(keys) != len(entry_blocks):
            lacking = [key for key in keys if key not in entry_blocks]
        rows = self._rows_of(lacking, young)
        first = next(rows, None)
        report.clean = catalogue.was_clean and not (report.rebuilt or gone or first)
        if not report.clean:
            fresh = rows if first is None else itertools.chain((first,), rows)
            # After a crash, a rebuild or a change behind its back, what exists is what the
            # block directory holds now (listed once every row is noted); blocks no
            # manifest names (debris) go.
            if report.rebuilt:
                blocks = catalogue.replace_all(fresh, self._present_blocks)
            else:
                blocks = catalogue.reconcile(gone, fresh, self._present_blocks)
            # The rows' pins may be stale or lost with the catalogue: the record is the truth.
            catalogue.replace_pins(self.pinned_keys(keys))
            manifests = manifest_bytes(entry_blocks.values())  # rows were added: recount
        catalogue.order_by_last_use()  # its rule 4: then the scan reads rows with no sort
        young.after_batch()  # the last batch's objects too, before the loop resumes them
        report.loop_turns = turns.turns
        return catalogue, blocks, manifests + sum(blocks.values())

    def _rows_of(self, keys: list[str], young: YoungCollections) -> Iterator[CatalogueRow]:
        """The catalogue rows of the manifests of ``keys`` (bad or unreadable ones
        skipped), counted in the store's tables, :data:`SCAN_BATCH` manifests at a time:
        a batch is read (one run of file reads and parses), yielded to the catalogue's
        insert, freed, and then the young generations are collected, as the block lists'
        batches are. So a rebuild of N manifests holds one batch of rows, and leaves
        neither N rows to free nor a pile of young objects for one pass of the collector
        on the event loop (docs/design.md invariant 16). The loop gets a turn whenever
        one is due, between two manifests read and between two rows written."""
        turns = self.turns
        for start in range(0, len(keys), SCAN_BATCH):
            batch = []
            for key in keys[start : start + SCAN_BATCH]:
                row = self._manifest_row(key)
                if row is not None:
                    batch.append(row)
                turns.offer()
            self.report.parsed += len(batch)
            for row in batch:
                self._note_row(row)
            for row in batch:
                yield row
                turns.offer()
            del batch, row  # written: freed before the collection, so none is kept as old
            young.after_batch()

    def _manifest_row(self, key: str) -> CatalogueRow | None:
        try:
            # Stat before reading: a manifest rewritten after the stat has another mtime
            # than the row records, so ``kvtrio gc`` never trusts the row for it.
            mtime_ns = self.tier.file_ops.stat(str(self.tier.path_of(key))).st_mtime_ns
            entry = self.tier.entry_blocking(key)
        except NewerFormatError:
            # A newer kvtrio's entry: not indexed, and kept, with every block it may name
            # (this open cannot read which: _present_blocks then sweeps nothing).
            self.report.newer_format += 1
            return None
        except (CorruptCacheError, CacheMissError, FileNotFoundError):
            return None  # bad, or not a regular file reached without a link (issue 15)
        except OSError as exc:  # unreadable: not an entry, and no reason to fail the open
            _log.warning("cold tier: %s unreadable, ignored (%s)", key, exc)
            return None
        row = header_row(key, entry.header, entry.disk_bytes, entry.mtime)
        return attrs.evolve(row, manifest_mtime_ns=mtime_ns)

    def _note_row(self, row: CatalogueRow) -> None:
        names = tuple(sys.intern(name) for name, _ in row.blocks)  # one str per block
        refs = self.refs
        for name in names:
            refs[name] = refs.get(name, 0) + 1
        key = sys.intern(row.key)  # the str the cache's open gets too (_enter_rows)
        self.entry_blocks[key] = record_of(row.file_bytes, names)

    def _present_blocks(self) -> dict[str, int]:
        """The size of each stored block a manifest names; the others (debris) deleted,
        unless a newer kvtrio's manifest was found (it may name any of them: none is).
        One pass over the listing, no object kept per block."""
        named, turns = self.refs, self.turns
        present: dict[str, int] = {}
        orphans = []
        for block in self.blocks.iter_blocks():
            if block.name in named:
                present[block.name] = block.size
            else:
                orphans.append(block.name)
            turns.offer()
        if self.report.newer_format:
            _log.warning(
                "cold tier %s: %d entries of a newer kvtrio's format kept; no block swept",
                self.tier.root, self.report.newer_format,
            )  # fmt: skip
        elif orphans:
            self.blocks.delete_many(orphans)
            self.report.orphans_swept = len(orphans)
        return present
