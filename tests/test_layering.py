"""docs/design.md invariant 9: the rooms import each other only as the layering table says.

Every ``import kvtrio...`` of every library module is read from its source (function-level
and ``TYPE_CHECKING`` imports included: a lazy import is still a dependency), and checked
against what its room may import. Nothing outside cli/, bench/, drills/ (and the
``python -m kvtrio`` entry point) imports those three.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: room -> the kvtrio rooms it may import (besides itself). ``_lazy`` is the re-export helper.
ALLOWED: dict[str, frozenset[str]] = {
    "runtime": frozenset({"errors", "_lazy"}),
    "storage": frozenset({"errors", "_lazy"}),
    "metal": frozenset({"storage", "errors", "_lazy"}),
    "actors": frozenset({"runtime", "storage", "metal", "errors", "_lazy"}),
    "serve": frozenset({"actors", "runtime", "storage", "metal", "errors", "_lazy", "api"}),
    "errors": frozenset(),
    "_lazy": frozenset(),
    # api registers the paged cache's codec (kvtrio.metal.codec), so load_cache knows
    # every built-in kind without the caller importing metal first (issue 15).
    "api": frozenset({"storage", "metal", "errors"}),
    "tinymodel": frozenset({"storage", "errors"}),
    "__init__": frozenset({"errors", "_lazy", "actors", "api", "storage"}),
}
#: Rooms that may import anything, and that nothing else may import.
TOP = frozenset({"cli", "bench", "drills"})
ENTRY_POINTS = {"__main__": frozenset({"cli"})}


def _room(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _library_modules() -> list[Path]:
    skip = {"tests", "examples", "docs", "build"}
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)
    )


def _kvtrio_imports(path: Path) -> set[str]:
    """The kvtrio rooms ``path`` imports (``kvtrio.storage.x`` -> ``storage``)."""
    rooms: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "kvtrio":
                names = [f"kvtrio.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvtrio" and len(parts) > 1:
                rooms.add(parts[1])
    return rooms


MODULES = _library_modules()


def test_every_library_room_is_in_the_table() -> None:
    rooms = {_room(p) for p in MODULES}
    unknown = rooms - set(ALLOWED) - TOP - set(ENTRY_POINTS)
    assert not unknown, f"rooms with no layering rule (add them to docs/design.md): {unknown}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_what_its_room_may(path: Path) -> None:
    room = _room(path)
    if room in TOP:
        return
    allowed = ALLOWED[room] if room in ALLOWED else ENTRY_POINTS.get(room)
    assert allowed is not None, room
    bad = _kvtrio_imports(path) - allowed - {room}
    assert not bad, f"{path.relative_to(ROOT)} ({room}/) imports {sorted(bad)}"


def test_the_checker_sees_function_level_and_type_only_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvtrio.actors.owner import MlxOwner\n"
        "def f():\n    import kvtrio.cli.demo\n    from kvtrio import drills\n"
    )
    assert _kvtrio_imports(sample) == {"actors", "cli", "drills"}
