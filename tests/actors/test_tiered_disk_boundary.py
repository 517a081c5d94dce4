"""Neighbours on the disk (issue 15, item 3): nothing under the root is followed, and
nothing that is not a regular file is opened.

On the landed code a symlinked ``blocks/`` made open delete every 64-hex-named file
there that no manifest named (a Hugging Face blob cache, an OCI store); a FIFO in
``caches/`` blocked open forever; a directory named like an entry failed open with an
ExceptionGroup[IsADirectoryError].
"""

from __future__ import annotations

import os
from pathlib import Path

import kvtrio
import pytest
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import open_tiered_cache
from kvtrio.errors import InvalidInputError
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.maintenance import collect_garbage

from ..storage.test_boundary import _unblock_fifo_after

MODEL = ModelKey("tiny", "fp-1")
DEADLINE = 20.0
SENTINEL = "ab" * 32  # a 64-hex name, as a Hugging Face blob or an OCI layer has


def _outside_with_sentinel(tmp_path: Path) -> Path:
    outside = tmp_path / "hf-blobs"
    outside.mkdir()
    (outside / SENTINEL).write_bytes(b"someone else's weights")
    return outside


async def _open_and_close(root: Path) -> int:
    async with (
        MlxOwner.dedicated() as owner,
        open_tiered_cache(root, MODEL, owner=owner, hot_budget=1 << 20, cold_budget=1 << 30) as c,
    ):
        return c.statistics().cold_entries


async def test_symlinked_blocks_dir_is_refused_and_nothing_outside_is_deleted(
    tmp_path: Path,
) -> None:
    outside = _outside_with_sentinel(tmp_path)
    root = tmp_path / "tier"
    root.mkdir()
    (root / "blocks").symlink_to(outside)
    with trio.fail_after(DEADLINE), pytest.raises(InvalidInputError, match=r"blocks: a symbolic"):
        await _open_and_close(root)
    assert (outside / SENTINEL).read_bytes() == b"someone else's weights"


def test_block_store_never_traverses_a_symlinked_directory(tmp_path: Path) -> None:
    outside = _outside_with_sentinel(tmp_path)
    old_tmp = outside / ".x.0123.kvtrio-tmp"  # a tmp-like name: still not ours to delete
    old_tmp.write_bytes(b"")
    os.utime(old_tmp, (0, 0))
    (tmp_path / "caches").mkdir()
    (tmp_path / "blocks").symlink_to(outside)
    store = LocalBlockStore(str(tmp_path / "blocks"))
    assert list(store.iter_blocks()) == []
    assert store.has_many([SENTINEL]) == [False]
    assert store.delete_many([SENTINEL]) == 0
    report = collect_garbage(str(tmp_path / "caches"), store, grace_s=0.0)
    assert (report.deleted_blocks, report.tmp_removed) == (0, 0)
    assert (outside / SENTINEL).exists() and old_tmp.exists()


async def test_fifo_in_caches_does_not_block_open(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    (root / "caches").mkdir(parents=True)
    fifo = root / "caches" / "x.kvc"
    os.mkfifo(fifo)
    with _unblock_fifo_after(fifo, DEADLINE + 5):
        with trio.fail_after(DEADLINE):
            assert await _open_and_close(root) == 0
    assert fifo.exists()  # ignored, not deleted


async def test_directory_in_place_of_an_entry_does_not_fail_open(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    (root / "caches" / "x.kvc").mkdir(parents=True)
    with trio.fail_after(DEADLINE):
        assert await _open_and_close(root) == 0


async def test_symlinked_entry_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    (root / "caches").mkdir(parents=True)
    target = tmp_path / "elsewhere.kvc"  # a valid cache file, outside the root
    kvtrio.save_cache(target, [], [], meta={"model_id": "tiny", "config_fingerprint": "fp-1"})
    (root / "caches" / "x.kvc").symlink_to(target)
    with trio.fail_after(DEADLINE):
        assert await _open_and_close(root) == 0
    assert target.exists()
