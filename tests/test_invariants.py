"""docs/design.md's rule for its invariants: each is stated next to the code that keeps it
and named by the tests that guard it. This test reads the numbered list under
"## Invariants" and requires every number to be cited (``invariant N``, or ``invariants
N, M and K``) by at least one test module and at least one module outside tests/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"invariants?\s+(\d+(?:\s*(?:,|and|&)\s*\d+)*)", re.I)
SKIP = {".venv", ".git", "docs", "build", "dist"}


def numbered_invariants() -> list[int]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Invariants\n", 1)[1].split("\n## ", 1)[0]
    return [int(n) for n in re.findall(r"^(\d+)\. \*\*", section, re.M)]


def citations(files: list[Path]) -> dict[int, set[str]]:
    cited: dict[int, set[str]] = {}
    for path in files:
        for match in CITATION.finditer(path.read_text(errors="replace")):
            for number in re.findall(r"\d+", match.group(1)):
                cited.setdefault(int(number), set()).add(str(path.relative_to(ROOT)))
    return cited


def python_files() -> list[Path]:
    return [
        path
        for path in ROOT.rglob("*.py")
        if not ({part for part in path.relative_to(ROOT).parts[:-1]} & SKIP)
        and not path.relative_to(ROOT).parts[0].startswith(".")
    ]


def test_the_invariants_are_numbered_one_to_n() -> None:
    numbers = numbered_invariants()
    assert numbers and numbers == list(range(1, len(numbers) + 1))


def test_every_invariant_is_named_by_a_test_and_by_the_code_that_keeps_it() -> None:
    files = python_files()
    tests = citations([p for p in files if p.relative_to(ROOT).parts[0] == "tests"])
    code = citations([p for p in files if p.relative_to(ROOT).parts[0] != "tests"])
    numbers = numbered_invariants()
    assert [n for n in numbers if n not in tests] == [], "named by no test"
    assert [n for n in numbers if n not in code] == [], "named by no module outside tests/"
    assert [n for n in {*tests, *code} if n not in numbers] == [], "cites an unknown number"
