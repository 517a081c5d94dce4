"""TieredPromptCache.spill over a fake cold store: what a save costs the owner thread."""

from __future__ import annotations

from pathlib import Path

from kvtrio.actors.owner import MlxOwner

from .fakes import MODEL, FakeColdStore, fake_caches, fake_tiered


async def test_a_spill_describes_and_plans_its_write_in_one_owner_job(tmp_path: Path) -> None:
    """Cold side rule 2: the spill's one owner job describes the caches and plans their
    write; the writer sizes the reservation from that plan off the owner, with no owner job
    (and no plan) of its own before the store."""
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store, hot_budget=0) as cache:
        assert isinstance(cache.owner, MlxOwner)
        executor = cache.owner.executor
        before = executor.statistics().started
        key = await cache.spill(list(range(8)), fake_caches(8))
        assert executor.statistics().started - before == 1
        await cache.wait_writes_settled()
        assert store.stored == [key] and store.plans == 1
        assert executor.statistics().started - before == 1  # the fake store runs none
        assert cache.statistics().cold_entries == 1
