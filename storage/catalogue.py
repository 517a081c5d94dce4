"""The cold tier's catalogue: what the index and the ledger need of every entry, in one
file, so that opening a directory of N entries reads one file instead of N manifests.

Why sqlite3 in WAL mode (and not an append-only journal): it is in the standard
library, a transaction is atomic across a crash without a format of ours to get right
(checksums, torn tails, compaction), WAL lets a write commit without rewriting the
file, and ``synchronous=NORMAL`` costs no fsync per commit (a crash may lose the last
commits, which the rules below repair from the manifests). Everything here is blocking
and CPU/disk only: callers run it on worker threads.

Rules:

1. The manifests stay the source of truth; the catalogue is a cache of them. It is
   written only by the directory's owner (the tier's lock, :mod:`kvtrio.storage.dirlock`),
   row by row as manifests are published and deleted.
2. ``clean`` is set when the owner closes it and cleared when it opens it. An open that
   finds it clean, with the same manifest names as the directory listing, trusts the
   rows; otherwise (a crash, a manifest added or removed behind its back, a missing,
   truncated or corrupt file, another schema version) the caller rebuilds it from the
   manifests (:meth:`Catalogue.replace_all`) and counts that; so is a catalogue of an
   older schema (before 4 tokens were little-endian, not sortable: the pins come back
   from the manifest store's record).
3. Per entry: key, model id and fingerprint, tokens (u32 big-endian, so that sqlite's
   BLOB order, memcmp, is the order of the token lists: the index's sorted runs are
   filled in that order without a sort on the event loop), trimmability,
   minimum reusable offset, conversations, manifest bytes, last use (seconds since the
   epoch: the cold LRU's order survives a restart), whether it is pinned (a copy of the
   manifest store's pins, :meth:`ManifestStore.pinned_names`, read instead of them when
   the catalogue is clean), its blocks with their sizes, and its manifest's mtime (ns,
   from a stat taken before the manifest was read: ``kvtrio gc`` trusts a row only for a
   manifest of the same size and mtime, so a manifest rewritten since is read).
   Per block that exists: its size. Reference counts are derived from the entries'
   block lists when loaded (so they cannot drift from them).
4. Where meta's ``ordered`` mark is set, the rows' rowid order is their last-use order
   (``last_use, key``), so the scan reads the table as it lies, with no sort at open: a
   last use moves its row to the end (:meth:`Catalogue.touch` gives it the next rowid,
   as an upsert does), and a write that would put a row out of that order (a last use
   older than the newest row's: a clock set back, a rebuild's or reconcile's rows with
   their manifests' mtimes) clears the mark in the same transaction. The owner's open
   then puts the rows back in order inside sqlite (:meth:`Catalogue.order_by_last_use`:
   O(N log N), the GIL released) and sets it again; until then the scan sorts.

Costs: :meth:`Catalogue.rows`, :meth:`Catalogue.block_lists` and :meth:`Catalogue.scan`
are one query each, O(N + references), any sorting done inside sqlite (which releases
the GIL; the token order is read from the ``entries_by_tokens`` index, the last-use order
is the rowid order: rule 4, so a clean open's scan sorts nothing), the rows fetched
:data:`SCAN_BATCH` at a time as compact tuples, as sqlite returns them: the last two
check every row's fields first in one more query (:meth:`Catalogue.check`, also inside
sqlite), so no row is checked in Python; an upsert or delete is O(blocks of the entry +
log N, the index's); :meth:`touch` is O(keys touched x log N) (each row moved to the end).

Keeps docs/design.md invariant 15.
"""

from __future__ import annotations

import array
import itertools
import json
import operator
import os
import sqlite3
import stat
import sys
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from kvtrio.errors import CorruptCacheError

__all__ = [
    "CATALOGUE_NAME",
    "SCAN_BATCH",
    "Catalogue",
    "CatalogueRow",
    "CompactRow",
    "ScannedRows",
    "conversations_of",
    "pack_tokens",
    "unpack_tokens",
]

CATALOGUE_NAME = ".kvtrio-catalogue.sqlite3"
# 3: a pinned column; 4: tokens big-endian (sortable); 5: manifest mtimes; 6: rowid order is
# last-use order where meta says so (rule 4: an older writer updates last uses in place)
SCHEMA_VERSION = 6
# Versions opened by a migration in place (2 and 3 store tokens little-endian: rebuilt). A
# version-4 row gets mtime 0, which no manifest has: ``kvtrio gc`` reads its manifest. A
# version 4 or 5 catalogue has no ``ordered`` mark: its rows are put in order at the next
# owner's open (:meth:`Catalogue.order_by_last_use`).
_MTIME_COLUMN = "ALTER TABLE entries ADD COLUMN manifest_mtime_ns INTEGER NOT NULL DEFAULT 0"
_MIGRATABLE: dict[str, tuple[str, ...]] = {"4": (_MTIME_COLUMN,), "5": ()}
_DIGEST = 32
# Rows fetched per step of a scan (bounded work per worker-thread call).
SCAN_BATCH = 1024
assert array.array("I").itemsize == 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    model_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    tokens BLOB NOT NULL,
    trimmable INTEGER NOT NULL,
    min_offset INTEGER NOT NULL,
    conversations TEXT NOT NULL,
    file_bytes INTEGER NOT NULL,
    last_use REAL NOT NULL,
    block_names BLOB NOT NULL,
    block_sizes BLOB NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    manifest_mtime_ns INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS blocks (name BLOB PRIMARY KEY, size INTEGER NOT NULL);
"""
# The entries in token order (Catalogue.scan's ranks): a walk of this index, no sort.
_TOKEN_INDEX = "CREATE INDEX IF NOT EXISTS entries_by_tokens ON entries (tokens, key)"


def _packed(typecode: str, values: Sequence[int], big_endian: bool) -> bytes:
    packed = array.array(typecode, values)
    if (sys.byteorder == "big") != big_endian:
        packed.byteswap()
    return packed.tobytes()


def _unpacked(typecode: str, data: bytes, big_endian: bool) -> array.array[int] | None:
    """The values :func:`_packed` packed, or None when ``data`` is not whole values."""
    packed = array.array(typecode)
    if len(data) % packed.itemsize:
        return None
    packed.frombytes(data)
    if (sys.byteorder == "big") != big_endian:
        packed.byteswap()
    return packed


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as u32 big-endian: memcmp order is the order of the token tuples."""
    return _packed("I", tokens, big_endian=True)


def unpack_tokens(data: bytes) -> array.array[int]:
    """The tokens :func:`pack_tokens` packed (an array: the caller makes its tuple)."""
    packed = _unpacked("I", data, big_endian=True)
    if packed is None:
        raise CorruptCacheError("catalogue: tokens are not whole u32 values")
    return packed


CompactRow = tuple[str, str, str, bytes, int, int, str, float, int, int]
"""One entry as a scan yields it, the tuple sqlite returns: key, model id, fingerprint,
tokens (as stored: u32 big-endian, :func:`pack_tokens`), trimmable (0 or not), minimum
reusable offset (within the tokens), conversations (a JSON list of strings:
:func:`conversations_of`), last use, pinned (0 or not), and its rowid (its rank in token
order is :meth:`ScannedRows.rank`). Every field checked in bulk by
:meth:`Catalogue.check`: no object per row beyond what sqlite returns."""


@attrs.frozen
class ScannedRows:
    """One step of :meth:`Catalogue.scan`: its rows as sqlite returned them (no tuple
    made again per row), and the rank in token order of every row of the scan, by rowid
    (one table for the whole scan, 0 for the entry whose tokens sort first)."""

    rows: list[CompactRow]
    ranks: Mapping[int, int]

    def __iter__(self) -> Iterator[CompactRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def rank(self, row: CompactRow) -> int:
        return self.ranks[row[9]]

# Every row's fields, of the types and shapes :meth:`Catalogue.block_lists` and
# :meth:`Catalogue.scan` yield them in (CompactRow), checked in one pass inside sqlite:
# the key of the first row that is not.
_CHECK = """
SELECT key FROM entries WHERE NOT (
    typeof(key) = 'text' AND typeof(model_id) = 'text' AND typeof(fingerprint) = 'text'
    AND typeof(tokens) = 'blob' AND length(tokens) % 4 = 0
    AND typeof(trimmable) = 'integer' AND typeof(pinned) = 'integer'
    AND typeof(min_offset) = 'integer' AND min_offset BETWEEN 0 AND length(tokens) / 4
    AND typeof(conversations) = 'text'
    AND (conversations = '[]' OR (
        json_valid(conversations) AND json_type(conversations) = 'array'
        AND NOT EXISTS (SELECT 1 FROM json_each(conversations) WHERE type != 'text')))
    AND typeof(last_use) = 'real' AND typeof(file_bytes) = 'integer' AND file_bytes >= 0
    AND typeof(block_names) = 'blob' AND length(block_names) % 32 = 0
) LIMIT 1
"""

_NO_CONVERSATIONS: tuple[str, ...] = ()


@attrs.frozen
class CatalogueRow:
    """One entry as the catalogue holds it (rule 3)."""

    key: str
    model_id: str
    fingerprint: str
    tokens: tuple[int, ...]
    trimmable: bool
    min_offset: int
    conversations: tuple[str, ...]
    file_bytes: int
    last_use: float
    blocks: tuple[tuple[str, int], ...]  # (sha256 hex, size) in the manifest's order
    pinned: bool = False
    manifest_mtime_ns: int = 0  # 0: not known (no manifest has it)


@attrs.define(eq=False)
class Catalogue:
    """An open catalogue (see the module docstring). Not thread-safe: one thread at a time
    (``check_same_thread`` is off so trio's worker threads may take turns)."""

    path: str
    _db: sqlite3.Connection
    was_clean: bool
    read_only: bool = False
    _checked: bool = False  # :meth:`check` passed, and nothing was written since
    _ordered: bool = False  # rule 4: the rowid order is the last-use order (meta's mark)

    @classmethod
    def open(cls, directory: str) -> Catalogue:
        """Open (creating) the catalogue in ``directory`` and mark it in use (rule 2).

        CorruptCacheError when the file exists but is not a usable catalogue (truncated,
        corrupt, another schema version): the caller removes it (:meth:`remove`) and
        rebuilds.
        """
        path = os.path.join(directory, CATALOGUE_NAME)
        _refuse_links(path)
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {path}: {exc}") from exc
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            db.execute(_TOKEN_INDEX)
            meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
            version = meta.get("version")
            migration = _MIGRATABLE.get(version or "")
            if version is not None and version != str(SCHEMA_VERSION) and migration is None:
                raise CorruptCacheError(f"catalogue {path}: schema {version}, not {SCHEMA_VERSION}")
            integrity = db.execute("PRAGMA quick_check").fetchone()
            if integrity is None or integrity[0] != "ok":
                raise CorruptCacheError(f"catalogue {path}: quick_check failed")
            was_clean = meta.get("clean") == "1" and version is not None
            # rule 4: a new catalogue is in order (no rows); a migrated one is not known to be
            ordered = version is None or (meta.get("ordered") == "1" and migration is None)
            with db:
                db.execute("BEGIN")
                for statement in migration or ():
                    db.execute(statement)
                db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('version', ?)", (str(SCHEMA_VERSION),)
                )
                db.execute("INSERT OR REPLACE INTO meta VALUES ('clean', '0')")
                db.execute("INSERT OR REPLACE INTO meta VALUES ('ordered', ?)", (f"{ordered:d}",))
        except sqlite3.Error as exc:
            db.close()
            raise CorruptCacheError(f"catalogue {path}: {exc}") from exc
        except BaseException:
            db.close()
            raise
        return cls(path, db, was_clean, ordered=ordered)

    @classmethod
    def open_read_only(cls, directory: str) -> Catalogue | None:
        """Open ``directory``'s catalogue to read it, changing nothing (not even its clean
        mark): None when there is none; CorruptCacheError when it is unusable."""
        path = os.path.join(directory, CATALOGUE_NAME)
        _refuse_links(path)
        if not os.path.isfile(path):
            return None
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {path}: {exc}") from exc
        try:
            meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
            if meta.get("version") != str(SCHEMA_VERSION):
                raise CorruptCacheError(f"catalogue {path}: schema {meta.get('version')}")
        except sqlite3.Error as exc:
            db.close()
            raise CorruptCacheError(f"catalogue {path}: {exc}") from exc
        except BaseException:
            db.close()
            raise
        ordered = meta.get("ordered") == "1"
        return cls(path, db, meta.get("clean") == "1", read_only=True, ordered=ordered)

    @staticmethod
    def remove(directory: str) -> None:
        """Delete a catalogue's files (before a rebuild)."""
        base = os.path.join(directory, CATALOGUE_NAME)
        for path in (base, base + "-wal", base + "-shm"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue

    def close(self, *, clean: bool = True) -> None:
        """Mark it clean (rule 2: every row matches a manifest) and close it (one opened
        read-only is closed as it is)."""
        try:
            if clean and not self.read_only:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('clean', '1')")
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            self._db.close()

    # -- reading ------------------------------------------------------------------------

    def keys(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT key FROM entries")}

    def rows(self) -> Iterator[CatalogueRow]:
        """Every entry, least recently used first. CorruptCacheError on a bad row."""
        query = (
            "SELECT key, model_id, fingerprint, tokens, trimmable, min_offset, conversations,"
            " file_bytes, last_use, block_names, block_sizes, pinned, manifest_mtime_ns"
            " FROM entries ORDER BY last_use"
        )
        try:
            for row in self._db.execute(query):
                yield _row(row)
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {self.path}: {exc}") from exc

    def check(self) -> None:
        """Refuse the catalogue if any row has a field of the wrong type or shape for
        :meth:`block_lists` and :meth:`scan` (rows are untrusted: a file edited, or
        damaged where sqlite's own checks do not look): CorruptCacheError naming the first
        bad row. One query, the checks done inside sqlite (which releases the GIL), so the
        rows those two yield are then used as they are, with no check per row in Python;
        each of them runs it first unless it has run since the last write."""
        if self._checked:
            return
        try:
            bad = self._db.execute(_CHECK).fetchone()
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {self.path}: {exc}") from exc
        if bad is not None:
            raise CorruptCacheError(f"catalogue: entry {bad[0]!r:.80}: a field of the wrong type")
        self._checked = True

    def block_lists(self) -> Iterator[list[tuple[str, int, bytes]]]:
        """Per entry: its key, manifest bytes and block names (the concatenated 32-byte
        digests, in the manifest's order), in no particular order, in lists of at most
        :data:`SCAN_BATCH`. CorruptCacheError on a bad row (:meth:`check`)."""
        self.check()
        try:
            query = "SELECT key, file_bytes, block_names FROM entries"
            yield from _batches(self._db.execute(query))
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {self.path}: {exc}") from exc

    def manifest_blocks(self) -> Iterator[tuple[str, int, int, bytes]]:
        """Per entry: key, manifest bytes and mtime (ns), and block names (as
        :meth:`block_lists`), in no particular order. CorruptCacheError on a bad row."""
        query = "SELECT key, file_bytes, manifest_mtime_ns, block_names FROM entries"
        try:
            for batch in _batches(self._db.execute(query)):
                for key, file_bytes, mtime_ns, names in batch:
                    if not (
                        isinstance(key, str)
                        and isinstance(file_bytes, int)
                        and isinstance(mtime_ns, int)
                        and isinstance(names, bytes)
                        and len(names) % _DIGEST == 0
                    ):
                        raise CorruptCacheError(f"catalogue: entry {key!r:.80}: bad block list")
                    yield key, file_bytes, mtime_ns, names
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {self.path}: {exc}") from exc

    def scan(self) -> Generator[ScannedRows, None, None]:
        """Every entry as a :data:`CompactRow`, least recently used first, at most
        :data:`SCAN_BATCH` per step (:class:`ScannedRows`: a worker thread fetches one, the
        event loop indexes it). The ranks come from sqlite's own sort of the token blobs.
        CorruptCacheError on a bad row (:meth:`check`, in one query before the first).

        The rows come in rowid order, which is the last-use order (rule 4: read as the
        table lies, no sort) unless a write since the last :meth:`order_by_last_use` put
        one out of it; then sqlite sorts them.

        The ranks: the rowids in token order first (a walk of the ``entries_by_tokens``
        index, which covers the query: no sort at open; a catalogue made before the index
        gets it at its next open), a table from rowid to rank that the reader consults
        row by row; cheaper than a window function over the rows, which sorts and
        materializes every row twice, or than a tuple made again per row with its rank."""
        self.check()
        try:
            ranks: dict[int, int] = {}
            by_tokens = self._db.execute("SELECT rowid FROM entries ORDER BY tokens, key")
            for batch in _batches(by_tokens):
                ranks.update(zip(map(_first, batch), itertools.count(len(ranks))))
            query = (
                "SELECT key, model_id, fingerprint, tokens, trimmable, min_offset,"
                " conversations, last_use, pinned, rowid FROM entries"
            )
            if not self._ordered:
                query += " ORDER BY last_use, key"
            for batch in _batches(self._db.execute(query)):
                yield ScannedRows(batch, ranks)
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {self.path}: {exc}") from exc

    def block_sizes(self) -> dict[str, int]:
        """The size of every block that exists (as last recorded)."""
        try:
            return {
                bytes(name).hex(): int(size)
                for name, size in self._db.execute("SELECT name, size FROM blocks")
            }
        except sqlite3.Error as exc:
            raise CorruptCacheError(f"catalogue {self.path}: {exc}") from exc

    @property
    def ordered(self) -> bool:
        """Rule 4: the rows' rowid order is their last-use order."""
        return self._ordered

    # -- writing ------------------------------------------------------------------------

    def order_by_last_use(self) -> None:
        """Rule 4: put the rows in last-use order (each gets the rowid of its place) and set
        the ``ordered`` mark, in one transaction inside sqlite (which releases the GIL):
        the rows copied to a temporary table sorted, then back. Nothing when they are."""
        if self._ordered:
            return
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DROP INDEX IF EXISTS entries_by_tokens")
            self._db.execute(
                "CREATE TEMP TABLE by_last_use AS SELECT * FROM entries ORDER BY last_use, key"
            )
            self._db.execute("DELETE FROM entries")
            self._db.execute("INSERT INTO entries SELECT * FROM temp.by_last_use ORDER BY rowid")
            self._db.execute("DROP TABLE temp.by_last_use")
            self._db.execute(_TOKEN_INDEX)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('ordered', '1')")
        self._ordered = True

    def _unordered(self) -> None:
        """Rule 4: clear the ``ordered`` mark (inside the caller's transaction)."""
        if self._ordered:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('ordered', '0')")
            self._ordered = False

    def _keeps_order(self, last_use: float, key: str) -> bool:
        """Rule 4: whether a row of ``last_use`` and ``key`` given the next rowid stays in
        last-use order (conservative: the newest row may be the one it replaces)."""
        newest = self._db.execute(
            "SELECT last_use, key FROM entries ORDER BY rowid DESC LIMIT 1"
        ).fetchone()
        return newest is None or (last_use, key) >= tuple(newest)

    def replace_all(
        self, rows: Iterable[CatalogueRow], blocks: Callable[[], dict[str, int]]
    ) -> dict[str, int]:
        """Rebuild: every row, then every existing block, in one transaction; returns what
        ``blocks()`` gave. ``rows`` is consumed as it is inserted (a caller reading
        manifests never holds them all) and ``blocks`` called after the last row (the
        rows name the blocks that are kept). The token index is made after the rows (one
        sorted build, its pages in token order for the scan's walk, rather than N inserts
        in the manifests' order)."""
        self._checked = False
        with self._db:
            self._db.execute("BEGIN")
            self._unordered()  # the rows come in the manifests' order (rule 4)
            self._db.execute("DROP INDEX IF EXISTS entries_by_tokens")
            self._db.execute("DELETE FROM entries")
            self._db.execute("DELETE FROM blocks")
            self._db.executemany(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (_values(row) for row in rows),
            )
            self._db.execute(_TOKEN_INDEX)
            present = blocks()
            self._db.executemany(
                "INSERT INTO blocks VALUES (?, ?)",
                ((bytes.fromhex(name), size) for name, size in present.items()),
            )
        return present

    def reconcile(
        self,
        gone: Iterable[str],
        fresh: Iterable[CatalogueRow],
        blocks: Callable[[], dict[str, int]],
    ) -> dict[str, int]:
        """In one transaction: drop the rows of ``gone`` keys, upsert ``fresh`` rows (consumed
        as they are written), then replace the table of existing blocks with ``blocks()``
        (called after the last row), which it returns. Fresh rows come last, with their
        manifests' mtimes as last uses: out of order (rule 4)."""
        self._checked = False
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM entries WHERE key = ?", ((k,) for k in gone))
            before = self._db.total_changes
            self._db.executemany(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (_values(row) for row in fresh),
            )
            if self._db.total_changes != before:
                self._unordered()
            present = blocks()
            self._db.execute("DELETE FROM blocks")
            self._db.executemany(
                "INSERT INTO blocks VALUES (?, ?)",
                ((bytes.fromhex(name), size) for name, size in present.items()),
            )
        return present

    def put(self, row: CatalogueRow, new_blocks: dict[str, int]) -> None:
        """An entry was published (its blocks in ``new_blocks`` are new on disk). Its row
        takes the next rowid (rule 4)."""
        self._checked = False
        with self._db:
            self._db.execute("BEGIN")
            if not self._keeps_order(row.last_use, row.key):
                self._unordered()
            self._db.execute(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                _values(row),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO blocks VALUES (?, ?)",
                ((bytes.fromhex(name), size) for name, size in new_blocks.items()),
            )

    def delete(self, key: str, gone_blocks: Iterable[str]) -> None:
        """An entry's manifest was deleted, and with it ``gone_blocks``."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
            self._db.executemany(
                "DELETE FROM blocks WHERE name = ?", ((bytes.fromhex(n),) for n in gone_blocks)
            )

    def delete_blocks(self, names: Iterable[str]) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "DELETE FROM blocks WHERE name = ?", ((bytes.fromhex(n),) for n in names)
            )

    def touch(self, last_use: dict[str, float]) -> None:
        """Record the last use of entries (the cold LRU's order across restarts): each row
        moved to the end, least recent first (rule 4)."""
        uses = sorted((when, key) for key, when in last_use.items())
        if not uses:
            return
        with self._db:
            self._db.execute("BEGIN")
            if not self._keeps_order(*uses[0]):
                self._unordered()
            self._db.executemany(
                "UPDATE entries SET last_use = ?, rowid = (SELECT max(rowid) FROM entries) + 1"
                " WHERE key = ?",
                uses,
            )

    def replace_pins(self, pinned: Iterable[str]) -> None:
        """Exactly the entries of ``pinned`` are pinned (a rebuild's copy of the record)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("UPDATE entries SET pinned = 0 WHERE pinned")
            self._db.executemany(
                "UPDATE entries SET pinned = 1 WHERE key = ?", ((key,) for key in pinned)
            )

    def set_pinned(self, pins: Mapping[str, bool]) -> None:
        """Record which entries are pinned (True) or not (rule 3; absent keys: nothing)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE entries SET pinned = ? WHERE key = ?",
                ((int(pinned), key) for key, pinned in pins.items()),
            )


_first = operator.itemgetter(0)


def _batches(cursor: sqlite3.Cursor) -> Iterator[list[Any]]:
    while batch := cursor.fetchmany(SCAN_BATCH):
        yield batch


def conversations_of(row: CompactRow) -> tuple[str, ...]:
    """The conversations of a scanned row (its JSON list of strings, :meth:`Catalogue.check`
    checked); none for the common ``[]``."""
    text = row[6]
    if text == "[]":
        return _NO_CONVERSATIONS
    try:
        loaded = json.loads(text)
    except ValueError as exc:  # sqlite's JSON and Python's may disagree at the edges
        raise CorruptCacheError(f"catalogue: entry {row[0]!r:.80}: {exc}") from exc
    if not isinstance(loaded, list) or not all(isinstance(c, str) for c in loaded):
        raise CorruptCacheError(f"catalogue: entry {row[0]!r:.80}: bad conversations")
    return tuple(loaded)


def _values(row: CatalogueRow) -> tuple[object, ...]:
    names = b"".join(bytes.fromhex(name) for name, _ in row.blocks)
    return (
        row.key,
        row.model_id,
        row.fingerprint,
        pack_tokens(row.tokens),
        int(row.trimmable),
        row.min_offset,
        json.dumps(list(row.conversations)),
        row.file_bytes,
        row.last_use,
        names,
        _pack_sizes([size for _, size in row.blocks]),
        int(row.pinned),
        row.manifest_mtime_ns,
    )


def _pack_sizes(sizes: Sequence[int]) -> bytes:
    return _packed("Q", sizes, big_endian=False)


def _unpack_sizes(data: bytes) -> array.array[int]:
    packed = _unpacked("Q", data, big_endian=False)
    if packed is None:
        raise ValueError("block sizes are not whole u64 values")
    return packed


def _row(row: tuple[object, ...]) -> CatalogueRow:
    (key, model_id, fingerprint, tokens, trimmable, min_offset, conversations, file_bytes,
     last_use, names, sizes, pinned, mtime_ns) = row  # fmt: skip
    try:
        if not (isinstance(names, bytes) and isinstance(tokens, bytes)):
            raise TypeError("names and tokens must be blobs")
        if not isinstance(sizes, bytes):
            raise TypeError("block sizes must be a blob")
        size_list = _unpack_sizes(sizes)
        conv = [] if conversations == "[]" else json.loads(str(conversations))
        if len(names) != _DIGEST * len(size_list) or not isinstance(conv, list):
            raise ValueError("block names and sizes disagree")
        hex_names = names.hex()
        step = 2 * _DIGEST
        blocks = tuple(
            (hex_names[i * step : (i + 1) * step], size) for i, size in enumerate(size_list)
        )
        return CatalogueRow(
            key=str(key),
            model_id=str(model_id),
            fingerprint=str(fingerprint),
            tokens=tuple(unpack_tokens(tokens)),
            trimmable=bool(trimmable),
            min_offset=int(str(min_offset)),
            conversations=tuple(str(c) for c in conv),
            file_bytes=int(str(file_bytes)),
            last_use=float(str(last_use)),
            blocks=blocks,
            pinned=bool(pinned),
            manifest_mtime_ns=int(str(mtime_ns)),
        )
    except (ValueError, TypeError) as exc:
        raise CorruptCacheError(f"catalogue: entry {key!r:.80}: {exc}") from exc


def _refuse_links(path: str) -> None:
    """The catalogue's files are opened by sqlite, by path (it takes no directory
    descriptor): anything but a regular file under their names (a link a neighbour put
    there, which sqlite would follow and write through) is CorruptCacheError before the
    open, so the caller removes the names (:meth:`Catalogue.remove` unlinks a link, never
    its target) and rebuilds. A swap between this check and sqlite's open is the one
    window docs/design.md invariant 18 leaves."""
    for name in (path, path + "-wal", path + "-shm"):
        try:
            info = os.lstat(name)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"catalogue {name}: not a regular file")
