"""``open_tiered_cache``: a :class:`~kvtrio.actors.tiered.TieredPromptCache` over a
:class:`~kvtrio.actors.tier.ColdTier` at a directory or a Redis URL, in one call."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvtrio.actors.callerchecks import (
    DEFAULT_MIN_REUSE_TOKENS,
    check_open_arguments,
    check_seconds,
)
from kvtrio.actors.coldside import DEFAULT_PENDING_BYTES
from kvtrio.actors.coldstore import ColdTierStore
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.plainerrors import plain_errors
from kvtrio.actors.policy import AdmissionPolicy, PolicyKind, PrefillCost
from kvtrio.actors.prefix import DEFAULT_BLOCK_SIZE, ModelKey
from kvtrio.actors.tier import DEFAULT_LOCK_TIMEOUT, ColdTier
from kvtrio.actors.tiered import TieredPromptCache, WritePolicy
from kvtrio.storage.format import Layout
from kvtrio.storage.openstore import is_redis_url
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions

__all__ = ["open_tiered_cache"]


@asynccontextmanager
async def _closing(store: ColdTierStore) -> AsyncIterator[None]:
    """Close the store's catalogue: clean after a normal exit, unclean otherwise (a
    cancelled removal may have left a row behind; the next open reconciles)."""
    try:
        yield
    except BaseException:
        await store.close(clean=False)
        raise
    await store.close()


@plain_errors
@asynccontextmanager
async def open_tiered_cache(
    directory: str | os.PathLike[str],
    model: ModelKey,
    *,
    owner: MlxOwner,
    hot_budget: int,
    cold_budget: int,
    policy: WritePolicy = WritePolicy.WRITE_BACK,
    layout: Layout = "blocks",
    block_size: int = DEFAULT_BLOCK_SIZE,
    min_free_bytes: int | None = None,
    shutdown_grace: float = 10.0,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    options: IoOptions = DEFAULT_IO_OPTIONS,
    shared_index: bool = True,
    shared_refresh: float | None = None,
    pending_budget: int = DEFAULT_PENDING_BYTES,
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS,
    eviction: PolicyKind = PolicyKind.COST,
    admission: AdmissionPolicy | None = None,
    prefill: PrefillCost | None = None,
    pin_limit: int = 0,
) -> AsyncIterator[TieredPromptCache]:
    """A :class:`TieredPromptCache` over a :class:`ColdTier` at ``directory``.

    ``owner`` is the server's MLX owner (model steps and cache work share its thread).
    The blocks layout stores a shared prefix once; ``block_size`` tokens are both the
    index's hash-chain block and the layout's token block. On a ``redis://`` URL the
    cold tier is shared: every save is registered in Redis's prefix index, and a lookup
    without an exact hit asks that index for longer prefixes other hosts saved (with
    ``shared_index``, the default; rule 8 of :class:`TieredPromptCache`). ``shared_refresh``
    seconds: also re-read the whole shared catalogue at most that often on such lookups
    (off by default; for entries saved without index registration). A local directory
    belongs to one process: a second opener waits up to ``lock_timeout`` seconds for the
    first to close, then gets DirectoryLockedError (:class:`ColdTier`'s rule 5).
    ``options``: the cold tier's I/O tuning (:class:`~kvtrio.storage.options.IoOptions`,
    docs/tuning.md). ``min_reuse_tokens``, ``eviction``, ``admission``, ``prefill``,
    ``pin_limit``: see :meth:`TieredPromptCache.open`.

    An error of the open, or of the block, reaches the caller as the one error it is, not
    wrapped in the nurseries' ExceptionGroups (:mod:`kvtrio.actors.plainerrors`).
    """
    # Everything the two openers check, before the directory is locked or touched.
    check_open_arguments(
        hot_budget=hot_budget,
        cold_budget=cold_budget,
        min_free_bytes=min_free_bytes,
        block_size=block_size,
        min_reuse_tokens=min_reuse_tokens,
        pending_budget=pending_budget,
        pin_limit=pin_limit,
        shared_refresh=shared_refresh,
    )
    check_seconds("shutdown_grace", shutdown_grace)
    check_seconds("lock_timeout", lock_timeout)
    shared = is_redis_url(os.fspath(directory))
    async with ColdTier.open(
        directory,
        layout=layout,
        block_tokens=block_size,
        owner=owner,
        shutdown_grace=shutdown_grace,
        lock_timeout=lock_timeout,
        options=options,
    ) as tier:
        store = await ColdTierStore.create(tier, index_block_size=block_size if shared else None)
        async with (
            _closing(store),
            TieredPromptCache.open(
                owner,
                store,
                model,
                hot_budget=hot_budget,
                cold_budget=cold_budget,
                policy=policy,
                min_free_bytes=min_free_bytes,
                block_size=block_size,
                shared_refresh=shared_refresh if shared else None,
                shared_index=shared and shared_index,
                pending_budget=pending_budget,
                min_reuse_tokens=min_reuse_tokens,
                eviction=eviction,
                admission=admission,
                prefill=prefill,
                pin_limit=pin_limit,
            ) as cache,
        ):
            yield cache
