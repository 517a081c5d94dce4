"""ColdTier under faults, cancellation and shutdown: nothing torn, nothing leaked."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from kvtrio.actors.spill import SpillOutcome
from kvtrio.actors.tier import ColdTier
from kvtrio.errors import CorruptCacheError
from kvtrio.runtime.testing import FaultPlan
from kvtrio.storage.fileops import OS_FILE_OPS, TMP_SUFFIX, FaultyFileOps
from kvtrio.storage.reader import read_header

Prefill = Callable[[Sequence[int]], list[Any]]
TOKENS = list(range(1, 300))


def leftovers(tier: ColdTier) -> list[str]:
    """Tmp files (torn writes) anywhere in the tier's directories."""
    assert tier.root is not None
    return [p.name for p in tier.root.rglob(f"*{TMP_SUFFIX}")]


class Gate:
    """A file-ops hook that parks the worker on the Nth call of ``op`` until released."""

    def __init__(self, op: str, on_call: int) -> None:
        self.op, self.on_call = op, on_call
        self.calls = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, op: str) -> None:
        if op != self.op:
            return
        self.calls += 1
        if self.calls == self.on_call:
            self.reached.set()
            self.release.wait(10)

    async def wait_reached(self) -> None:
        await trio.to_thread.run_sync(self.reached.wait, 10)


async def test_a_failed_write_is_followed_by_successful_ones(
    tmp_path: Path, prefilled: Prefill
) -> None:
    """Deterministic (inline owner and I/O): fsync fails once; the queue goes on."""
    plan = FaultPlan().fail("fsync", on_call=1, error=OSError(5, "EIO"))
    async with ColdTier.open(
        tmp_path, inline=True, file_ops=FaultyFileOps(OS_FILE_OPS, plan)
    ) as tier:
        caches = prefilled(TOKENS)
        first = await tier.save("first", TOKENS, caches)
        second = await tier.save("second", TOKENS, caches)
        await tier.drain()
        bad, good = await first.wait(), await second.wait()
        assert bad.outcome is SpillOutcome.FAILED and isinstance(bad.error, OSError)
        assert str(bad.error) == "[Errno 5] EIO"
        assert good.written
        assert [e.key for e in await tier.list()] == ["second"]
        assert leftovers(tier) == []
    stats = tier.statistics()
    assert (stats.spill.failed, stats.spill.written) == (1, 1)
    assert stats.snapshots.live == 0


def kv_caches(layers: int, tokens: int) -> list[Any]:
    """Plain mlx-lm KV caches with random contents (owner thread)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for _ in range(layers):
        cache = KVCache()
        shape = (1, 2, tokens, 64)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        caches.append(cache)
    return caches


async def test_cancel_mid_write_removes_the_tmp_file_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    """docs/design.md invariant 6: the worker stops at the next tensor boundary, removes its tmp
    file,
    and only then does the ticket settle CANCELLED; no final file ever appears.

    The first data write is parked; the writer cannot get past the following tensors
    (its write pipeline is a few chunks deep, and 8 tensors are more) until it is
    released, after the cancel."""
    gate = Gate("write", on_call=1)
    async with ColdTier.open(tmp_path, file_ops=FaultyFileOps(OS_FILE_OPS, gate)) as tier:
        caches = await tier.owner.run(kv_caches, 4, 300)
        ticket = await tier.save("torn", list(range(300)), caches)
        await gate.wait_reached()
        assert len(leftovers(tier)) == 1  # the write is under way, in its tmp file
        tier.spill.abort()
        await trio.sleep(0.05)
        assert ticket.outcome is None  # the worker holds the buffers: not abandoned
        gate.release.set()
        assert (await ticket.wait()).outcome is SpillOutcome.CANCELLED
        assert leftovers(tier) == []
        assert not tier.path_of("torn").exists()
    assert tier.statistics().writer.cancelled == 1
    assert tier.statistics().snapshots.live == 0


async def test_every_settle_path_releases_each_snapshot_once(
    tmp_path: Path, prefilled: Prefill
) -> None:
    """Invariant 2: written, dropped, superseded, failed and cancelled-at-shutdown saves
    all release their snapshot exactly once; the ledger ends at zero live."""
    gate = Gate("open", on_call=1)
    plan = FaultPlan().fail("fsync", on_call=3)  # probe, again, then failing

    def hook(op: str) -> None:
        gate(op)
        plan(op)

    small = list(range(1, 40))
    async with ColdTier.open(
        tmp_path, file_ops=FaultyFileOps(OS_FILE_OPS, hook), shutdown_grace=0
    ) as tier:
        caches = await tier.owner.run(prefilled, small)
        per_save = (await tier.save("probe", small, caches)).nbytes
        await gate.wait_reached()  # "probe" is in flight, parked in open()
        tier.spill._queue.cap_bytes = 2.5 * per_save
        dropped = await tier.save("dropped", small, caches)
        superseded = await tier.save("again", small, caches)
        assert dropped.outcome is SpillOutcome.DROPPED
        tier.spill._queue.cap_bytes = float("inf")
        again = await tier.save("again", small, caches)
        failing = await tier.save("failing", small, caches)
        assert superseded.outcome is SpillOutcome.CANCELLED
        gate.release.set()
        assert (await again.wait()).written
        assert (await failing.wait()).outcome is SpillOutcome.FAILED
        late = await tier.save("late", small, caches)
        stats = tier.statistics().snapshots
        assert stats.live >= 1
    assert late.outcome in (SpillOutcome.WRITTEN, SpillOutcome.CANCELLED)
    stats = tier.statistics().snapshots
    assert (stats.created, stats.released, stats.live, stats.live_bytes) == (6, 6, 0, 0)
    assert leftovers(tier) == []


async def test_graceful_shutdown_writes_until_the_deadline_then_cancels(
    tmp_path: Path, prefilled: Prefill
) -> None:
    """Leaving the block drains for ``shutdown_grace`` seconds, then cancels the rest;
    every WRITTEN save loads, nothing is torn."""
    plan = FaultPlan().delay("write", seconds=0.02, times=10_000)
    async with ColdTier.open(
        tmp_path, file_ops=FaultyFileOps(OS_FILE_OPS, plan), shutdown_grace=0.3
    ) as tier:
        caches = await tier.owner.run(prefilled, TOKENS)
        tickets = [await tier.save(f"s{i}", TOKENS, caches) for i in range(12)]
        started = trio.current_time()
    elapsed = trio.current_time() - started
    outcomes = [t.outcome for t in tickets]
    assert set(outcomes) == {SpillOutcome.WRITTEN, SpillOutcome.CANCELLED}
    assert outcomes == sorted(outcomes, key=lambda o: o is SpillOutcome.CANCELLED)
    assert 0.3 <= elapsed < 2.0
    async with ColdTier.open(tmp_path) as tier:
        for ticket, outcome in zip(tickets, outcomes, strict=True):
            exists = tier.path_of(ticket.key).exists()
            assert exists == (outcome is SpillOutcome.WRITTEN)
            if exists:
                await tier.load(ticket.key)
        assert leftovers(tier) == []
        assert tier.statistics().debris_removed == 0


async def test_cancel_mid_write_in_the_blocks_layout_publishes_no_manifest(
    tmp_path: Path,
) -> None:
    """Invariant 6, blocks layout: the writer stops at the next block boundary; the
    manifest is never published (the blocks already stored wait for GC)."""
    gate = Gate("write", on_call=1)
    async with ColdTier.open(
        tmp_path, layout="blocks", block_tokens=64, file_ops=FaultyFileOps(OS_FILE_OPS, gate)
    ) as tier:
        caches = await tier.owner.run(kv_caches, 4, 300)
        ticket = await tier.save("torn", list(range(300)), caches)
        await gate.wait_reached()
        tier.spill.abort()
        gate.release.set()
        assert (await ticket.wait()).outcome is SpillOutcome.CANCELLED
        assert not tier.path_of("torn").exists()
        assert leftovers(tier) == []
        assert await tier.list() == []
    assert tier.statistics().snapshots.live == 0


async def test_loads_verify_on_request(tmp_path: Path) -> None:
    """Invariant 4: a verified load never returns bytes that fail their hash; verify=False
    (for callers who re-verify elsewhere) skips the check."""
    async with ColdTier.open(tmp_path) as tier:
        caches = await tier.owner.run(kv_caches, 1, 100)
        assert (await (await tier.save("k", list(range(100)), caches)).wait()).written
        path = tier.path_of("k")
        data_start = read_header(str(path)).data_start
        data = bytearray(path.read_bytes())
        data[data_start] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptCacheError, match=r"xxh3: tensor bytes do not match"):
            await tier.load("k")
        loaded = await tier.load("k", verify=False)
        assert loaded.tokens == tuple(range(100))
    stats = tier.statistics()
    assert (stats.loads, stats.load_failures) == (2, 1)
