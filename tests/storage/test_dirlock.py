"""One owner per directory (kvtrio.storage.dirlock): the lock excludes a second holder,
names the holder, is released on close, and never follows a planted link.

Guards docs/design.md invariant 10.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtrio.storage.dirlock import LOCK_NAME, holder_pid, try_lock


def test_a_second_holder_is_refused_until_the_first_releases(tmp_path: Path) -> None:
    first = try_lock(str(tmp_path))
    assert first is not None and first.held
    assert try_lock(str(tmp_path)) is None  # flock is per open file: refused in-process too
    assert holder_pid(str(tmp_path)) == os.getpid()
    first.release()
    first.release()  # idempotent
    assert holder_pid(str(tmp_path)) is None
    again = try_lock(str(tmp_path))
    assert again is not None
    again.release()


def test_a_dead_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    """The kernel drops a flock when its process dies (kill -9 included); the pid left
    in the file is only a report."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from kvtrio.storage.dirlock import try_lock; "
            "lock = try_lock(sys.argv[1]); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert try_lock(str(tmp_path)) is None
        assert holder_pid(str(tmp_path)) == child.pid
    finally:
        child.kill()
        child.wait()
    lock = try_lock(str(tmp_path))
    assert lock is not None
    lock.release()


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    os.symlink(target, tmp_path / LOCK_NAME)
    with pytest.raises(OSError):
        try_lock(str(tmp_path))
    assert target.read_text() == "precious"


@pytest.mark.parametrize("kind", ["file", "fifo", "link to a file"])
def test_a_path_that_is_no_directory_is_refused_as_not_a_directory(
    tmp_path: Path, kind: str
) -> None:
    """``kvtrio serve --cache-dir FILE`` said ``FileExistsError: File exists`` (makedirs's
    error), which reads as if the directory were fine: the error is NotADirectoryError."""
    target = tmp_path / "target"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("not a directory")
    if kind == "link to a file":
        os.symlink(target, tmp_path / "link")
        target = tmp_path / "link"
    with pytest.raises(NotADirectoryError):
        try_lock(str(target))
