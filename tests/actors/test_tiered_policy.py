"""Issue 18 through TieredPromptCache: eviction policies for both tiers, write admission and
wear, pins, TTLs, explained misses and the metrics text (over the fake cold store)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from kvtrio.actors.misses import MissReason
from kvtrio.actors.policy import (
    AdmitAll,
    MinimumTokens,
    PolicyKind,
    RecomputePerByte,
)
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import Tier, TieredPromptCache, WritePolicy
from kvtrio.errors import CorruptCacheError, KvtrioError, PinLimitError, StoreUnavailableError

from .fakes import (
    LAYERS,
    MODEL,
    FakeCache,
    FakeColdStore,
    entry_bytes,
    fake_caches,
    fake_tiered,
)


@attrs.define
class FaultyStore(FakeColdStore):
    """A fake store whose fetch of the keys in ``faults`` raises the error given."""

    faults: dict[str, KvtrioError] = attrs.field(factory=dict)
    fetches: int = 0

    async def fetch(
        self, key: str, *, model: ModelKey, tokens: Sequence[int] | None = None
    ) -> tuple[list[Any], int]:
        self.fetches += 1
        if key in self.faults:
            raise self.faults[key]
        return await super().fetch(key, model=model, tokens=tokens)


def _quadratic_prefill(cache: TieredPromptCache) -> None:
    # Attention makes long prompts cost more than their length (and their bytes).
    for n in (100, 1000, 4000, 16000):
        cache.observe_prefill(0, n, 1e-3 * n + 1e-7 * n * n)


def test_the_default_is_the_cost_policy_and_the_default_admission(tmp_path: Path) -> None:
    cache = TieredPromptCache(
        owner=None,  # type: ignore[arg-type]
        cold=FakeColdStore(tmp_path, MODEL),
        model=MODEL,
        hot_budget=1,
        cold_budget=1,
    )
    assert cache.eviction is PolicyKind.COST
    assert isinstance(cache.admission, RecomputePerByte)


@pytest.mark.parametrize("eviction", [PolicyKind.LRU, PolicyKind.COST])
async def test_hot_eviction_on_a_crafted_trace(tmp_path: Path, eviction: PolicyKind) -> None:
    # A long document, then two short chats; the RAM budget holds the document and one chat.
    # Nothing is written back (admission refuses all), so RAM entries are valued by
    # recompute: LRU drops the document (oldest), the cost policy the first chat.
    document, chat1, chat2 = list(range(1000, 1400)), [1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]
    async with fake_tiered(
        FakeColdStore(tmp_path, MODEL),
        hot_budget=entry_bytes(406),
        eviction=eviction,
        admission=MinimumTokens(10**9),
    ) as cache:
        _quadratic_prefill(cache)
        await cache.insert(document, fake_caches(len(document)))
        await cache.insert(chat1, fake_caches(len(chat1)))
        await cache.insert(chat2, fake_caches(len(chat2)))
        kept_document = (await cache.fetch_nearest(document)).tier is Tier.HOT
        kept_chat1 = (await cache.fetch_nearest(chat1)).tier is Tier.HOT
        assert (kept_document, kept_chat1) == (
            eviction is PolicyKind.COST,
            eviction is PolicyKind.LRU,
        )
        assert (await cache.fetch_nearest(chat2)).tier is Tier.HOT
        assert cache.statistics().hot_evictions == 1
        cache.check()


@pytest.mark.parametrize("eviction", [PolicyKind.LRU, PolicyKind.COST])
async def test_cold_eviction_goes_through_the_cold_policy(
    tmp_path: Path, eviction: PolicyKind
) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    document, chat1, chat2 = list(range(1000, 1400)), [1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]
    async with fake_tiered(
        store,
        cold_budget=entry_bytes(406),
        policy=WritePolicy.WRITE_THROUGH,
        eviction=eviction,
        admission=AdmitAll(),
    ) as cache:
        _quadratic_prefill(cache)
        for tokens in (document, chat1, chat2):
            await cache.insert(tokens, fake_caches(len(tokens)))
            await cache.wait_writes_settled()
        on_disk = {info.tokens for info, _ in store.disk.values()}
        gone = document if eviction is PolicyKind.LRU else chat1
        assert tuple(gone) not in on_disk and len(on_disk) == 2
        assert cache.statistics().cold_evictions == 1
        cache.check()


async def test_admission_decides_write_backs_and_wear_is_counted(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    short, long_ = [1, 2, 3], list(range(100, 130))
    async with fake_tiered(
        store, hot_budget=entry_bytes(30), eviction=PolicyKind.LRU, admission=MinimumTokens(20)
    ) as cache:
        await cache.insert(short, fake_caches(3))
        await cache.insert(long_, fake_caches(30))  # the short one leaves RAM: refused
        await cache.insert([7] * 30, fake_caches(30))  # the long one leaves RAM: written
        await cache.wait_writes_settled()
        assert [info.tokens for info, _ in store.disk.values()] == [tuple(long_)]
        wear = cache.statistics().wear
        assert wear is not None
        assert (wear.admitted, wear.refused, wear.bytes_refused) == (1, 1, entry_bytes(3))
        assert (wear.bytes_written, wear.bytes_reused) == (entry_bytes(30), 0)
        assert (await cache.fetch_nearest(long_)).tier is Tier.COLD
        wear = cache.statistics().wear
        assert wear is not None and (wear.bytes_reused, wear.entries_read_back) == (
            entry_bytes(30),
            1,
        )
        assert (await cache.fetch_nearest(short)).explanation.reason is MissReason.DROPPED  # type: ignore[union-attr]


async def test_a_pinned_entry_survives_pressure_within_the_pin_limit(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    system = list(range(50, 60))
    async with fake_tiered(
        store, hot_budget=entry_bytes(20), cold_budget=entry_bytes(20), pin_limit=entry_bytes(10)
    ) as cache:
        with pytest.raises(KvtrioError):  # nothing of these tokens yet
            cache.pin(system)
        await cache.insert(system, fake_caches(10))
        key = cache.pin(system)
        await cache.insert(list(range(200, 215)), fake_caches(15))  # evicted to disk
        await cache.wait_writes_settled()
        with pytest.raises(PinLimitError):
            cache.pin(list(range(200, 215)))
        for n in range(6):  # pressure on both tiers
            await cache.insert([n] * 10, fake_caches(10))
            await cache.wait_writes_settled()
        found = await cache.fetch_nearest(system)
        assert found.tier is Tier.HOT and found.remaining == ()
        stats = cache.statistics()
        assert stats.hot_policy is not None and stats.hot_policy.pinned_bytes == entry_bytes(10)
        assert stats.hot_evictions >= 5 and stats.hot_bytes > stats.hot_budget - entry_bytes(10)
        cache.unpin(system)
        for n in range(6):
            await cache.insert([n + 10] * 10, fake_caches(10))
        await cache.wait_writes_settled()
        assert key not in cache._hot_lru
        cache.check()


async def test_ttl_expires_entries_on_trios_clock(tmp_path: Path, autojump_clock: Any) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, policy=WritePolicy.WRITE_THROUGH) as cache:
        with pytest.raises(ValueError):
            await cache.insert([9, 9], fake_caches(2), ttl=-1)
        await cache.insert([1, 2, 3, 4], fake_caches(4), ttl=10)
        await cache.insert([5, 6, 7, 8], fake_caches(4))
        await cache.wait_writes_settled()
        await trio.sleep(6)
        assert (await cache.fetch_nearest([1, 2, 3, 4])).tier is Tier.HOT  # a use: 10 s more
        await trio.sleep(9)
        assert (await cache.fetch_nearest([1, 2, 3, 4])).tier is Tier.HOT
        await trio.sleep(11)
        gone = await cache.fetch_nearest([1, 2, 3, 4])
        assert gone.caches is None
        assert gone.explanation is not None and gone.explanation.reason is MissReason.EXPIRED
        assert (await cache.fetch_nearest([5, 6, 7, 8])).tier is Tier.HOT  # no TTL
        await cache.wait_writes_settled()
        assert len(store.disk) == 1
        stats = cache.statistics()
        assert stats.hot_policy is not None and stats.hot_policy.expired == 1
        cache.check()


async def test_every_miss_reason_through_the_cache(tmp_path: Path, autojump_clock: Any) -> None:
    seen: dict[MissReason | None, int] = {}

    async def reason(cache: TieredPromptCache, tokens: list[int]) -> MissReason | None:
        fetched = await cache.fetch_nearest(tokens)
        assert fetched.explanation is not None
        seen[fetched.explanation.reason] = seen.get(fetched.explanation.reason, 0) + 1
        return fetched.explanation.reason

    other = ModelKey("other", "fp-1")
    store = FaultyStore(tmp_path, MODEL)
    async with fake_tiered(store, model=other) as cache:
        await cache.insert([40, 41, 42, 43, 44], fake_caches(5))
    async with fake_tiered(store, hot_budget=entry_bytes(10), cold_budget=entry_bytes(20)) as cache:
        assert await reason(cache, [40, 41, 42, 43, 44]) is MissReason.OTHER_MODEL
        assert await reason(cache, [1, 2, 3]) is MissReason.NO_ENTRY
        await cache.insert(list(range(10)), fake_caches(10, trimmable=False))
        assert await reason(cache, [*range(6), 99]) is MissReason.NOT_TRIMMABLE
        assert await reason(cache, list(range(10))) is None  # exact: nothing better
        caches = [FakeCache(10, min_reusable_offset=8) for _ in range(LAYERS)]
        await cache.insert(list(range(20, 30)), caches)
        assert await reason(cache, [*range(20, 26), 99]) is MissReason.BELOW_MIN_REUSE
        # Three more entries through a RAM tier of one and a disk of two: the oldest
        # written back is evicted from disk.
        for n in (60, 70, 80):
            await cache.insert([n] * 10, fake_caches(10))
            await cache.wait_writes_settled()
        assert await reason(cache, list(range(10))) is MissReason.EVICTED
        corrupt, unreachable = [60] * 10, [70] * 10
        store.faults[cache.peek(corrupt).entry.key] = CorruptCacheError("bad")  # type: ignore[union-attr]
        store.faults[cache.peek(unreachable).entry.key] = StoreUnavailableError("down")  # type: ignore[union-attr]
        assert await reason(cache, corrupt) is MissReason.CORRUPT
        assert await reason(cache, unreachable) is MissReason.STORE_UNREACHABLE
        await cache.insert([90] * 10, fake_caches(10), ttl=5)
        await trio.sleep(6)
        assert await reason(cache, [90] * 10) is MissReason.EXPIRED
        stats = cache.statistics()
    async with fake_tiered(
        FakeColdStore(tmp_path / "d", MODEL),
        admission=MinimumTokens(99),
        hot_budget=entry_bytes(10),
    ) as cache:
        await cache.insert([1] * 10, fake_caches(10))
        await cache.insert([2] * 10, fake_caches(10))  # the first leaves RAM, refused
        assert await reason(cache, [1] * 10) is MissReason.DROPPED
    assert set(seen) == {None, *MissReason}
    assert stats.lookups is not None
    assert stats.lookups.lookups == sum(seen.values()) - 1
    assert stats.lookups.count(MissReason.CORRUPT) == 1 and stats.lookups.best_possible == 1


async def test_metrics_text_parses(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        await cache.insert([1, 2, 3, 4], fake_caches(4))
        await cache.fetch_nearest([1, 2, 3, 4])
        await cache.fetch_nearest([9, 9])
        text = cache.metrics_text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["kvtrio_cache_hits_total", (("tier", "hot"),)] == 1
    assert samples["kvtrio_cache_misses_total", ()] == 1
    assert samples["kvtrio_cache_lookup_reasons_total", (("reason", "no-entry"),)] == 1
    assert samples["kvtrio_cache_lookup_reasons_total", (("reason", "none"),)] == 1
    assert samples["kvtrio_cold_queue_depth", ()] == 0
    assert ("kvtrio_cache_pinned_bytes", (("tier", "cold"),)) in samples
    assert samples["kvtrio_cold_prefetches_total", ()] == 0
    assert samples["kvtrio_cold_prefetch_bytes_total", (("outcome", "wasted"),)] == 0


async def test_load_save_and_loop_lag_histograms_count(tmp_path: Path) -> None:
    """Rule 15: a completed save and a completed load each add one observation to their
    histogram in metrics_text, and the loop-lag probe observes while the cache is open."""
    from prometheus_client.parser import text_string_to_metric_families

    def histograms(text: str) -> dict[str, float]:
        families = {f.name: f for f in text_string_to_metric_families(text)}
        out = {}
        for name in ("kvtrio_cold_load_seconds", "kvtrio_cold_save_seconds",
                     "kvtrio_event_loop_lag_seconds"):  # fmt: skip
            assert families[name].type == "histogram"
            samples = {s.name: s for s in families[name].samples}
            inf = [s for s in families[name].samples if s.labels.get("le") == "+Inf"]
            assert inf[0].value == samples[name + "_count"].value
            assert samples[name + "_sum"].value >= 0
            out[name] = samples[name + "_count"].value
        return out

    async with fake_tiered(FakeColdStore(tmp_path, MODEL), hot_budget=entry_bytes(10)) as cache:
        before = histograms(cache.metrics_text())
        assert before["kvtrio_cold_save_seconds"] == before["kvtrio_cold_load_seconds"] == 0
        await _on_disk(cache, [1, 2, 3, 4, 5, 6])  # saves one entry (the other stays hot)
        saved = histograms(cache.metrics_text())
        assert saved["kvtrio_cold_save_seconds"] == 1
        assert (await cache.fetch_nearest([1, 2, 3, 4, 5, 6])).tier is Tier.COLD
        await trio.sleep(0.2)
        loaded = histograms(cache.metrics_text())
        assert loaded["kvtrio_cold_load_seconds"] == 1
        assert loaded["kvtrio_event_loop_lag_seconds"] >= 2  # every 0.05 s


async def _on_disk(cache: TieredPromptCache, *prompts: list[int]) -> None:
    for tokens in prompts:
        await cache.insert(tokens, fake_caches(len(tokens)))
    await cache.insert([0] * 10, fake_caches(10))  # pushes the others out of RAM
    await cache.wait_writes_settled()


async def test_a_prefetch_is_adopted_by_the_lookup(tmp_path: Path) -> None:
    store = FaultyStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=entry_bytes(10), eviction=PolicyKind.LRU) as cache:
        prompt = list(range(100, 110))
        await _on_disk(cache, prompt)
        store.gate = trio.Event()  # the load is in flight when the lookup comes
        assert cache.prefetch([*prompt, 5])
        assert not cache.prefetch(prompt)  # one load per entry
        assert not cache.prefetch([0] * 10)  # hot: nothing to load
        await trio.sleep(0.01)
        assert store.fetches == 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, 0.01)
            store.gate.set()
        got = await cache.fetch_nearest([*prompt, 5])
        assert got.tier is Tier.COLD and got.remaining == (5,)
        assert store.fetches == 1  # adopted: not read again
        stats = cache.statistics()
        assert (stats.prefetches, stats.prefetch_used_bytes) == (1, entry_bytes(10))
        assert (stats.prefetch_wasted_bytes, stats.prefetch_bytes) == (0, 0)


async def test_a_prefetch_of_an_entry_a_lookup_is_loading_reads_nothing(
    tmp_path: Path,
) -> None:
    """Rule 14: an arrival's prefetch that the loop runs after the request's lookup has
    started its own load (two tasks of one batch, run in either order) starts no second
    read of the entry; the lookup's load serves the request."""
    store = FaultyStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=entry_bytes(10), eviction=PolicyKind.LRU) as cache:
        prompt = list(range(100, 110))
        await _on_disk(cache, prompt)
        store.gate = trio.Event()  # the lookup's load is in flight
        got: list[Any] = []

        async def look() -> None:
            got.append(await cache.fetch_nearest([*prompt, 5]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await trio.sleep(0.01)
            assert store.fetches == 1 and not got
            assert not cache.prefetch([*prompt, 5])  # already loading
            await trio.sleep(0.01)
            assert store.fetches == 1 and cache.statistics().prefetches == 0
            store.gate.set()
        assert got[0].tier is Tier.COLD and got[0].remaining == (5,)
        assert store.fetches == 1
        assert cache._lookup_loads == {}  # nothing is left marked as loading


async def test_a_prefetch_starts_only_for_a_match_longer_than_more_than(tmp_path: Path) -> None:
    """Rule 14's ``more_than``: a caller whose own RAM serves ``n`` tokens asks for a load
    only of a match reusing more, in the one index lookup that starts it."""
    store = FaultyStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=entry_bytes(10), eviction=PolicyKind.LRU) as cache:
        prompt = list(range(100, 110))
        await _on_disk(cache, prompt)
        assert not cache.prefetch([*prompt, 5], more_than=10)  # RAM serves as much
        assert not cache.prefetch([*prompt, 5], more_than=11)
        assert cache.statistics().prefetches == 0 and store.fetches == 0
        assert cache.prefetch([*prompt, 5], more_than=9)
        await trio.sleep(0.01)
        assert cache.statistics().prefetches == 1 and store.fetches == 1


async def test_a_cold_hit_is_explained_while_its_load_waits_and_counted_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold hit's miss explanation (index walks of the whole prompt) is worked out while
    its load is in flight, not after it on the request's path, and counted once the load
    has succeeded (one lookup, as before)."""
    from kvtrio.actors import tieredextras
    from kvtrio.actors.misses import explain as real

    store = FaultyStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=entry_bytes(10), eviction=PolicyKind.LRU) as cache:
        prompt = list(range(100, 110))
        await _on_disk(cache, prompt)
        explained: list[int] = []

        def counted(*args: Any, **kwargs: Any) -> Any:
            explained.append(store.fetches)
            return real(*args, **kwargs)

        monkeypatch.setattr(tieredextras, "explain", counted)
        before = cache.statistics().lookups
        assert before is not None
        store.gate = trio.Event()
        got: list[Any] = []

        async def look() -> None:
            got.append(await cache.fetch_nearest([*prompt, 5]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await trio.sleep(0.05)
            assert explained == [0] and not got  # explained; the load is still held
            assert cache.statistics().lookups == before  # not counted yet
            store.gate.set()
        assert got[0].tier is Tier.COLD and explained == [0]
        after = cache.statistics().lookups
        assert after is not None and after.lookups == before.lookups + 1


async def test_a_prefetch_alone_starts_whatever_its_estimated_bytes(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """The budget is soft by one (rule 14): with nothing prefetched, a prefetch over the
    budget starts (an entry found at open is estimated at 128 KiB a token: a 16k-token
    conversation after a restart was refused at the default 2 GiB), and the next waits."""
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=entry_bytes(10), eviction=PolicyKind.LRU) as cache:
        cache.prefetch_budget = entry_bytes(5)
        a, b = list(range(100, 110)), list(range(200, 210))
        await _on_disk(cache, a, b)
        assert cache.prefetch(a)
        assert not cache.prefetch(b)
        assert (await cache.fetch_nearest(a)).tier is Tier.COLD
        assert cache.statistics().prefetch_used_bytes == entry_bytes(10)


async def test_prefetches_unused_or_superseded_are_wasted_and_bounded(
    tmp_path: Path, autojump_clock: Any
) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=entry_bytes(10), eviction=PolicyKind.LRU) as cache:
        cache.prefetch_budget = entry_bytes(15)
        cache.prefetch_deadline = 5.0
        a, b = list(range(100, 110)), list(range(200, 210))
        await _on_disk(cache, a, b)
        assert cache.prefetch(a)
        assert not cache.prefetch(b)  # over the byte bound
        assert cache.statistics().prefetch_bytes == entry_bytes(10)
        await trio.sleep(6)  # unused past the deadline
        stats = cache.statistics()
        assert (stats.prefetch_wasted_bytes, stats.prefetch_bytes) == (entry_bytes(10), 0)
        assert cache.prefetch(b)  # room again
        await trio.sleep(1)  # loaded, waiting for its lookup
        assert cache.statistics().prefetch_bytes == entry_bytes(10)
        record = cache._records[cache.peek(b).entry.key]  # type: ignore[union-attr]
        await cache._remove(record)  # b leaves the index: its prefetch is superseded
        await trio.sleep(0.1)
        stats = cache.statistics()
        assert (stats.prefetch_bytes, stats.prefetch_used_bytes) == (0, 0)
        assert stats.prefetch_wasted_bytes == entry_bytes(20)
        assert (await cache.fetch_nearest(b)).caches is None
        cache.check()
