"""A local manifest store's listing: exactly the valid manifest names, however batched."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtrio.storage import manifeststore
from kvtrio.storage.manifeststore import LocalManifestStore
from kvtrio.storage.writer import TMP_SUFFIX

_BAD = ["-lead", "a b", "a" * 201, "\u00e9t\u00e9", ".hidden", "x\ny", "m00003.kvc" + TMP_SUFFIX]


@pytest.mark.parametrize("bad", _BAD)
def test_names_keeps_exactly_the_valid_manifest_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """``names`` checks the listing a batch at a time (one regex call per batch): one bad
    name among good ones (of any kind: a temporary file, or a name holding a newline,
    which the joined batch would otherwise read as two good names) drops that name
    alone, as the rule for one name does."""
    monkeypatch.setattr(manifeststore, "_NAMES_BATCH", 8)  # every batch of good names but one
    store = LocalManifestStore(str(tmp_path / "manifests"))
    good = [f"m{i:05d}.kvc" for i in range(37)] + ["a" * 200, "A.b_c-d"]
    for name in [*good, bad]:
        (tmp_path / "manifests" / name).write_bytes(b"")
    assert sorted(store.names()) == sorted(good)
