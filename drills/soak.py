"""Overload soak: submit to the actors' Spill at twice the disk's write rate.

Theory of operation
-------------------
The drill first measures what the disk sustains: durable single-file writes (the storage
writer, fsync included) of ``item_bytes`` each, for a second. It then runs a
:class:`~kvtrio.actors.spill.Spill` whose store is that same write (on a worker thread),
and a producer that submits items of fresh memory at twice that rate for the soak
duration (3 s in CI, 60 s with ``--full``). A sampler checks, every 10 ms and after every
submission:

1. pending bytes never exceed the cap plus one item (docs/design.md invariant 3's soft cap);
2. RSS stays bounded: its growth over the run stays under the cap plus a few items plus
   a fixed allowance, while the producer offers many times that much;
3. every ticket settles once the queue is closed and drained, and the counts add up:
   submitted == written + dropped + cancelled + failed == released.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import attrs
from kvtrio.drills.report import DrillResult, Tally
from kvtrio.storage.format import CacheEntry, Header, TensorSlot
from kvtrio.storage.writer import write_single

__all__ = ["run_soak_drill"]

_ITEM_BYTES = 1 << 20
_CAP_ITEMS = 8
_RSS_ALLOWANCE = 64 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _header(nbytes: int) -> Header:
    slot = TensorSlot(shape=(nbytes,), dtype="uint8", nbytes=nbytes)
    entry = CacheEntry("kv", 0, 0, True, {}, (slot,))
    return Header(layout="single", tokens=(), caches=(entry,), created_at=0.0)


@attrs.define(eq=False)
class _Item:
    """One queued snapshot stand-in: it owns ``nbytes`` of memory until released."""

    data: bytearray | None
    nbytes: int


def _write(directory: Path, slot: int, item: _Item) -> None:
    assert item.data is not None
    write_single(str(directory / f"item{slot % 4}"), _header(item.nbytes), [memoryview(item.data)])


def _disk_rate(directory: Path) -> float:
    """Bytes per second of durable single-file writes of one item each, for ~1 s."""
    item = _Item(bytearray(os.urandom(_ITEM_BYTES)), _ITEM_BYTES)
    written, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0 or written < 4 * _ITEM_BYTES:
        _write(directory, written // _ITEM_BYTES, item)
        written += _ITEM_BYTES
    return written / (time.perf_counter() - start)


async def _soak(directory: Path, seconds: float, rate: float, tally: Tally) -> None:
    import trio
    from kvtrio.actors.spill import Spill, SpillTicket

    cap = _CAP_ITEMS * _ITEM_BYTES
    released = 0
    stored = 0

    def release(item: _Item) -> None:
        nonlocal released
        if item.data is None:
            tally.violation("an item was released twice")
        item.data = None  # the memory goes back now, as a snapshot's would
        released += 1

    async def store(item: _Item) -> None:
        nonlocal stored
        stored += 1
        await trio.to_thread.run_sync(_write, directory, stored, item)

    spill: Spill[_Item] = Spill(store, release, cap_bytes=cap, bytes_of=lambda i: i.nbytes)
    tickets: list[SpillTicket[_Item]] = []
    limit = cap + _ITEM_BYTES
    base_rss = _rss()

    def sample() -> None:
        stats = spill.statistics()
        tally.peak("peak pending bytes", stats.pending_bytes)
        tally.peak("peak RSS growth (bytes)", _rss() - base_rss)
        if stats.pending_bytes > limit:
            tally.violation(f"pending {stats.pending_bytes} bytes > cap + one item ({limit})")

    async def sampler() -> None:
        while True:
            sample()
            await trio.sleep(0.01)

    interval = _ITEM_BYTES / (2 * rate)
    async with trio.open_nursery() as nursery:
        await nursery.start(spill.run)
        nursery.start_soon(sampler)
        start = trio.current_time()
        n = 0
        while trio.current_time() - start < seconds:
            tickets.append(spill.submit_nowait(_Item(bytearray(_ITEM_BYTES), _ITEM_BYTES)))
            n += 1
            sample()
            await trio.sleep_until(start + n * interval)
        offered = trio.current_time() - start
        spill.close()
        with trio.move_on_after(60):
            await spill.drain()
        nursery.cancel_scope.cancel()
    stats = spill.statistics()
    unsettled = sum(not t.settled for t in tickets)
    tally.set("soak seconds", round(offered, 2))
    tally.add("items submitted", len(tickets))
    tally.set("offered bytes/s", round(len(tickets) * _ITEM_BYTES / offered))
    tally.set("written", stats.written)
    tally.set("dropped", stats.dropped)
    tally.set("cancelled", stats.cancelled)
    tally.set("failed", stats.failed)
    tally.set("released", released)
    tally.set("unsettled tickets", unsettled)
    tally.set("cap bytes", cap)
    if unsettled:
        tally.violation(f"{unsettled} tickets never settled")
    total = stats.written + stats.dropped + stats.cancelled + stats.failed
    if not len(tickets) == total == released:
        tally.violation(
            f"counts do not add up: submitted {len(tickets)}, settled {total}, released {released}"
        )
    if stats.failed:
        tally.violation(f"{stats.failed} writes failed")
    if stats.dropped == 0:
        tally.violation("nothing was dropped: the soak did not overload the queue")
    growth = tally.figures["peak RSS growth (bytes)"]
    assert isinstance(growth, int)
    if growth > cap + 4 * _ITEM_BYTES + _RSS_ALLOWANCE:
        tally.violation(f"RSS grew {growth} bytes, over cap + 4 items + {_RSS_ALLOWANCE}")


def run_soak_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """Overload a Spill at twice the measured disk rate: 3 s, or 60 s with ``full``."""
    import trio

    del seed  # timing-driven; nothing random to seed
    tally = Tally("soak")
    started = time.perf_counter()
    directory = workdir / "soak"
    directory.mkdir(parents=True, exist_ok=True)
    rate = _disk_rate(directory)
    tally.set("disk write rate (bytes/s)", round(rate))
    tally.set("item bytes", _ITEM_BYTES)
    seconds = float(os.environ.get("KVTRIO_DRILL_SOAK_S", 0)) or (60.0 if full else 3.0)
    trio.run(_soak, directory, seconds, rate, tally)
    if not math.isfinite(rate):
        tally.violation("could not measure the disk rate")
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)
