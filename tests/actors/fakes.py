"""Test doubles for the tiered cache: caches with just the mlx-lm protocol it uses, and a
cold store whose "disk" is a dict that outlives one TieredPromptCache (a restart)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import (
    CONVERSATIONS_META,
    ColdEntryInfo,
    SharedColdStore,
    StoreResult,
    TieredPromptCache,
)
from kvtrio.errors import CacheMismatchError, CacheMissError, KvtrioError

__all__ = [
    "BYTES_PER_TOKEN",
    "LAYERS",
    "MODEL",
    "FakeCache",
    "FakeColdStore",
    "entry_bytes",
    "fake_caches",
    "fake_tiered",
]

BYTES_PER_TOKEN = 100
LAYERS = 2  # fake_caches' default
MODEL = ModelKey("tiny", "fp-1")


def entry_bytes(n_tokens: int) -> int:
    """The bytes of ``fake_caches(n_tokens)``."""
    return n_tokens * BYTES_PER_TOKEN * LAYERS


@attrs.define
class FakeCache:
    """The part of mlx-lm's cache protocol the tiered cache touches."""

    offset: int
    trimmable: bool = True
    min_reusable_offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.offset * BYTES_PER_TOKEN

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


def fake_caches(n_tokens: int, *, layers: int = LAYERS, trimmable: bool = True) -> list[Any]:
    return [FakeCache(n_tokens, trimmable) for _ in range(layers)]


@attrs.define
class FakeColdStore:
    directory: Path
    model: ModelKey
    disk: dict[str, tuple[ColdEntryInfo, list[Any]]] = attrs.field(factory=dict)
    fail_stores: bool = False
    clock: float = 0.0
    stored: list[str] = attrs.field(factory=list)
    sizes: dict[str, int] = attrs.field(factory=dict)
    gate: trio.Event | None = None  # fetches wait for it when set
    jitter: random.Random | None = None  # when set, each operation yields a few times
    capacity: int | None = None  # a volume of this many bytes: a store past it is ENOSPC
    store_gate: trio.Event | None = None  # stores wait for it when set
    peak: int = 0  # the most bytes the "disk" ever held
    plans: int = 0  # write plans made (owner jobs of a save, rule 2 of the cold side)

    def shared_lookups(self) -> SharedColdStore | None:
        return None  # only this process writes it

    async def _yield(self) -> None:
        if self.jitter is not None:
            for _ in range(self.jitter.randrange(4)):
                await trio.sleep(0)

    async def store(
        self,
        key: str,
        model: ModelKey,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        meta: Mapping[str, str],
    ) -> StoreResult:
        await self._yield()
        if self.store_gate is not None:
            await self.store_gate.wait()
        if self.fail_stores:
            raise KvtrioError("disk full")
        nbytes = sum(c.nbytes for c in caches)
        freed = self.sizes.get(key, 0) if key in self.disk else 0
        if self.capacity is not None and self.disk_bytes - freed + nbytes > self.capacity:
            return StoreResult(written=False, no_space=True)
        self.clock += 1
        info = ColdEntryInfo(
            key=key,
            model=model,
            tokens=tuple(tokens),
            trimmable=all(c.is_trimmable() for c in caches),
            min_reusable_offset=max(c.min_reusable_offset for c in caches),
            mtime=self.clock,
            conversations=tuple(json.loads(meta.get(CONVERSATIONS_META, "[]"))),
        )
        self.disk[key] = (info, copy.deepcopy(caches))
        freed = self.sizes.get(key, 0)
        self.sizes[key] = nbytes
        self.stored.append(key)
        self.peak = max(self.peak, self.disk_bytes)
        return StoreResult(written=True, disk_bytes=nbytes - freed, bytes_written=nbytes)

    def write_plan(
        self, model: ModelKey, tokens: Sequence[int], caches: list[Any], meta: Mapping[str, str]
    ) -> object:
        self.plans += 1
        return sum(c.nbytes for c in caches)  # what store() counts on this "disk"

    def plan_size(self, plan: object) -> int:
        assert isinstance(plan, int)
        return plan

    async def fetch(
        self, key: str, *, model: ModelKey, tokens: Sequence[int] | None = None
    ) -> tuple[list[Any], int]:
        await self._yield()
        if key not in self.disk or self.disk[key][0].model != model:
            raise CacheMissError(key)
        if tokens is not None and self.disk[key][0].tokens != tuple(tokens):
            raise CacheMismatchError(f"{key}: other tokens")
        _, caches = self.disk[key]
        out = copy.deepcopy(caches), self.sizes[key]
        if self.gate is not None:  # read, then stall: the file may go meanwhile
            await self.gate.wait()
        return out

    async def remove(self, key: str) -> int:
        await self._yield()
        self.disk.pop(key, None)
        return self.sizes.pop(key, 0)

    async def usage(self) -> int:
        return self.disk_bytes

    def entry_bytes(self, key: str) -> int | None:
        return self.sizes.get(key) if key in self.disk else None

    async def touch(self, last_use: Mapping[str, float]) -> None:
        for key, when in last_use.items():
            if key in self.disk:
                info, caches = self.disk[key]
                self.disk[key] = (attrs.evolve(info, mtime=when), caches)

    async def pin(self, pins: Mapping[str, bool]) -> None:
        for key, pinned in pins.items():
            if key in self.disk:
                info, caches = self.disk[key]
                self.disk[key] = (attrs.evolve(info, pinned=pinned), caches)

    async def entries(self) -> AsyncGenerator[list[ColdEntryInfo], None]:
        yield [info for info, _ in self.disk.values()]

    @property
    def disk_bytes(self) -> int:
        return sum(self.sizes[key] for key in self.disk)


@asynccontextmanager
async def fake_tiered(
    store: FakeColdStore,
    *,
    model: ModelKey = MODEL,
    min_reuse_tokens: int | None = 0,
    **options: Any,
) -> AsyncIterator[TieredPromptCache]:
    """A TieredPromptCache over ``store`` on an inline owner with budgets that never evict,
    4-token blocks, and every cold match loaded (``min_reuse_tokens`` 0: prompts of a few
    tokens; None: the cache's default), unless ``options`` (TieredPromptCache.open's) say
    otherwise."""
    options = {"hot_budget": 10**9, "cold_budget": 10**12, "block_size": 4, **options}
    if min_reuse_tokens is not None:
        options["min_reuse_tokens"] = min_reuse_tokens
    async with (
        MlxOwner.inline() as owner,
        TieredPromptCache.open(owner, store, model, **options) as cache,
    ):
        yield cache
