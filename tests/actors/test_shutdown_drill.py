"""The graceful-shutdown drill: SIGTERM a process that saves caches in a loop.

Once: it exits 0, every acknowledged save loads and verifies, nothing is torn. Twice:
it exits within 1 s, and still nothing is torn.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from kvtrio.actors.tier import ColdTier
from kvtrio.storage.fileops import TMP_SUFFIX

CHILD = Path(__file__).with_name("shutdown_child.py")


def _start(directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _read_until_acks(proc: subprocess.Popen[str], acks: int) -> list[str]:
    return _read_until(proc, lambda lines: sum(line.startswith("ACK ") for line in lines) >= acks)


def _read_until_stopping(proc: subprocess.Popen[str]) -> list[str]:
    """The lines up to the child's STOPPING (it has seen the first signal): a second
    signal sent earlier could coalesce with the first (trio delivers a pending signal once)."""
    return _read_until(proc, lambda lines: bool(lines) and lines[-1] == "STOPPING")


def _read_until(proc: subprocess.Popen[str], done: Callable[[list[str]], bool]) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while not done(lines):
        line = proc.stdout.readline()
        assert line, f"child ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
        lines.append(line.strip())
        assert time.monotonic() < deadline, "child too slow"
    return lines


async def _check_nothing_torn(directory: Path, acked: dict[str, str]) -> int:
    """Every final file loads and verifies; every acknowledged save is there, bit-exact.
    Returns the number of files found. Tmp debris is checked before the tier opens."""
    assert list(directory.rglob(f"*{TMP_SUFFIX}")) == []
    async with ColdTier.open(directory) as tier:
        entries = await tier.list()
        files = sorted(p.name for p in tier.cache_dir.iterdir())
        assert len(files) == len(entries), f"a file failed validation: {files}"
        for entry in entries:
            loaded = await tier.load(entry.key)
            digest = await tier.owner.run(_digest, loaded.caches)
            if entry.key in acked:
                assert digest == acked.pop(entry.key)
        assert acked == {}, f"acknowledged saves missing: {sorted(acked)}"
    return len(entries)


def _digest(caches: list[object]) -> str:
    import mlx.core as mx

    digest = hashlib.sha256()
    for cache in caches:
        for array in (cache.keys, cache.values):  # type: ignore[attr-defined]
            live: Any = mx.contiguous(array)
            mx.eval(live)
            digest.update(memoryview(live))
    return digest.hexdigest()


def _acks(lines: list[str]) -> dict[str, str]:
    return dict(line.split()[1:3] for line in lines if line.startswith("ACK "))


async def test_sigterm_drains_and_every_acknowledged_save_loads(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    lines = await trio.to_thread.run_sync(_read_until_acks, proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = await trio.to_thread.run_sync(proc.communicate, None, 60)
    assert proc.returncode == 0, err
    acked = _acks(lines + out.splitlines())
    assert len(acked) >= 2
    assert await _check_nothing_torn(tmp_path, dict(acked)) >= len(acked)


async def test_sigterm_twice_exits_within_a_second_and_nothing_is_torn(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    lines = await trio.to_thread.run_sync(_read_until_acks, proc, 1)
    proc.send_signal(signal.SIGTERM)
    lines += await trio.to_thread.run_sync(_read_until_stopping, proc)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = await trio.to_thread.run_sync(proc.communicate, None, 60)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 1, err
    assert elapsed < 1.0, f"exited {elapsed:.2f} s after the second SIGTERM"
    await _check_nothing_torn(tmp_path, _acks(lines + out.splitlines()))
