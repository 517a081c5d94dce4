"""The block layout: dedup of shared prefixes, durability order, GC and verify."""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.errors import CorruptCacheError
from kvtrio.storage.blockstore import CorruptBlockError, LocalBlockStore
from kvtrio.storage.cacheio import materialize, snapshot
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps, OsFileOps
from kvtrio.storage.maintenance import collect_garbage, verify_tree
from kvtrio.storage.reader import allocate_buffers, read_header, read_tensors
from kvtrio.storage.writer import write_blocks
from mlx_lm.models import cache as _mlx_cache_module

from .conftest import assert_same, kv, logical_state

mlx_cache: Any = _mlx_cache_module


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _conversation(n_prefix: int, n_suffix: int, seed: int) -> Any:
    cache = mlx_cache.KVCache()
    cache.update_and_fetch(*kv(n_prefix, seed=1))  # the shared prefix
    if n_suffix:
        cache.update_and_fetch(*kv(n_suffix, seed=seed))
    return cache


def test_shared_prefix_blocks_are_stored_once(tmp_path: Path) -> None:
    """Dedup: a cache extending another stores only its new token blocks."""
    short = _conversation(512, 0, 0)
    long = _conversation(512, 256, 2)
    r1 = kvtrio.save_cache(tmp_path / "a.kvt", [], [short], layout="blocks", block_tokens=128)
    r2 = kvtrio.save_cache(tmp_path / "b.kvt", [], [long], layout="blocks", block_tokens=128)
    per_token = 2 * short.keys.shape[1] * short.keys.shape[3] * 2  # keys + values, fp16
    assert r1.new_block_bytes == 512 * per_token
    assert r2.new_block_bytes == 256 * per_token
    assert _disk_bytes(tmp_path / "blocks") == 768 * per_token
    for name, cache in (("a.kvt", short), ("b.kvt", long)):
        assert_same(
            logical_state(kvtrio.load_cache(tmp_path / name).caches[0]), logical_state(cache)
        )


def test_same_cache_twice_stores_nothing_new(tmp_path: Path) -> None:
    cache = _conversation(300, 0, 0)
    kvtrio.save_cache(tmp_path / "a.kvt", [], [cache], layout="blocks")
    before = _disk_bytes(tmp_path / "blocks")
    again = kvtrio.save_cache(tmp_path / "b.kvt", [], [cache], layout="blocks")
    assert again.new_block_bytes == 0 and _disk_bytes(tmp_path / "blocks") == before


def test_blocks_are_durable_before_the_manifest_is_published(tmp_path: Path) -> None:
    """docs/design.md invariant 5: every block put (and fsynced) precedes the manifest's rename."""
    events: list[str] = []
    ops = FaultyFileOps(OS_FILE_OPS, events.append)
    store = LocalBlockStore(str(tmp_path / "blocks"), file_ops=ops)
    snap = snapshot([_conversation(300, 0, 0)], [])
    host = materialize(snap, block_tokens=128)
    write_blocks(
        str(tmp_path / "m.kvt"),
        snap.header,
        [h.pieces for h in host],
        store,
        block_tokens=128,
        file_ops=ops,
    )
    renames = [i for i, e in enumerate(events) if e == "rename"]
    manifest_rename = renames[-1]
    assert events[manifest_rename - 1] == "fsync"  # the manifest's own fsync
    assert events[manifest_rename + 1] == "fsync_dir"
    block_events = events[: manifest_rename - 3]
    assert block_events.count("rename") == 6 and block_events[-1] == "fsync_dir"


def test_gc_deletes_only_old_unreferenced_blocks(tmp_path: Path) -> None:
    store = LocalBlockStore(str(tmp_path / "blocks"))
    kvtrio.save_cache(tmp_path / "keep.kvt", [], [_conversation(256, 0, 0)], layout="blocks")
    kvtrio.save_cache(tmp_path / "drop.kvt", [], [_conversation(256, 128, 5)], layout="blocks")
    os.unlink(tmp_path / "drop.kvt")
    young = collect_garbage(str(tmp_path), store, grace_s=3600)
    assert young.deleted_blocks == 0 and young.young_unreferenced == 2
    old = collect_garbage(str(tmp_path), store, grace_s=3600, now=time.time() + 7200)
    assert old.deleted_blocks == 2 and old.live_blocks == 2
    assert kvtrio.load_cache(tmp_path / "keep.kvt").caches[0].offset == 256


def test_gc_removes_old_tmp_debris(tmp_path: Path) -> None:
    store = LocalBlockStore(str(tmp_path / "blocks"))
    (tmp_path / "blocks").mkdir()
    debris = [tmp_path / ".x.kvt.0123.kvtrio-tmp", tmp_path / "blocks" / ".ab.01.kvtrio-tmp"]
    for path in debris:
        path.write_bytes(b"partial")
    assert collect_garbage(str(tmp_path), store, grace_s=60).tmp_removed == 0
    report = collect_garbage(str(tmp_path), store, grace_s=60, now=time.time() + 120)
    assert report.tmp_removed == 2 and not any(p.exists() for p in debris)


def test_putting_an_existing_block_restarts_its_grace_period(tmp_path: Path) -> None:
    store = LocalBlockStore(str(tmp_path / "blocks"))
    kvtrio.save_cache(tmp_path / "a.kvt", [], [_conversation(128, 0, 0)], layout="blocks")
    os.unlink(tmp_path / "a.kvt")
    for info in store.iter_blocks():
        os.utime(store.path_of(info.name), (0, 0))
    # A writer re-puts the same blocks before publishing its manifest: GC must spare them.
    snap = snapshot([_conversation(128, 0, 0)], [])
    host = materialize(snap, block_tokens=256)
    for h in host:
        store.put_many([(hashlib.sha256(p).hexdigest(), p) for p in h.pieces])
    assert collect_garbage(str(tmp_path), store, grace_s=3600).deleted_blocks == 0


def test_verify_reports_every_bad_file_and_block(tmp_path: Path) -> None:
    store = LocalBlockStore(str(tmp_path / "blocks"))
    kvtrio.save_cache(tmp_path / "s.kvt", [], [_conversation(64, 0, 0)])
    kvtrio.save_cache(tmp_path / "m.kvt", [], [_conversation(300, 0, 0)], layout="blocks")
    clean = verify_tree(str(tmp_path), store)
    assert clean.ok and clean.files_ok == 2 and clean.blocks_ok == 4
    raw = bytearray((tmp_path / "s.kvt").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "s.kvt").write_bytes(bytes(raw))
    names = sorted(i.name for i in store.iter_blocks())
    (tmp_path / "blocks" / names[0]).write_bytes(b"x")
    os.unlink(tmp_path / "blocks" / names[1])
    report = verify_tree(str(tmp_path), store)
    assert [p for p, _ in report.bad_files] == [str(tmp_path / "s.kvt")]
    assert [n for n, _ in report.bad_blocks] == [names[0]]
    assert [n for _, n in report.missing_blocks] == [names[1]]


class _EvictingStore(LocalBlockStore):
    """A live owner's eviction landing while ``kvtrio verify`` checks a manifest's blocks:
    the manifest goes, then the blocks only it named (the tier's order)."""

    manifest: Path | None = None

    def has_many(self, names: Sequence[str]) -> list[bool]:
        if self.manifest is not None:
            self.manifest.unlink()
            self.manifest = None
            self.delete_many(list(names))
        return super().has_many(names)


def test_verify_beside_a_live_owner_reports_no_blocks_of_an_entry_evicted_meanwhile(
    tmp_path: Path,
) -> None:
    """``kvtrio verify`` takes no lock (docs/cli.md): an entry evicted between reading its
    manifest and checking its blocks was reported as missing blocks, exit 1."""
    store = _EvictingStore(str(tmp_path / "blocks"))
    kvtrio.save_cache(tmp_path / "m.kvt", [], [_conversation(300, 0, 0)], layout="blocks")
    store.manifest = tmp_path / "m.kvt"
    report = verify_tree(str(tmp_path), store)
    assert report.ok and report.missing_blocks == ()
    assert report.files_ok == 0 and report.foreign_files == ()  # gone: neither ok nor foreign
    kvtrio.save_cache(tmp_path / "kept.kvt", [], [_conversation(300, 0, 0)], layout="blocks")
    names = sorted(i.name for i in store.iter_blocks())
    os.unlink(tmp_path / "blocks" / names[0])  # a block missing under a live manifest
    assert [n for _, n in verify_tree(str(tmp_path), store).missing_blocks] == [names[0]]


class _EvictingOpen(OsFileOps):
    """The same eviction landing between verify's listing and its read of the manifest."""

    def __init__(self, manifest: Path) -> None:
        self.manifest: Path | None = manifest

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        if self.manifest is not None and path == str(self.manifest):
            self.manifest.unlink()
            self.manifest = None
        return super().open(path, flags, mode, dir_fd=dir_fd)


def test_verify_does_not_list_a_manifest_evicted_since_the_listing_as_foreign(
    tmp_path: Path,
) -> None:
    """It was listed as 'not kvtrio's' (the file could not be read, so it had no magic)."""
    store = LocalBlockStore(str(tmp_path / "blocks"))
    kvtrio.save_cache(tmp_path / "m.kvt", [], [_conversation(300, 0, 0)], layout="blocks")
    report = verify_tree(str(tmp_path), store, file_ops=_EvictingOpen(tmp_path / "m.kvt"))
    assert report.ok and report.foreign_files == () and report.files_ok == 0


def test_verify_progress_counts_every_file_and_block_up_to_the_total(tmp_path: Path) -> None:
    store = LocalBlockStore(str(tmp_path / "blocks"))
    kvtrio.save_cache(tmp_path / "s.kvt", [], [_conversation(64, 0, 0)])
    kvtrio.save_cache(tmp_path / "m.kvt", [], [_conversation(300, 0, 0)], layout="blocks")
    block_names = os.listdir(tmp_path / "blocks")
    (tmp_path / "blocks" / block_names[0]).write_bytes(b"x")  # bad items count as checked too
    files = [p for p in tmp_path.iterdir() if p.is_file()]
    calls: list[tuple[int, int]] = []
    report = verify_tree(str(tmp_path), store, progress=lambda d, t: calls.append((d, t)))
    total = len(files) + len(block_names)
    assert total == report.files_ok + report.blocks_ok + len(report.bad_blocks)
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert all(a < b for a, b in itertools.pairwise(done))
    assert done[0] == 0 and done[-1] == total


@pytest.mark.parametrize("block_tokens", [1, 100, 4096])
def test_any_block_size_round_trips(tmp_path: Path, block_tokens: int) -> None:
    cache = _conversation(250, 0, 0)
    kvtrio.save_cache(tmp_path / "m.kvt", [], [cache], layout="blocks", block_tokens=block_tokens)
    assert_same(
        logical_state(kvtrio.load_cache(tmp_path / "m.kvt").caches[0]), logical_state(cache)
    )
    assert mx.array_equal(
        kvtrio.load_cache(tmp_path / "m.kvt").caches[0].keys, cache.keys[..., :250, :]
    )


def _old_orphan(tmp_path: Path) -> tuple[LocalBlockStore, str, memoryview]:
    store = LocalBlockStore(str(tmp_path / "blocks"))
    data = memoryview(b"orphaned block bytes")
    name = hashlib.sha256(data).hexdigest()
    store.put_many([(name, data)])
    os.utime(store.path_of(name), (0, 0))
    return store, name, data


def test_gc_keeps_a_block_freshened_after_its_listing(tmp_path: Path) -> None:
    """GC race (found by the gcrace drill): GC lists an old orphan, a writer then
    freshens it and publishes a manifest naming it; the sweep must not delete it."""
    store, name, data = _old_orphan(tmp_path)
    listed = [b.name for b in store.iter_blocks() if b.mtime < time.time() - 3600]
    assert listed == [name]
    store.put_many([(name, data)])  # the writer's dedup path: freshen only
    assert store.delete_stale(listed, time.time() - 3600) == (0, 0)
    assert store.has_many([name]) == [True]


def test_gc_and_a_writer_racing_on_a_moved_aside_block(tmp_path: Path) -> None:
    """A writer that comes after GC moved the block aside writes it again."""
    store, name, data = _old_orphan(tmp_path)
    writer = LocalBlockStore(str(tmp_path / "blocks"))

    def hook(op: str) -> None:
        return None

    class WriterAfterRename(FaultyFileOps):
        def rename(
            self,
            src: str,
            dst: str,
            *,
            src_dir_fd: int | None = None,
            dst_dir_fd: int | None = None,
        ) -> None:
            super().rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            if dst.endswith(".kvtrio-tmp"):  # GC just moved the block aside
                assert writer.put_many([(name, data)]) == len(data)

    gc_store = LocalBlockStore(
        str(tmp_path / "blocks"), file_ops=WriterAfterRename(OS_FILE_OPS, hook)
    )
    assert gc_store.delete_stale([name], time.time() - 3600) == (1, len(data))
    assert store.has_many([name]) == [True]
    assert [n for n in os.listdir(tmp_path / "blocks") if n.startswith(".")] == []


@pytest.mark.parametrize("op", ["open", "read"])
def test_gc_deletes_nothing_when_a_manifest_cannot_be_read(tmp_path: Path, op: str) -> None:
    """An I/O error reading a manifest aborts the pass: its blocks may still be live."""
    kvtrio.save_cache(tmp_path / "live.kvt", [], [_conversation(256, 0, 0)], layout="blocks")
    for info in LocalBlockStore(str(tmp_path / "blocks")).iter_blocks():
        os.utime(tmp_path / "blocks" / info.name, (0, 0))

    def hook(name: str) -> None:
        if name == op:
            raise OSError(5, "injected EIO")

    store = LocalBlockStore(str(tmp_path / "blocks"))
    with pytest.raises(OSError, match=r"injected EIO"):
        collect_garbage(str(tmp_path), store, grace_s=60, file_ops=FaultyFileOps(OS_FILE_OPS, hook))
    assert len(list(store.iter_blocks())) == 2
    assert kvtrio.load_cache(tmp_path / "live.kvt").caches[0].offset == 256


class _StoreVerifyingWith(LocalBlockStore):
    """A local store that declares verified reads, whose verifying read raises the error
    it is given."""

    supports_verified_reads: ClassVar[bool] = True

    def __init__(self, directory: str, error: CorruptBlockError) -> None:
        super().__init__(directory)
        self.error = error

    def read_many_verified_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        raise self.error


@pytest.mark.parametrize("field", ["sha256", "bytes"])
def test_store_block_error_is_named_by_its_field_not_its_text(
    tmp_path: Path, field: Literal["sha256", "bytes"]
) -> None:
    """The reader restates a store's CorruptBlockError with the header field from its
    ``field``: a detail that happens to mention hashing does not make it a hash error."""
    kvtrio.save_cache(tmp_path / "a.kvt", [], [_conversation(300, 0, 0)], layout="blocks")
    cache_file = read_header(str(tmp_path / "a.kvt"))
    first = next(iter(cache_file.header.slots())).blocks
    assert first is not None
    error = CorruptBlockError(first[0].sha256, field, "stored size 1, does not hash either")
    store = _StoreVerifyingWith(str(tmp_path / "blocks"), error)
    buffers = [[memoryview(b) for b in slot] for slot in allocate_buffers(cache_file.header)]
    with pytest.raises(CorruptCacheError) as info:
        read_tensors(cache_file, buffers, store=store)
    assert str(info.value) == (
        f"caches[0].tensors[0].blocks[0].{field}: stored size 1, does not hash either"
    )
    assert info.value.__cause__ is error


def test_corrupt_block_error_pickles_with_its_fields() -> None:
    error = CorruptBlockError("ab" * 32, "bytes", "stored size 5 != expected 8")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.name, copy.field, copy.detail) == (
        CorruptBlockError,
        f"block {'ab' * 32}: stored size 5 != expected 8",
        "ab" * 32,
        "bytes",
        "stored size 5 != expected 8",
    )


@pytest.mark.parametrize("batch_blocks", [64, 8])
def test_a_local_block_read_opens_the_directory_once_per_batch_not_each_block_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_blocks: int
) -> None:
    """A cold load's 64 blocks: one link check and one walk to the directory per batch
    of SMALL_BATCH_BYTES, each block opened relative to it (before: a link check and a
    walk from the path per block), and the bytes still verified and bit-exact."""
    from kvtrio.storage import reader

    cache = _conversation(512, 0, 0)
    kvtrio.save_cache(tmp_path / "a.kvt", [], [cache], layout="blocks", block_tokens=16)
    cache_file = read_header(str(tmp_path / "a.kvt"))
    block = next(iter(cache_file.header.slots())).blocks
    assert block is not None and len(block) == 32  # 2 tensors: 64 blocks
    monkeypatch.setattr(reader, "SMALL_BATCH_BYTES", batch_blocks * block[0].nbytes)
    counting = FaultyFileOps(OS_FILE_OPS, lambda op: None)
    store = LocalBlockStore(str(tmp_path / "blocks"), file_ops=counting)
    buffers = [[memoryview(b) for b in slot] for slot in allocate_buffers(cache_file.header)]
    read_tensors(cache_file, buffers, store=store)
    assert counting.calls == {
        "open_dir": 64 // batch_blocks,
        "open": 64,
        "will_need": 64,
        "read": 64,
    }
    assert_same(
        logical_state(kvtrio.load_cache(tmp_path / "a.kvt").caches[0]), logical_state(cache)
    )
    want = [[memoryview(b) for b in slot] for slot in allocate_buffers(cache_file.header)]
    read_tensors(cache_file, want, store=LocalBlockStore(str(tmp_path / "blocks")))
    assert [[bytes(b) for b in slot] for slot in buffers] == [
        [bytes(b) for b in slot] for slot in want
    ]


def test_a_loads_look_at_its_blocks_stats_them_through_one_directory_descriptor(
    tmp_path: Path,
) -> None:
    """Before a load allocates, check_blocks stats every block the manifest names: one
    walk to the block directory for the whole entry, then one stat relative to it per
    block (before: a link check of the directory and a walk by path per block, 2 stats
    a block). A missing block is still a miss, a link or a directory still refused."""
    from kvtrio.errors import CacheMissError
    from kvtrio.storage.reader import check_blocks

    class CountingStats(FaultyFileOps):
        def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
            self._before("stat" if dir_fd is None else "stat_at")
            return self.inner.stat(path, dir_fd=dir_fd)

    cache = _conversation(512, 0, 0)
    kvtrio.save_cache(tmp_path / "a.kvt", [], [cache], layout="blocks", block_tokens=16)
    header = read_header(str(tmp_path / "a.kvt")).header
    refs = [ref for slot in header.slots() for ref in slot.blocks or ()]
    assert len(refs) == 64  # 2 tensors of 32 blocks
    counting = CountingStats(OS_FILE_OPS, lambda op: None)
    check_blocks(header, LocalBlockStore(str(tmp_path / "blocks"), file_ops=counting))
    assert counting.calls == {"stat": 1, "open_dir": 1, "stat_at": 64}  # 1: the link check
    blocks = tmp_path / "blocks"
    (blocks / refs[40].sha256).unlink()
    (blocks / refs[40].sha256).symlink_to(blocks / refs[0].sha256)
    with pytest.raises(CorruptCacheError, match=rf"^block {refs[40].sha256}: is a symbolic link$"):
        check_blocks(header, LocalBlockStore(str(blocks)))
    (blocks / refs[40].sha256).unlink()
    (blocks / refs[40].sha256).mkdir()
    with pytest.raises(CorruptCacheError, match=rf"^block {refs[40].sha256}: not a regular file$"):
        check_blocks(header, LocalBlockStore(str(blocks)))
    (blocks / refs[40].sha256).rmdir()
    missing = rf"^caches\[0\]\.tensors\[1\]\.blocks\[8\]: block {refs[40].sha256} is missing$"
    with pytest.raises(CacheMissError, match=missing):
        check_blocks(header, LocalBlockStore(str(blocks)))


def test_a_local_block_read_advises_a_group_of_blocks_before_reading_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cold page cache one block read at a time keeps one read in flight (1,020
    blocks of 96 KiB: 359 ms of a 536 ms load). Each group of READ_AHEAD_BLOCKS blocks is
    opened and advised (POSIX_FADV_WILLNEED) before the first of them is read, so the
    kernel reads the group's files at once; no more descriptors than a group are open
    at a time, and the bytes stay verified and bit-exact."""
    from kvtrio.storage import blockstore

    cache = _conversation(512, 0, 0)
    kvtrio.save_cache(tmp_path / "a.kvt", [], [cache], layout="blocks", block_tokens=16)
    cache_file = read_header(str(tmp_path / "a.kvt"))
    monkeypatch.setattr(blockstore, "READ_AHEAD_BLOCKS", 16)
    events: list[str] = []
    counting = FaultyFileOps(OS_FILE_OPS, events.append)
    store = LocalBlockStore(str(tmp_path / "blocks"), file_ops=counting)
    buffers = [[memoryview(b) for b in slot] for slot in allocate_buffers(cache_file.header)]
    read_tensors(cache_file, buffers, store=store)
    blocks = [e for e in events if e != "open_dir"]
    group = ["open", "will_need"] * 16 + ["read"] * 16
    assert blocks == group * 4  # 64 blocks
    want = [[memoryview(b) for b in slot] for slot in allocate_buffers(cache_file.header)]
    read_tensors(cache_file, want, store=LocalBlockStore(str(tmp_path / "blocks")))
    assert [[bytes(b) for b in slot] for slot in buffers] == [
        [bytes(b) for b in slot] for slot in want
    ]
