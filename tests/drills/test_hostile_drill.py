"""Hostile files: the committed corpus (one file per validation rule) and the mutation drill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvtrio.drills.hostile import OUTCOME_OF_ERROR, load_hostile
from kvtrio.drills.workload import CacheDir, EntrySpec, write_entry
from kvtrio.tests.drills.helpers import run_drill_cli

CORPUS = Path(__file__).with_name("corpus")
EXPECTED: dict[str, dict[str, str]] = json.loads((CORPUS / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_corpus_file_is_refused_naming_the_field_at_fault(name: str, tmp_path: Path) -> None:
    """docs/design.md invariant 4, untrusted-header rules: each crafted file breaks one rule; a load
    through kvtrio.load_cache raises exactly the expected error, whose message starts
    with the field at fault."""
    expected = EXPECTED[name]
    cache_dir = CacheDir(str(tmp_path)).make()
    base = EntrySpec("base", 2, 20)  # the corpus was cut from this entry: its blocks exist
    write_entry(cache_dir, base, "blocks")
    target = Path(cache_dir.caches if name.endswith(".kvc") else cache_dir.manifests) / name
    shutil.copyfile(CORPUS / name, target)
    outcome, message = load_hostile(str(target), cache_dir)
    kind = OUTCOME_OF_ERROR[expected["error"]]
    # (A top-level field's name may come with a leading dot: ".evil: unknown field".)
    field = message.removeprefix(".")
    assert (outcome, field[: len(expected["prefix"])]) == (kind, expected["prefix"]), message


def test_mutation_drill_only_corrupt_cache_errors_escape(tmp_path: Path) -> None:
    """>= 100,000 mutated headers (re-sealed so they reach field validation), every header
    bit flip, and the corpus: only CorruptCacheError (or a clean miss) escapes, memory
    stays within a small multiple of the bytes on disk, no open leaves the cache dir."""
    figures = run_drill_cli("hostile", tmp_path)
    assert figures["hostile cases"] >= 100_000 + figures["header bit flips (single)"]
    assert figures["header bit flips (single)"] > 0
    assert figures["header bit flips (blocks)"] > 0
    assert figures["end-to-end loads"] >= 1_000
    assert figures["corpus cases"] == len(EXPECTED)
    assert figures["tier loads"] >= len(EXPECTED)
    assert figures["losses"] == 0


def test_the_audit_hook_sees_an_open_outside_the_cache_dir_and_a_followed_link(
    tmp_path: Path,
) -> None:
    """The drill's path guard itself: an open outside the root, or of a link inside it
    without O_NOFOLLOW, is recorded (so a clean drill run means something)."""
    import os

    from kvtrio.drills.hostile import _Audit

    root = tmp_path / "cache"
    root.mkdir()
    (root / "link").symlink_to("/etc/hostname")
    audit = _Audit(root=str(root), active=True)
    audit("open", (str(root / "inside"), None, os.O_RDONLY))
    audit("open", ("/etc/hostname", None, os.O_RDONLY))
    audit("open", (str(root / "link"), None, os.O_RDONLY))
    audit("open", (str(root / "link"), None, os.O_RDONLY | os.O_NOFOLLOW))
    # Relative to a directory descriptor (the tier's rooted file operations): one name,
    # with O_NOFOLLOW; anything else may leave the root.
    audit("open", ("x.kvc", None, os.O_RDONLY | os.O_NOFOLLOW))
    audit("open", ("x.kvc", None, os.O_RDONLY))
    audit("open", ("../x.kvc", None, os.O_RDONLY | os.O_NOFOLLOW))
    assert audit.bad == [
        "opened outside the cache directory: /etc/hostname",
        f"opened a link without O_NOFOLLOW: {root / 'link'}",
        "opened a relative path that may leave the root: x.kvc",
        "opened a relative path that may leave the root: ../x.kvc",
    ]
