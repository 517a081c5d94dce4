"""TieredPromptCache over a fake shared cold store with a prefix index (rule 8 of
kvtrio.actors.tiered): which manifests a lookup reads, stale registrations, and the pause
after the index is out of reach (trio's clock). Redis itself: tests/redis/."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from kvtrio.actors.misses import MissReason
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey, entry_key
from kvtrio.actors.sharedkeys import index_keys, probe_keys
from kvtrio.actors.tiered import ColdEntryInfo, SharedColdStore, Tier, TieredPromptCache
from kvtrio.errors import StoreUnavailableError

from .fakes import FakeColdStore, fake_caches

MODEL = ModelKey("tiny", "fp-1")
BLOCK = 4


@attrs.define
class FakeSharedStore(FakeColdStore):
    """A cold store other hosts write to: ``publish`` is another host's save."""

    index: dict[str, set[str]] = attrs.field(factory=dict)
    gone: set[str] = attrs.field(factory=set)  # registered, manifest vanished
    find_calls: int = 0
    entry_calls: list[str] = attrs.field(factory=list)
    forgotten: list[str] = attrs.field(factory=list)
    fail_find: bool = False

    def shared_lookups(self) -> SharedColdStore | None:
        return self  # other hosts write to it: its prefix index is asked (rule 8)

    def publish(self, tokens: Sequence[int], *, trimmable: bool = True) -> str:
        key = entry_key(MODEL, tokens, BLOCK)
        info = ColdEntryInfo(key, MODEL, tuple(tokens), trimmable, 0, mtime=0.0)
        self.disk[key] = (info, fake_caches(len(tokens), trimmable=trimmable))
        self.sizes[key] = 1
        for index_key in index_keys(MODEL, tokens, BLOCK):
            self.index.setdefault(index_key, set()).add(key)
        return key

    async def find(self, model: ModelKey, tokens: Sequence[int]) -> list[tuple[str, int]]:
        self.find_calls += 1
        if self.fail_find:
            raise StoreUnavailableError("redis: connection refused")
        found: dict[str, int] = {}
        for index_key, bound in probe_keys(model, tokens, BLOCK):
            for key in sorted(self.index.get(index_key, ())):
                found.setdefault(key, bound)
        return list(found.items())

    async def entry(self, key: str) -> ColdEntryInfo | None:
        self.entry_calls.append(key)
        if key in self.gone or key not in self.disk:
            return None
        return self.disk[key][0]

    async def forget(self, key: str, model: ModelKey, tokens: Sequence[int]) -> None:
        self.forgotten.append(key)
        for members in self.index.values():
            members.discard(key)


@asynccontextmanager
async def _open(store: FakeSharedStore) -> AsyncIterator[TieredPromptCache]:
    async with (
        MlxOwner.inline() as owner,
        TieredPromptCache.open(
            owner, store, MODEL, hot_budget=10**9, cold_budget=10**12, block_size=BLOCK,
            shared_index=True, min_reuse_tokens=0,  # short prompts: every match loads
        ) as cache,
    ):  # fmt: skip
        yield cache


async def test_a_lookup_reads_only_the_deepest_entry(tmp_path: Path) -> None:
    store = FakeSharedStore(tmp_path, MODEL)
    async with _open(store) as cache:
        store.publish(list(range(8)))
        deep = store.publish(list(range(12)))
        store.publish([5, 5, 5, 5, 5])
        fetched = await cache.fetch_nearest(list(range(14)))
        assert (fetched.tier, fetched.remaining) == (Tier.COLD, (12, 13))
        assert store.entry_calls == [deep]
        stats = cache.statistics()
        assert (stats.shared_lookups, stats.shared_found, stats.shared_refreshes) == (1, 1, 0)
        again = await cache.fetch_nearest(list(range(12)))  # exact, now known here
        assert (again.tier, store.find_calls) == (Tier.HOT, 1)


async def test_an_unusable_deeper_entry_gives_way_to_a_shorter_one(tmp_path: Path) -> None:
    """A longer entry that cannot be trimmed back is read, found useless, and the next
    deepest is read; never more than that."""
    store = FakeSharedStore(tmp_path, MODEL)
    async with _open(store) as cache:
        rigid = store.publish(list(range(16)), trimmable=False)
        short = store.publish(list(range(8)))
        fetched = await cache.fetch_nearest(list(range(14)))
        assert (fetched.tier, fetched.remaining) == (Tier.COLD, tuple(range(8, 14)))
        assert store.entry_calls == [rigid, short]


async def test_a_stale_registration_is_skipped_and_forgotten(tmp_path: Path) -> None:
    store = FakeSharedStore(tmp_path, MODEL)
    async with _open(store) as cache:
        stale = store.publish(list(range(12)))
        live = store.publish(list(range(8)))
        store.gone.add(stale)
        query = list(range(14))
        fetched = await cache.fetch_nearest(query)
        assert (fetched.tier, fetched.remaining) == (Tier.COLD, tuple(range(8, 14)))
        assert store.entry_calls == [stale, live]
        await cache.wait_writes_settled()
        assert store.forgotten == [stale]
        assert cache.statistics().shared_vanished == 1


async def test_an_unreachable_index_is_paused(tmp_path: Path, autojump_clock: Any) -> None:
    """After a failed index lookup, lookups skip the index for 1 s, then 2 s, ... (trio's
    clock); a success resets the pause. Every one of them is a clean miss meanwhile."""
    store = FakeSharedStore(tmp_path, MODEL)
    query = list(range(6))
    async with _open(store) as cache:
        store.publish(query)
        store.fail_find = True
        for wait, calls in ((0.0, 1), (0.5, 1), (0.6, 2), (1.5, 2), (0.6, 3)):
            await trio.sleep(wait)
            missed = await cache.fetch_nearest(query)
            assert (missed.caches, store.find_calls) == (None, calls)
        assert cache.statistics().shared_errors == 3
        store.fail_find = False
        await trio.sleep(4.1)
        assert (await cache.fetch_nearest(query)).tier is Tier.COLD
        store.fail_find = True
        await cache.fetch_nearest([9, 9, 9])
        await trio.sleep(1.1)  # back to the shortest pause after a success
        await cache.fetch_nearest([9, 9, 9])
        assert store.find_calls == 6


async def test_an_unreachable_index_is_a_store_unreachable_miss(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """A lookup the shared store could not answer (its index lookup failed, or was skipped
    in the pause after a failure) with nothing better to blame is counted
    store-unreachable, not no-entry; once the store answers, an empty lookup is no-entry."""
    store = FakeSharedStore(tmp_path, MODEL)
    query = list(range(6))
    async with _open(store) as cache:
        store.publish(query)
        store.fail_find = True
        failed = await cache.fetch_nearest(query)
        paused = await cache.fetch_nearest(query)
        assert store.find_calls == 1  # the second was not asked: paused
        for missed in (failed, paused):
            assert missed.caches is None and missed.explanation is not None
            assert missed.explanation.reason is MissReason.STORE_UNREACHABLE
        lookups = cache.statistics().lookups
        assert lookups is not None
        assert (lookups.count(MissReason.STORE_UNREACHABLE), lookups.no_entry) == (2, 0)
        store.fail_find = False
        await trio.sleep(1.1)
        answered = await cache.fetch_nearest([9, 9, 9])
        assert answered.explanation is not None
        assert answered.explanation.reason is MissReason.NO_ENTRY
