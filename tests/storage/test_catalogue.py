"""kvtrio.storage.catalogue: rows round-trip, last uses order them, a damaged file or
another schema is refused with CorruptCacheError (the tier then rebuilds it)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from kvtrio.errors import CorruptCacheError
from kvtrio.storage.catalogue import (
    CATALOGUE_NAME,
    Catalogue,
    CatalogueRow,
    CompactRow,
    unpack_tokens,
)


def _row(key: str, last_use: float, blocks: int = 2) -> CatalogueRow:
    return CatalogueRow(
        key=key,
        model_id="m",
        fingerprint="f",
        tokens=(0, 1, 2**32 - 1),
        trimmable=True,
        min_offset=1,
        conversations=("c",),
        file_bytes=100,
        last_use=last_use,
        blocks=tuple((f"{i:02x}" * 32, 10 + i) for i in range(blocks)),
    )


def test_rows_round_trip_in_last_use_order(tmp_path: Path) -> None:
    catalogue = Catalogue.open(str(tmp_path))
    assert not catalogue.was_clean
    catalogue.put(_row("b", 2.0), {"00" * 32: 10})
    catalogue.put(_row("a", 1.0), {"01" * 32: 11})
    catalogue.touch({"a": 3.0, "missing": 9.0})
    rows = list(catalogue.rows())
    assert [r.key for r in rows] == ["b", "a"]
    assert rows[0] == _row("b", 2.0)
    catalogue.delete("b", ["00" * 32])
    assert catalogue.keys() == {"a"} and catalogue.block_sizes() == {"01" * 32: 11}
    catalogue.close()
    again = Catalogue.open(str(tmp_path))
    assert again.was_clean and [r.key for r in again.rows()] == ["a"]
    again.close(clean=False)
    assert not Catalogue.open(str(tmp_path)).was_clean


def test_garbage_is_refused(tmp_path: Path) -> None:
    (tmp_path / CATALOGUE_NAME).write_bytes(b"not a database" * 100)
    with pytest.raises(CorruptCacheError):
        Catalogue.open(str(tmp_path))
    Catalogue.remove(str(tmp_path))
    assert not Catalogue.open(str(tmp_path)).was_clean


def test_another_schema_version_is_refused(tmp_path: Path) -> None:
    Catalogue.open(str(tmp_path)).close()
    db = sqlite3.connect(tmp_path / CATALOGUE_NAME)
    db.execute("UPDATE meta SET value = '99' WHERE name = 'version'")
    db.commit()
    db.close()
    with pytest.raises(CorruptCacheError, match="schema"):
        Catalogue.open(str(tmp_path))


def test_a_bad_row_is_refused(tmp_path: Path) -> None:
    catalogue = Catalogue.open(str(tmp_path))
    catalogue.put(_row("a", 1.0), {})
    catalogue._db.execute("UPDATE entries SET block_sizes = zeroblob(8)")  # 2 names, 1 size
    with pytest.raises(CorruptCacheError, match="entry 'a'"):
        list(catalogue.rows())


def test_pins_round_trip(tmp_path: Path) -> None:
    catalogue = Catalogue.open(str(tmp_path))
    catalogue.put(attrs.evolve(_row("a", 1.0), pinned=True), {})
    catalogue.put(_row("b", 2.0), {})
    catalogue.set_pinned({"a": False, "b": True, "missing": True})
    assert [(r.key, r.pinned) for r in catalogue.rows()] == [("a", False), ("b", True)]


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_catalogue_with_little_endian_tokens_is_refused(tmp_path: Path, version: str) -> None:
    """Schemas 2 and 3 stored tokens little-endian, which sqlite cannot sort in token
    order: such a catalogue is refused (CorruptCacheError), so the tier rebuilds it from
    the manifests (its pins from the manifest store's record), never reads it as is."""
    catalogue = Catalogue.open(str(tmp_path))
    catalogue.put(_row("a", 1.0), {"00" * 32: 10})
    catalogue.close()
    db = sqlite3.connect(tmp_path / CATALOGUE_NAME)
    db.execute("UPDATE meta SET value = ? WHERE name = 'version'", (version,))
    db.commit()
    db.close()
    with pytest.raises(CorruptCacheError, match=rf"schema {version}, not 6$"):
        Catalogue.open(str(tmp_path))


def test_a_version_4_catalogue_is_migrated_in_place(tmp_path: Path) -> None:
    """Schema 4 lacked the manifests' mtimes: opening one adds the column, keeps every
    row, and records mtime 0 (no manifest has it, so ``kvtrio gc`` reads those)."""
    catalogue = Catalogue.open(str(tmp_path))
    catalogue.put(_row("a", 1.0), {"00" * 32: 10})
    catalogue.close()
    db = sqlite3.connect(tmp_path / CATALOGUE_NAME)
    db.execute("ALTER TABLE entries DROP COLUMN manifest_mtime_ns")
    db.execute("UPDATE meta SET value = '4' WHERE name = 'version'")
    db.commit()
    db.close()
    catalogue = Catalogue.open(str(tmp_path))
    assert [(key, mtime) for key, _, mtime, _ in catalogue.manifest_blocks()] == [("a", 0)]
    assert [row.key for row in catalogue.rows()] == ["a"]
    catalogue.close()


def test_a_scan_ranks_the_entries_in_token_order(tmp_path: Path) -> None:
    """The ranks a scan gives are the order of the token tuples (the prefix index is
    filled by appends in that order), whatever the order of last uses."""
    catalogue = Catalogue.open(str(tmp_path))
    tokens = [(3, 1), (1, 70000), (1, 2, 3), (70000,), (1, 2), ()]
    for i, t in enumerate(tokens):
        catalogue.put(attrs.evolve(_row(f"k{i}", float(-i)), tokens=t, min_offset=0), {})
    ranked = _ranked(catalogue)
    assert [row[0] for _, row in ranked] == [f"k{i}" for i in reversed(range(len(tokens)))]
    by_rank = [row for _, row in sorted(ranked)]
    assert [tuple(unpack_tokens(row[3])) for row in by_rank] == sorted(tokens)
    catalogue.close()


def _ranked(catalogue: Catalogue) -> list[tuple[int, CompactRow]]:
    """A scan's rows, each with its rank in token order."""
    return [(batch.rank(row), row) for batch in catalogue.scan() for row in batch]


def test_the_token_order_is_read_from_an_index_even_of_an_older_catalogue(
    tmp_path: Path,
) -> None:
    """The scan's token order walks the ``entries_by_tokens`` index (no sort of N rows at
    open), which a catalogue made without it gets at its next open, its ranks unchanged."""
    catalogue = Catalogue.open(str(tmp_path))
    tokens = [(3, 1), (1, 70000), (1, 2, 3), (70000,), (1, 2)]
    for i, t in enumerate(tokens):
        catalogue.put(attrs.evolve(_row(f"k{i}", float(i)), tokens=t, min_offset=0), {})
    catalogue.close()
    db = sqlite3.connect(tmp_path / CATALOGUE_NAME)
    db.execute("DROP INDEX entries_by_tokens")  # as a catalogue before the index
    db.commit()
    db.close()
    catalogue = Catalogue.open(str(tmp_path))
    plan = catalogue._db.execute(
        "EXPLAIN QUERY PLAN SELECT rowid FROM entries ORDER BY tokens, key"
    ).fetchall()
    assert [row[-1] for row in plan] == ["SCAN entries USING COVERING INDEX entries_by_tokens"]
    by_rank = [row for _, row in sorted(_ranked(catalogue))]
    assert [tuple(unpack_tokens(row[3])) for row in by_rank] == sorted(tokens)
    catalogue.close()


@pytest.mark.parametrize(
    "damage",
    [
        "key = x'00'",  # a blob (a number would be stored as text: the column's affinity)
        "model_id = x'01'",
        "tokens = 'abc'",
        "tokens = zeroblob(6)",  # not whole u32 values
        "trimmable = 'yes'",
        "min_offset = -1",
        "min_offset = 4",  # past its 3 tokens
        "conversations = '{\"a\": 1}'",  # not a list
        "conversations = '[\"c\", 3]'",  # not all strings
        "conversations = 'not json'",
        "last_use = 'soon'",
        "pinned = 'no'",
        "file_bytes = 1.5",
        "block_names = zeroblob(31)",  # not whole 32-byte digests
    ],
)
def test_a_row_of_the_wrong_type_or_shape_is_refused_before_any_row(
    tmp_path: Path, damage: str
) -> None:
    """Rows are untrusted: a field of the wrong type or shape anywhere refuses the scan
    and the block lists (CorruptCacheError, so the tier rebuilds), checked for every row
    in one query inside sqlite before the first row is yielded (``Catalogue.check``)."""
    catalogue = Catalogue.open(str(tmp_path))
    for i in range(3):
        catalogue.put(_row(f"k{i}", float(i)), {})
    catalogue._db.execute(f"UPDATE entries SET {damage} WHERE key = 'k1'")
    with pytest.raises(CorruptCacheError, match="entry"):
        next(catalogue.scan())
    with pytest.raises(CorruptCacheError, match="entry"):
        next(catalogue.block_lists())
    catalogue.close(clean=False)


def test_rows_that_pass_the_check_are_yielded_as_stored(tmp_path: Path) -> None:
    """What the check lets through is what the readers need: the scan's conversations
    parse (``conversations_of``), its tokens unpack, the block lists split into digests."""
    from kvtrio.storage.catalogue import conversations_of

    catalogue = Catalogue.open(str(tmp_path))
    catalogue.put(_row("a", 1.0), {})
    catalogue.put(attrs.evolve(_row("b", 2.0), conversations=()), {})
    rows = [row for batch in catalogue.scan() for row in batch]
    assert [conversations_of(row) for row in rows] == [("c",), ()]
    assert [tuple(unpack_tokens(row[3])) for row in rows] == [(0, 1, 2**32 - 1)] * 2
    lists = sorted(row for batch in catalogue.block_lists() for row in batch)
    assert lists == [(k, 100, bytes.fromhex("00" * 32 + "01" * 32)) for k in ("a", "b")]
    catalogue.close()


@pytest.mark.parametrize("write", ["replace_all", "reconcile"])
def test_a_rebuilds_rows_are_consumed_as_written_and_its_blocks_listed_after_the_last(
    tmp_path: Path, write: str
) -> None:
    """``replace_all`` and ``reconcile`` take the rows as an iterable, read one at a time
    (a rebuild never holds them all), and call ``blocks`` once, after the last row (the
    rows name the blocks that are kept); they write what it returns, and return it."""
    catalogue = Catalogue.open(str(tmp_path))
    catalogue.put(_row("gone", 0.5), {"09" * 32: 9})
    consumed: list[str] = []

    def rows() -> Iterator[CatalogueRow]:
        for i in range(5):
            consumed.append(f"k{i}")
            yield _row(f"k{i}", float(i))

    calls: list[list[str]] = []

    def blocks() -> dict[str, int]:
        calls.append(list(consumed))
        return {"00" * 32: 10, "01" * 32: 11}

    if write == "replace_all":
        written = catalogue.replace_all(rows(), blocks)
    else:
        written = catalogue.reconcile(["gone"], rows(), blocks)
    assert calls == [[f"k{i}" for i in range(5)]]
    assert written == catalogue.block_sizes() == {"00" * 32: 10, "01" * 32: 11}
    assert [row.key for row in catalogue.rows()] == [f"k{i}" for i in range(5)]
    catalogue.close()


def _scan_plans(catalogue: Catalogue) -> list[str]:
    """The query plan of every statement a scan runs (EXPLAIN QUERY PLAN's details)."""
    statements: list[str] = []
    catalogue._db.set_trace_callback(statements.append)
    rows = [row for batch in catalogue.scan() for row in batch]
    catalogue._db.set_trace_callback(None)
    assert rows
    plans = []
    for statement in statements:
        if statement.startswith("SELECT"):
            plans += [step[-1] for step in catalogue._db.execute(f"EXPLAIN QUERY PLAN {statement}")]
    return plans


def test_a_clean_scan_reads_last_use_order_from_the_rowids_with_no_sort(tmp_path: Path) -> None:
    """Rule 4: the rows lie in last-use order (a use moves its row to the end), so a
    scan of an ordered catalogue sorts nothing: no temporary B-tree in any of its plans
    (a sort of N rows at every open, spilled to a temporary file at 100,000 entries)."""
    catalogue = Catalogue.open(str(tmp_path))
    for i in range(5):
        catalogue.put(_row(f"k{i}", float(i)), {})
    catalogue.touch({"k3": 10.0, "k1": 9.0, "missing": 11.0})
    catalogue.put(_row("k0", 12.0), {})  # rewritten: newest
    assert catalogue.ordered
    expected = ["k2", "k4", "k1", "k3", "k0"]
    assert [row.key for row in catalogue.rows()] == expected
    catalogue.close()
    catalogue = Catalogue.open(str(tmp_path))
    assert catalogue.ordered
    assert [row[0] for batch in catalogue.scan() for row in batch] == expected
    assert not [plan for plan in _scan_plans(catalogue) if "TEMP B-TREE" in plan]
    catalogue.close()


def test_a_last_use_out_of_order_clears_the_mark_and_the_open_puts_rows_back(
    tmp_path: Path,
) -> None:
    """Rule 4: a last use older than the newest row's (a clock set back) clears the
    ``ordered`` mark, so the scan sorts (the order stays right) until the owner puts the
    rows back in order; the mark survives a reopen only when it holds."""
    catalogue = Catalogue.open(str(tmp_path))
    for i in range(4):
        catalogue.put(_row(f"k{i}", float(10 + i)), {})
    catalogue.touch({"k3": 1.0})  # older than every row: out of rowid order
    assert not catalogue.ordered
    expected = ["k3", "k0", "k1", "k2"]
    assert [row[0] for batch in catalogue.scan() for row in batch] == expected
    catalogue.close()
    catalogue = Catalogue.open(str(tmp_path))
    assert not catalogue.ordered
    catalogue.order_by_last_use()
    assert catalogue.ordered
    assert [row[0] for batch in catalogue.scan() for row in batch] == expected
    assert not [plan for plan in _scan_plans(catalogue) if "TEMP B-TREE" in plan]
    catalogue.put(_row("k9", 5.0), {})  # an upsert older than the newest: out of order
    assert not catalogue.ordered
    assert [row.key for row in catalogue.rows()] == ["k3", "k9", "k0", "k1", "k2"]
    catalogue.close()


def test_a_version_5_catalogue_is_put_in_last_use_order_at_its_first_open(
    tmp_path: Path,
) -> None:
    """Schema 5 updated last uses in place (its rowids are in no order): opened, it is
    not trusted as ordered; the owner's reorder keeps every row and the order."""
    catalogue = Catalogue.open(str(tmp_path))
    for i in range(3):
        catalogue.put(_row(f"k{i}", float(i)), {"00" * 32: 10})
    catalogue.close()
    db = sqlite3.connect(tmp_path / CATALOGUE_NAME)
    db.execute("UPDATE entries SET last_use = 9 WHERE key = 'k0'")  # as version 5 touched
    db.execute("UPDATE meta SET value = '5' WHERE name = 'version'")
    db.commit()
    db.close()
    catalogue = Catalogue.open(str(tmp_path))
    assert not catalogue.ordered
    catalogue.order_by_last_use()
    assert catalogue.ordered
    assert [row[0] for batch in catalogue.scan() for row in batch] == ["k1", "k2", "k0"]
    assert catalogue.block_sizes() == {"00" * 32: 10}
    catalogue.close()


def test_a_scan_yields_the_rows_sqlite_returned_with_no_tuple_made_again(
    tmp_path: Path,
) -> None:
    """The scan hands on sqlite's own row tuples, each rank read from one table by rowid,
    instead of a new tuple per row with its rank (100,000 tuples made and freed at open)."""
    catalogue = Catalogue.open(str(tmp_path))
    for i in range(3):
        catalogue.put(_row(f"k{i}", float(i)), {})
    returned: list[tuple[object, ...]] = []

    def note(cursor: sqlite3.Cursor, row: tuple[object, ...]) -> tuple[object, ...]:
        returned.append(row)
        return row

    catalogue._db.row_factory = note
    (batch,) = list(catalogue.scan())
    scanned = {id(row) for row in returned}
    assert [row[0] for row in batch] == ["k0", "k1", "k2"]
    assert all(id(row) in scanned for row in batch)
    assert sorted(batch.rank(row) for row in batch) == [0, 1, 2]
    catalogue.close()
