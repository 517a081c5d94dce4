"""The crash drill's power-loss simulation keeps what fsync covered and loses the rest."""

from __future__ import annotations

import os
import random
from pathlib import Path

from kvtrio.drills.fileops import LossyFileOps
from kvtrio.storage.fileops import OS_FILE_OPS


def _lossy(tmp_path: Path, seed: int) -> LossyFileOps:
    backup = tmp_path / "backup"
    backup.mkdir(exist_ok=True)
    return LossyFileOps(OS_FILE_OPS, str(backup), random.Random(seed))


def _write(ops: LossyFileOps, path: Path, data: bytes, offset: int = 0) -> int:
    fd = ops.open(str(path), os.O_WRONLY | os.O_CREAT, 0o600)
    ops.write(fd, memoryview(data), offset)
    return fd


def test_synced_bytes_survive_and_unsynced_bytes_may_not(tmp_path: Path) -> None:
    """Bytes written before the file's fsync (and the dir's) always survive; bytes written
    after it are dropped, torn or zeroed in some seeds, never altered below the synced end."""
    outcomes = set()
    for seed in range(40):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        ops = _lossy(tmp_path, seed)
        fd = _write(ops, d / "f", b"A" * 100)
        ops.fsync(fd)
        ops.fsync_dir(str(d))
        ops.write(fd, memoryview(b"B" * 100), 100)
        ops.close(fd)
        assert ops.lose_unsynced() >= 1
        data = (d / "f").read_bytes()
        assert data[:100] == b"A" * 100
        outcomes.add(data[100:])
    assert b"" in outcomes  # dropped
    assert bytes(100) in outcomes  # zeroed: the size reached the disk, the data did not
    assert len(outcomes) >= 3  # and torn ones


def test_a_rename_without_a_directory_fsync_may_be_undone(tmp_path: Path) -> None:
    """tmp written and fsynced, renamed, no fsync_dir: after the loss the final name holds
    the whole file or nothing, and in some seeds the rename is undone."""
    undone = kept = 0
    for seed in range(40):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        ops = _lossy(tmp_path, seed)
        fd = _write(ops, d / "tmp", b"C" * 64)
        ops.fsync(fd)
        ops.close(fd)
        ops.rename(str(d / "tmp"), str(d / "final"))
        ops.lose_unsynced()
        if (d / "final").exists():
            assert (d / "final").read_bytes() == b"C" * 64
            kept += 1
        else:
            undone += 1
    assert undone > 0
    assert kept > 0
