"""One owner per cold-tier directory, with two real processes (tests/actors/lock_host.py):
a second opener waits, then fails with DirectoryLockedError naming the holder; a rolling
restart hands over once the first has flushed, with nothing lost; `kvtrio gc` refuses
to run beside a live owner.

Guards docs/design.md invariant 10.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio
from kvtrio.actors.tier import ColdTier
from kvtrio.cli import main
from kvtrio.errors import DirectoryLockedError

HOST = Path(__file__).with_name("lock_host.py")


class _Host:
    """A lock_host.py child, its stdout lines in a queue (read on a thread)."""

    def __init__(self, directory: Path, lock_timeout: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(HOST), str(directory), str(lock_timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def expect(self, timeout: float = 60.0) -> str:
        return self.lines.get(timeout=timeout)

    def silent_for(self, seconds: float) -> bool:
        try:
            self.lines.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def finish(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def test_a_second_process_waits_then_fails_naming_the_holder(tmp_path: Path) -> None:
    first = _Host(tmp_path, 0.0)
    try:
        opened = first.expect()
        assert opened == f"opened {first.process.pid}"
        second = _Host(tmp_path, 0.5)
        try:
            assert second.expect() == f"locked {first.process.pid} {tmp_path}"
        finally:
            second.finish()
        first.send("close")
        assert first.expect() == "closed"
    finally:
        first.finish()


def test_a_rolling_restart_hands_over_with_nothing_lost(tmp_path: Path) -> None:
    """The new process waits while the old one still writes; the old one's saves in
    flight are flushed before the new one opens (and sweeps), so every entry survives."""
    old = _Host(tmp_path, 0.0)
    new: _Host | None = None
    try:
        assert old.expect().startswith("opened")
        new = _Host(tmp_path, 120.0)
        for n in range(3):
            old.send(f"insert {n}")
        for n in range(3):
            assert old.expect() == f"inserted {n}"
        assert new.silent_for(1.0)  # still waiting for the lock
        old.send("close")  # writes in flight: the close flushes them
        assert old.expect() == "closed"
        assert new.expect() == f"opened {new.process.pid}"
        new.send("count")
        assert new.expect() == "entries 3"
        new.send("close")
        assert new.expect() == "closed"
    finally:
        old.finish()
        if new is not None:
            new.finish()


async def test_an_opener_in_the_same_process_is_refused_too(tmp_path: Path) -> None:
    async with ColdTier.open(tmp_path, inline=True):
        with trio.fail_after(5):
            with pytest.raises(DirectoryLockedError) as info:
                async with ColdTier.open(tmp_path, inline=True, lock_timeout=0.2):
                    pass
        assert info.value.directory == str(tmp_path)
        assert info.value.waited >= 0.2
    async with ColdTier.open(tmp_path, inline=True, lock_timeout=0):
        pass  # released at close


async def test_gc_refuses_beside_a_live_owner(tmp_path: Path) -> None:
    async with ColdTier.open(tmp_path, inline=True):
        assert main(["gc", str(tmp_path), "--grace", "0"]) == 3
        assert main(["gc", str(tmp_path), "--grace", "0", "--dry-run"]) == 0
    assert main(["gc", str(tmp_path), "--grace", "0"]) == 0


async def test_a_save_in_flight_while_another_opener_runs_loses_nothing(tmp_path: Path) -> None:
    """Issue 14: before the lock, a second opener's sweep deleted the blocks of a save
    still in flight (its ticket said written; loading it missed). Held mid-write here, the
    save's directory is refused to a second opener and to ``kvtrio gc`` (exit 3), and once
    the write goes on the entry is on disk and loads after a restart."""
    import random
    import threading

    from kvtrio.actors.coldstore import ColdTierStore
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import Tier, TieredPromptCache, WritePolicy
    from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps
    from kvtrio.tinymodel import build_tiny_model, make_caches, prefill

    entered, go_on = threading.Event(), threading.Event()
    held = {"armed": False}

    def hold_writes(op: str) -> None:  # on the tier's worker thread
        if held["armed"] and op == "write":
            entered.set()
            assert go_on.wait(60)

    tiny = build_tiny_model(seed=5)
    model = ModelKey(tiny.model_id, tiny.fingerprint)
    rng = random.Random(7)
    tokens = [rng.randrange(512) for _ in range(150)]
    caches = make_caches(tiny)
    prefill(tiny, caches, tokens)
    ops = FaultyFileOps(OS_FILE_OPS, hold_writes)

    async def settle(cache: TieredPromptCache) -> None:
        await trio.to_thread.run_sync(entered.wait, 60)
        with pytest.raises(DirectoryLockedError):
            async with ColdTier.open(tmp_path, inline=True, lock_timeout=0.3):
                pass
        assert await trio.to_thread.run_sync(main, ["gc", str(tmp_path), "--grace", "0"]) == 3
        assert cache.statistics().cold_entries == 0  # still in flight
        go_on.set()

    async with MlxOwner.inline() as owner:
        async with ColdTier.open(tmp_path, layout="blocks", owner=owner, file_ops=ops) as tier:
            store = await ColdTierStore.create(tier)
            async with TieredPromptCache.open(
                owner, store, model, hot_budget=1 << 30, cold_budget=1 << 40,
                policy=WritePolicy.WRITE_THROUGH, min_free_bytes=0,
            ) as cache:
                held["armed"] = True
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(settle, cache)
                    await cache.insert(tokens, caches)
                    await cache.wait_writes_settled()
                assert cache.statistics().cold_entries == 1 and cache.statistics().drops == 0
        async with ColdTier.open(tmp_path, layout="blocks", owner=owner) as tier:
            store = await ColdTierStore.create(tier)
            async with TieredPromptCache.open(
                owner, store, model, hot_budget=1 << 30, cold_budget=1 << 40
            ) as cache:
                found = await cache.fetch_nearest([*tokens, 1])
                assert found.tier is Tier.COLD and found.remaining == (1,)
