"""A promise in the docs is a test: every Python block of README.md and docs/*.md runs.

The blocks of one document run in order in one namespace (as a reader would paste them),
in a temporary working directory, each in a fresh subprocess per document. A block that
cannot run here (a fragment, a model download, a Redis host) is preceded by
``<!-- not runnable: REASON -->``, and the reason must be given.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!-- not runnable: (?P<reason>[^>]*\S)\s*-->\s*$")


def blocks(doc: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason it is not runnable or None)`` for each Python block."""
    text = doc.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group(1), mark.group("reason") if mark else None))
    return found


RUNNABLE = [doc for doc in DOCS if any(reason is None for _, _, reason in blocks(doc))]


def test_not_runnable_marks_give_a_reason() -> None:
    for doc in DOCS:
        text = doc.read_text()
        for bad in re.findall(r"<!-- not runnable(?!: \S)[^>]*-->", text):
            pytest.fail(f"{doc.name}: a not-runnable mark without a reason: {bad}")


def test_the_mark_is_read() -> None:
    sample = "x\n<!-- not runnable: needs a GPU -->\n```python\nimport nothing\n```\n"
    [(_, _, reason)] = [
        (0, m.group(1), MARK.search(sample[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]))
        for m in FENCE.finditer(sample)
    ]
    assert reason is not None and reason.group("reason") == "needs a GPU"


@pytest.mark.parametrize("doc", RUNNABLE, ids=lambda d: d.name)
def test_python_blocks_run(doc: Path, tmp_path: Path) -> None:
    program = []
    for line, code, reason in blocks(doc):
        if reason is None:
            program.append(f"# --- {doc.name}, line {line}\n{code}")
    script = tmp_path / "blocks.py"
    script.write_text("\n".join(program))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"{doc.name}'s blocks failed:\n{out.stdout}\n{out.stderr}"


def _sources() -> list[Path]:
    skip = {".venv", "build", ".git"}
    return sorted(
        p for p in ROOT.rglob("*") if p.suffix in {".py", ".md"} and p.is_file()
        and not any(part in skip or part.startswith(".") for part in p.relative_to(ROOT).parts)
    )


def test_cited_invariants_are_docs_design_mds() -> None:
    """Code and tests cite invariants by number: the file names docs/design.md, and the
    number is one of the invariants listed there."""
    design = (ROOT / "docs" / "design.md").read_text()
    numbers = {int(n) for n in re.findall(r"^(\d+)\. \*\*", design, re.M)}
    assert numbers == set(range(1, len(numbers) + 1)), "invariants are numbered 1..N"
    for path in _sources():
        if path.suffix != ".py":
            continue
        text = path.read_text()
        cited = {int(n) for n in re.findall(r"\b[Ii]nvariants? (\d+)", text)}
        if cited:
            where = path.relative_to(ROOT)
            assert "docs/design.md" in text, f"{where} cites invariants without docs/design.md"
            assert cited <= numbers, f"{where} cites unknown invariants {cited - numbers}"


def test_every_cited_document_exists() -> None:
    for path in _sources():
        for doc in set(re.findall(r"\b(?:docs/[\w.-]+\.md|DESIGN\.md)\b", path.read_text())):
            assert (ROOT / doc).is_file(), f"{path.relative_to(ROOT)} cites missing {doc}"
