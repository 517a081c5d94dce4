"""TieredLRUPromptCache: mlx-lm's LRUPromptCache with a cold tier, called synchronously
from one thread (the generation thread), which is also the tier's MLX owner."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from kvtrio.actors.policy import AdmissionPolicy, AdmitAll
from kvtrio.actors.prefix import ModelKey, PrefixIndex
from kvtrio.actors.testing import mlx_thread_guard
from kvtrio.serve.adapter import CacheTier, FetchInfo, TieredLRUPromptCache
from kvtrio.serve.bridge import TierOptions, TierThread
from kvtrio.serve.restore import Restore
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill
from mlx_lm.models.cache import LRUPromptCache

MODEL = ("tiny", None, None)  # mlx-lm's model key: (path, adapter, draft)
BLOCK = 16


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=3)


def _prefilled(tiny: TinyModel, tokens: list[int]) -> list[Any]:
    caches = make_caches(tiny)
    prefill(tiny, caches, tokens)
    return caches


def _bytes(caches: list[Any]) -> list[bytes]:
    """What a cache holds: its offset and the bytes of its live keys and values."""
    out = []
    for c in caches:
        out.append(str(c.offset).encode())
        for a in c.keys_and_values():
            out.append(bytes(np.array(a)))
    return out


@contextmanager
def _adapter(
    tiny: TinyModel,
    directory: Path,
    admission: AdmissionPolicy | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Iterator[tuple[TieredLRUPromptCache, TierThread]]:
    tier = TierThread(
        TierOptions(
            str(directory),
            ModelKey(tiny.model_id, tiny.fingerprint),
            block_size=BLOCK,
            min_reuse_tokens=0,  # prompts of 40-50 tokens: every cold match is loaded
            admission=admission,
            **(options or {}),
        )
    )
    tier.start()
    tier.bind()
    cache = TieredLRUPromptCache(tier=tier, tier_model=MODEL, **kwargs)
    try:
        yield cache, tier
    finally:
        assert cache.close(timeout=30)


def _pump_until(cache: TieredLRUPromptCache, done: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        cache.pump(0.01)
        time.sleep(0.001)


def _cold_entries(tier: TierThread) -> int:
    assert tier.cache is not None
    return tier.peek(lambda: tier.cache.statistics().cold_entries)  # type: ignore[union-attr]


def test_an_evicted_entry_is_served_from_disk_bit_exact_after_a_restart(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """An entry RAM evicts is written, and after a restart a lookup that misses RAM loads
    it bit-exact; every MLX call stays on the generation thread (docs/design.md
    invariant 8)."""
    a = list(range(1, 41))
    b = list(range(100, 150))
    with mlx_thread_guard(lambda: tier_ref[0].executor.is_owner_thread()) as guard:
        tier_ref: list[TierThread] = []
        with _adapter(tiny, tmp_path, max_size=1) as (cache, tier):
            tier_ref.append(tier)
            original = _prefilled(tiny, a)
            expected = _bytes(original)
            cache.insert_cache(MODEL, a, original)
            cache.insert_cache(MODEL, b, _prefilled(tiny, b))  # evicts a (max_size=1)
            assert len(cache) == 1
            _pump_until(cache, lambda: _cold_entries(tier) == 1)
            got, rest = cache.fetch_nearest_cache(MODEL, a)
            assert rest == [] and cache.last_fetch is not None
            assert cache.last_fetch.tier is CacheTier.COLD and cache.last_fetch.reused == len(a)
            assert _bytes(got) == expected
        assert tier.cache is not None
        ledger = tier.cache.cold.tier.ledger.statistics()  # type: ignore[attr-defined]
        assert ledger.created >= 2 and ledger.live == 0

        # Restart: both entries (b was in RAM and written at close) come back from disk.
        with _adapter(tiny, tmp_path, max_size=1) as (cache, tier):
            tier_ref[0] = tier
            got, rest = cache.fetch_nearest_cache(MODEL, [*b, 7, 8])
            assert rest == [7, 8] and cache.last_fetch == FetchInfo(CacheTier.COLD, len(b))
            got, rest = cache.fetch_nearest_cache(MODEL, a)
            assert rest == [] and _bytes(got) == expected
            assert cache.statistics().hits_cold == 2
    assert guard.calls > 0 and guard.violations == []


def test_a_close_writes_every_ram_entry_even_past_the_pending_byte_cap(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """kvtrio serve's SIGTERM promise on a model whose entries are large beside the pending
    writes' byte cap (256 MiB: three 4k-token entries of a SmolLM2-135M-shaped float16
    model are 300 MB): the close hands every RAM entry to the tier at once, and none of
    them may be shed by the cap, which is for RAM evictions while serving. Here the cap
    holds two of three entries; after the restart all three are found on disk."""
    prompts = [[100 * (i + 1), *range(1, 60)] for i in range(3)]
    entry = sum(c.nbytes for c in _prefilled(tiny, prompts[0]))
    small = {"pending_budget": 2 * entry + entry // 2}
    with _adapter(tiny, tmp_path, options=small) as (cache, tier):
        for prompt in prompts:
            cache.insert_cache(MODEL, prompt, _prefilled(tiny, prompt))
        assert len(cache) == 3 and _cold_entries(tier) == 0
    with _adapter(tiny, tmp_path, options=small) as (cache, tier):
        assert _cold_entries(tier) == 3
        for prompt in prompts:
            _, rest = cache.fetch_nearest_cache(MODEL, prompt)
            assert rest == [] and cache.last_fetch == FetchInfo(CacheTier.COLD, len(prompt))


def test_ram_semantics_are_mlx_lms(tiny: TinyModel) -> None:
    """Same inserts, same lookups, same answers as LRUPromptCache (cache_type ordering,
    max_size, prefix removal, trimming a longer entry): RAM is mlx-lm's own code."""
    plain = LRUPromptCache(max_size=3)
    cache = TieredLRUPromptCache(max_size=3)
    sequences = [
        (list(range(1, 30)), "system"),
        (list(range(1, 40)), "user"),
        (list(range(50, 80)), "assistant"),
        (list(range(1, 45)), "assistant"),
        (list(range(200, 230)), "user"),
        (list(range(300, 330)), "assistant"),
    ]
    queries = [list(range(1, 35)), list(range(50, 90)), list(range(1, 45)), [9, 9, 9]]
    for tokens, kind in sequences:
        caches = _prefilled(tiny, tokens)
        plain.insert_cache(MODEL, tokens, caches, cache_type=kind)
        cache.insert_cache(MODEL, tokens, _prefilled(tiny, tokens), cache_type=kind)
        assert len(cache) == len(plain) and cache.nbytes == plain.nbytes
        assert cache.stats_by_type() == plain.stats_by_type()
        for query in queries:
            mine, rest = cache.fetch_nearest_cache(MODEL, query)
            theirs, their_rest = plain.fetch_nearest_cache(MODEL, query)
            assert rest == their_rest and (mine is None) == (theirs is None)
            if mine is not None:
                assert _bytes(mine) == _bytes(theirs)
    cache.trim_to(n_bytes=plain.nbytes // 2)
    plain.trim_to(n_bytes=plain.nbytes // 2)
    assert len(cache) == len(plain) and cache.stats_by_type() == plain.stats_by_type()


def test_other_models_stay_in_ram(tiny: TinyModel, tmp_path: Path) -> None:
    other = ("other", None, None)
    with _adapter(tiny, tmp_path, max_size=1) as (cache, tier):
        cache.insert_cache(other, [1, 2, 3], _prefilled(tiny, [1, 2, 3]))
        cache.insert_cache(other, [4, 5, 6], _prefilled(tiny, [4, 5, 6]))
        assert cache.statistics().spilled == 0
    with _adapter(tiny, tmp_path) as (cache, tier):
        assert _cold_entries(tier) == 0


def _stall_stores(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every cold write waits (on a worker thread) until the returned event is set."""
    from kvtrio.actors.tiered import ColdTierStore

    gate = threading.Event()
    real_store = ColdTierStore.store

    async def stalled_store(self: Any, *args: Any, **kwargs: Any) -> Any:
        await trio.to_thread.run_sync(gate.wait)
        return await real_store(self, *args, **kwargs)

    monkeypatch.setattr(ColdTierStore, "store", stalled_store)
    return gate


def test_a_save_never_makes_the_generation_thread_wait_for_the_disk(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every cold write stuck on a worker thread, inserts and pumps still return at
    once; the write lands when the disk comes back."""
    gate = _stall_stores(monkeypatch)
    with _adapter(tiny, tmp_path, max_size=1) as (cache, tier):
        slowest = 0.0
        for i in range(6):
            tokens = list(range(10 * i + 1, 10 * i + 30))
            caches = _prefilled(tiny, tokens)
            start = time.perf_counter()
            cache.insert_cache(MODEL, tokens, caches)
            for _ in range(5):
                cache.pump(0.005)
            slowest = max(slowest, time.perf_counter() - start)
        assert cache.statistics().spilled == 5 and _cold_entries(tier) == 0
        assert slowest < 0.1, slowest
        gate.set()
        _pump_until(cache, lambda: _cold_entries(tier) == 5)


def test_an_evicted_entry_waits_while_the_server_decodes_and_close_writes_it_anyway(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """docs/serve.md, "Threads": while the server decodes (``TierThread.set_foreground``)
    an evicted entry's write waits to start, and none of its owner jobs runs; once the
    server is idle it is written; at close nothing waits (SIGTERM loses nothing)."""
    a, b, c = list(range(1, 41)), list(range(100, 150)), list(range(200, 240))
    with _adapter(tiny, tmp_path, max_size=1) as (cache, tier):
        assert tier.cache is not None
        tier.set_foreground(True)
        cache.insert_cache(MODEL, a, _prefilled(tiny, a))
        cache.insert_cache(MODEL, b, _prefilled(tiny, b))  # evicts a (max_size=1)
        cold = tier.cache
        _pump_until(cache, lambda: tier.peek(cold.statistics).pending_writes == 1)
        jobs = tier.executor.statistics().started  # the spill's one job has run
        deadline = time.monotonic() + 0.5  # below TierOptions.write_defer (2 s)
        while time.monotonic() < deadline:
            cache.pump(0.01)
            time.sleep(0.005)
        stats = tier.peek(tier.cache.statistics)
        assert (stats.cold_entries, stats.pending_writes) == (0, 1)
        assert tier.executor.statistics().started == jobs  # nothing of it ran meanwhile
        tier.set_foreground(False)
        _pump_until(cache, lambda: _cold_entries(tier) == 1)
        tier.set_foreground(True)
        cache.insert_cache(MODEL, c, _prefilled(tiny, c))  # evicts b: held back
    with _adapter(tiny, tmp_path, max_size=1) as (cache, tier):
        assert _cold_entries(tier) == 3  # a; b and c, written at close


def test_a_cold_load_that_outlives_its_timeout_is_a_miss(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtrio.actors.tiered import ColdTierStore

    tokens = list(range(1, 40))
    with _adapter(tiny, tmp_path, max_size=1) as (cache, _tier):
        cache.insert_cache(MODEL, tokens, _prefilled(tiny, tokens))
    gate = threading.Event()
    real_fetch = ColdTierStore.fetch

    async def stuck_fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        await trio.to_thread.run_sync(gate.wait, abandon_on_cancel=True)
        return await real_fetch(self, *args, **kwargs)

    monkeypatch.setattr(ColdTierStore, "fetch", stuck_fetch)
    with _adapter(tiny, tmp_path, load_timeout=0.3) as (cache, _):
        start = time.monotonic()
        got, rest = cache.fetch_nearest_cache(MODEL, tokens)
        waited = time.monotonic() - start
        assert got is None and rest == tokens and 0.3 <= waited < 2.0
        assert cache.statistics().load_timeouts == 1
        assert cache.last_fetch is not None and cache.last_fetch.tier is CacheTier.MISS
        gate.set()
        monkeypatch.setattr(ColdTierStore, "fetch", real_fetch)
        got, rest = cache.fetch_nearest_cache(MODEL, tokens)
        assert rest == [] and cache.last_fetch == FetchInfo(CacheTier.COLD, len(tokens))


REQUESTS = 1000
LIFETIMES = 10  # so 9 restarts


def test_no_snapshot_is_leaked_over_many_requests_and_restarts(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """1,000 requests over 10 server lifetimes (9 restarts), every RAM eviction written and
    every tenth request continuing a conversation of the lifetime before (a cold load):
    each snapshot made is released (the tier's ledger counts them), none is live at any
    close, and the counts add up."""
    requests = restarts = made = released = cold_hits = 0
    per_lifetime = REQUESTS // LIFETIMES
    for life in range(LIFETIMES):
        restarts += life > 0
        with _adapter(tiny, tmp_path, AdmitAll(), max_size=2) as (cache, tier):
            for i in range(per_lifetime):
                tokens = [life + 1, i + 1, *range(3, 3 + i % 7)]
                if life > 0 and i % 10 == 0:  # the earlier lifetime's entry, one token on
                    tokens = [life, i + 1, *range(3, 3 + i % 7), 99]
                hit, rest = cache.fetch_nearest_cache(MODEL, tokens)
                caches = hit if hit is not None else make_caches(tiny)
                if rest:
                    prefill(tiny, caches, rest)
                cache.insert_cache(MODEL, tokens, caches)
                cache.pump(0.002)
                requests += 1
            cold_hits += cache.statistics().hits_cold
        assert tier.cache is not None
        ledger = tier.cache.cold.tier.ledger.statistics()  # type: ignore[attr-defined]
        assert ledger.live == 0 and ledger.live_bytes == 0, (life, ledger)
        made += ledger.created
        released += ledger.released
    assert (requests, restarts) == (REQUESTS, LIFETIMES - 1)
    assert made == released and made >= REQUESTS
    assert cold_hits == (LIFETIMES - 1) * (per_lifetime // 10)


def test_prefetch_loads_without_waiting_and_the_lookup_is_then_a_ram_hit(
    tiny: TinyModel, tmp_path: Path
) -> None:
    tokens = list(range(1, 50))
    with _adapter(tiny, tmp_path) as (cache, _):
        original = _prefilled(tiny, tokens)
        expected = _bytes(original)
        cache.insert_cache(MODEL, tokens, original)
    with _adapter(tiny, tmp_path) as (cache, tier):
        settled: list[bool] = []
        assert cache.prefetch(MODEL, [*tokens, 5], settled.append)
        assert settled == [] and len(cache) == 0  # returned before the load
        _pump_until(cache, lambda: bool(settled))
        assert settled == [True] and len(cache) == 1
        # The load was the tier's own prefetch (TieredPromptCache.prefetch), adopted.
        cold = tier.peek(lambda: tier.cache.statistics())  # type: ignore[union-attr]
        assert cold.prefetches == 1 and cold.prefetch_used_bytes > 0
        got, rest = cache.fetch_nearest_cache(MODEL, [*tokens, 5])
        assert rest == [5] and cache.last_fetch == FetchInfo(CacheTier.HOT, len(tokens))
        assert _bytes(got) == expected
        # RAM now serves it as well as disk: nothing more to prefetch.
        assert not cache.prefetch(MODEL, [*tokens, 5], settled.append)


def _on_disk(tiny: TinyModel, directory: Path, tokens: list[int]) -> None:
    """Write ``tokens``'s entry to the cold tier (a close writes RAM to disk)."""
    with _adapter(tiny, directory) as (cache, _):
        cache.insert_cache(MODEL, tokens, _prefilled(tiny, tokens))


def test_a_lookup_reads_the_cold_index_without_waiting_for_the_tiers_loop(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """While the tier's trio thread is busy (here: stuck for 1.5 s in one step), a lookup
    still answers at once from the cold index (TierThread.lookup, the index's own lock),
    where a round trip to the loop (TierThread.peek) would wait for it."""
    tokens = list(range(1, 50))
    _on_disk(tiny, tmp_path, tokens)
    with _adapter(tiny, tmp_path, load_in_lookup=False) as (cache, tier):
        stuck = threading.Event()

        async def hog_the_loop() -> None:
            stuck.set()
            time.sleep(1.5)  # a step of the loop that never yields

        assert tier.submit(hog_the_loop)
        assert stuck.wait(5)
        start = time.monotonic()
        match = tier.lookup([*tokens, 7])
        assert cache.prefetch(MODEL, [*tokens, 7], lambda _: None) is True
        got, rest = cache.fetch_nearest_cache(MODEL, [*tokens, 7])
        answered = time.monotonic() - start
        assert match is not None and match.reuse == len(tokens)
        assert got is None and rest == [*tokens, 7]  # not loaded here (load_in_lookup off)
        assert answered < 0.5, answered
        with pytest.raises(TimeoutError):  # the round trip the lookup no longer makes
            tier.peek(lambda: None, timeout=0.2)


def test_with_load_in_lookup_off_a_lookup_never_loads_from_disk(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvtrio serve's adapter (``load_in_lookup=False``): a prompt that disk serves better
    than RAM is RAM's answer, counted, and no load runs on the calling thread: nothing
    waits for the tier (TierThread.call) and no owner job runs during the lookup."""
    tokens = list(range(1, 50))
    _on_disk(tiny, tmp_path, tokens)
    with _adapter(tiny, tmp_path, load_in_lookup=False) as (cache, tier):

        def no_wait(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the lookup waited for the tier")

        monkeypatch.setattr(tier, "call", no_wait)
        cache.pump(0.05)
        jobs = tier.executor.statistics().started
        got, rest = cache.fetch_nearest_cache(MODEL, [*tokens, 7])
        assert tier.executor.statistics().started == jobs
        assert got is None and rest == [*tokens, 7]
        assert cache.last_fetch == FetchInfo(CacheTier.MISS, 0)
        assert cache.statistics().cold_not_loaded == 1
        # The way such a request is served: set aside while it loads, then a RAM hit.
        monkeypatch.undo()
        settled: list[bool] = []
        assert cache.prefetch(MODEL, [*tokens, 7], settled.append)
        _pump_until(cache, lambda: bool(settled))
        got, rest = cache.fetch_nearest_cache(MODEL, [*tokens, 7])
        assert rest == [7] and cache.last_fetch == FetchInfo(CacheTier.HOT, len(tokens))


def test_a_disk_match_gaining_fewer_than_min_reuse_tokens_is_not_loaded(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """RAM reuses 30 tokens, disk 40: a gain of 10 is not loaded at min_reuse_tokens=16
    (neither by the lookup nor by a prefetch); at 8 it is."""
    full = list(range(1, 41))
    _on_disk(tiny, tmp_path, full)
    for threshold, expected in (
        (16, FetchInfo(CacheTier.HOT, 30)),
        (8, FetchInfo(CacheTier.COLD, 40)),
    ):
        with _adapter(tiny, tmp_path, min_reuse_tokens=threshold) as (cache, _):
            cache.insert_cache(MODEL, full[:30], _prefilled(tiny, full[:30]))
            assert cache.prefetch(MODEL, [*full, 3], lambda _: None) is (threshold == 8)
            cache.fetch_nearest_cache(MODEL, [*full, 3])
            assert cache.last_fetch == expected, threshold
            assert cache.statistics().short_reuses_skipped == (threshold == 16)
            cache.trim_to(n_sequences=0)  # keep the disk as it was for the next pass


def test_a_longer_ram_entry_is_not_copied_to_keep_a_few_tokens(tiny: TinyModel) -> None:
    """mlx-lm serves a prompt from a longer entry by deep-copying all of it and trimming
    it back; below ``min_reuse_tokens`` tokens kept, the adapter does not copy (a miss);
    at 0, mlx-lm's answer."""
    long = list(range(1, 200))
    query = [*long[:5], 999, 998]
    for threshold, expected in (
        (16, FetchInfo(CacheTier.MISS, 0)),
        (0, FetchInfo(CacheTier.HOT, 5)),
    ):
        cache = TieredLRUPromptCache(max_size=2, min_reuse_tokens=threshold)
        cache.insert_cache(MODEL, long, _prefilled(tiny, long))
        got, rest = cache.fetch_nearest_cache(MODEL, query)
        assert cache.last_fetch == expected, threshold
        assert rest == query[expected.reused :] and (got is None) is (expected.reused == 0)
        assert cache.statistics().short_reuses_skipped == (threshold == 16)


def test_prefetch_on_arrival_from_another_thread_is_adopted_by_the_lookup(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """docs/serve.md, "Prefetch": an HTTP handler thread starts the load (no MLX call
    there: the guard), the generation thread's lookup adopts it; RAM serving as well as
    disk starts nothing."""
    tokens = list(range(1, 50))
    with _adapter(tiny, tmp_path) as (cache, _):
        original = _prefilled(tiny, tokens)
        expected = _bytes(original)
        cache.insert_cache(MODEL, tokens, original)
    with mlx_thread_guard(lambda: tier_ref[0].executor.is_owner_thread()):
        tier_ref: list[TierThread] = []
        with _adapter(tiny, tmp_path) as (cache, tier):
            tier_ref.append(tier)
            started: list[bool] = []
            handler = threading.Thread(
                target=lambda: started.append(cache.prefetch_on_arrival(MODEL, [*tokens, 5]))
            )
            handler.start()
            handler.join()
            assert started == [True] and len(cache) == 0

            def loaded() -> bool:
                stats = tier.peek(lambda: tier.cache.statistics())  # type: ignore[union-attr]
                return bool(stats.prefetches == 1)

            _pump_until(cache, loaded)
            got, rest = cache.fetch_nearest_cache(MODEL, [*tokens, 5])
            assert rest == [5] and cache.last_fetch == FetchInfo(CacheTier.COLD, len(tokens))
            assert _bytes(got) == expected
            cold = tier.peek(lambda: tier.cache.statistics())  # type: ignore[union-attr]
            assert cold.prefetches == 1 and cold.prefetch_used_bytes > 0
            cache.insert_cache(MODEL, [*tokens, 5], got)
            cache.prefetch_on_arrival(MODEL, [*tokens, 5])  # RAM serves it as well now
            time.sleep(0.3)  # the loop has run the request
            cold = tier.peek(lambda: tier.cache.statistics())  # type: ignore[union-attr]
            assert cold.prefetches == 1


def test_prefetch_on_arrival_looks_the_index_up_once(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arrival's load starts after one index lookup of the prompt (it decides and
    starts the load: no lookup of its own before the tier's prefetch looks up again)."""
    tokens = list(range(1, 50))
    with _adapter(tiny, tmp_path) as (cache, _):
        cache.insert_cache(MODEL, tokens, _prefilled(tiny, tokens))
    with _adapter(tiny, tmp_path) as (cache, tier):
        cold = tier.cache
        assert cold is not None
        lookups: list[int] = []
        real = PrefixIndex.lookup

        def counted(index: PrefixIndex, model: Any, query: Any) -> Any:
            lookups.append(len(query))
            return real(index, model, query)

        monkeypatch.setattr(PrefixIndex, "lookup", counted)
        assert cache.prefetch_on_arrival(MODEL, [*tokens, 5])

        def loaded() -> bool:
            stats = tier.peek(lambda: cold.statistics())
            return bool(stats.prefetches == 1)

        _pump_until(cache, loaded)
        assert lookups == [len(tokens) + 1]


def test_a_cold_hit_after_an_arrival_prefetch_walks_the_index_once(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/serve.md, "Prefetch": one request's cold hit costs one walk of the cold index
    (kvtrio.actors.prefix rule 5): the arrival's prefetch, the generation thread's peek,
    the tier's own lookup and its explanation of the hit share it."""
    tokens = [t % 500 + 1 for t in range(600)]  # two full blocks of 256 and a tail
    with _adapter(tiny, tmp_path) as (cache, _):
        original = _prefilled(tiny, tokens)
        expected = _bytes(original)
        cache.insert_cache(MODEL, tokens, original)
    with _adapter(tiny, tmp_path) as (cache, tier):
        cold = tier.cache
        assert cold is not None
        walks: list[int] = []
        real = PrefixIndex._walk

        def counted(index: PrefixIndex, model: Any, little: Any) -> Any:
            if index is cold._index:
                walks.append(len(little) // 4)
            return real(index, model, little)

        monkeypatch.setattr(PrefixIndex, "_walk", counted)
        query = [*tokens, 5, 6]
        assert cache.prefetch_on_arrival(MODEL, query)
        got, rest = cache.fetch_nearest_cache(MODEL, query)
        assert rest == [5, 6] and cache.last_fetch == FetchInfo(CacheTier.COLD, len(tokens))
        assert _bytes(got) == expected
        assert walks == [len(query)]
        stats = tier.peek(lambda: cold.statistics())
        assert stats.lookups is not None and stats.lookups.lookups == 1
        assert stats.hits_cold == 1


def _held_opening(tiny: TinyModel, directory: Path) -> tuple[Any, threading.Event]:
    """kvtrio serve's background open of a tier at ``directory``, started and held until
    the event is set."""
    from kvtrio.serve.coldopen import ColdOpening

    release = threading.Event()
    options = TierOptions(
        str(directory),
        ModelKey(tiny.model_id, tiny.fingerprint),
        block_size=BLOCK,
        min_reuse_tokens=0,
    )

    def held_options() -> TierOptions:
        release.wait(30)
        return options

    opening = ColdOpening(held_options)
    opening.start()
    return opening, release


def test_a_tier_still_opening_leaves_lookups_to_ram_and_holds_evictions(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """docs/serve.md, "Start": while the cold tier opens in the background a lookup is
    RAM's answer (counted, reason opening), RAM's evictions wait in RAM, and once the
    tier is open the generation thread takes it and writes them."""
    from kvtrio.serve.coldopen import ServeCache

    a, b = list(range(1, 41)), list(range(100, 150))
    with _adapter(tiny, tmp_path) as (cache, _):
        cache.insert_cache(MODEL, a, _prefilled(tiny, a))  # on disk for the next start
    opening, release = _held_opening(tiny, tmp_path)
    serving = ServeCache(1, 1 << 63, opening=opening, tier_model=MODEL, load_timeout=30)
    got, rest = serving.fetch_nearest_cache(MODEL, a)
    assert got is None and rest == a  # on disk, but the tier is not open yet
    assert serving.lookups_before_open == 1 and not serving.cold_ready
    serving.insert_cache(MODEL, b, _prefilled(tiny, b))
    serving.insert_cache(MODEL, [7, *b], _prefilled(tiny, [7, *b]))  # evicts b (max 1)
    assert serving.statistics().spilled == 0  # held: no tier to hand it to
    release.set()
    assert opening.done.wait(30) and opening.failure is None
    _pump_until(serving, lambda: serving.cold_ready)
    assert serving.statistics().spilled == 1  # b, once the tier was there
    got, rest = serving.fetch_nearest_cache(MODEL, [*a, 3])
    assert rest == [3] and serving.last_fetch == FetchInfo(CacheTier.COLD, len(a))
    assert "kvtrio_serve_cold_ready 1" in serving.metrics_text()
    assert 'kvtrio_serve_cold_unavailable_total{reason="opening"} 1' in serving.metrics_text()
    assert serving.close(timeout=30)


def test_an_eviction_right_after_the_open_ends_is_written(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """docs/serve.md, "Start": an entry RAM evicts after the tier's open has ended but
    before the generation thread took the tier (no pump or lookup in between) is handed
    to it, not dropped. Found on the H200 (gpu15): 12 turns sent while the tier opened,
    the open ending during the last ones, 2 of 12 entries never written."""
    from kvtrio.serve.coldopen import ServeCache

    opening, release = _held_opening(tiny, tmp_path)
    serving = ServeCache(2, 1 << 63, opening=opening, tier_model=MODEL, load_timeout=30)
    prompts = [[100 * (i + 1), *range(1, 60)] for i in range(3)]
    for prompt in prompts[:2]:
        serving.insert_cache(MODEL, prompt, _prefilled(tiny, prompt))
    release.set()
    assert opening.done.wait(30) and opening.failure is None and not serving.cold_ready
    serving.insert_cache(MODEL, prompts[2], _prefilled(tiny, prompts[2]))  # evicts the first
    assert serving.statistics().spilled == 1
    assert serving.close(timeout=30)
    with _adapter(tiny, tmp_path) as (cache, tier):
        assert _cold_entries(tier) == 3
        _, rest = cache.fetch_nearest_cache(MODEL, prompts[0])
        assert rest == [] and cache.last_fetch == FetchInfo(CacheTier.COLD, len(prompts[0]))


def test_a_tagged_response_queue_hands_tokens_straight_to_mlx_lms_queue() -> None:
    """kvtrio serve tags a request's context with its lookup (docs/serve.md, "What a client
    sees"); once tagged, the per-token puts on the generation thread are mlx-lm's own."""
    from queue import Queue

    from kvtrio.serve.tagging import TaggingQueue
    from mlx_lm.server import GenerationContext

    cache = TieredLRUPromptCache(max_size=4)
    inner: Queue[Any] = Queue()
    tagging = TaggingQueue(inner, cache)
    cache.fetch_nearest_cache(("m", None, None), [1, 2, 3])  # the request's lookup
    ctx: Any = GenerationContext.__new__(GenerationContext)
    tagging.put(ctx)
    assert ctx.kvtrio.ready.is_set() and ctx.kvtrio.fetch.tier is CacheTier.MISS
    assert tagging.put == inner.put  # the per-token path: mlx-lm's queue itself
    tagging.put("token")
    assert [inner.get_nowait(), inner.get_nowait()] == [ctx, "token"]


def test_while_a_batch_decodes_one_owner_job_runs_between_two_steps() -> None:
    """docs/serve.md, "Threads" (kvtrio serve's rule 8): with a batch in flight (mlx-lm
    asks for a request without a timeout) the pump between two decode steps runs one
    queued owner job, not the adapter's 5 ms of them; idle, it runs them all."""
    from kvtrio.runtime.external import ExternalThreadExecutor
    from kvtrio.serve.steps import between_steps

    executor = ExternalThreadExecutor()
    ran: list[int] = []

    async def queue_jobs() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(executor.run, ran.append, i)

    loop = threading.Thread(target=trio.run, args=(queue_jobs,), daemon=True)
    loop.start()
    while executor.statistics().queued < 3:
        time.sleep(0.001)
    decoding, budget = between_steps(None)
    assert decoding and executor.pump(budget if budget is not None else 0.005) == 1
    assert len(ran) == 1
    idle, budget = between_steps(0.1)
    assert not idle and executor.pump(budget if budget is not None else 0.005) == 2
    loop.join(10)
    assert sorted(ran) == [0, 1, 2]


def test_a_request_queued_behind_a_wake_up_is_taken_in_the_same_call() -> None:
    """kvtrio serve's rule 1: a wake-up (the tier queued an owner job) read from mlx-lm's
    request queue is followed at once by the request queued behind it. Returning after
    the wake-up alone made mlx-lm decode another time slice (up to 0.5 s) before it took
    that request: on the H200 one in two of the decode phase's 8-stream bursts waited so."""
    from queue import Queue

    from kvtrio.serve.server import _WAKE, _generator_class
    from kvtrio.serve.tagging import TaggingQueue

    cls: Any = _generator_class()
    generator: Any = cls.__new__(cls)  # mlx-lm's __init__ would start its thread
    generator.adapter = TieredLRUPromptCache(max_size=4)
    generator.requests = Queue()
    generator._is_distributed, generator._rank = False, 0
    generator._wake_pending = threading.Event()
    generator._open_pending, generator._ready = False, []
    generator._deferred, generator._deferred_since = {}, {}
    generator.prefetching, generator.in_flight = False, 0
    generator.active, generator._active_lock = {}, threading.Lock()
    generator._restore = Restore(generator.adapter, 0, lambda: False, done=True)  # off
    generator._wake()
    assert generator.requests.qsize() == 1
    body, args = object(), object()
    generator.requests.put((Queue(), body, args))
    taken = generator._next_request(None)  # mlx-lm asks so while a batch is in flight
    assert taken is not None and taken[1:] == (body, args)
    assert isinstance(taken[0], TaggingQueue) and generator.requests.empty()
    assert _WAKE not in (taken[1], taken[2])


def test_an_opening_that_freezes_pauses_the_collector_and_freezes_the_index_once(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvtrio serve's open (coldopen rule 4): automatic collections paused from the open's
    start, the index frozen once the tier is open and before they resume, the collector
    left enabled as it was; an open that fails freezes nothing. (``gc.freeze`` is
    recorded, not run: freezing this test process would outlive the test.)"""
    import gc

    from kvtrio.serve.coldopen import ColdOpening

    _on_disk(tiny, tmp_path, list(range(1, 50)))
    frozen: list[tuple[bool, int]] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append((gc.isenabled(), len(frozen))))
    options = TierOptions(
        str(tmp_path), ModelKey(tiny.model_id, tiny.fingerprint), block_size=BLOCK
    )
    paused: list[bool] = []

    def make_options() -> TierOptions:
        paused.append(not gc.isenabled())
        return options

    assert gc.isenabled()
    opening = ColdOpening(make_options, freeze=True)
    opening.start()
    assert opening.done.wait(60) and opening.failure is None and opening.tier is not None
    assert paused == [True] and frozen == [(False, 0)] and gc.isenabled()
    opening.tier.bind()
    assert opening.tier.close(timeout=30)

    def failing() -> TierOptions:
        raise OSError("no such directory")

    broken = ColdOpening(failing, freeze=True)
    broken.start()
    assert broken.done.wait(60) and isinstance(broken.failure, OSError)
    assert len(frozen) == 1 and gc.isenabled()
    plain = ColdOpening(make_options)  # the library's default: the collector untouched
    plain.start()
    assert plain.done.wait(60) and plain.tier is not None
    assert paused == [True, False] and len(frozen) == 1
    plain.tier.bind()
    assert plain.tier.close(timeout=30)
