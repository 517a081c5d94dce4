"""Durable writes: publication order, fault injection at every step, cancellation.

docs/design.md invariant 4: no final file name ever names a partial or unverified file.
Invariant 5: a durable acknowledgement means fsync(file), rename, fsync(dir) returned.
Invariant 6: a cancelled job stops at a tensor/block boundary and removes its tmp file.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.errors import OperationCancelled
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.cacheio import materialize, snapshot
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps
from kvtrio.storage.format import CacheEntry
from kvtrio.storage.reader import allocate_buffers, read_header, read_tensors
from kvtrio.storage.writer import write_blocks, write_single

from .conftest import BUILDERS


class Boom(OSError):
    pass


def _plan() -> Any:
    snap = snapshot([BUILDERS["kv"](), BUILDERS["arrays"]()], [])
    return snap, materialize(snap), materialize(snap, block_tokens=128)


def _fail_on(op: str, nth: int = 1) -> FaultyFileOps:
    seen = {"n": 0}

    def hook(name: str) -> None:
        if name == op:
            seen["n"] += 1
            if seen["n"] == nth:
                raise Boom(f"injected {op}")

    return FaultyFileOps(OS_FILE_OPS, hook)


def test_single_file_publication_order(tmp_path: Path) -> None:
    """Invariant 5: open, writes, fsync, rename, fsync_dir — in that order, nothing after."""
    events: list[str] = []
    snap, host, _ = _plan()
    write_single(
        str(tmp_path / "c.kvt"),
        snap.header,
        [h.pieces[0] for h in host],
        file_ops=FaultyFileOps(OS_FILE_OPS, events.append),
    )
    assert events[0] == "open" and events[-3:] == ["fsync", "rename", "fsync_dir"]
    assert set(events[1:-3]) == {"write"}


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("op", ["open", "write", "fsync", "rename", "fsync_dir"])
def test_single_write_fault_leaves_no_partial_file(tmp_path: Path, op: str, direct: bool) -> None:
    """Invariant 4: a fault at any step leaves neither a final name nor a tmp file.

    A failed fsync_dir happens after the rename: the file is complete but not known
    durable, so it is removed again and the error propagates (nothing is acknowledged).
    """
    snap, host, _ = _plan()
    target = tmp_path / "c.kvt"
    with pytest.raises(Boom, match=rf"^injected {op}$"):
        write_single(
            str(target),
            snap.header,
            [h.pieces[0] for h in host],
            file_ops=_fail_on(op),
            direct=direct,
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("op", ["open", "write", "fsync", "rename", "fsync_dir"])
@pytest.mark.parametrize("nth", [1, 3])
def test_block_write_fault_never_publishes_the_manifest(tmp_path: Path, op: str, nth: int) -> None:
    snap, _, pieces = _plan()
    ops = _fail_on(op, nth)
    store = LocalBlockStore(str(tmp_path / "blocks"), file_ops=ops)
    with pytest.raises(Boom):
        write_blocks(
            str(tmp_path / "m.kvt"),
            snap.header,
            [h.pieces for h in pieces],
            store,
            block_tokens=128,
            file_ops=ops,
        )
    assert not (tmp_path / "m.kvt").exists()  # fsync_dir included: removed again
    tmp_files = [n for n in os.listdir(tmp_path / "blocks") if n.endswith(".kvtrio-tmp")]
    assert tmp_files == []


def _cancel_after(n: int) -> Any:
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return calls["n"] > n

    return cancel


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("after", [0, 1, 2, 4])
def test_cancelled_single_write_removes_its_tmp_file(
    tmp_path: Path, after: int, direct: bool
) -> None:
    snap, host, _ = _plan()
    with pytest.raises(OperationCancelled, match=r"^write cancelled at a step boundary$"):
        write_single(
            str(tmp_path / "c.kvt"),
            snap.header,
            [h.pieces[0] for h in host],
            cancel=_cancel_after(after),
            direct=direct,
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("after", [0, 1, 3])
def test_cancelled_block_write_publishes_nothing(tmp_path: Path, after: int) -> None:
    snap, _, pieces = _plan()
    store = LocalBlockStore(str(tmp_path / "blocks"))
    with pytest.raises(OperationCancelled):
        write_blocks(
            str(tmp_path / "m.kvt"),
            snap.header,
            [h.pieces for h in pieces],
            store,
            block_tokens=128,
            cancel=_cancel_after(after),
        )
    assert not (tmp_path / "m.kvt").exists()


def test_cancelled_read_stops_at_a_boundary(tmp_path: Path) -> None:
    kvtrio.save_cache(tmp_path / "c.kvt", [], [BUILDERS["kv"]()])
    cache_file = read_header(str(tmp_path / "c.kvt"))
    bufs = [[memoryview(b) for b in p] for p in allocate_buffers(cache_file.header)]
    with pytest.raises(OperationCancelled, match=r"^read cancelled at a step boundary$"):
        read_tensors(cache_file, bufs, cancel=_cancel_after(1))


def test_read_fault_propagates(tmp_path: Path) -> None:
    kvtrio.save_cache(tmp_path / "c.kvt", [], [BUILDERS["kv"]()])
    cache_file = read_header(str(tmp_path / "c.kvt"))
    bufs = [[memoryview(b) for b in p] for p in allocate_buffers(cache_file.header)]
    with pytest.raises(Boom, match=r"^injected read$"):
        read_tensors(cache_file, bufs, file_ops=_fail_on("read"))


def test_replaced_file_is_detected_between_header_and_data(tmp_path: Path) -> None:
    kvtrio.save_cache(tmp_path / "c.kvt", [], [BUILDERS["kv"]()])
    cache_file = read_header(str(tmp_path / "c.kvt"))
    kvtrio.save_cache(tmp_path / "c.kvt", [], [BUILDERS["kv"]()])
    bufs = [[memoryview(b) for b in p] for p in allocate_buffers(cache_file.header)]
    with pytest.raises(kvtrio.CorruptCacheError, match=r"^file: replaced or resized since"):
        read_tensors(cache_file, bufs)


@pytest.mark.parametrize("direct", [True, False])
def test_direct_and_buffered_writes_read_back_identically(tmp_path: Path, direct: bool) -> None:
    snap, host, _ = _plan()
    path = str(tmp_path / "c.kvt")
    write_single(path, snap.header, [h.pieces[0] for h in host], direct=direct)
    cache_file = read_header(path)
    bufs = allocate_buffers(cache_file.header)
    read_tensors(cache_file, [[memoryview(b) for b in p] for p in bufs])
    assert [bytes(b[0]) for b in bufs] == [bytes(h.pieces[0]) for h in host]


def test_page_aligned_sources_are_written_without_a_copy(tmp_path: Path) -> None:
    """A source the device accepts for O_DIRECT goes straight to disk; the result is the
    same file a bounce-buffered write makes."""
    from kvtrio.storage.format import Header, TensorSlot

    sizes = [3 * 8 * 1024 * 1024 + 4096, 12288, 5000]
    sources = []
    for i, size in enumerate(sizes):
        buf = mmap.mmap(-1, size)  # page aligned
        buf.write(bytes([i + 1]) * size)
        sources.append(memoryview(buf))
    slots = tuple(TensorSlot((n,), "uint8", n) for n in sizes)
    entry = CacheEntry("arrays", 0, 0, False, {}, slots)
    header = Header(layout="single", tokens=(), caches=(entry,), created_at=0.0)
    write_single(str(tmp_path / "a.kvt"), header, sources, direct=True)
    write_single(str(tmp_path / "b.kvt"), header, sources, direct=False)
    for name in ("a.kvt", "b.kvt"):
        cache_file = read_header(str(tmp_path / name))
        bufs = allocate_buffers(cache_file.header)
        read_tensors(cache_file, [[memoryview(b) for b in p] for p in bufs])
        assert [bytes(b[0]) for b in bufs] == [bytes(s) for s in sources]


def test_reads_work_without_preadv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some macOS Pythons lack os.preadv: reads fall back to lseek + readv."""
    from kvtrio.storage import fileops

    monkeypatch.setattr(fileops, "_HAS_PREADV", False)
    original = BUILDERS["kv"]()
    kvtrio.save_cache(tmp_path / "c.kvt", [], [original])
    loaded = kvtrio.load_cache(tmp_path / "c.kvt").caches[0]
    assert mx.array_equal(loaded.keys, original.keys[..., : original.offset, :]).item()
