"""Pre-faulting load destinations (storage/memadvise.py), the reader's optional helper
threads, and destinations allocated without a zero fill (hostbuffers._untouched_uint8),
each switched on through IoOptions.

docs/design.md invariant 4: a reader never returns bytes it has not checked against the header's
hashes
when asked to verify — with the verify thread and the pre-fault thread on as well.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys
import threading
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.storage import hostbuffers, memadvise, reader
from kvtrio.storage.fileops import OsFileOps
from kvtrio.storage.options import IoOptions

from .conftest import assert_same, make_kv

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice")


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> memadvise._State:
    state = memadvise._State(hugepage=True, populate=True)
    monkeypatch.setattr(memadvise, "_state", state)
    return state


def _helper_threads() -> list[str]:
    names = ("kvtrio-prefault", "kvtrio-verify")
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


@linux_only
def test_prefault_keeps_the_bytes(fresh_state: memadvise._State) -> None:
    if memadvise._madvise is None:
        pytest.skip("no libc madvise")
    size = 4 * memadvise.HUGE_PAGE
    region = mmap.mmap(-1, size)
    region[: 4096 * 3] = b"\x5a" * (4096 * 3)
    view = memoryview(region)[100:]  # not page aligned: only whole pages inside are advised
    done = memadvise.prefault(view)
    assert 0 < done <= len(view) and done % 4096 == 0
    assert region[: 4096 * 3] == b"\x5a" * (4096 * 3) and region[4096 * 3 :] == bytes(size - 12288)
    stats = memadvise.statistics()
    assert stats.calls == 1 and stats.populated_bytes == done


def test_prefault_does_nothing_without_madvise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memadvise, "_madvise", None)
    region = mmap.mmap(-1, 1 << 20)
    assert memadvise.prefault(memoryview(region)) == 0
    with memadvise.PrefaultAhead([memoryview(region)]) as ahead:
        assert ahead._thread is None
        ahead.ready(0)


def test_prefault_stops_asking_a_kernel_that_refuses(
    monkeypatch: pytest.MonkeyPatch, fresh_state: memadvise._State
) -> None:
    """EINVAL (a kernel before 5.14, THP off): no error, nothing populated, no retries."""
    calls: list[int] = []

    def refusing(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(memadvise, "_madvise", refusing)
    region = mmap.mmap(-1, 3 * memadvise.HUGE_PAGE)
    assert memadvise.prefault(memoryview(region), huge=True) == 0
    assert calls == [memadvise.MADV_HUGEPAGE, memadvise.MADV_POPULATE_WRITE]
    assert not fresh_state.hugepage and not fresh_state.populate and fresh_state.failures == 2
    assert memadvise.prefault(memoryview(region), huge=True) == 0
    assert len(calls) == 2


def test_huge_pages_are_asked_for_only_when_wanted(
    monkeypatch: pytest.MonkeyPatch, fresh_state: memadvise._State
) -> None:
    """IoOptions.prefault_huge off (the default): MADV_HUGEPAGE is never sent."""
    calls: list[int] = []

    def accepting(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        return 0

    monkeypatch.setattr(memadvise, "_madvise", accepting)
    region = mmap.mmap(-1, 3 * memadvise.HUGE_PAGE)
    assert memadvise.prefault(memoryview(region)) == 3 * memadvise.HUGE_PAGE
    assert calls == [memadvise.MADV_POPULATE_WRITE]
    memadvise.prefault(memoryview(region), huge=True)
    assert calls[1:] == [memadvise.MADV_HUGEPAGE, memadvise.MADV_POPULATE_WRITE]


def test_prefault_skips_small_and_read_only_ranges(fresh_state: memadvise._State) -> None:
    assert memadvise.prefault(memoryview(bytearray(4096))) == 0
    assert memadvise.prefault(memoryview(bytes(1 << 20))) == 0
    assert fresh_state.calls == 0


@linux_only
def test_prefault_ahead_runs_every_range_and_joins(fresh_state: memadvise._State) -> None:
    if memadvise._madvise is None:
        pytest.skip("no libc madvise")
    region = mmap.mmap(-1, 8 << 20)
    views = [memoryview(region)[i << 20 : (i + 1) << 20] for i in range(8)]
    with memadvise.PrefaultAhead(views) as ahead:
        for k in range(len(views)):
            ahead.ready(k)
    assert ahead._thread is None and _helper_threads() == []
    assert fresh_state.calls == 8 and fresh_state.populated_bytes == 8 << 20


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks small enough that the helper threads run on a small cache."""
    monkeypatch.setattr(reader, "_CHUNK", 64 * 1024)
    monkeypatch.setattr(memadvise, "_MIN_BYTES", 4096)


def _helpers_on(direct: bool) -> IoOptions:
    """The reader's optional helper threads on, and unfilled destinations."""
    return IoOptions(
        alloc_untouched=True, prefault_ahead=True, load_hash_thread=True, load_direct=direct
    )


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("layout", ["single", "blocks"])
def test_loads_with_the_helper_threads_are_bit_exact(
    tmp_path: Path, layout: Any, direct: bool
) -> None:
    original = make_kv([600, 3])
    kvtrio.save_cache(tmp_path / "c.kvt", list(range(603)), [original], layout=layout)
    loaded = kvtrio.load_cache(tmp_path / "c.kvt", options=_helpers_on(direct)).caches[0]
    assert_same(
        [loaded.keys, loaded.values],
        [original.keys[..., :603, :], original.values[..., :603, :]],
    )
    assert _helper_threads() == []


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("direct", [False, True])
def test_a_corrupt_chunk_is_caught_by_the_verify_thread(tmp_path: Path, direct: bool) -> None:
    """Invariant 4: a byte flipped in a late chunk of a tensor fails the load."""
    path = tmp_path / "c.kvt"
    kvtrio.save_cache(path, list(range(603)), [make_kv([600, 3])])
    header = reader.read_header(str(path))
    slot = next(iter(header.header.slots()))
    with open(path, "r+b") as f:
        f.seek(header.data_start + (slot.off or 0) + slot.nbytes - 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(kvtrio.CorruptCacheError, match=r"\.xxh3: tensor bytes do not match"):
        kvtrio.load_cache(path, options=_helpers_on(direct))
    assert _helper_threads() == []


def _no_zeros(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("mx.zeros called: the unfilled allocation fell back to a zero fill")


def _no_load(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("mx.load called: the zero-filled allocation was not asked for")


def test_destinations_are_allocated_without_a_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unfilled path itself works on this MLX: with mx.zeros made to fail, the
    fallback cannot pass for it."""
    monkeypatch.setattr(mx, "zeros", _no_zeros)  # the module hostbuffers calls
    array = hostbuffers._untouched_uint8(3 * 4096 + 5, untouched=True)
    assert array.shape == (3 * 4096 + 5,) and array.dtype == mx.uint8
    view = memoryview(array)
    assert not view.readonly and view.c_contiguous


def test_a_load_allocates_without_a_fill_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IoOptions() (alloc_untouched on): a load never zero-fills a non-empty destination."""
    original = make_kv([600, 3])
    kvtrio.save_cache(tmp_path / "c.kvt", list(range(603)), [original])
    monkeypatch.setattr(mx, "zeros", _no_zeros)
    loaded = kvtrio.load_cache(tmp_path / "c.kvt").caches[0]
    monkeypatch.undo()
    assert_same([loaded.keys], [original.keys[..., :603, :]])


def test_allocation_falls_back_to_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("this MLX cannot load that stream")

    monkeypatch.setattr(mx, "load", broken)  # the module hostbuffers calls
    array = hostbuffers._untouched_uint8(8192, untouched=True)
    assert array.shape == (8192,) and not mx.any(array).item()


class DropRecorder(OsFileOps):
    def __init__(self) -> None:
        self.dropped: list[tuple[int, int]] = []

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        self.dropped.append((offset, length))
        super().drop_behind(fd, offset, length)


@pytest.mark.parametrize("willneed", [False, True])
@pytest.mark.parametrize("verify", [True, False])
def test_buffered_loads_drop_what_they_read_behind_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool, willneed: bool
) -> None:
    """Chunks already read (and hashed) leave the page cache; the bytes are exact."""
    monkeypatch.setattr(reader, "_CHUNK", 16 * 1024)
    monkeypatch.setattr(reader, "_SUB", 4096)
    original = make_kv([600, 3])
    kvtrio.save_cache(tmp_path / "c.kvt", list(range(603)), [original])
    cache_file = reader.read_header(str(tmp_path / "c.kvt"))
    ops = DropRecorder()
    bufs = reader.allocate_buffers(cache_file.header)
    reader.read_tensors(
        cache_file,
        [[memoryview(b) for b in p] for p in bufs],
        verify=verify,
        file_ops=ops,
        options=IoOptions(willneed=willneed, load_direct=False),
    )
    dense: Any = mx.contiguous(original.keys[..., :603, :])
    keys = bytes(memoryview(dense).cast("B"))
    assert bytes(bufs[0][0]) == keys
    slot = next(iter(cache_file.header.slots()))
    start = cache_file.data_start + (slot.off or 0)
    chunks = -(-slot.nbytes // reader._CHUNK)
    assert ops.dropped[: chunks - reader._BEHIND] == [
        (start + k * reader._CHUNK, reader._CHUNK) for k in range(chunks - reader._BEHIND)
    ]


def test_zero_filled_allocation_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """alloc_untouched off: load destinations are MLX zeros (every page touched)."""
    monkeypatch.setattr(mx, "load", _no_load)
    array = hostbuffers._untouched_uint8(3 * 4096 + 1, untouched=False)
    assert array.shape == (3 * 4096 + 1,) and array.dtype == mx.uint8
    assert not mx.any(array).item()
