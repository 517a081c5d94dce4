"""TieredPromptCache over a fake cold store: lookup semantics, budgets, write policies,
restart, namespacing and supersession (the real ColdTier is in test_tiered_real.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kvtrio.actors.lifecycle import ColdState
from kvtrio.actors.prefix import MatchKind, ModelKey
from kvtrio.actors.tiered import Tier, TieredPromptCache, WritePolicy

from .fakes import LAYERS, MODEL, FakeColdStore, entry_bytes, fake_caches, fake_tiered


async def test_hot_hits_exact_shorter_and_longer_trimmed(tmp_path: Path) -> None:
    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        await cache.insert(list(range(10)), fake_caches(10))
        exact = await cache.fetch_nearest(list(range(10)))
        assert (exact.tier, exact.remaining) == (Tier.HOT, ())
        shorter = await cache.fetch_nearest(list(range(13)))
        assert shorter.match is not None and shorter.match.kind is MatchKind.SHORTER
        assert shorter.remaining == (10, 11, 12)
        longer = await cache.fetch_nearest([*range(6), 99])
        assert longer.match is not None and longer.match.kind is MatchKind.LONGER
        assert longer.caches is not None and [c.offset for c in longer.caches] == [6, 6]
        assert longer.remaining == (99,)
        miss = await cache.fetch_nearest([7, 7, 7])
        assert (miss.caches, miss.remaining) == (None, (7, 7, 7))
        stats = cache.statistics()
        assert (stats.hits_hot, stats.hits_cold, stats.misses) == (3, 0, 1)


async def test_a_fetched_cache_is_a_private_copy(tmp_path: Path) -> None:
    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        await cache.insert(list(range(10)), fake_caches(10))
        first = await cache.fetch_nearest([*range(5), 42])
        assert first.caches is not None
        first.caches[0].offset = 1000
        again = await cache.fetch_nearest(list(range(12)))
        assert again.caches is not None and [c.offset for c in again.caches] == [10, 10]


async def test_non_trimmable_entries_are_not_trimmed_back(tmp_path: Path) -> None:
    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        await cache.insert(list(range(10)), fake_caches(10, trimmable=False))
        assert (await cache.fetch_nearest([*range(6), 99])).caches is None
        assert (await cache.fetch_nearest(list(range(11)))).tier is Tier.HOT


async def test_ram_budget_is_never_exceeded_by_more_than_one_entry(tmp_path: Path) -> None:
    """Write-back: what leaves RAM goes to disk, and is found there."""
    store = FakeColdStore(tmp_path, MODEL)
    budget = entry_bytes(50)
    rng = random.Random(1)
    async with fake_tiered(store, hot_budget=budget) as cache:
        keys = []
        for i in range(20):
            n = rng.randrange(5, 40)
            keys.append(await cache.insert([i + 1000, *range(n)], fake_caches(n + 1)))
            stats = cache.statistics()
            assert stats.hot_bytes <= budget or stats.hot_entries == 1
        await cache.wait_writes_settled()
        stats = cache.statistics()
        assert stats.hot_evictions > 0
        assert set(store.stored) <= set(keys) and len(store.stored) == stats.hot_evictions
        first = await cache.fetch_nearest([1000, *range(200)])
        assert first.tier is Tier.COLD
        assert cache.statistics().hits_cold == 1


async def test_disk_budget_is_never_exceeded_by_more_than_one_entry(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    budget = entry_bytes(60)
    sizes = []
    async with fake_tiered(
        store, hot_budget=0, cold_budget=budget, policy=WritePolicy.WRITE_THROUGH
    ) as cache:
        for i in range(15):
            n = 5 + 3 * i % 31
            sizes.append(entry_bytes(n + 1))
            await cache.insert([i + 1000, *range(n)], fake_caches(n + 1))
            await cache.wait_writes_settled()
            assert store.disk_bytes <= budget or len(store.disk) == 1
            assert cache.statistics().cold_bytes == store.disk_bytes
        assert cache.statistics().cold_evictions > 0


async def test_restart_keeps_the_cache_and_other_models_never_hit(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    prompt = list(range(30))
    async with fake_tiered(store) as cache:
        await cache.insert(prompt, fake_caches(30))
        await cache.flush()
    async with fake_tiered(store) as cache:
        assert cache.statistics().cold_entries == 1
        hit = await cache.fetch_nearest([*prompt, 1, 2])
        assert (hit.tier, hit.remaining) == (Tier.COLD, (1, 2))
        again = await cache.fetch_nearest([*prompt, 3])
        assert again.tier is Tier.HOT  # promoted on the cold hit
    for other in (ModelKey("other", "fp-1"), ModelKey("tiny", "fp-2")):
        async with fake_tiered(store, model=other) as cache:
            for query in (prompt, [*prompt, 1], prompt[:10]):
                assert (await cache.fetch_nearest(query)).caches is None


async def test_checkpoints_supersede_older_ones_of_the_same_conversation(
    tmp_path: Path,
) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, policy=WritePolicy.WRITE_THROUGH) as cache:
        await cache.insert(list(range(8)), fake_caches(8), conversation="c1")
        await cache.insert(list(range(8)), fake_caches(8), conversation="c2")
        await cache.wait_writes_settled()
        await cache.insert(list(range(12)), fake_caches(12), conversation="c1")
        await cache.insert(list(range(16)), fake_caches(16), conversation="c1")
        await cache.wait_writes_settled()
        stats = cache.statistics()
        assert stats.superseded == 1  # the shared 8-token entry is still c2's
        assert sorted(len(info.tokens) for info, _ in store.disk.values()) == [8, 16]
        assert stats.hot_entries == 2


async def test_a_failing_cold_tier_never_fails_a_request(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL, fail_stores=True)
    async with fake_tiered(store, hot_budget=entry_bytes(10)) as cache:
        await cache.insert(list(range(10)), fake_caches(10))
        await cache.insert(list(range(100, 110)), fake_caches(10))
        await cache.wait_writes_settled()
        assert cache.statistics().drops == 1
        assert (await cache.fetch_nearest(list(range(11)))).caches is None
        assert (await cache.fetch_nearest(list(range(100, 111)))).tier is Tier.HOT


async def test_a_vanished_cold_file_is_a_clean_miss(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store) as cache:
        await cache.insert(list(range(10)), fake_caches(10))
        await cache.flush()
    async with fake_tiered(store) as cache:
        store.disk.clear()
        result = await cache.fetch_nearest(list(range(12)))
        assert result.caches is None
        stats = cache.statistics()
        assert (stats.drops, stats.misses, stats.cold_entries) == (1, 1, 0)


async def test_need_logits_leaves_one_token_on_an_exact_hit(tmp_path: Path) -> None:
    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        await cache.insert(list(range(10)), fake_caches(10))
        found = await cache.fetch_nearest(list(range(10)), need_logits=True)
        assert found.remaining == (9,)
        assert found.caches is not None and [c.offset for c in found.caches] == [9, 9]
        await cache.insert(list(range(100, 110)), fake_caches(10, trimmable=False))
        await cache.insert(list(range(100, 105)), fake_caches(5, trimmable=False))
        fallback = await cache.fetch_nearest(list(range(100, 110)), need_logits=True)
        assert fallback.remaining == tuple(range(105, 110))


async def test_a_filling_disk_shrinks_the_cold_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk budget is min(cold_budget, used + free - min_free_bytes)."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 10**12}
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(0, 0, free["bytes"]))
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0, policy=WritePolicy.WRITE_THROUGH) as cache:
        for i in range(4):
            await cache.insert([i + 1000, *range(9)], fake_caches(10))
        await cache.wait_writes_settled()
        assert len(store.disk) == 4
        free["bytes"] = 0  # the disk is full: only what the tier holds may stay
        cache.min_free_bytes = entry_bytes(20)  # and the tier must leave 2 entries' worth free
        await cache.insert([2000, *range(9)], fake_caches(10))
        await cache.wait_writes_settled()
        assert store.disk_bytes <= 5 * entry_bytes(10) - entry_bytes(20) + entry_bytes(10)
        assert cache.statistics().cold_evictions >= 2


async def test_supersession_survives_a_restart_and_a_racing_disk_hit(tmp_path: Path) -> None:
    """A turn after a restart supersedes the conversation's checkpoint on disk, even while
    a fetch of that checkpoint is still loading (the late load is not promoted to RAM);
    the old file goes once the new checkpoint is durable."""
    import trio

    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store) as cache:
        await cache.insert(list(range(12)), fake_caches(12), conversation="c1")
    assert len(store.disk) == 1
    store.gate = trio.Event()
    async with fake_tiered(store) as cache:
        async with trio.open_nursery() as nursery:
            results = []

            async def fetch() -> None:
                results.append(await cache.fetch_nearest(list(range(14))))

            nursery.start_soon(fetch)
            await trio.testing.wait_all_tasks_blocked()
            await cache.insert(list(range(16)), fake_caches(16), conversation="c1")
            store.gate.set()
        assert results[0].tier is Tier.COLD
        await cache.wait_writes_settled()
        stats = cache.statistics()
        # The old checkpoint stays on disk until the new one is durable (at close here).
        assert (stats.superseded, stats.hot_entries, stats.cold_entries) == (1, 1, 1)
    assert [len(info.tokens) for info, _ in store.disk.values()] == [16]


def _check_consistent(cache: TieredPromptCache) -> None:
    """Every indexed entry is in RAM or durable on disk; the LRUs, the pending queue and
    the ledger's reservations agree with the entries' states."""
    records = cache._records
    for entry in cache._index:
        record = records[entry.key]
        assert record.hot is not None or record.cold.state is ColdState.DURABLE
    assert all(records[k].hot is not None for k in cache._hot_lru)
    assert all(records[k].cold.state is ColdState.DURABLE for k in cache._ledger.durable_keys())
    assert cache._hot_bytes == sum(records[k].hot_bytes for k in cache._hot_lru)
    cache.check()


@pytest.mark.parametrize("seed", range(12))
async def test_random_operations_keep_the_invariants(tmp_path: Path, seed: int) -> None:
    """Random inserts (shared prefixes, conversations), lookups and restarts, checked
    against the budgets and against what the store really holds."""
    rng = random.Random(seed)
    store = FakeColdStore(tmp_path, MODEL, jitter=random.Random(seed))
    policy = rng.choice(list(WritePolicy))
    hot_budget, cold_budget = (
        entry_bytes(rng.randrange(20, 80)),
        entry_bytes(rng.randrange(40, 200)),
    )
    base = [rng.randrange(6) for _ in range(40)]
    history: dict[str, list[int]] = {}
    for _restart in range(3):
        async with fake_tiered(
            store, hot_budget=hot_budget, cold_budget=cold_budget, policy=policy
        ) as cache:
            for _ in range(40):
                if rng.random() < 0.5:
                    conv = rng.choice(["a", "b", "c", None])
                    if conv is not None and conv in history and rng.random() < 0.7:
                        tokens = history[conv] + [rng.randrange(6) for _ in range(3)]
                    else:
                        tokens = [*base[: rng.randrange(1, 40)], rng.randrange(6)]
                    if conv is not None:
                        history[conv] = tokens
                    await cache.insert(tokens, fake_caches(len(tokens)), conversation=conv)
                    stats = cache.statistics()
                    assert stats.hot_bytes <= hot_budget or stats.hot_entries == 1
                else:
                    query = [*base[: rng.randrange(1, 40)], rng.randrange(6)]
                    found = await cache.fetch_nearest(query, need_logits=rng.random() < 0.5)
                    if found.match is not None:
                        assert found.caches is not None
                        assert [c.offset for c in found.caches] == [found.reused] * LAYERS
                        assert found.match.entry.tokens[: found.reused] == tuple(
                            query[: found.reused]
                        )
                        assert tuple(query[found.reused :]) == found.remaining
                _check_consistent(cache)
                if rng.random() < 0.2:
                    await cache.wait_writes_settled()
                    assert set(cache._ledger.durable_keys()) == set(store.disk)
                    assert cache.statistics().cold_bytes == store.disk_bytes
                    assert store.disk_bytes <= cold_budget or len(store.disk) == 1
        assert cache.statistics().cold_bytes == store.disk_bytes
