"""Buffered streaming saves: write-behind hints, the hash thread, and the same bytes.

docs/design.md invariant 4: no final file name ever names a partial or unverified file.
Invariant 5: a durable acknowledgement means fsync(file), rename, fsync(dir) returned;
the write-behind hints (sync_file_range, fadvise) come before the fsync and replace none
of it.
Invariant 6: a cancelled job stops at a tensor/chunk boundary and removes its tmp file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from kvtrio.errors import OperationCancelled
from kvtrio.storage import writer
from kvtrio.storage.cacheio import materialize, snapshot
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps, FileOps, OsFileOps
from kvtrio.storage.format import FORMAT_VERSION
from kvtrio.storage.reader import allocate_buffers, read_header, read_tensors
from kvtrio.storage.writer import write_single

from .conftest import make_kv


class Boom(OSError):
    pass


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 KiB in 16 KiB pieces: a test-sized cache spans many chunks, so the
    hash thread, write-behind and drop-behind all run."""
    monkeypatch.setattr(writer, "_CHUNK", 64 * 1024)
    monkeypatch.setattr(writer, "_SUB", 16 * 1024)


def _plan() -> Any:
    # 301 tokens x 2 heads x 64 x fp16: 77056 bytes per tensor, not a multiple of 4 KiB.
    snap = snapshot([make_kv([300, 1]), make_kv([299, 2])], list(range(301)))
    return snap, materialize(snap)


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvtrio-hash")]


class RecordingOps(OsFileOps):
    """The real file operations, recording each call (ranges for writes and hints)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, int]] = []

    def write(self, fd: int, data: memoryview, offset: int) -> int:
        n = super().write(fd, data, offset)
        self.log.append(("write", offset, n))
        return n

    def write_behind(self, fd: int, offset: int, length: int) -> None:
        self.log.append(("write_behind", offset, length))
        super().write_behind(fd, offset, length)

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        self.log.append(("drop_behind", offset, length))
        super().drop_behind(fd, offset, length)

    def fsync(self, fd: int) -> None:
        self.log.append(("fsync", 0, 0))
        super().fsync(fd)

    def rename(self, src: str, dst: str, **dir_fds: int | None) -> None:
        self.log.append(("rename", 0, 0))
        super().rename(src, dst, **dir_fds)

    def fsync_dir(self, directory: str | int) -> None:
        self.log.append(("fsync_dir", 0, 0))
        OS_FILE_OPS.fsync_dir(directory)  # not super(): it calls self.fsync


@pytest.mark.usefixtures("small_chunks")
def test_streaming_and_direct_saves_write_the_same_file(tmp_path: Path) -> None:
    """Byte for byte, size included (each tensor's tail is padded to 4 KiB both ways)."""
    snap, host = _plan()
    for name, direct in (("buffered.kvt", False), ("direct.kvt", True)):
        write_single(
            str(tmp_path / name), snap.header, [h.segments[0] for h in host], direct=direct
        )
    buffered = (tmp_path / "buffered.kvt").read_bytes()
    assert buffered == (tmp_path / "direct.kvt").read_bytes()
    assert len(buffered) % 4096 == 0
    cache_file = read_header(str(tmp_path / "buffered.kvt"))
    bufs = allocate_buffers(cache_file.header)
    read_tensors(cache_file, [[memoryview(b) for b in p] for p in bufs])
    assert [bytes(b[0]) for b in bufs] == [b"".join(h.segments[0]) for h in host]


@pytest.mark.usefixtures("small_chunks")
def test_write_behind_hints_precede_the_durable_publication(tmp_path: Path) -> None:
    """Invariant 5: every hinted range was written first, each drop follows its start,
    and fsync, rename, fsync_dir come after every write, in that order."""
    snap, host = _plan()
    ops = RecordingOps()
    write_single(str(tmp_path / "c.kvt"), snap.header, [h.segments[0] for h in host], file_ops=ops)
    names = [name for name, _, _ in ops.log]
    assert names[-3:] == ["fsync", "rename", "fsync_dir"]
    assert "fsync" not in names[:-3]
    written: list[tuple[int, int]] = []
    started: list[tuple[int, int]] = []
    for name, offset, length in ops.log[:-3]:
        if name == "write":
            written.append((offset, offset + length))
        elif name == "write_behind":
            assert any(a <= offset and offset + length <= b for a, b in _merged(written))
            started.append((offset, length))
        elif name == "drop_behind":
            assert (offset, length) in started
    dropped = names.count("drop_behind")
    assert names.count("write_behind") > writer._BEHIND and dropped > 0
    # Every chunk is dropped from the page cache but the last _BEHIND ones of the file.
    assert dropped == names.count("write_behind") - writer._BEHIND


@pytest.mark.usefixtures("small_chunks")
def test_writeback_starts_only_on_whole_written_pages(tmp_path: Path) -> None:
    """Every write-behind and drop-behind range is whole 4 KiB pages, and no write touches
    a page after its writeback was started (a tensor ending mid-page is padded first):
    re-dirtying a page under writeback made each drop wait for a second write of it."""
    snap, host = _plan()
    assert any(not isinstance(h.segments[0], memoryview) and len(h.segments[0]) > 1 for h in host)
    ops = RecordingOps()
    write_single(str(tmp_path / "c.kvt"), snap.header, [h.segments[0] for h in host], file_ops=ops)
    page = 4096
    started: list[tuple[int, int]] = []
    hinted = 0
    for name, offset, length in ops.log:
        if name in ("write_behind", "drop_behind"):
            assert offset % page == 0 and length % page == 0, (name, offset, length)
            hinted += 1
            if name == "write_behind":
                started.append((offset, offset + length))
        elif name == "write":
            first, last = offset // page * page, offset + length
            assert not any(a < last and first < b for a, b in started), (offset, length)
    assert hinted > 0


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("nth", [1, 5, 12])
def test_a_failed_write_mid_tensor_leaves_nothing_and_joins_the_hash_thread(
    tmp_path: Path, nth: int
) -> None:
    """Invariant 4, with the hash thread reading the caller's bytes at the time."""
    seen = {"n": 0}

    def hook(name: str) -> None:
        if name == "write":
            seen["n"] += 1
            if seen["n"] == nth:
                raise Boom("injected write")

    snap, host = _plan()
    with pytest.raises(Boom, match=r"^injected write$"):
        write_single(
            str(tmp_path / "c.kvt"),
            snap.header,
            [h.segments[0] for h in host],
            file_ops=FaultyFileOps(OS_FILE_OPS, hook),
        )
    assert os.listdir(tmp_path) == []
    assert _hash_threads() == []


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("after", [1, 3, 7])
def test_cancel_between_chunks_removes_the_tmp_file(tmp_path: Path, after: int) -> None:
    """Invariant 6: chunk boundaries inside a tensor are cancellation points too."""
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return calls["n"] > after

    snap, host = _plan()
    with pytest.raises(OperationCancelled, match=r"^write cancelled at a step boundary$"):
        write_single(
            str(tmp_path / "c.kvt"), snap.header, [h.segments[0] for h in host], cancel=cancel
        )
    assert os.listdir(tmp_path) == []
    assert _hash_threads() == []


@pytest.mark.usefixtures("small_chunks")
def test_faulty_file_ops_forward_the_hints_unhooked(tmp_path: Path) -> None:
    events: list[str] = []
    inner = RecordingOps()
    snap, host = _plan()
    write_single(
        str(tmp_path / "c.kvt"),
        snap.header,
        [h.segments[0] for h in host],
        file_ops=FaultyFileOps(inner, events.append),
    )
    assert set(events) == {"open", "write", "fsync", "rename", "fsync_dir"}
    assert any(name == "write_behind" for name, _, _ in inner.log)


class NoHintOps(OsFileOps):
    """A FileOps whose hints do nothing (as a wrapper with its own descriptors would)."""

    def write_behind(self, fd: int, offset: int, length: int) -> None:
        return None

    def drop_behind(self, fd: int, offset: int, length: int) -> None:
        return None


def test_the_hints_are_declared_by_the_file_ops_protocol() -> None:
    # One mechanism: every FileOps declares the hints (no getattr probing).
    assert {"write_behind", "drop_behind"} <= set(vars(FileOps))


@pytest.mark.usefixtures("small_chunks")
def test_file_ops_whose_hints_do_nothing_write_plain_buffered(tmp_path: Path) -> None:
    snap, host = _plan()
    ops = NoHintOps()
    write_single(str(tmp_path / "a.kvt"), snap.header, [h.segments[0] for h in host], file_ops=ops)
    write_single(str(tmp_path / "b.kvt"), snap.header, [h.segments[0] for h in host])
    assert (tmp_path / "a.kvt").read_bytes() == (tmp_path / "b.kvt").read_bytes()


@pytest.mark.parametrize("direct", [False, True])
def test_the_golden_snapshot_is_written_as_the_golden_file(
    tmp_path: Path, direct: bool
) -> None:
    """Both write paths make the current version's committed golden file's bytes, then
    zeros to 4 KiB (the O_DIRECT tail padding, which the streaming path writes too)."""
    import importlib.util

    import attrs

    golden = Path(__file__).resolve().parent.parent / "golden"
    spec = importlib.util.spec_from_file_location("make_golden", golden / "make_golden.py")
    assert spec is not None and spec.loader is not None
    script: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    snap = snapshot(
        script.build_caches(),
        script.tokens_for(FORMAT_VERSION),
        model_id=script.META["model_id"],
        config_fingerprint=script.META["config_fingerprint"],
        meta={"note": script.META["note"]},
        attachments=script.build_attachments(),
    )
    snap = attrs.evolve(snap, header=attrs.evolve(snap.header, created_at=0.0))
    host = materialize(snap)
    path = tmp_path / "single.kvt"
    write_single(str(path), snap.header, [h.segments[0] for h in host], direct=direct)
    want = (golden / f"v{FORMAT_VERSION}" / "single.kvt").read_bytes()
    got = path.read_bytes()
    assert got == want + bytes(-len(want) % 4096)
