"""The block-layout reader over Redis: batched round trips, still verifying every block.

docs/design.md invariant 4: a reader never returns bytes it has not checked against the header's
hashes;
with a batched store every block of a batch is re-hashed, a missing one is a clean
CacheMissError and a corrupted or resized one a CorruptCacheError.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import attrs
import pytest
from kvtrio.errors import (
    CacheMissError,
    CorruptCacheError,
    OperationCancelled,
    StoreUnavailableError,
)
from kvtrio.storage import reader
from kvtrio.storage.blockstore import BlockInfo, BlockStore
from kvtrio.storage.format import xxh3_hex
from kvtrio.storage.openstore import open_store
from kvtrio.storage.reader import CacheFile, allocate_buffers, check_blocks, read_manifest
from kvtrio.storage.redisstore import RedisBlockStore

from . import hostscripts

TOKENS = 64  # 4 blocks per tensor, 4 tensors: 16 blocks of 2 KiB


host = hostscripts.load("host_process.py")


class CountingStore(BlockStore):
    """A RedisBlockStore that counts the reader's calls (round trips); it declares batched
    reads, not verified ones, so the reader hashes each block itself."""

    supports_batched_reads: ClassVar[bool] = True

    def __init__(self, inner: RedisBlockStore) -> None:
        self.inner = inner
        self.batches: list[int] = []
        self.single_reads = 0

    def read_many_into(self, items: Sequence[tuple[str, memoryview]]) -> list[bool]:
        self.batches.append(len(items))
        return self.inner.read_many_into(items)

    def read_into(self, name: str, buffer: memoryview) -> bool:
        self.single_reads += 1
        return self.inner.read_into(name, buffer)

    def put_many(self, blocks: Sequence[tuple[str, memoryview]]) -> int:
        return self.inner.put_many(blocks)

    def has_many(self, names: Sequence[str]) -> list[bool]:
        return self.inner.has_many(names)

    def delete_many(self, names: Sequence[str]) -> int:
        return self.inner.delete_many(names)

    def iter_blocks(self) -> Iterator[BlockInfo]:
        return self.inner.iter_blocks()

    def close(self) -> None:
        self.inner.close()


def _saved(url: str, tmp_path: Path) -> CacheFile:
    host.main("save", url, str(tmp_path / "a"), "m", TOKENS)
    blocks, manifests = open_store(url)
    try:
        return read_manifest(manifests, "m")
    finally:
        blocks.close()


def _load(cache_file: CacheFile, store: object, **options: object) -> list[list[bytearray]]:
    buffers = allocate_buffers(cache_file.header)
    views = [[memoryview(b) for b in pieces] for pieces in buffers]
    reader.read_tensors(cache_file, views, store=store, **options)  # type: ignore[arg-type]
    return buffers


def _third_block(cache_file: CacheFile) -> str:
    refs = next(iter(cache_file.header.slots())).blocks
    assert refs is not None
    return refs[2].sha256


@pytest.fixture
def store(redis_url: str) -> Iterator[CountingStore]:
    counting = CountingStore(RedisBlockStore.open(redis_url))
    yield counting
    counting.close()


def test_batched_reads_are_bit_exact(
    tmp_path: Path, redis_url: str, store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_file = _saved(redis_url, tmp_path)
    block = 2 * host.HEADS * host.BLOCK_TOKENS * host.DIM
    monkeypatch.setattr(reader, "BLOCK_BATCH_BYTES", 5 * block)
    buffers = _load(cache_file, store)
    assert host.digest(buffers) == host.digest(host.pieces_of(*host.synthetic_cache(TOKENS)))
    assert (store.batches, store.single_reads) == ([5, 5, 5, 1], 0)


def test_default_budget_reads_a_small_cache_in_one_round_trip(
    tmp_path: Path, redis_url: str, store: CountingStore
) -> None:
    cache_file = _saved(redis_url, tmp_path)
    _load(cache_file, store)
    assert store.batches == [16]


def test_missing_block_mid_batch_is_a_clean_miss(
    tmp_path: Path, redis_url: str, store: CountingStore
) -> None:
    cache_file = _saved(redis_url, tmp_path)
    name = _third_block(cache_file)
    store.inner.client.delete(store.inner.block_key(name))  # as maxmemory eviction would
    with pytest.raises(
        CacheMissError, match=rf"^caches\[0\]\.tensors\[0\]\.blocks\[2\]: block {name} is missing$"
    ):
        _load(cache_file, store)
    assert store.batches == [16]
    with pytest.raises(
        CacheMissError, match=rf"^caches\[0\]\.tensors\[0\]\.blocks\[2\]: block {name} is missing$"
    ):
        check_blocks(cache_file.header, store.inner)


def test_corrupted_block_mid_batch_is_corrupt(
    tmp_path: Path, redis_url: str, store: CountingStore
) -> None:
    cache_file = _saved(redis_url, tmp_path)
    key = store.inner.block_key(_third_block(cache_file))
    stored = store.inner.client.get(key)
    assert isinstance(stored, bytes)
    value = bytearray(stored)
    value[7] ^= 0x01
    store.inner.client.set(key, bytes(value))  # same size, different bytes
    with pytest.raises(
        CorruptCacheError,
        match=r"^caches\[0\]\.tensors\[0\]\.blocks\[2\]\.sha256: block content does not hash",
    ):
        _load(cache_file, store)
    check_blocks(cache_file.header, store.inner)  # sizes agree: only the hash can tell


def test_resized_block_is_corrupt_before_and_during_the_read(
    tmp_path: Path, redis_url: str, store: CountingStore
) -> None:
    cache_file = _saved(redis_url, tmp_path)
    name = _third_block(cache_file)
    key = store.inner.block_key(name)
    stored = store.inner.client.get(key)
    assert isinstance(stored, bytes)
    store.inner.client.set(key, stored + b"x")
    size = rf"^block {name}: stored size {len(stored) + 1} != expected {len(stored)}$"
    with pytest.raises(CorruptCacheError, match=size):
        check_blocks(cache_file.header, store.inner)
    with pytest.raises(CorruptCacheError, match=size):
        _load(cache_file, store)


def test_cancel_is_checked_between_batches(
    tmp_path: Path, redis_url: str, store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_file = _saved(redis_url, tmp_path)
    monkeypatch.setattr(
        reader, "BLOCK_BATCH_BYTES", 4 * 2 * host.HEADS * host.BLOCK_TOKENS * host.DIM
    )
    with pytest.raises(OperationCancelled, match=r"^read cancelled at a step boundary$"):
        _load(cache_file, store, cancel=lambda: len(store.batches) >= 2)
    assert store.batches == [4, 4]


def test_stored_sizes(redis_url: str) -> None:
    store = RedisBlockStore.open(redis_url)
    present, absent, empty = "1" * 64, "2" * 64, "3" * 64
    store.client.set(store.block_key(present), b"abc")
    store.client.set(store.block_key(empty), b"")
    assert store.stored_sizes([present, absent, empty]) == [3, None, 0]
    assert (store.stored_size(present), store.stored_size(absent)) == (3, None)
    assert store.stored_sizes([]) == []
    store.close()


def test_replies_received_into_buffers_across_reads(redis_url: str) -> None:
    """Blocks larger than the read-ahead, tiny ones and misses in one pipeline, bit-exact;
    the connection stays usable for the next command, and after a size mismatch too."""
    store = RedisBlockStore.open(redis_url)
    blobs = [os.urandom(n) for n in (3 * 1024 * 1024 + 7, 1, 70_000, 5)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    store.put_many([(n, memoryview(b)) for n, b in zip(names, blobs, strict=True)])
    absent = hashlib.sha256(b"never stored").hexdigest()
    order = [names[0], absent, names[1], names[2], absent, names[3]]
    sizes = [len(blobs[0]), 9, 1, len(blobs[2]), 9, 5]
    buffers = [bytearray(n) for n in sizes]
    found = store.read_many_into([(n, memoryview(b)) for n, b in zip(order, buffers, strict=True)])
    assert found == [True, False, True, True, False, True]
    assert [bytes(b) for b, ok in zip(buffers, found, strict=True) if ok] == blobs
    resized = bytearray(len(blobs[2]) - 1)
    with pytest.raises(CorruptCacheError, match=rf"^block {names[2]}: stored size 70000 != "):
        store.read_many_into([(names[0], memoryview(bytearray(len(blobs[0])))),
                              (names[2], memoryview(resized)),
                              (names[3], memoryview(bytearray(5)))])  # fmt: skip
    one = bytearray(5)
    assert store.read_into(names[3], memoryview(one)) and bytes(one) == blobs[3]
    assert store.client.ping()
    stats = store.statistics()
    assert (stats.blocks_read, stats.misses) == (5, 2)
    store.close()


def test_a_key_of_another_type_is_store_unavailable(redis_url: str) -> None:
    store = RedisBlockStore.open(redis_url)
    name = "4" * 64
    store.client.rpush(store.block_key(name), b"x")
    with pytest.raises(StoreUnavailableError, match=r"^redis .*WRONGTYPE"):
        store.read_into(name, memoryview(bytearray(1)))
    assert store.client.ping()
    store.close()


@pytest.mark.parametrize("verified_by", ["reader", "store"])
def test_a_forged_block_is_refused_though_the_manifest_records_its_xxh3(
    tmp_path: Path, redis_url: str, store: CountingStore, verified_by: str
) -> None:
    """Other clients write the shared store (BlockStore.written_by_others): its blocks are
    checked against their sha256 names, never the xxh3 a manifest records, so a block
    forged under another's name fails even where the manifest's xxh3 agrees with it
    (docs/format.md rule 10; a local load would check the xxh3 alone)."""
    cache_file = _saved(redis_url, tmp_path)
    name = _third_block(cache_file)
    key = store.inner.block_key(name)
    stored = store.inner.client.get(key)
    assert isinstance(stored, bytes)
    forged = bytearray(stored)
    forged[7] ^= 0x01
    store.inner.client.set(key, bytes(forged))
    slots = list(cache_file.header.slots())
    refs = slots[0].blocks
    assert refs is not None and refs[2].xxh3 is not None  # a version 2 manifest
    agreeing = attrs.evolve(refs[2], xxh3=xxh3_hex(bytes(forged)))
    slots[0] = attrs.evolve(slots[0], blocks=(*refs[:2], agreeing, *refs[3:]))
    forged_file = attrs.evolve(cache_file, header=cache_file.header.with_slots(slots))
    with pytest.raises(
        CorruptCacheError,
        match=r"^caches\[0\]\.tensors\[0\]\.blocks\[2\]\.sha256: block content does not hash",
    ):
        _load(forged_file, store if verified_by == "reader" else store.inner)
