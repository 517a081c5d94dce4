"""The shared prefix index in Redis, as the TieredPromptCache uses it (rule 8 of
kvtrio.actors.tiered): every save registers its entry under its token-block chain hashes;
a lookup without an exact entry asks the index in one round trip and reads only the
manifest of the deepest entry found, never the whole catalogue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.sharedkeys import index_keys
from kvtrio.actors.tiered import Tier, open_tiered_cache
from kvtrio.storage.redisstore import RedisBlockStore

from . import hostscripts

host = hostscripts.load("tier_host.py")


def _run_host(url: str, local_dir: Path, *args: object) -> dict[str, Any]:
    return hostscripts.run("tier_host.py", url, local_dir, *args)


def _options(owner: MlxOwner) -> dict[str, Any]:
    return {
        "owner": owner, "hot_budget": 1 << 30, "cold_budget": 1 << 40,
        "block_size": host.BLOCK_TOKENS, "min_reuse_tokens": 0,  # short prompts
    }  # fmt: skip


def _command_calls(client: Any, command: str) -> int:
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_host_finds_another_process_entry_through_the_index(
    tmp_path: Path, private_redis: Any
) -> None:
    """Host B, open before host A (another process) saved, finds A's longest entry for its
    prompt through the prefix index: one index round trip, one manifest read, no
    catalogue re-read (no SCAN reaches Redis), and loads it bit-exact."""
    url = private_redis.url(0, prefix="kvtrio")
    client = private_redis.client()
    query = [*range(1, 65), 999]
    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(host._build)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        async with open_tiered_cache(url, model, **_options(owner)) as host_b:
            missed = await host_b.fetch_nearest(query)
            assert (missed.caches, missed.remaining) == (None, tuple(query))
            # Host A saves two entries along the prompt: 32 and 64 tokens.
            saved = await trio.to_thread.run_sync(
                _run_host, url, tmp_path / "host-a", "insert", 32, 64
            )
            assert saved["cold_entries"] == 2
            client.config_resetstat()
            before = host_b.statistics()

            fetched = await host_b.fetch_nearest(query)
            assert (fetched.tier, fetched.remaining) == (Tier.COLD, (999,))
            assert fetched.caches is not None
            assert await owner.run(host.kv_digest, fetched.caches) == saved["digests"]["64"]
            after = host_b.statistics()
            assert after.shared_lookups - before.shared_lookups == 1
            assert (after.shared_found, after.shared_vanished, after.hits_cold) == (1, 0, 1)
            assert after.shared_refreshes == 0
            assert _command_calls(client, "scan") == 0  # no catalogue listing
            assert _command_calls(client, "srandmember") == len(query) // host.BLOCK_TOKENS + 1
    client.close()


async def test_saves_are_registered_under_their_chain_hashes(private_redis: Any) -> None:
    """A save through the tiered cache registers its manifest under every chain hash of
    its full token blocks and under its own key, in Redis's index keyspace."""
    url = private_redis.url(0, prefix="kvtrio")
    client = private_redis.client()
    tokens = list(range(1, 41))  # 2 full 16-token blocks and a tail
    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(host._build)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        caches = await owner.run(host._fresh, tiny, tokens)
        async with open_tiered_cache(url, model, **_options(owner)) as cache:
            key = await cache.insert(tokens, caches)
            await cache.flush()
    keys = index_keys(model, tokens, host.BLOCK_TOKENS)
    assert len(keys) == 3
    for index_key in keys:
        members = client.smembers(f"kvtrio:prefix:{index_key}")
        assert members == {f"{key}.kvc".encode()}
    registered = client.smembers(f"kvtrio:manifest-keys:{key}.kvc")
    assert {m.decode() for m in registered} == set(keys)
    client.close()


async def test_vanished_manifest_or_blocks_are_clean_misses(private_redis: Any) -> None:
    """An index entry whose manifest is gone (evicted, deleted) is skipped: a miss, counted
    as vanished. An entry whose blocks are gone is a miss too, never an error."""
    url = private_redis.url(0, prefix="kvtrio")
    first = list(range(1, 49))
    second = list(range(300, 348))
    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(host._build)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        caches = [await owner.run(host._fresh, tiny, t) for t in (first, second)]
        async with (
            open_tiered_cache(url, model, **_options(owner)) as host_b,
            open_tiered_cache(url, model, **_options(owner)) as host_a,
        ):
            key1 = await host_a.insert(first, caches[0])
            await host_a.flush()
            client = private_redis.client()
            assert client.delete(f"kvtrio:manifest:{key1}.kvc") == 1
            query = [*first, 7]
            missed = await host_b.fetch_nearest(query)
            assert (missed.caches, missed.remaining) == (None, tuple(query))
            stats = host_b.statistics()
            assert (stats.shared_lookups, stats.shared_vanished, stats.shared_found) == (1, 1, 0)
            # The stale registration is removed, in the background, for every host.
            await host_b.wait_writes_settled()
            for index_key in index_keys(model, first, host.BLOCK_TOKENS):
                assert client.smembers(f"kvtrio:prefix:{index_key}") == set()
            await host_b.fetch_nearest(query)
            assert host_b.statistics().shared_vanished == 1

            await host_a.insert(second, caches[1])
            await host_a.flush()
            blocks = RedisBlockStore.open(url)
            names = [info.name for info in blocks.iter_blocks()]
            assert blocks.delete_many(names) == len(names) > 0
            blocks.close()
            query = [*second, 7]
            missed = await host_b.fetch_nearest(query)
            assert (missed.caches, missed.remaining) == (None, tuple(query))
            stats = host_b.statistics()
            assert (stats.shared_found, stats.drops, stats.misses) == (1, 1, 3)
            client.close()
