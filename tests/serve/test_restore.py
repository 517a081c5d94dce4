"""The warm restart of ``kvtrio serve`` (kvtrio.serve.restore): after a start, while the
server is idle, the most recently used disk entries are loaded back into RAM, one at a
time, within the budgets; a request arriving stops it before the next load."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.testing import mlx_thread_guard
from kvtrio.serve.adapter import CacheTier, FetchInfo, TieredLRUPromptCache
from kvtrio.serve.bridge import TierThread
from kvtrio.serve.restore import DEFAULT_RESTORE_BYTES, Restore
from kvtrio.tests.serve.test_adapter import MODEL, _adapter, _bytes, _cold_entries, _prefilled
from kvtrio.tests.serve.test_adapter import _pump_until as pump_until
from kvtrio.tinymodel import TinyModel, build_tiny_model

#: Four conversations, written to disk in this order (A least recently used).
PROMPTS = [[100 * (i + 1), *range(1, 40)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=3)


def _on_disk_in_order(tiny: TinyModel, directory: Path) -> list[list[bytes]]:
    """PROMPTS written to disk one after another (RAM holds one: each insert evicts the
    one before, whose write lands before the next); their caches' bytes."""
    expected = []
    with _adapter(tiny, directory, max_size=1) as (cache, tier):
        for n, prompt in enumerate(PROMPTS):
            caches = _prefilled(tiny, prompt)
            expected.append(_bytes(caches))
            cache.insert_cache(MODEL, prompt, caches)
            pump_until(cache, lambda n=n: _cold_entries(tier) == n)
    return expected


@contextmanager
def _guarded(
    tiny: TinyModel, directory: Path, *, loads: bool = True, **kwargs: object
) -> Iterator[tuple[TieredLRUPromptCache, TierThread]]:
    """An adapter over ``directory`` whose every MLX call must be on the owner thread
    (docs/design.md invariant 8; and, with ``loads``, some are made)."""
    tier_ref: list[TierThread] = []
    with mlx_thread_guard(lambda: tier_ref[0].executor.is_owner_thread()) as guard:
        with _adapter(tiny, directory, **kwargs) as (cache, tier):  # type: ignore[arg-type]
            tier_ref.append(tier)
            yield cache, tier
    assert guard.violations == [] and (guard.calls > 0) == loads


def _run(restore: Restore, cache: TieredLRUPromptCache) -> None:
    restore.step()
    pump_until(cache, lambda: restore.done)


def test_the_tier_lists_its_entries_most_recently_used_first_within_the_bytes(
    tiny: TinyModel, tmp_path: Path
) -> None:
    _on_disk_in_order(tiny, tmp_path)
    with _adapter(tiny, tmp_path) as (_, tier):
        assert tier.cache is not None
        listed = tier.peek(tier.cache.recent_entries, 1 << 40, 10)
        assert [list(tokens) for tokens, _ in listed] == PROMPTS[::-1]
        one = listed[0][1]
        assert all(nbytes == one > 0 for _, nbytes in listed)
        assert len(tier.peek(tier.cache.recent_entries, 2 * one + one // 2, 10)) == 2
        assert len(tier.peek(tier.cache.recent_entries, 1 << 40, 3)) == 3


def test_after_a_restart_the_newest_entries_are_ram_hits_up_to_rams_entry_count(
    tiny: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The restore stops at RAM's budget (2 entries here): D and C come back, bit-exact
    RAM hits; B stays on disk. RAM's order is the one before the restart: a new entry
    evicts C (used before D), not D."""
    expected = _on_disk_in_order(tiny, tmp_path)
    with _guarded(tiny, tmp_path, max_size=2) as (cache, _):
        restore = Restore(cache, DEFAULT_RESTORE_BYTES, lambda: True)
        _run(restore, cache)
        assert (restore.restored, len(cache)) == (2, 2)
        stats = cache.statistics()
        assert stats.restored == 2 and stats.restored_bytes == cache.nbytes
        assert stats.prefetches == 0  # a restore is not a request's prefetch
        out = capsys.readouterr().out
        assert f"kvtrio serve: restored 2 entries ({cache.nbytes} bytes) to RAM in" in out
        for prompt, want in ((PROMPTS[3], expected[3]), (PROMPTS[2], expected[2])):
            got, rest = cache.fetch_nearest_cache(MODEL, [*prompt, 7])
            assert rest == [7] and cache.last_fetch == FetchInfo(CacheTier.HOT, len(prompt))
            assert _bytes(got) == want
        cache.insert_cache(MODEL, [5, 6, 7], _prefilled(tiny, [5, 6, 7]))
        cache.fetch_nearest_cache(MODEL, [*PROMPTS[3], 7])
        assert cache.last_fetch == FetchInfo(CacheTier.HOT, len(PROMPTS[3]))
        cache.fetch_nearest_cache(MODEL, [*PROMPTS[1], 7])  # B: not restored
        assert cache.last_fetch == FetchInfo(CacheTier.COLD, len(PROMPTS[1]))


def test_the_restore_stops_at_its_byte_cap_and_at_rams_byte_budget(
    tiny: TinyModel, tmp_path: Path
) -> None:
    _on_disk_in_order(tiny, tmp_path)
    with _adapter(tiny, tmp_path) as (_, tier):
        assert tier.cache is not None
        one = tier.peek(tier.cache.recent_entries, 1 << 40, 1)[0][1]
    with _guarded(tiny, tmp_path) as (cache, _):
        restore = Restore(cache, one + one // 2, lambda: True)  # the cap: one entry
        _run(restore, cache)
        assert restore.restored == 1 and len(cache) == 1
    with _guarded(tiny, tmp_path, max_bytes=3 * one - 1) as (cache, _):
        restore = Restore(cache, DEFAULT_RESTORE_BYTES, lambda: True)
        _run(restore, cache)
        assert restore.restored == 2 and len(cache) == 2  # a third would evict one


def test_a_request_arriving_stops_the_restore_before_its_next_load(
    tiny: TinyModel, tmp_path: Path
) -> None:
    """Idleness is checked before each load: once a request is in flight no load starts;
    the one already running finishes; the restore goes on at the next idle moment."""
    _on_disk_in_order(tiny, tmp_path)
    with _guarded(tiny, tmp_path) as (cache, _):
        idle = [True]
        checks: list[int] = []

        def is_idle() -> bool:
            checks.append(len(cache))
            return idle[0]

        restore = Restore(cache, DEFAULT_RESTORE_BYTES, is_idle)
        assert restore.step() and restore.loading
        idle[0] = False  # a request arrives while the first entry loads
        pump_until(cache, lambda: not restore.loading)
        assert restore.restored == 1 and not restore.done
        assert not restore.step() and not restore.loading  # still busy: nothing starts
        assert checks == [0, 1, 1]  # asked before the first load, after it, and again
        idle[0] = True  # the request was answered
        _run(restore, cache)
        assert restore.restored == 4
        # Asked again before each further load (RAM holding 1, 2, 3), and at the end.
        assert checks == [0, 1, 1, 1, 2, 3, 4]


def test_a_request_for_the_entry_the_restore_is_loading_joins_that_load(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request set aside for the entry whose restore load is in flight is released by
    that load's admission: the entry is read from disk once (before, the request's load
    could find the restore's caches already taken, not yet in RAM, and read it again)."""
    from kvtrio.actors.tieredload import IndexAndLoadMixin

    reads: list[str] = []
    real_load = IndexAndLoadMixin._load_cold

    async def counted(self: object, record: object) -> object:
        reads.append(record.entry.key)  # type: ignore[attr-defined]
        return await real_load(self, record)  # type: ignore[arg-type]

    monkeypatch.setattr(IndexAndLoadMixin, "_load_cold", counted)
    expected = _on_disk_in_order(tiny, tmp_path)
    with _guarded(tiny, tmp_path, max_size=1) as (cache, _):
        restore = Restore(cache, DEFAULT_RESTORE_BYTES, lambda: not released_to)
        released_to: list[bool] = []
        assert restore.step() and restore.loading  # D, the newest
        assert cache.prefetch(MODEL, [*PROMPTS[3], 7], released_to.append)
        pump_until(cache, lambda: bool(released_to) and not restore.loading)
        assert released_to == [True] and len(reads) == 1
        assert cache.statistics().prefetches == 1 and restore.restored == 1
        got, rest = cache.fetch_nearest_cache(MODEL, [*PROMPTS[3], 7])
        assert rest == [7] and cache.last_fetch == FetchInfo(CacheTier.HOT, len(PROMPTS[3]))
        assert _bytes(got) == expected[3]


def test_restore_bytes_zero_restores_nothing(tiny: TinyModel, tmp_path: Path) -> None:
    _on_disk_in_order(tiny, tmp_path)
    with _guarded(tiny, tmp_path, loads=False) as (cache, _):
        restore = Restore.of(cache, _provider(restore_bytes=0), lambda: True)
        assert restore.done and not restore.step()
        cache.pump(0.05)
        assert len(cache) == 0 and cache.statistics().restored == 0
        default = Restore.of(cache, _provider(restore_bytes=None), lambda: True)
        assert default.cap == DEFAULT_RESTORE_BYTES and not default.done


def _provider(model: object = None, **flags: object) -> argparse.Namespace:
    """What Restore.of reads of mlx-lm's ModelProvider: its flags, and its model."""
    return argparse.Namespace(cli_args=argparse.Namespace(**flags), model=model)


def test_after_the_restore_the_model_runs_a_short_turn_over_a_copy_and_ram_is_untouched(
    tiny: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule 5: once the entries are back, the model runs WARM_TOKENS tokens over a copy of
    the newest one's caches (on the owner thread, as the guard checks); RAM's entries,
    their bytes, their order and the counters are as the restore left them."""
    from kvtrio.serve.restore import WARM_TOKENS, warm_up

    expected = _on_disk_in_order(tiny, tmp_path)
    calls: list[int] = []

    class Counted:  # the model, its calls counted (its layers read as the model's)
        def __getattr__(self, name: str) -> Any:
            return getattr(tiny.model, name)

        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            calls.append(int(inputs.shape[1]))
            held = len(PROMPTS[3]) - WARM_TOKENS
            assert cache is not None and all(c.offset == held for c in cache)
            return tiny.model(inputs, cache=cache)

    counted = Counted()

    with _guarded(tiny, tmp_path, max_size=2) as (cache, _):
        restore = Restore.of(cache, _provider(counted, restore_bytes=None), lambda: True)
        _run(restore, cache)
        assert calls == [WARM_TOKENS] and restore.restored == 2
        assert "to RAM in" in (out := capsys.readouterr().out) and ", warmed up in " in out
        stats = cache.statistics()
        assert (stats.hits_hot, stats.hits_cold, stats.misses) == (0, 0, 0)
        lru = cache._lru._lrus["assistant"]
        assert [list(tokens) for _, tokens in lru] == [PROMPTS[2], PROMPTS[3]]
        got, rest = cache.fetch_nearest_cache(MODEL, [*PROMPTS[3], 7])
        assert rest == [7] and _bytes(got) == expected[3]  # the entry itself unchanged
        # An entry no longer in RAM, or one token long, is not warmed (nothing to trim).
        assert warm_up(cache, counted, (1, 2, 3)) is None
        assert warm_up(cache, counted, tuple(PROMPTS[3])) is not None


def test_a_batching_server_warms_up_through_mlx_lms_batch_generator(
    tiny: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule 5, mlx-lm's server batching (``is_batchable``): the warm-up's turn goes the
    way a request's does, through a BatchGenerator (on the owner thread, as the guard
    checks): the model first runs WARM_TOKENS - 1 tokens over a batch cache holding the
    newest entry less WARM_TOKENS tokens, then decode steps of one token, to the first
    token; RAM's entries, their order and the counters are as the restore left them."""
    from kvtrio.serve.restore import WARM_TOKENS

    expected = _on_disk_in_order(tiny, tmp_path)
    calls: list[tuple[int, str, int]] = []

    class Counted:  # the model, its calls and the caches they ran over recorded
        def __getattr__(self, name: str) -> Any:
            return getattr(tiny.model, name)

        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            calls.append((int(inputs.shape[1]), type(cache[0]).__name__, cache[0]._idx))
            return tiny.model(inputs, cache=cache)

    provider = argparse.Namespace(
        cli_args=argparse.Namespace(restore_bytes=None), model=Counted(), is_batchable=True
    )
    with _guarded(tiny, tmp_path, max_size=2) as (cache, _):
        restore = Restore.of(cache, provider, lambda: True)
        _run(restore, cache)
        held = len(PROMPTS[3]) - WARM_TOKENS
        assert calls[0] == (WARM_TOKENS - 1, "BatchKVCache", held)
        assert calls[1] == (1, "BatchKVCache", held + WARM_TOKENS - 1)
        assert all(n == 1 and kind == "BatchKVCache" for n, kind, _ in calls[1:])
        assert ", warmed up in " in capsys.readouterr().out
        stats = cache.statistics()
        assert (stats.hits_hot, stats.hits_cold, stats.misses) == (0, 0, 0)
        lru = cache._lru._lrus["assistant"]
        assert [list(tokens) for _, tokens in lru] == [PROMPTS[2], PROMPTS[3]]
        got, rest = cache.fetch_nearest_cache(MODEL, [*PROMPTS[3], 7])
        assert rest == [7] and _bytes(got) == expected[3]  # the entry itself unchanged
