"""TieredPromptCache trusts nothing a caller hands it (issue 15, items 1 and 10).

Each test is a call the landed code accepted and then served or wrote wrongly: a token
list shorter than the caches (wrong logits on the next step), a token id the reader
refuses (the entry vanished at the next open), an int conversation id beside a str one
(the write-back at close raised TypeError and wrote nothing), an insert after close
(silently never written), and negative budgets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtrio.errors import CacheMismatchError, InvalidInputError, ShuttingDown

from .fakes import MODEL, FakeColdStore, fake_caches, fake_tiered


async def test_insert_of_fewer_tokens_than_the_caches_hold_is_refused(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store) as cache:
        with pytest.raises(
            CacheMismatchError,
            match=r"^caches\[0\]\.offset: the cache holds 400 tokens, 10 tokens were given$",
        ):
            await cache.insert(list(range(10)), fake_caches(400))
        miss = await cache.fetch_nearest(list(range(10)))
        assert miss.caches is None and cache.statistics().hot_entries == 0
    assert store.disk == {}


async def test_token_id_of_2_to_the_31_is_refused_at_insert(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store) as cache:
        with pytest.raises(
            InvalidInputError, match=r"^tokens\[2\]: 2147483648 is outside \[0, 2147483647\]$"
        ):
            await cache.insert([1, 2, 2**31], fake_caches(3))
        assert cache.statistics().hot_entries == 0


async def test_int_conversation_id_is_refused_and_the_others_are_written(tmp_path: Path) -> None:
    store = FakeColdStore(tmp_path, MODEL)
    async with fake_tiered(store) as cache:
        await cache.insert(list(range(8)), fake_caches(8), conversation="ok")
        with pytest.raises(InvalidInputError, match=r"^conversation: expected a str, got int$"):
            await cache.insert(list(range(12)), fake_caches(12), conversation=5)  # type: ignore[arg-type]
    assert len(store.disk) == 1  # the good entry is written back at close


async def test_meta_values_must_be_strings(tmp_path: Path) -> None:
    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        with pytest.raises(InvalidInputError, match=r"^meta\['n'\]: expected a str, got int$"):
            await cache.insert([1], fake_caches(1), meta={"n": 1})  # type: ignore[dict-item]


async def test_insert_after_close_raises_shutting_down(tmp_path: Path) -> None:
    async with fake_tiered(FakeColdStore(tmp_path, MODEL)) as cache:
        pass
    with pytest.raises(ShuttingDown, match=r"^tiered prompt cache is closed: insert refused$"):
        await cache.insert([1], fake_caches(1))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"hot_budget": -1}, r"^hot_budget: expected an int >= 0, got -1$"),
        ({"cold_budget": -5}, r"^cold_budget: expected an int >= 0, got -5$"),
        ({"min_free_bytes": -1}, r"^min_free_bytes: expected >= 0, got -1$"),
        ({"block_size": 0}, r"^block_size: expected an int >= 1, got 0$"),
    ],
)
async def test_budgets_are_validated_at_open(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        async with fake_tiered(FakeColdStore(tmp_path, MODEL), **options):
            pass


async def test_a_cold_match_reusing_too_few_tokens_is_not_loaded(tmp_path: Path) -> None:
    """Item 9: below min_reuse_tokens a load is slower than recomputing (bench reuse)."""
    store = FakeColdStore(tmp_path, MODEL)
    tokens = list(range(1, 101))
    async with fake_tiered(store) as cache:
        await cache.insert(tokens, fake_caches(100))
    async with fake_tiered(store, min_reuse_tokens=64) as cache:  # reopened: the entry is cold
        few = await cache.fetch_nearest([*tokens[:10], 999])
        assert few.caches is None and cache.statistics().cold_skipped == 1
        many = await cache.fetch_nearest([*tokens[:80], 999])
        assert many.caches is not None and many.match is not None and many.match.reuse == 80
        assert cache.statistics().hits_cold == 1


async def test_the_default_minimum_reuse_is_the_measured_one(tmp_path: Path) -> None:
    from kvtrio.actors.callerchecks import DEFAULT_MIN_REUSE_TOKENS

    async with fake_tiered(FakeColdStore(tmp_path, MODEL), min_reuse_tokens=None) as cache:
        assert cache.min_reuse_tokens == DEFAULT_MIN_REUSE_TOKENS == 64
    with pytest.raises(InvalidInputError, match=r"^min_reuse_tokens: expected an int >= 0"):
        async with fake_tiered(FakeColdStore(tmp_path, MODEL), min_reuse_tokens=-1):
            pass
