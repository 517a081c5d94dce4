"""RedisBlockStore's GET path: replies scattered straight into the callers' buffers
(``recvmsg_into`` over the expected framing), the reply-by-reply parser it falls back to
when the replies differ (misses, resized blocks, error replies), re-hashing on arrival
(``verify=True``) on the receiving thread or on helper threads
(``IoOptions.redis_hash_threads``), and the
public-API path when redis-py's connection has no raw socket.
docs/design.md invariant 4: a verified read never returns bytes that do not hash to their name.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections.abc import Iterator

import pytest
from kvtrio.errors import CorruptCacheError
from kvtrio.storage import options, redisrecv, redisstore
from kvtrio.storage.options import IoOptions
from kvtrio.storage.redisstore import RedisBlockStore

SIZES = (0, 1, 5, 2048, 65536, 70_000, 300_000)


@pytest.fixture(params=["raw socket", "public API", "hash threads"])
def store(request: pytest.FixtureRequest, redis_url: str) -> Iterator[RedisBlockStore]:
    """The store, reading through the raw socket or (its attribute gone) redis-py's API,
    re-hashing on the receiving thread, or (``hash threads``) on two helper threads."""
    patch = pytest.MonkeyPatch()
    request.addfinalizer(patch.undo)
    threads = IoOptions(redis_hash_threads=2 if request.param == "hash threads" else 0)
    if request.param == "public API":
        patch.setattr(redisstore, "_SOCKET_ATTRIBUTE", "_kvtrio_no_such_attribute")
    opened = RedisBlockStore.open(redis_url, options=threads)
    yield opened
    opened.close()


def _stored(store: RedisBlockStore, rng: random.Random, count: int) -> list[bytes]:
    blobs = [rng.randbytes(rng.choice(SIZES)) for _ in range(count)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    store.put_many([(n, memoryview(b)) for n, b in zip(names, blobs, strict=True)])
    return blobs


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("verify", [False, True])
def test_mixed_batches_are_bit_exact(store: RedisBlockStore, seed: int, verify: bool) -> None:
    """Random sizes (empty blocks included), misses anywhere (first, last, runs of them),
    more buffers than one recvmsg_into takes: bit-exact, misses False, connection reusable."""
    rng = random.Random(seed)
    blobs = _stored(store, rng, 40)
    absent = [os.urandom(rng.choice(SIZES[3:])) for _ in range(10)]  # never stored
    order = [rng.choice(blobs) for _ in range(150)] + absent
    rng.shuffle(order)
    order = [absent[0], *order, absent[1]]  # a miss first and last
    buffers = [bytearray(len(b)) for b in order]
    items = [
        (hashlib.sha256(b).hexdigest(), memoryview(buf))
        for b, buf in zip(order, buffers, strict=True)
    ]
    found = store.read_many_into(items, verify=verify)
    assert found == [not any(b is a for a in absent) for b in order]
    for ok, want, got in zip(found, order, buffers, strict=True):
        if ok:
            assert bytes(got) == want
    assert store.client.ping()
    stats = store.statistics()
    assert stats.blocks_verified == (sum(found) if verify else 0)


def test_all_present_needs_no_reply_parser(redis_url: str) -> None:
    """When every block is present at its size, the replies land in the buffers through
    the scatter path alone, and nothing is read past them."""
    store = RedisBlockStore.open(redis_url)
    blobs = _stored(store, random.Random(9), 300)
    buffers = [bytearray(len(b)) for b in blobs]
    items = [
        (hashlib.sha256(b).hexdigest(), memoryview(buf))
        for b, buf in zip(blobs, buffers, strict=True)
    ]
    assert all(store.read_many_into(items, verify=True))
    assert [bytes(b) for b in buffers] == blobs
    assert store.read_many_into(items[:1]) == [True] and store.client.ping()
    assert store.statistics().public_api_reads == 0
    store.close()


@pytest.mark.parametrize("position", [0, 7, 19])
def test_verified_read_rejects_a_corrupted_block(store: RedisBlockStore, position: int) -> None:
    rng = random.Random(position)
    blobs = [rng.randbytes(4096 + i) for i in range(20)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    store.put_many([(n, memoryview(b)) for n, b in zip(names, blobs, strict=True)])
    value = bytearray(blobs[position])
    value[-1] ^= 0x40
    store.client.set(store.block_key(names[position]), bytes(value))
    buffers = [bytearray(len(b)) for b in blobs]
    items = [(n, memoryview(buf)) for n, buf in zip(names, buffers, strict=True)]
    expected = rf"^block {names[position]}: block content does not hash to its name$"
    with pytest.raises(CorruptCacheError, match=expected):
        store.read_many_into(items, verify=True)
    assert store.read_many_into(items) == [True] * 20  # unverified: the caller hashes
    assert store.client.ping()


def test_resized_block_is_corrupt(store: RedisBlockStore) -> None:
    blobs = [os.urandom(1000), os.urandom(2000)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    store.put_many([(n, memoryview(b)) for n, b in zip(names, blobs, strict=True)])
    items = [(names[0], memoryview(bytearray(1000))), (names[1], memoryview(bytearray(1999)))]
    with pytest.raises(
        CorruptCacheError, match=rf"^block {names[1]}: stored size 2000 != expected 1999$"
    ):
        store.read_many_into(items)
    assert store.client.ping()


def test_public_api_fallback_is_used_and_counted(redis_url: str) -> None:
    """Without redis-py's private socket attribute, reads go through its public parser."""
    patch = pytest.MonkeyPatch()
    patch.setattr(redisstore, "_SOCKET_ATTRIBUTE", "_kvtrio_no_such_attribute")
    try:
        store = RedisBlockStore.open(redis_url)
        blob = os.urandom(5000)
        name = hashlib.sha256(blob).hexdigest()
        store.put_many([(name, memoryview(blob))])
        buffer = bytearray(5000)
        assert store.read_many_into([(name, memoryview(buffer))], verify=True) == [True]
        assert bytes(buffer) == blob
        assert store.statistics().public_api_reads == 1
        store.close()
    finally:
        patch.undo()


@pytest.mark.parametrize("hash_threads", [0, 2])
@pytest.mark.parametrize("where", [0, 1_000_000, 3 * 1024 * 1024 - 1])
def test_verified_read_rejects_a_large_block_corrupted_anywhere(
    redis_url: str, where: int, hash_threads: int
) -> None:
    """A block larger than one receive is hashed piece by piece as it arrives (or whole,
    on a helper thread): a flipped byte at its start, middle or end is still caught."""
    store = RedisBlockStore.open(redis_url, options=IoOptions(redis_hash_threads=hash_threads))
    blob = os.urandom(3 * 1024 * 1024)
    name = hashlib.sha256(blob).hexdigest()
    store.put_many([(name, memoryview(blob))])
    buffer = bytearray(len(blob))
    assert store.read_many_into([(name, memoryview(buffer))], verify=True) == [True]
    value = bytearray(blob)
    value[where] ^= 1
    store.client.set(store.block_key(name), bytes(value))
    with pytest.raises(CorruptCacheError, match=rf"^block {name}: block content does not"):
        store.read_many_into([(name, memoryview(buffer))], verify=True)
    store.close()


def test_first_corrupted_block_in_order_is_reported_with_hash_threads(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Helper threads finish in any order; the error names the first bad block of the
    batch, and the read waits for every helper before raising (none is left reading)."""
    monkeypatch.setattr(redisrecv, "_HASH_GROUP", 1)  # one block per helper task
    store = RedisBlockStore.open(redis_url, options=IoOptions(redis_hash_threads=3))
    blobs = [os.urandom(65536) for _ in range(64)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    store.put_many([(n, memoryview(b)) for n, b in zip(names, blobs, strict=True)])
    for bad in (40, 13, 41):
        value = bytearray(blobs[bad])
        value[0] ^= 1
        store.client.set(store.block_key(names[bad]), bytes(value))
    items = [(n, memoryview(bytearray(65536))) for n in names]
    with pytest.raises(CorruptCacheError, match=rf"^block {names[13]}: "):
        store.read_many_into(items, verify=True)
    assert store.client.ping()
    store.close()


@pytest.mark.parametrize(
    ("raw", "expected"), [("0", 0), ("3", 3), (" 2 ", 2), ("-1", None), ("two", None)]
)
def test_hash_threads_setting(raw: str, expected: int | None) -> None:
    """KVTRIO_REDIS_HASH_THREADS, read at the CLI's edge, sets the store's helpers."""
    environ = {"KVTRIO_REDIS_HASH_THREADS": raw}
    if expected is None:
        with pytest.raises(ValueError, match=r"^KVTRIO_REDIS_HASH_THREADS="):
            IoOptions.from_environ(environ)
    else:
        assert IoOptions.from_environ(environ).redis_hash_threads == expected


def test_hash_threads_default_leaves_two_cores_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, expected in ((1, 0), (2, 0), (4, 1), (8, 2), (16, 4), (64, 4)):
        monkeypatch.setattr(options, "usable_cpus", lambda n=cpus: n)
        assert IoOptions().redis_hash_threads == expected


def test_the_hash_helpers_end_with_the_store(redis_url: str) -> None:
    """The store's sha256 helpers start on the first verified read and are joined by
    close(): none outlives the store."""
    before = set(threading.enumerate())
    store = RedisBlockStore.open(redis_url, options=IoOptions(redis_hash_threads=2))
    blobs = [os.urandom(65536) for _ in range(32)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    store.put_many([(n, memoryview(b)) for n, b in zip(names, blobs, strict=True)])
    items = [(n, memoryview(bytearray(65536))) for n in names]
    assert store.read_many_into(items, verify=True) == [True] * len(names)
    helpers = [t for t in set(threading.enumerate()) - before if t.name.startswith("kvtrio-sha256")]
    assert helpers
    store.close()
    assert not any(t.is_alive() for t in helpers)
