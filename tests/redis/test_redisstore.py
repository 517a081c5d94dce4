"""RedisBlockStore: blocks written once, pipelined reads, clean misses, URL options."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
from kvtrio.errors import CorruptCacheError, StoreUnavailableError
from kvtrio.storage.blockstore import BlockStore
from kvtrio.storage.redisstore import RedisBlockStore, parse_redis_url


def _blocks(count: int, size: int, seed: int = 0) -> list[tuple[str, memoryview]]:
    out = []
    for i in range(count):
        data = hashlib.sha256(f"{seed}:{i}".encode()).digest() * (size // 32) + os.urandom(
            size % 32
        )
        out.append((hashlib.sha256(data).hexdigest(), memoryview(data)))
    return out


def _read_back(store: RedisBlockStore, blocks: list[tuple[str, memoryview]]) -> list[bytes | None]:
    buffers = [bytearray(len(data)) for _, data in blocks]
    found = store.read_many_into(
        [(name, memoryview(buf)) for (name, _), buf in zip(blocks, buffers, strict=True)]
    )
    return [bytes(buf) if ok else None for ok, buf in zip(found, buffers, strict=True)]


def _key_count(store: RedisBlockStore) -> int:
    return len(list(store.client.scan_iter(match=f"{store.target.prefix}:block:*")))


def test_is_a_block_store(redis_url: str) -> None:
    store = RedisBlockStore.open(redis_url)
    try:
        assert isinstance(store, BlockStore)
    finally:
        store.close()


def test_each_block_is_stored_once(redis_url: str) -> None:
    """SET NX: a second put of the same blocks stores nothing and reports 0 new bytes."""
    blocks = _blocks(5, 4096)
    store = RedisBlockStore.open(redis_url)
    assert store.put_many(blocks) == 5 * 4096
    assert store.put_many(blocks + _blocks(1, 100, seed=1)) == 100
    assert _key_count(store) == 6
    stats = store.statistics()
    assert (stats.blocks_put, stats.blocks_stored) == (11, 6)
    assert stats.bytes_deduplicated == 5 * 4096
    store.close()


def test_a_second_client_reads_bit_exact(redis_url: str) -> None:
    blocks = _blocks(40, 70_000)
    writer = RedisBlockStore.open(redis_url)
    writer.put_many(blocks)
    reader = RedisBlockStore.open(redis_url)
    assert _read_back(reader, blocks) == [bytes(data) for _, data in blocks]
    buffer = bytearray(len(blocks[3][1]))
    assert reader.read_into(blocks[3][0], memoryview(buffer))
    assert buffer == blocks[3][1]
    assert reader.has_many([blocks[0][0], "0" * 64]) == [True, False]
    writer.close()
    reader.close()


def test_batches_split_large_puts(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelines are cut by bytes and by count; results stay in order across batches."""
    from kvtrio.storage import redisstore

    monkeypatch.setattr(redisstore, "PIPELINE_BYTES", 10_000)
    monkeypatch.setattr(redisstore, "PIPELINE_BLOCKS", 3)
    blocks = _blocks(10, 4_000)
    store = RedisBlockStore.open(redis_url)
    assert store.put_many(blocks) == 40_000
    store.delete_many([blocks[4][0]])
    got = _read_back(store, blocks)
    assert got == [None if i == 4 else bytes(d) for i, (_, d) in enumerate(blocks)]
    store.close()


def test_missing_block_is_a_clean_miss(redis_url: str) -> None:
    """A block deleted behind kvtrio's back reads as absent, and the buffer is untouched."""
    blocks = _blocks(2, 1000)
    store = RedisBlockStore.open(redis_url)
    store.put_many(blocks)
    store.client.delete(store.block_key(blocks[0][0]))
    buffer = bytearray(b"\x07" * 1000)
    assert store.read_into(blocks[0][0], memoryview(buffer)) is False
    assert buffer == b"\x07" * 1000
    assert store.statistics().misses == 1
    store.close()


def test_wrong_size_is_corrupt(redis_url: str) -> None:
    blocks = _blocks(1, 1000)
    store = RedisBlockStore.open(redis_url)
    store.client.set(store.block_key(blocks[0][0]), b"short")
    with pytest.raises(
        CorruptCacheError, match=r"^block [0-9a-f]{64}: stored size 5 != expected 1000$"
    ):
        store.read_into(blocks[0][0], memoryview(bytearray(1000)))
    store.close()


def test_bad_names_never_reach_redis(redis_url: str) -> None:
    store = RedisBlockStore.open(redis_url)
    with pytest.raises(CorruptCacheError, match=r"^block name: not 64 lowercase hex digits"):
        store.put_many([("../../etc/passwd", memoryview(b"x"))])
    with pytest.raises(CorruptCacheError):
        store.read_into("*", memoryview(bytearray(1)))
    assert _key_count(store) == 0
    store.close()


def test_iter_and_delete(redis_url: str) -> None:
    blocks = _blocks(3, 500)
    store = RedisBlockStore.open(redis_url)
    store.put_many(blocks)
    store.client.set(f"{store.target.prefix}:block:not-a-block", b"ignored")
    infos = sorted(store.iter_blocks(), key=lambda info: info.name)
    assert [info.name for info in infos] == sorted(name for name, _ in blocks)
    assert {info.size for info in infos} == {500}
    assert store.delete_many([blocks[0][0], blocks[0][0], "f" * 64]) == 1
    assert store.count_blocks() == (2, 1000)
    store.close()


def test_prefix_and_db_isolate_tiers(redis_server: Any, redis_url: str) -> None:
    blocks = _blocks(1, 64)
    a = RedisBlockStore.open(redis_server.url(0, prefix="a"))
    b = RedisBlockStore.open(redis_server.url(0, prefix="b"))
    c = RedisBlockStore.open(redis_server.url(1, prefix="a"))
    a.put_many(blocks)
    assert [s.has_many([blocks[0][0]]) for s in (a, b, c)] == [[True], [False], [False]]
    assert c.put_many(blocks) == 64
    for store in (a, b, c):
        store.close()


def test_password_from_url(start_redis: Callable[..., Any]) -> None:
    server = start_redis("--requirepass", "s3cret")
    store = RedisBlockStore.open(f"redis://:s3cret@127.0.0.1:{server.port}/0")
    assert store.put_many(_blocks(1, 10)) == 10
    store.close()
    with pytest.raises(StoreUnavailableError, match=r"^redis redis://127\.0\.0\.1:\d+/0.*: "):
        RedisBlockStore.open(f"redis://127.0.0.1:{server.port}/0")
    with pytest.raises(StoreUnavailableError, match=r"^redis redis://:\*\*\*@127\.0\.0\.1"):
        RedisBlockStore.open(f"redis://:wrong@127.0.0.1:{server.port}/0")


def test_url_options() -> None:
    target = parse_redis_url("rediss://u:pw@cache.example:6380/3?prefix=tier1&socket_timeout=5")
    assert target.prefix == "tier1"
    assert target.display == "rediss://u:***@cache.example:6380/3"
    assert "prefix" not in target.url and "socket_timeout=5" in target.url
    import redis

    pool = redis.ConnectionPool.from_url(target.url)
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["db"] == 3
    assert pool.connection_kwargs["password"] == "pw"
    with pytest.raises(ValueError, match=r"^not a Redis URL"):
        parse_redis_url("/var/cache/kvtrio")


def test_unreachable_server_is_store_unavailable(private_redis: Any) -> None:
    """Invariant: a dead server fails the call with StoreUnavailableError, quickly."""
    store = RedisBlockStore.open(private_redis.url())
    private_redis.kill()
    with pytest.raises(StoreUnavailableError, match=r"^redis redis://127\.0\.0\.1:\d+/0"):
        store.put_many(_blocks(1, 10))
    assert store.statistics().errors == 1
    private_redis.start()
    assert store.put_many(_blocks(1, 10)) == 10
    store.close()


def test_evicted_blocks_are_clean_misses(start_redis: Callable[..., Any]) -> None:
    """Under maxmemory + allkeys-lru blocks vanish; reads give misses, never wrong bytes."""
    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    store = RedisBlockStore.open(server.url())
    blocks = _blocks(64, 256 * 1024)
    for i in range(0, len(blocks), 4):
        store.put_many(blocks[i : i + 4])
    got = _read_back(store, blocks)
    assert 0 < sum(g is None for g in got) < len(blocks)
    for (_, data), g in zip(blocks, got, strict=True):
        assert g is None or g == bytes(data)
    store.close()
