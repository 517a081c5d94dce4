"""The cold tier on Redis: ``ColdTier.open("redis://...")`` shared by hosts.

Two hosts are two processes (``tier_host.py``) with separate local directories and one
Redis; the failure tests run in-process with a redis-server of their own.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from kvtrio.actors.coldstore import ColdTierStore
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.spill import SpillOutcome
from kvtrio.actors.tier import ColdTier
from kvtrio.actors.tiered import Tier, WritePolicy, open_tiered_cache
from kvtrio.errors import CacheMissError, CorruptCacheError, StoreUnavailableError
from kvtrio.storage.redisstore import RedisBlockStore

from . import hostscripts

host = hostscripts.load("tier_host.py")


def _run_host(url: str, local_dir: Path, *args: object) -> dict[str, Any]:
    return hostscripts.run("tier_host.py", url, local_dir, *args)


def test_two_hosts_share_one_tier(tmp_path: Path, redis_url: str) -> None:
    """Host B loads bit-exact what host A saved; B's extension of it stores only new blocks
    (measured by Redis's key count and value bytes)."""
    counter = RedisBlockStore.open(redis_url)
    saved = _run_host(redis_url, tmp_path / "host-a", "save", "conv1", 64)
    keys_a, bytes_a = counter.count_blocks()
    assert bytes_a == saved["new_block_bytes"] > 0

    loaded = _run_host(redis_url, tmp_path / "host-b", "load", "conv1")
    assert loaded["digest"] == saved["digest"]

    extended = _run_host(redis_url, tmp_path / "host-b", "extend", "conv1", "conv2", 80)
    keys_b, bytes_b = counter.count_blocks()
    tensors = 2 * host.CONFIG["num_hidden_layers"]  # K and V per layer
    assert keys_b - keys_a == tensors  # 64 -> 80 tokens: one new 16-token block per tensor
    assert bytes_b - bytes_a == extended["new_block_bytes"] == bytes_a // 4
    assert (
        _run_host(redis_url, tmp_path / "host-a", "load", "conv2")["digest"] == (extended["digest"])
    )
    counter.close()


async def _tiny(tier: ColdTier) -> Any:
    return await tier.owner.run(host._build)


async def test_deleted_and_corrupted_blocks_behind_the_tiers_back(redis_url: str) -> None:
    async with ColdTier.open(redis_url, layout="blocks", block_tokens=host.BLOCK_TOKENS) as tier:
        tiny = await _tiny(tier)
        tokens = list(range(1, 49))
        caches = await tier.owner.run(host._fresh, tiny, tokens)
        for key in ("a", "b"):
            assert (await (await tier.save(key, tokens, caches)).wait()).written
        store = RedisBlockStore.open(redis_url)
        names = sorted(info.name for info in store.iter_blocks())
        # "a" and "b" share every block: corrupt one first (all present: a hash failure),
        # then delete another (a clean miss, found before anything is allocated).
        stored = store.client.get(store.block_key(names[1]))
        assert isinstance(stored, bytes)
        value = bytearray(stored)
        value[0] ^= 1
        store.client.set(store.block_key(names[1]), bytes(value))
        with pytest.raises(CorruptCacheError, match=r"block content does not hash to its name$"):
            await tier.load("b")
        store.client.delete(store.block_key(names[0]))
        with pytest.raises(CacheMissError, match=rf"block {names[0]} is missing$"):
            await tier.load("a")
        store.close()


async def test_redis_restarted_mid_run(private_redis: Any) -> None:
    """A save in flight when Redis dies settles FAILED; the tier goes on; after Redis is
    back, saves succeed and load bit-exact."""
    url = private_redis.url(0, prefix="kvtrio")
    async with ColdTier.open(url, layout="blocks", block_tokens=host.BLOCK_TOKENS) as tier:
        tiny = await _tiny(tier)
        tokens = list(range(1, 33))
        caches = await tier.owner.run(host._fresh, tiny, tokens)
        want = await tier.owner.run(host.kv_digest, caches)
        assert (await (await tier.save("before", tokens, caches)).wait()).written

        gate = threading.Event()
        tickets = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.owner.run, gate.wait, 30)  # the owner is busy...
            await trio.testing.wait_all_tasks_blocked()

            async def save() -> None:
                tickets.append(await tier.save("during", tokens, caches))

            nursery.start_soon(save)  # ...so this save is accepted but not yet written
            await trio.testing.wait_all_tasks_blocked()
            private_redis.kill()
            gate.set()
        result = await tickets[0].wait()
        assert result.outcome is SpillOutcome.FAILED
        assert isinstance(result.error, StoreUnavailableError)
        with pytest.raises(StoreUnavailableError):
            await tier.load("before")

        private_redis.start()  # no persistence: Redis is back, empty
        assert (await (await tier.save("after", tokens, caches)).wait()).written
        restored = await tier.load("after")
        assert await tier.owner.run(host.kv_digest, restored.caches) == want
        assert tier.statistics().spill.failed == 1


TOKENS = list(range(1, 65))


async def _entry(owner: MlxOwner) -> tuple[ModelKey, Any, Any]:
    """The tiny model's key, its caches after :data:`TOKENS`, and their digest."""
    tiny = await owner.run(host._build)
    caches = await owner.run(host._fresh, tiny, TOKENS)
    return (
        ModelKey(tiny.model_id, tiny.fingerprint),
        caches,
        await owner.run(host.kv_digest, caches),
    )


def _tiered_options(owner: MlxOwner, **extra: Any) -> dict[str, Any]:
    """What every TieredPromptCache here is opened with (budgets that never evict; short
    prompts, so every cold match is loaded)."""
    return {
        "owner": owner, "hot_budget": 1 << 30, "cold_budget": 1 << 40,
        "block_size": host.BLOCK_TOKENS, "min_reuse_tokens": 0, **extra,
    }  # fmt: skip


async def test_tiered_cache_on_redis_keeps_serving(private_redis: Any) -> None:
    """TieredPromptCache, unchanged, over the shared tier: host B's cold hit is host A's
    entry, bit-exact; with Redis down a cold lookup is a miss, never an error."""
    url = private_redis.url(0, prefix="kvtrio")
    query = [*TOKENS, 999]
    async with MlxOwner.dedicated() as owner:
        model, caches, want = await _entry(owner)
        options = _tiered_options(owner)
        async with open_tiered_cache(url, model, **options) as host_a:
            await host_a.insert(TOKENS, caches)
            await host_a.flush()
        async with open_tiered_cache(url, model, **options) as host_b:
            fetched = await host_b.fetch_nearest(query)
            assert (fetched.tier, fetched.remaining) == (Tier.COLD, (999,))
            assert fetched.caches is not None
            assert await owner.run(host.kv_digest, fetched.caches) == want
        async with open_tiered_cache(url, model, **options) as host_c:
            private_redis.kill()
            missed = await host_c.fetch_nearest(query)
            assert (missed.caches, missed.remaining) == (None, tuple(query))
            private_redis.start()


async def test_catalogue_refresh_fallback_without_the_index(private_redis: Any) -> None:
    """The fallback for entries saved without index registration: hosts that do not ask
    the prefix index (``shared_index=False``) find entries saved after they opened by
    re-reading the catalogue, at most once per ``shared_refresh`` seconds: host B (due at
    once) gets A's entry bit-exact, host C (not due for an hour) still misses."""
    url = private_redis.url(0, prefix="kvtrio")
    query = [*TOKENS, 999]
    async with MlxOwner.dedicated() as owner:
        model, caches, want = await _entry(owner)
        options = _tiered_options(owner, shared_index=False)
        async with (
            open_tiered_cache(url, model, shared_refresh=0.0, **options) as host_b,
            open_tiered_cache(url, model, shared_refresh=3600.0, **options) as host_c,
            open_tiered_cache(url, model, **options) as host_a,
        ):
            for early in (host_b, host_c):
                missed = await early.fetch_nearest(query)
                assert (missed.caches, missed.remaining) == (None, tuple(query))
            await host_a.insert(TOKENS, caches)
            await host_a.flush()
            fetched = await host_b.fetch_nearest(query)
            assert (fetched.tier, fetched.remaining) == (Tier.COLD, (999,))
            assert fetched.caches is not None
            assert await owner.run(host.kv_digest, fetched.caches) == want
            stats = host_b.statistics()
            assert (stats.hits_cold, stats.shared_refreshes, stats.shared_lookups) == (1, 2, 0)
            late = await host_c.fetch_nearest(query)
            assert (late.caches, late.remaining) == (None, tuple(query))
            assert host_c.statistics().shared_refreshes == 1


async def test_a_host_never_deletes_shared_blocks(private_redis: Any) -> None:
    """docs/design.md invariant 17. Shared-block GC is not a host's job (ColdTierStore's
    rule 3): removing an entry deletes its manifest, while its blocks stay for every other
    host's manifests (Redis's own eviction, or a GC over the shared manifests with its
    grace period, takes them); the host's ledger stops counting them all the same."""
    url = private_redis.url(0, prefix="kvtrio")
    async with MlxOwner.dedicated() as owner:
        model, caches, _ = await _entry(owner)
        options = _tiered_options(owner, policy=WritePolicy.WRITE_THROUGH)
        async with open_tiered_cache(url, model, **options) as cache:
            key = await cache.insert(TOKENS, caches)
            await cache.wait_writes_settled()
            store = cache.cold
            assert isinstance(store, ColdTierStore)
            entry = await trio.to_thread.run_sync(store.tier.entry_blocking, key)
            blocks = [ref.sha256 for slot in entry.header.slots() for ref in slot.blocks or ()]
            assert blocks
            assert await store.remove(key) > 0 and await store.usage() == 0
            with pytest.raises(CacheMissError):
                await store.tier.entry(key)
        shared = RedisBlockStore.open(url)
        try:
            assert all(shared.has_many(blocks))
        finally:
            shared.close()


async def test_the_cold_lru_order_survives_a_restart_on_redis(private_redis: Any) -> None:
    """Last uses live beside the manifests (``P:manifest-last-use``): entries written
    A, B, C and then A used come back after a restart least recently used first, B, C,
    A, so a host's budget evicts B first, not A (Redis's manifests have no mtime)."""
    url = private_redis.url(0, prefix="kvtrio")
    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(host._build)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        prompts = [[seed, *range(2, 40)] for seed in (100, 200, 300)]
        options = _tiered_options(owner, policy=WritePolicy.WRITE_THROUGH)
        keys = []
        async with open_tiered_cache(url, model, **options) as cache:
            for tokens in prompts:
                keys.append(await cache.insert(tokens, await owner.run(host._fresh, tiny, tokens)))
                await cache.wait_writes_settled()
        async with open_tiered_cache(url, model, **options) as cache:
            assert (await cache.fetch_nearest([*prompts[0], 1])).tier is Tier.COLD
        async with open_tiered_cache(url, model, **options) as cache:
            assert cache._ledger.durable_keys() == [keys[1], keys[2], keys[0]]


async def test_a_pin_survives_a_restart_on_redis(private_redis: Any) -> None:
    """Pins live beside the last uses (``P:manifest-pinned``): an entry pinned before a
    restart is pinned again after it (never the cold policy's victim), and an unpin
    survives a restart too."""
    url = private_redis.url(0, prefix="kvtrio")
    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(host._build)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        prompts = [[seed, *range(2, 40)] for seed in (100, 200)]
        options = _tiered_options(owner, policy=WritePolicy.WRITE_THROUGH, pin_limit=1 << 30)
        async with open_tiered_cache(url, model, **options) as cache:
            for tokens in prompts:
                await cache.insert(tokens, await owner.run(host._fresh, tiny, tokens))
            await cache.wait_writes_settled()
            key = cache.pin(prompts[0])
        async with open_tiered_cache(url, model, **options) as cache:
            assert cache.cold_policy.is_pinned(key)
            assert cache.cold_policy.victim() != key and cache.cold_policy.victim() is None
            cache.unpin(prompts[0])
        async with open_tiered_cache(url, model, **options) as cache:
            assert not cache.cold_policy.is_pinned(key)
