"""Regression: a process whose MLX owner thread did work must exit cleanly.

MLX keeps per-thread streams; left to process teardown they abort some exits
("terminate called without an active exception", SIGABRT): 6 of 30 runs of a bare thread
doing one matmul, 1 of 16 runs of a ColdTier save + load, seen here. The owner releases
its thread's streams before the thread ends (``release_thread_streams``): 0 of 40 and
0 of 24 with it. The abort is timing-dependent, so this guard is probabilistic.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

SCRIPT = """
import mlx.core as mx
import trio
from kvtrio.actors.owner import MlxOwner


def step() -> float:
    a = mx.random.normal((128, 128))
    return float((a @ a).sum().item())


async def main() -> None:
    async with MlxOwner.dedicated() as owner:
        await owner.run(step)


trio.run(main)
"""

RUNS = 10


async def test_processes_that_used_the_owner_thread_exit_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "owner_exit.py"
    script.write_text(SCRIPT)
    results: list[subprocess.CompletedProcess[bytes]] = []
    limiter = trio.CapacityLimiter(2)

    async def one() -> None:
        async with limiter:
            results.append(
                await trio.run_process(
                    [sys.executable, str(script)], capture_stderr=True, check=False
                )
            )

    async with trio.open_nursery() as nursery:
        for _ in range(RUNS):
            nursery.start_soon(one)
    failures = [(r.returncode, r.stderr.decode()[-300:]) for r in results if r.returncode != 0]
    assert failures == []
