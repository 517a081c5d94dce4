"""`kvtrio inspect`, `kvtrio verify` and `kvtrio gc` on files kvtrio wrote."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from kvtrio.api import save_cache
from kvtrio.cli import main
from kvtrio.storage.reader import read_header
from kvtrio.tinymodel import build_tiny_model, make_caches, prefill


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with two single-layout files and two manifests sharing blocks."""
    root = tmp_path_factory.mktemp("tree")
    tiny = build_tiny_model(seed=9)
    tokens = list(range(3, 150))
    caches = make_caches(tiny)
    prefill(tiny, caches, tokens)
    meta = {"model_id": tiny.model_id, "config_fingerprint": tiny.fingerprint, "turn": "1"}
    save_cache(root / "a.kvc", tokens, caches, meta=meta)
    save_cache(root / "m1.kvc", tokens, caches, meta=meta, layout="blocks", block_tokens=64)
    caches2 = make_caches(tiny)
    prefill(tiny, caches2, [*tokens[:128], 7, 7, 7])
    save_cache(
        root / "m2.kvc",
        [*tokens[:128], 7, 7, 7],
        caches2,
        meta=meta,
        layout="blocks",
        block_tokens=64,
    )
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_inspect_prints_the_header_as_json(
    written: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(written / "m1.kvc"), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["layout"] == "blocks" and body["tokens"] == 147
    assert body["model_id"] == "kvtrio/tiny-llama" and body["meta"] == {"turn": "1"}
    assert [c["kind"] for c in body["caches"]] == ["kv", "kv"]
    assert all(len(t["blocks"]) == 3 for c in body["caches"] for t in c["tensors"])


def test_inspect_shows_tables_and_refuses_a_corrupt_file(
    written: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(written / "a.kvc")]) == 0
    out = capsys.readouterr().out
    assert "layers" in out and "tensors" in out and "kvtrio/tiny-llama" in out
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(b"not a cache file at all" * 10)
    assert main(["inspect", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().err


def test_inspect_names_a_path_it_cannot_read_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory or a missing path is a usage error (exit 2) in one line naming the path
    once: before, ``kvtrio inspect DIR`` printed "DIR: DIR: not a regular file" and a
    missing file "PATH: [Errno 2] No such file or directory: 'PATH'"."""
    assert main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"kvtrio inspect: {tmp_path}: not a regular file\n"
    missing = tmp_path / "missing.kvc"
    assert main(["inspect", str(missing)]) == 2
    assert capsys.readouterr().err == f"kvtrio inspect: {missing}: No such file or directory\n"


def test_verify_passes_a_good_tree(written: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(written), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] and body["files_ok"] == 3 and body["blocks_ok"] > 0


def test_verify_exits_1_naming_each_bad_file(
    written: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = _copy(written, tmp_path / "tree")
    data_start = read_header(str(tree / "a.kvc")).data_start
    with open(tree / "a.kvc", "r+b") as f:  # a tensor byte: its xxh3 no longer matches
        f.seek(data_start + 5)
        f.write(b"\xff\xfe")
    blocks = sorted((tree / "blocks").iterdir())
    with open(blocks[0], "r+b") as f:
        f.write(b"\x00\x01")
    assert main(["verify", str(tree)]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert str(tree / "a.kvc") in out
    assert blocks[0].name in out
    assert "corruption found" in out


def test_gc_dry_run_deletes_nothing_and_gc_respects_the_grace_period(
    written: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = _copy(written, tmp_path / "tree")
    os.unlink(tree / "m2.kvc")  # its unshared blocks are now garbage
    before = sorted(p.name for p in (tree / "blocks").iterdir())
    assert main(["gc", str(tree), "--grace", "0", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["deleted_blocks"] > 0 and len(dry["would_delete"]) == dry["deleted_blocks"]
    assert {Path(p).name for p in dry["would_delete"]} <= set(before)
    assert sorted(p.name for p in (tree / "blocks").iterdir()) == before
    assert main(["gc", str(tree), "--grace", "3600", "--json"]) == 0
    young = json.loads(capsys.readouterr().out)
    assert young["deleted_blocks"] == 0 and young["young_unreferenced"] == dry["deleted_blocks"]
    past = time.time() - 7200
    for path in (tree / "blocks").iterdir():
        os.utime(path, (past, past))
    assert main(["gc", str(tree), "--grace", "3600"]) == 0
    after = sorted(p.name for p in (tree / "blocks").iterdir())
    assert len(after) == len(before) - dry["deleted_blocks"]
    assert main(["verify", str(tree), "--json"]) == 0
