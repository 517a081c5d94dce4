"""IoOptions: the I/O switches as one record, read from the environment only at the edge.

docs/tuning.md's table is the contract: every ``KVTRIO_*`` variable it lists overrides one
IoOptions field when the CLI or a benchmark starts, and the defaults it states are the
record's. No library module reads the environment.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import attrs
import kvtrio
import pytest
from kvtrio.errors import InvalidInputError
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, ENVIRONMENT, IoOptions

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("runtime", "storage", "actors", "metal", "serve", "api.py")


def test_defaults_are_the_measured_ones() -> None:
    """The defaults docs/tuning.md states (behaviour of a plain ``load_cache``/``ColdTier``)."""
    options = IoOptions()
    assert options == DEFAULT_IO_OPTIONS
    assert (options.save_direct, options.save_hash_thread, options.zero_copy) == (
        False,
        True,
        True,
    )
    assert (options.load_streams, options.load_direct, options.drop_behind) == (None, False, True)
    assert options.streams(4) == 4 and IoOptions(load_streams=2).streams(4) == 2
    assert (options.willneed, options.load_hash_thread, options.alloc_untouched) == (
        False,
        False,
        True,
    )
    assert (options.prefault, options.prefault_ahead, options.prefault_huge) == (
        True,
        False,
        False,
    )


def test_an_empty_environment_changes_nothing() -> None:
    assert IoOptions.from_environ({}) == DEFAULT_IO_OPTIONS
    blank = {name: " " for name in ENVIRONMENT}
    assert IoOptions.from_environ(blank) == DEFAULT_IO_OPTIONS


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("KVTRIO_SAVE_DIRECT", "1", "save_direct", sys.platform.startswith("linux")),
        ("KVTRIO_SAVE_HASH_THREAD", "0", "save_hash_thread", False),
        ("KVTRIO_SAVE_COPY", "1", "zero_copy", False),
        ("KVTRIO_LOAD_THREADS", "7", "load_streams", 7),
        ("KVTRIO_LOAD_DIRECT", "1", "load_direct", True),
        ("KVTRIO_LOAD_DROP_BEHIND", "0", "drop_behind", False),
        ("KVTRIO_LOAD_WILLNEED", "1", "willneed", True),
        ("KVTRIO_LOAD_HASH_THREAD", "1", "load_hash_thread", True),
        ("KVTRIO_ALLOC_UNTOUCHED", "0", "alloc_untouched", False),
        ("KVTRIO_PREFAULT", "0", "prefault", False),
        ("KVTRIO_PREFAULT_AHEAD", "1", "prefault_ahead", True),
        ("KVTRIO_PREFAULT_HUGE", "1", "prefault_huge", True),
        ("KVTRIO_REDIS_HASH_THREADS", "3", "redis_hash_threads", 3),
    ],
)
def test_each_variable_overrides_its_field_only(
    variable: str, value: str, field: str, expected: object
) -> None:
    got = IoOptions.from_environ({variable: value})
    assert getattr(got, field) == expected
    assert attrs.evolve(got, **{field: getattr(DEFAULT_IO_OPTIONS, field)}) == DEFAULT_IO_OPTIONS


def test_prefault_off_wins_over_prefault_ahead() -> None:
    both = IoOptions.from_environ({"KVTRIO_PREFAULT": "0", "KVTRIO_PREFAULT_AHEAD": "1"})
    assert not both.prefaults_ahead
    assert IoOptions(prefault_ahead=True).prefaults_ahead


@pytest.mark.parametrize(
    ("field", "bad", "minimum"),
    [
        ("load_streams", 0, 1),
        ("load_streams", True, 1),
        ("load_streams", 2.0, 1),
        ("redis_hash_threads", -1, 0),
        ("redis_hash_threads", False, 0),
        ("redis_hash_threads", float("nan"), 0),
    ],
)
def test_counts_are_validated_with_the_typed_error(field: str, bad: object, minimum: int) -> None:
    """Issue 15, item 10: a bool is no count, nor a float; the error is kvtrio's own."""
    with pytest.raises(InvalidInputError, match=rf"^{field}: expected an int >= {minimum}, got "):
        IoOptions(**{field: bad})  # type: ignore[arg-type]


def test_docs_tuning_lists_every_variable_and_each_one_is_read() -> None:
    """docs/tuning.md's table and ENVIRONMENT name the same variables, and each row names
    the IoOptions field it overrides."""
    text = (ROOT / "docs" / "tuning.md").read_text()
    rows = re.findall(r"^\| `(KVTRIO_[A-Z_]+)=[^`]*` \| `(\w+)` \|", text, flags=re.M)
    assert dict(rows) == {name: field for name, (field, _) in ENVIRONMENT.items()}


def test_the_cli_reads_the_environment_into_io_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one place the variables are read: a bad value is a one-line usage error."""
    from kvtrio.cli import main

    monkeypatch.setenv("KVTRIO_LOAD_THREADS", "none")
    assert main(["gc", str(ROOT), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "kvtrio gc: KVTRIO_LOAD_THREADS='none': expected an integer >= 1\n"
    )


_READERS = {"environ", "getenv", "environb", "getenvb"}


def _environment_reads(source: str, name: str) -> list[str]:
    """Where ``source`` reads the environment (``os.environ``, ``os.getenv``, imports)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Attribute) and node.attr in _READERS:
            found.append(f"{name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [
                f"{name}:{node.lineno}: import {a.name}" for a in node.names if a.name in _READERS
            ]
    return found


def test_no_library_module_reads_the_environment() -> None:
    """Configuration is passed in (IoOptions); os.environ is read at the CLI and bench edge."""
    modules = [
        path
        for room in LIBRARY
        for path in ([ROOT / room] if room.endswith(".py") else sorted((ROOT / room).rglob("*.py")))
        if path.exists()
    ]
    assert any(p.parts[-2:] == ("storage", "reader.py") for p in modules)
    offenders = [
        hit
        for path in modules
        for hit in _environment_reads(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert offenders == []


def test_the_scan_finds_what_it_looks_for() -> None:
    source = "import os\nfrom os import getenv\nx = os.environ.get('A')\ny = os.getenv('B')\n"
    assert len(_environment_reads(source, "sample.py")) == 3


def test_io_options_is_public() -> None:
    assert kvtrio.IoOptions is IoOptions
