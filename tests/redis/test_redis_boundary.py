"""A shared store is untrusted and may stall (issue 15, item 5).

On the landed code a Redis that accepts connections and never answers held four
concurrent ``fetch_nearest`` calls for 90-270 s (a 30 s socket timeout, retried, in
uncancellable threads), and a manifest padded to 300 MB with a recomputed hash was read
whole at open and on every hit (the local store caps manifests at 64 MiB).
"""

from __future__ import annotations

import hashlib
import signal
import time
from typing import Any

import pytest
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.tiered import open_tiered_cache
from kvtrio.errors import CorruptCacheError, StoreUnavailableError
from kvtrio.storage.manifeststore import MAX_MANIFEST_BYTES, RedisManifestStore
from kvtrio.storage.redisstore import DEFAULT_DEADLINE_S

from ..actors.test_tiered_content_binding import insert_two_cold, options
from .test_tier_redis import TOKENS, _entry, _tiered_options


async def test_four_lookups_against_a_stopped_redis_return_within_the_deadline(
    private_redis: Any,
) -> None:
    url = private_redis.url(0, prefix="kvtrio")
    async with MlxOwner.dedicated() as owner:
        model, caches, _ = await _entry(owner)
        options = _tiered_options(owner)
        async with open_tiered_cache(url, model, **options) as host_a:
            await host_a.insert(TOKENS, caches)
            await host_a.flush()
        async with open_tiered_cache(url, model, **options) as host_b:
            # A cold exact entry, a longer query, and two prompts only the shared index
            # could answer: every path to Redis a lookup takes.
            queries = [TOKENS, [*TOKENS, 7], [9, 9, 9, *TOKENS], list(range(500, 600))]
            private_redis.process.send_signal(signal.SIGSTOP)
            took: list[float] = []
            try:

                async def lookup(query: list[int]) -> None:
                    start = time.monotonic()
                    await host_b.fetch_nearest(query)
                    took.append(time.monotonic() - start)

                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        for query in queries:
                            nursery.start_soon(lookup, query)
            finally:
                private_redis.process.send_signal(signal.SIGCONT)
            assert len(took) == 4
            assert max(took) <= DEFAULT_DEADLINE_S + 1.0, took


async def test_a_cancelled_shared_lookup_returns_at_once(private_redis: Any) -> None:
    """The prefix-index lookup holds no borrowed buffer: cancelled, it is abandoned."""
    url = private_redis.url(0, prefix="kvtrio")
    async with MlxOwner.dedicated() as owner:
        model, _, _ = await _entry(owner)
        async with open_tiered_cache(url, model, **_tiered_options(owner)) as cache:
            private_redis.process.send_signal(signal.SIGSTOP)
            try:
                start = time.monotonic()
                with trio.move_on_after(0.1):
                    await cache.fetch_nearest(list(range(500, 600)))
                assert time.monotonic() - start < 0.5
            finally:
                private_redis.process.send_signal(signal.SIGCONT)


async def test_a_manifest_value_replaced_by_another_entrys_is_a_drop_not_a_hit(
    private_redis: Any,
) -> None:
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.tinymodel import build_tiny_model

    url = private_redis.url(0, prefix="kvtrio")
    async with MlxOwner.inline() as owner:
        tiny = await owner.run(build_tiny_model)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        async with open_tiered_cache(url, model, **options(tiny, owner)) as cache:  # type: ignore[arg-type]
            (key_a, tokens_a), (key_b, _) = await insert_two_cold(cache, tiny, owner)
            store = RedisManifestStore.open(url)
            try:
                value = store.client.get(store.manifest_key(f"{key_b}.kvc"))
                assert isinstance(value, bytes)
                store.client.set(store.manifest_key(f"{key_a}.kvc"), value)
            finally:
                store.close()
            fetched = await cache.fetch_nearest(tokens_a)
            assert fetched.caches is None and fetched.remaining == tuple(tokens_a)
            stats = cache.statistics()
            assert (stats.hits_cold, stats.drops) == (0, 1)


async def test_a_store_failing_during_open_raises_a_plain_typed_error(
    start_redis: Any,
) -> None:
    """Connect works, listing fails (SCAN disabled): the caller sees the one
    StoreUnavailableError, not an ExceptionGroup around it."""
    server = start_redis("--rename-command", "SCAN", "")
    url = server.url(0, prefix="kvtrio")
    async with MlxOwner.inline() as owner:
        model, _, _ = await _entry(owner)
        with pytest.raises(StoreUnavailableError):
            async with open_tiered_cache(url, model, **_tiered_options(owner)):
                pass


def test_a_manifest_over_the_cap_is_refused_without_reading_it_whole(redis_url: str) -> None:
    store = RedisManifestStore.open(redis_url)
    try:
        data = b"x" * (MAX_MANIFEST_BYTES + 1)
        value = hashlib.sha256(data).digest() + data  # a valid hash: only the size is wrong
        store.client.set(store.manifest_key("big.kvc"), value)
        with pytest.raises(CorruptCacheError, match=r"^manifest big\.kvc: over the"):
            store.get("big.kvc")
        store.client.set(store.manifest_key("ok.kvc"), hashlib.sha256(b"m").digest() + b"m")
        assert store.get("ok.kvc") == b"m"
        assert store.get("absent.kvc") is None
    finally:
        store.close()


def test_a_stalled_redis_fails_one_operation_within_the_deadline(private_redis: Any) -> None:
    store = RedisManifestStore.open(private_redis.url(0))
    private_redis.process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            store.get("x.kvc")
        assert time.monotonic() - start <= DEFAULT_DEADLINE_S + 0.5
    finally:
        private_redis.process.send_signal(signal.SIGCONT)
        store.close()
