"""The public openers at the boundary (issue 15, items 4 and 10).

- Errors reach the caller plain: ``ColdTier.open``, ``TieredPromptCache.open`` and
  ``open_tiered_cache`` raise the one typed error, not their internal nurseries'
  ExceptionGroup around it (``kvtrio.actors.plainerrors``); two errors stay a group.
- Every numeric argument of an opener (budgets, caps, counts, times) is checked once, at
  the API, with InvalidInputError naming it, before the directory is locked or touched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
from kvtrio.actors.factory import open_tiered_cache
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.plainerrors import plain_errors, sole_exception
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tier import ColdTier
from kvtrio.actors.tiered import TieredPromptCache
from kvtrio.errors import CacheMissError, DirectoryLockedError, InvalidInputError
from kvtrio.storage.dirlock import try_lock

from .fakes import FakeColdStore

MODEL = ModelKey("tiny", "fp-1")

# -- item 4: plain errors --------------------------------------------------------------


async def test_a_cold_tier_blocks_typed_error_reaches_the_caller_plain(tmp_path: Path) -> None:
    """Before: ExceptionGroup[CacheMissError] (the tier's actor system's nursery)."""
    with pytest.raises(CacheMissError, match=r"^cold tier has no entry 'absent'$"):
        async with ColdTier.open(tmp_path, inline=True) as tier:
            await tier.load("absent")


async def test_a_failing_cold_tier_open_raises_the_typed_error(tmp_path: Path) -> None:
    lock = try_lock(str(tmp_path))
    assert lock is not None
    try:
        with pytest.raises(DirectoryLockedError):
            async with ColdTier.open(tmp_path, inline=True, lock_timeout=0):
                pass
    finally:
        lock.release()


async def test_a_tiered_caches_typed_error_reaches_the_caller_plain(tmp_path: Path) -> None:
    """Before: ExceptionGroup[InvalidInputError] (the cache's writer-task nursery)."""
    with pytest.raises(InvalidInputError, match=r"^tokens\[0\]: -1 is outside \[0, 2147483647\]$"):
        async with (
            MlxOwner.inline() as owner,
            TieredPromptCache.open(
                owner, FakeColdStore(tmp_path, MODEL), MODEL, hot_budget=10**9, cold_budget=0
            ) as cache,
        ):
            await cache.insert([-1], [])


async def test_open_tiered_cache_errors_reach_the_caller_plain(tmp_path: Path) -> None:
    with pytest.raises(CacheMissError, match=r"^from the block$"):
        async with (
            MlxOwner.inline() as owner,
            open_tiered_cache(tmp_path, MODEL, owner=owner, hot_budget=1, cold_budget=1),
        ):
            raise CacheMissError("from the block")


async def test_two_errors_stay_a_group_nothing_is_hidden() -> None:
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    @plain_errors
    @asynccontextmanager
    async def two_tasks() -> AsyncIterator[None]:
        async def fail() -> None:
            raise KeyError("task")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail)
            yield

    with pytest.raises(BaseExceptionGroup) as caught:
        async with two_tasks():
            raise ValueError("block")  # the task, not started yet, still runs and fails
    assert sorted(type(e).__name__ for e in caught.value.exceptions) == ["KeyError", "ValueError"]

    group = BaseExceptionGroup("g", [KeyError("a"), ValueError("b")])
    assert sole_exception(group) is None
    leaf = CacheMissError("x")
    assert sole_exception(BaseExceptionGroup("g", [ExceptionGroup("h", [leaf])])) is leaf
    assert sole_exception(BaseExceptionGroup("g", [KeyboardInterrupt()])) is None


# -- item 10: numeric arguments ---------------------------------------------------------

NAN = math.nan


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"cap_bytes": -1}, r"^cap_bytes: expected bytes >= 0, got -1$"),
        ({"cap_bytes": NAN}, r"^cap_bytes: expected bytes >= 0, got nan$"),
        ({"cap_bytes": True}, r"^cap_bytes: expected a number of bytes, got True$"),
        ({"cap_bytes": "1"}, r"^cap_bytes: expected a number of bytes, got '1'$"),
        ({"shutdown_grace": -1.0}, r"^shutdown_grace: expected seconds >= 0, got -1.0$"),
        ({"shutdown_grace": NAN}, r"^shutdown_grace: expected seconds >= 0, got nan$"),
        ({"shutdown_grace": True}, r"^shutdown_grace: expected a number of seconds, got True$"),
        ({"lock_timeout": -0.5}, r"^lock_timeout: expected seconds >= 0, got -0.5$"),
        ({"lock_timeout": None}, r"^lock_timeout: expected a number of seconds, got None$"),
        ({"io_threads": 0}, r"^io_threads: expected an int >= 1, got 0$"),
        ({"io_threads": True}, r"^io_threads: expected an int >= 1, got True$"),
        ({"io_threads": 1.5}, r"^io_threads: expected an int >= 1, got 1.5$"),
        ({"block_tokens": 0}, r"^block_tokens: expected an int >= 1, got 0$"),
        ({"background": 0}, r"^background: expected seconds > 0, got 0$"),
        ({"background": math.inf}, r"^background: expected a finite number of seconds, got inf$"),
    ],
)
async def test_cold_tier_open_validates_its_numbers_before_touching_the_directory(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    root = tmp_path / "tier"
    with pytest.raises(InvalidInputError, match=match):
        async with ColdTier.open(root, inline=True, **options):
            pass
    assert not root.exists()


async def test_cold_tier_open_accepts_the_meaningful_edges(tmp_path: Path) -> None:
    """Zero grace, zero lock wait, a zero queue cap and no cap at all are meaningful."""
    async with ColdTier.open(
        tmp_path, inline=True, shutdown_grace=0, lock_timeout=0, cap_bytes=0
    ):
        pass
    async with ColdTier.open(tmp_path, inline=True, cap_bytes=math.inf, shutdown_grace=math.inf):
        pass


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"pending_budget": -1}, r"^pending_budget: expected an int >= 0, got -1$"),
        ({"pending_budget": True}, r"^pending_budget: expected an int >= 0, got True$"),
        ({"pin_limit": -1}, r"^pin_limit: expected an int >= 0, got -1$"),
        ({"pin_limit": 1.0}, r"^pin_limit: expected an int >= 0, got 1.0$"),
        ({"shared_refresh": NAN}, r"^shared_refresh: expected seconds >= 0, got nan$"),
        ({"hot_budget": True}, r"^hot_budget: expected an int >= 0, got True$"),
        ({"cold_budget": 1.5}, r"^cold_budget: expected an int >= 0, got 1.5$"),
        ({"min_reuse_tokens": -1}, r"^min_reuse_tokens: expected an int >= 0, got -1$"),
        ({"block_size": 0}, r"^block_size: expected an int >= 1, got 0$"),
        ({"shutdown_grace": NAN}, r"^shutdown_grace: expected seconds >= 0, got nan$"),
        ({"lock_timeout": -1}, r"^lock_timeout: expected seconds >= 0, got -1$"),
    ],
)
async def test_open_tiered_cache_validates_its_numbers_before_touching_the_directory(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    root = tmp_path / "tier"
    budgets: dict[str, Any] = {"hot_budget": 10**6, "cold_budget": 10**9, **options}
    with pytest.raises(InvalidInputError, match=match):
        async with (
            MlxOwner.inline() as owner,
            open_tiered_cache(root, MODEL, owner=owner, **budgets),
        ):
            pass
    assert not root.exists()
