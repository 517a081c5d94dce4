"""Golden files: every format version ever written stays readable, bit-exact.

The files in tests/golden/v<N>/ were written by tests/golden/make_golden.py when version N
was current and are never regenerated. A change that breaks one of these tests breaks
users' caches on disk.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import kvtrio
import pytest
from kvtrio.storage.format import FORMAT_VERSION, SUPPORTED_VERSIONS

from .conftest import assert_same, logical_state

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERSIONS = sorted(int(p.name[1:]) for p in GOLDEN.iterdir() if p.name.startswith("v"))


def test_every_supported_version_has_golden_files() -> None:
    assert set(VERSIONS) == set(SUPPORTED_VERSIONS) and FORMAT_VERSION in VERSIONS


@pytest.mark.parametrize("name", ["single.kvt", "manifest.kvt"])
@pytest.mark.parametrize("version", VERSIONS)
def test_golden_file_loads_bit_exact(version: int, name: str) -> None:
    script = _script()
    loaded = kvtrio.load_cache(GOLDEN / f"v{version}" / name)
    header = loaded.header
    assert header.format_version == version
    assert list(loaded.tokens) == script.tokens_for(version) and header.created_at == 0.0
    assert header.model_id == script.META["model_id"]
    assert header.config_fingerprint == script.META["config_fingerprint"]
    assert dict(header.meta) == {"note": script.META["note"]}
    expected = script.build_caches()
    assert len(loaded.caches) == len(expected)
    for got, want in zip(loaded.caches, expected, strict=True):
        assert_same(logical_state(got), logical_state(want))
    assert loaded.caches[0].min_reusable_offset == 9
    assert header.min_reusable_offset == 9 and not header.trimmable  # the rotating one wrapped
    (attachment,) = loaded.attachments
    (want_attachment,) = script.build_attachments()
    assert attachment.schema == want_attachment.schema
    assert dict(attachment.metadata) == dict(want_attachment.metadata)
    assert_same(list(attachment.arrays), list(want_attachment.arrays))


def test_golden_script_refuses_to_overwrite_a_written_version() -> None:
    assert os.path.isdir(GOLDEN / f"v{FORMAT_VERSION}")
    assert _script().main() == 1
