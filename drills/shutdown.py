"""Graceful shutdown drills through ColdTier: SIGTERM once during a flush, and twice.

Theory of operation
-------------------
The server stand-in is the actors engineer's ``tests/actors/shutdown_child.py``: it
saves 4-layer caches through a real :class:`~kvtrio.actors.tier.ColdTier` in a loop
(``shutdown_grace=20`` s) and prints ``ACK key sha256`` for each save acknowledged
WRITTEN (durable). This program runs it in rounds:

- ``graceful``: SIGTERM once acknowledgements flow (a flush is in progress): the child
  must exit 0 within its 20 s deadline, having drained;
- ``forced``: SIGTERM, then SIGTERM again as soon as the child says it has seen the
  first (``STOPPING``): the child must exit (status 1) within 1 s of the second signal.
  Its exit waits for the owner job in flight (MLX work cannot be interrupted), so the
  stand-in's jobs are short, like a server's model steps (one tensor each).

After every round the directory is reopened: no tmp file, every file under a final name
loads and verifies, and every acknowledged save loads with exactly the acknowledged
bytes (sha256 of the live keys and values).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtrio.drills.report import DrillResult, Tally
from kvtrio.storage.fileops import TMP_SUFFIX

__all__ = ["run_shutdown_drill"]

CHILD = Path(__file__).resolve().parents[1] / "tests" / "actors" / "shutdown_child.py"
_GRACE = 20.0  # the child's ColdTier shutdown_grace


def _start(directory: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _read_acks(proc: subprocess.Popen[str], wanted: int) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while sum(line.startswith("ACK ") for line in lines) < wanted:
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            raise RuntimeError(f"the child stopped before {wanted} acknowledgements")
        lines.append(line.strip())
    return lines


def _read_until_stopping(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 30
    while not lines or lines[-1] != "STOPPING":
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            break  # ended or silent: the resend below still covers a lost second signal
        lines.append(line.strip())
    return lines


def _acks(lines: list[str]) -> dict[str, str]:
    return dict(line.split()[1:3] for line in lines if line.startswith("ACK "))


def _digest(caches: list[Any]) -> str:
    import mlx.core as mx

    digest = hashlib.sha256()
    for cache in caches:
        for array in (cache.keys, cache.values):
            live = mx.contiguous(array[..., : cache.offset, :])
            mx.eval(live)
            digest.update(memoryview(live))  # type: ignore[arg-type]
    return digest.hexdigest()


async def _check(directory: Path, acked: dict[str, str], where: str, tally: Tally) -> None:
    from kvtrio.actors.tier import ColdTier

    debris = list(directory.rglob(f"*{TMP_SUFFIX}"))
    if debris:
        tally.violation(f"{where}: tmp files left: {[p.name for p in debris[:3]]}")
    async with ColdTier.open(directory) as tier:
        entries = await tier.list()
        files = [p for p in tier.cache_dir.iterdir() if not p.name.startswith(".")]
        if len(files) != len(entries):
            tally.violation(f"{where}: {len(files) - len(entries)} torn file(s) under final names")
        for entry in entries:
            loaded = await tier.load(entry.key)
            digest = await tier.owner.run(_digest, loaded.caches)
            tally.add("entries verified")
            want = acked.pop(entry.key, None)
            if want is not None and digest != want:
                tally.violation(f"{where}: acknowledged {entry.key} has other bytes")
    for key in acked:
        tally.violation(f"{where}: acknowledged save {key} lost")


def _round(directory: Path, forced: bool, tally: Tally) -> dict[str, str]:
    where = f"{'forced' if forced else 'graceful'} round in {directory.name}"
    proc = _start(directory)
    try:
        lines = _read_acks(proc, 1 if forced else 2)
    except RuntimeError as exc:
        proc.kill()
        _, err = proc.communicate()
        tally.violation(f"{where}: {exc}: {err[-500:]}")
        return {}
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    if forced:
        # The second signal goes once the child has seen the first (it prints STOPPING):
        # two signals that arrive before trio reads the first are delivered as one.
        lines += _read_until_stopping(proc)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        # Two signals close together may coalesce into one: if it has not ended after
        # half a second, the second one was not seen; send it again.
        while proc.poll() is None and time.monotonic() - sent < 10:
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                tally.add("second signals resent (coalesced)")
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - sent
    acked = _acks(lines + out.splitlines())
    tally.add("acknowledged saves", len(acked))
    if forced:
        tally.add("forced rounds")
        tally.peak("slowest exit after the second SIGTERM (s)", round(elapsed, 3))
        # 1: cancelled; -SIGTERM: a resent signal met the process already on its way out.
        if proc.returncode not in (1, -signal.SIGTERM) or elapsed > 1.0:
            tally.violation(
                f"{where}: exit {proc.returncode} {elapsed:.2f} s after the 2nd SIGTERM"
            )
    else:
        tally.add("graceful rounds")
        tally.peak("slowest drain after SIGTERM (s)", round(elapsed, 3))
        tally.set("drain deadline (s)", _GRACE)
        if proc.returncode != 0 or elapsed > _GRACE + 5:
            tally.violation(f"{where}: exit {proc.returncode} after {elapsed:.2f} s: {err[-300:]}")
    return acked


def run_shutdown_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """SIGTERM drills through ColdTier: one round of each (five with ``full``)."""
    import trio

    del seed
    tally = Tally("shutdown")
    started = time.perf_counter()
    if not CHILD.exists():
        tally.violation(f"the shutdown child is missing: {CHILD}")
        return tally.result(time.perf_counter() - started)
    for i in range(5 if full else 1):
        for forced in (False, True):
            directory = workdir / f"round{i}-{'forced' if forced else 'graceful'}"
            directory.mkdir(parents=True, exist_ok=True)
            acked = _round(directory, forced, tally)
            trio.run(_check, directory, acked, directory.name, tally)
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)
