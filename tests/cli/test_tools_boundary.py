"""Operator tools judge only kvtrio's files, and every error is one line, exit 2
(issue 15, item 10).

On the landed code ``kvtrio verify`` on the demo's parent directory reported its
``conversations.json`` and mlx-lm ``.safetensors`` files as corruption (exit 1, no kvtrio
file checked), and ``kvtrio drill shutdown --dir MISSING`` printed a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvtrio.cli import main
from kvtrio.storage.dirlock import LOCK_NAME

from .test_tools import written  # noqa: F401  (the fixture)


def _with_foreign_files(tree: Path) -> list[Path]:
    foreign = [tree / "conversations.json", tree / "prompt.safetensors"]
    foreign[0].write_text(json.dumps({"turns": []}))
    foreign[1].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b"\0" * 64)
    return foreign


@pytest.fixture
def foreign_tree(written: Path, tmp_path: Path) -> tuple[Path, list[Path]]:  # noqa: F811
    """A copy of the written tier's caches with two files beside them that are not
    kvtrio's, and those two."""
    tree = tmp_path / "tree"
    shutil.copytree(written, tree)
    return tree, _with_foreign_files(tree)


def test_verify_lists_foreign_files_apart_and_passes(
    foreign_tree: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    tree, foreign = foreign_tree
    assert main(["verify", str(tree), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] and body["files_ok"] == 3 and body["bad_files"] == []
    assert sorted(body["foreign_files"]) == sorted(str(p) for p in foreign)
    assert main(["verify", str(tree)]) == 0
    assert "not kvtrio's" in capsys.readouterr().out


def test_gc_lists_foreign_files_apart_and_leaves_them(
    foreign_tree: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    tree, foreign = foreign_tree
    assert main(["gc", str(tree), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["unreadable"] == [] and sorted(body["foreign"]) == sorted(map(str, foreign))
    assert all(p.exists() for p in foreign)


def test_verify_of_a_directory_without_a_tier_says_so_and_suggests_one(
    written: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    parent = tmp_path / "demo"
    parent.mkdir()
    _with_foreign_files(parent)
    tier = parent / "tier"
    shutil.copytree(written, tier / "caches")
    for command in ("verify", "gc"):
        assert main([command, str(parent)]) == 2
        out, err = capsys.readouterr()
        assert out == ""  # verify drew its progress bar first (an empty line) before
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"kvtrio {command}: {parent}: holds no kvtrio tier")
        assert f"a cold tier is at {tier}: try that" in err


def test_gc_of_a_directory_without_a_tier_leaves_it_as_it_was(tmp_path: Path) -> None:
    """``kvtrio gc`` on the wrong directory (a model's, a home directory) refuses it
    without taking the tier's lock there: it used to leave a ``.kvtrio-lock`` file in
    it, and then say it held no tier."""
    model = tmp_path / "model"
    model.mkdir()
    before = sorted(p.name for p in _with_foreign_files(model))
    assert main(["gc", str(model)]) == 2
    assert sorted(p.name for p in model.iterdir()) == before
    assert not (model / LOCK_NAME).exists()


@pytest.mark.parametrize("flag", ["--grace=-1", "--grace=nan", "--wait=-1", "--wait=nan"])
def test_gc_refuses_a_negative_or_nan_time(
    written: Path,  # noqa: F811
    tmp_path: Path,
    flag: str,
) -> None:
    """``--wait -1`` ran and, beside a live owner, said it 'waited -1 s'; ``--grace nan``
    ran a collection that could delete nothing."""
    tree = tmp_path / "tree"
    shutil.copytree(written, tree)
    assert main(["gc", str(tree), flag]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}/x.kvc"],
        ["verify", "{missing}"],
        ["gc", "{missing}"],
        ["drill", "shutdown", "--dir", "{missing}"],
    ],
)
def test_every_cli_error_is_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    missing = tmp_path / "missing"
    assert main([a.format(missing=missing) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"kvtrio {argv[0]}")
