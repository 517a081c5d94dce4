"""The block layout over Redis: two hosts (two processes, separate local dirs, one Redis).

These run the storage engineer's writer and reader unchanged over the Redis stores
(:func:`kvtrio.storage.openstore.open_store`): the writer publishes the manifest with
``ManifestStore.put`` and the reader gets it with
:func:`~kvtrio.storage.reader.read_manifest`, the local directory store and Redis alike.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from kvtrio.errors import (
    CacheMissError,
    CorruptCacheError,
    OperationCancelled,
    StoreUnavailableError,
)
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.manifeststore import LocalManifestStore, ManifestStore, RedisManifestStore
from kvtrio.storage.openstore import open_store
from kvtrio.storage.reader import read_manifest
from kvtrio.storage.redisstore import RedisBlockStore

from . import hostscripts

host = hostscripts.load("host_process.py")


def _run_host(*args: object) -> dict[str, Any]:
    """One host = one process: ``host_process.py ACTION URL LOCAL_DIR NAME TOKENS``."""
    return hostscripts.run("host_process.py", *args, timeout=60)


def _expected_digest(tokens: int) -> str:
    header, arrays = host.synthetic_cache(tokens)
    return str(host.digest(host.pieces_of(header, arrays)))


def test_open_store_local_and_redis(tmp_path: Path, redis_url: str) -> None:
    blocks, manifests = open_store(tmp_path / "tier")
    assert isinstance(blocks, LocalBlockStore) and isinstance(manifests, LocalManifestStore)
    assert blocks.directory == str(tmp_path / "tier" / "blocks")
    blocks, manifests = open_store(redis_url)
    assert isinstance(blocks, RedisBlockStore) and isinstance(manifests, RedisManifestStore)
    assert blocks.client is manifests.client  # one connection pool
    blocks.close()


def test_host_b_loads_bit_exact_what_host_a_saved(tmp_path: Path, redis_url: str) -> None:
    saved = _run_host("save", redis_url, tmp_path / "host-a", "conv1", 64)
    loaded = _run_host("load", redis_url, tmp_path / "host-b", "conv1", 0)
    assert loaded == {"tokens": 64, "digest": saved["digest"]}
    assert saved["digest"] == _expected_digest(64)
    assert not (tmp_path / "host-b").exists()  # B needed nothing local: all came from Redis


def test_host_b_extending_a_writes_only_new_blocks(tmp_path: Path, redis_url: str) -> None:
    """Dedup across hosts, measured by Redis's own key count and value bytes."""
    counter = RedisBlockStore.open(redis_url)
    first = _run_host("save", redis_url, tmp_path / "host-a", "turn1", 64)
    keys_a, bytes_a = counter.count_blocks()
    tensors = 2 * host.LAYERS
    block_bytes = host.HEADS * host.BLOCK_TOKENS * host.DIM * 2
    assert (keys_a, bytes_a) == (tensors * 4, tensors * 4 * block_bytes)
    assert first["new_block_bytes"] == bytes_a

    second = _run_host("save", redis_url, tmp_path / "host-b", "turn2", 96)
    keys_b, bytes_b = counter.count_blocks()
    assert (keys_b - keys_a, bytes_b - bytes_a) == (tensors * 2, tensors * 2 * block_bytes)
    assert second["new_block_bytes"] == bytes_b - bytes_a
    assert _run_host("load", redis_url, tmp_path / "host-a", "turn2", 0)["digest"] == (
        _expected_digest(96)
    )
    counter.close()


def _save_in_process(url: str, local: Path, name: str, tokens: int) -> None:
    host.main("save", url, str(local), name, tokens)


def test_deleted_block_is_a_clean_miss(tmp_path: Path, redis_url: str) -> None:
    _save_in_process(redis_url, tmp_path / "a", "m", 32)
    store = RedisBlockStore.open(redis_url)
    name = next(store.iter_blocks()).name
    store.client.delete(store.block_key(name))  # as maxmemory eviction would
    missing = rf"^caches\[\d\]\.tensors\[\d\]\.blocks\[\d\]: block {name} is missing$"
    with pytest.raises(CacheMissError, match=missing):
        host.main("load", redis_url, str(tmp_path / "b"), "m", 0)
    store.close()


def test_corrupted_block_is_corrupt_never_a_wrong_cache(tmp_path: Path, redis_url: str) -> None:
    _save_in_process(redis_url, tmp_path / "a", "m", 32)
    store = RedisBlockStore.open(redis_url)
    name = next(store.iter_blocks()).name
    key = store.block_key(name)
    stored = store.client.get(key)
    assert isinstance(stored, bytes)
    value = bytearray(stored)
    value[100] ^= 0xFF
    store.client.set(key, bytes(value))  # same size, different bytes
    mismatch = r"^caches\[\d\]\.tensors\[\d\]\.blocks\[\d\]\.sha256: block content does not hash"
    with pytest.raises(CorruptCacheError, match=mismatch):
        host.main("load", redis_url, str(tmp_path / "b"), "m", 0)
    store.close()


def test_tampered_manifest_is_corrupt(tmp_path: Path, redis_url: str) -> None:
    _save_in_process(redis_url, tmp_path / "a", "m", 32)
    manifests = RedisManifestStore.open(redis_url)
    key = manifests.manifest_key("m")
    stored = manifests.client.get(key)
    assert isinstance(stored, bytes)
    tampered = bytearray(stored)
    tampered[200] ^= 0x01
    manifests.client.set(key, bytes(tampered))
    with pytest.raises(CorruptCacheError, match=r"^manifest m: content does not match its sha256$"):
        host.main("load", redis_url, str(tmp_path / "b"), "m", 0)
    manifests.close()


def test_missing_manifest_is_file_not_found(tmp_path: Path, redis_url: str) -> None:
    with pytest.raises(FileNotFoundError):
        host.main("load", redis_url, str(tmp_path / "b"), "never-saved", 0)


@pytest.fixture(params=["local", "redis"])
def tier_target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A cold tier's stores: a local directory, or a Redis URL (the same two interfaces)."""
    if request.param == "local":
        return str(tmp_path / "tier")
    return str(request.getfixturevalue("redis_url"))


def test_failed_write_publishes_no_manifest(tier_target: str) -> None:
    """docs/design.md invariant 4 through the manifest store: a write that fails before
    ``put`` leaves no manifest."""
    blocks, manifests = open_store(tier_target)
    header, arrays = host.synthetic_cache(32)
    pieces = host.pieces_of(header, arrays)
    pieces[-1] = pieces[-1][:-1]  # one piece short: the writer refuses
    with pytest.raises(ValueError, match=r"pieces, expected"):
        host.write_blocks("m", header, pieces, blocks, block_tokens=host.BLOCK_TOKENS,
                          manifests=manifests)  # fmt: skip
    assert manifests.list() == [] and manifests.get("m") is None
    with pytest.raises(FileNotFoundError):
        read_manifest(manifests, "m")
    manifests.close()
    blocks.close()


def test_write_cancelled_after_its_blocks_publishes_no_manifest(tier_target: str) -> None:
    """A write cancelled once its blocks are stored, before the manifest goes out, leaves
    no manifest: its blocks are unreferenced (GC's or eviction's), never half an entry."""
    blocks, manifests = open_store(tier_target)
    header, arrays = host.synthetic_cache(32)
    stored = lambda: any(True for _ in blocks.iter_blocks())  # noqa: E731
    with pytest.raises(OperationCancelled):
        host.write_blocks("m", header, host.pieces_of(header, arrays), blocks,
                          block_tokens=host.BLOCK_TOKENS, manifests=manifests,
                          cancel=stored)  # fmt: skip
    assert stored() and manifests.list() == [] and manifests.get("m") is None
    manifests.close()
    blocks.close()


class _CheckingPut(LocalManifestStore):
    """A local manifest store whose ``put`` records whether every block the manifest
    names was already in ``blocks`` (docs/design.md invariant 5)."""

    def __init__(self, directory: str, blocks: LocalBlockStore | RedisBlockStore) -> None:
        super().__init__(directory)
        self.blocks = blocks
        self.seen: list[bool] = []

    def put(self, name: str, data: bytes, *, index_keys: Sequence[str] = ()) -> None:
        super().put(name, data, index_keys=index_keys)
        header = read_manifest(self, name).header
        shas = [ref.sha256 for slot in header.slots() for ref in slot.blocks or ()]
        self.seen.append(bool(shas) and all(self.blocks.has_many(shas)))


def test_manifest_is_put_after_its_blocks_are_stored(tier_target: str, tmp_path: Path) -> None:
    """docs/design.md invariant 5: ``put`` comes after ``put_many`` of every block."""
    blocks, shared = open_store(tier_target)
    assert isinstance(blocks, LocalBlockStore | RedisBlockStore)
    manifests = _CheckingPut(str(tmp_path / "checked"), blocks)
    header, arrays = host.synthetic_cache(48)
    host.write_blocks("m", header, host.pieces_of(header, arrays), blocks,
                      block_tokens=host.BLOCK_TOKENS, manifests=manifests)  # fmt: skip
    assert manifests.seen == [True]
    shared.close()
    blocks.close()


def test_store_capabilities_are_declared() -> None:
    """What the callers read instead of probing for methods."""
    assert (LocalBlockStore.supports_batched_reads, LocalBlockStore.supports_sizes) == (
        False,
        True,
    )
    assert RedisBlockStore.supports_batched_reads and RedisBlockStore.supports_verified_reads
    # A local block is read straight into its runs of a tensor of several kv heads; a
    # Redis one arrives as one value, and such a tensor is joined after the read.
    assert LocalBlockStore.supports_scatter_reads and not RedisBlockStore.supports_scatter_reads
    local: type[ManifestStore] = LocalManifestStore
    redis: type[ManifestStore] = RedisManifestStore
    assert (local.shared, local.supports_index, local.supports_touch) == (False, False, True)
    assert (redis.shared, redis.supports_index, redis.supports_touch) == (True, True, True)
    assert local.supports_listing and local.supports_deletes
    assert redis.supports_listing and redis.supports_deletes


def test_redis_restarted_mid_run(tmp_path: Path, private_redis: Any) -> None:
    """A save while Redis is down fails cleanly (no manifest); after a restart saves work."""
    url = private_redis.url(0, prefix="kvtrio")
    _save_in_process(url, tmp_path / "a", "before", 32)
    private_redis.kill()
    with pytest.raises(StoreUnavailableError, match=r"^redis redis://127\.0\.0\.1:\d+/0"):
        _save_in_process(url, tmp_path / "a", "during", 32)
    private_redis.start()  # no persistence configured: Redis comes back empty
    _save_in_process(url, tmp_path / "a", "after", 48)
    assert host.main("load", url, str(tmp_path / "b"), "after", 0)["tokens"] == 48
    manifests = RedisManifestStore.open(url)
    assert manifests.list() == ["after"]
    manifests.close()


def test_local_store_keeps_the_same_contract(tmp_path: Path) -> None:
    """The same host script over open_store(path): the default local tier."""
    root = tmp_path / "local"
    saved = host.main("save", str(root), str(root), "m", 40)
    loaded = host.main("load", str(root), str(root), "m", 0)
    assert loaded["digest"] == saved["digest"]
    assert sorted(os.listdir(root)) == ["blocks", "manifests"]
