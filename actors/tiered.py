"""TieredPromptCache: a prompt cache in RAM (hot) over a cold tier on disk.

A server asks ``fetch_nearest(tokens)`` before prefill and calls ``insert(tokens,
caches)`` after a turn. Entries live in the hot tier (live MLX caches, LRU by bytes)
and/or the cold tier (files written by the actors' ColdTier, LRU by bytes, aware of
free disk space). One :class:`~kvtrio.actors.prefix.PrefixIndex` over both tiers finds
the longest reusable prefix; on open it is rebuilt from the files on disk, so a restart
keeps the cache.

Theory of operation
-------------------
1. The hot tier owns private copies: ``insert`` clones the caller's caches on the MLX
   owner thread, and ``fetch_nearest`` hands out a fresh clone (trimmed when the match
   was a longer entry), so neither side can change what the other holds.
2. Budgets are soft by at most one entry: after an insert, least recently used hot
   entries are evicted while the hot bytes exceed the budget and more than one entry is
   hot; the cold tier likewise after each completed write.
3. Policy ``write-back`` writes an entry to the cold tier when it leaves the hot tier;
   ``write-through`` writes every insert at once. Until a write is durable the entry is
   findable only while it is hot: an entry in neither tier is not in the index.
4. A checkpoint supersedes the older entry of the same conversation that it extends: the
   older one leaves RAM at once and the disk once the newer one is durable there.
5. The cold tier is best effort: a failed or dropped write, a missing or corrupt file is
   counted, the entry forgotten, and the lookup retried; it never fails a request.
6. Lookups are namespaced by the model key (model id and config fingerprint); entries
   of other models on the same disk count towards the disk budget but never match.
7. Cold operations on one key (write, delete) run one at a time in the order started.
8. A shared cold store (Redis: :class:`SharedColdStore`) is searched at lookup time: a
   lookup without an exact entry asks the store's prefix index, in one round trip, which
   entries any host registered under the query's token-block chain hashes, reads the
   manifest of the deepest one this host does not know (a few at most) and adds it to the
   index; nothing else of the catalogue is read. Every save registers its entry there
   (the tier's manifest publication does). A store out of reach, or an entry gone since it
   was registered, leaves the lookup a miss. Re-reading the whole catalogue
   (``shared_refresh``) remains as an optional fallback for entries saved without
   registration.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import math
import os
import shutil
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import (
    DEFAULT_BLOCK_SIZE,
    MatchKind,
    ModelKey,
    PrefixEntry,
    PrefixIndex,
    PrefixMatch,
    index_keys,
    probe_keys,
)
from kvtrio.actors.tier import SUFFIX, ColdTier, TierEntry
from kvtrio.errors import (
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    InvalidInputError,
    KvtrioError,
    ShuttingDown,
    StoreUnavailableError,
    UnknownCacheKindError,
)
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.format import (
    PREAMBLE,
    Header,
    Layout,
    check_meta,
    check_token_ids,
    parse_header,
    parse_preamble,
)
from kvtrio.storage.manifeststore import ManifestStore
from kvtrio.storage.openstore import ManifestFileOps, is_redis_url
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions

__all__ = [
    "CONVERSATIONS_META",
    "ColdEntryInfo",
    "ColdStore",
    "ColdTierStore",
    "Fetched",
    "OwnerLike",
    "SharedColdStore",
    "StoreResult",
    "Tier",
    "TieredPromptCache",
    "TieredStatistics",
    "WritePolicy",
    "open_tiered_cache",
]


# At most this many manifests are read per lookup from a shared store's prefix index.
SHARED_READS = 4
#: Cold matches reusing fewer tokens are not loaded: recomputing them is faster. Measured
#: on the demo's model (``kvtrio bench reuse``, two runs, 2-core VM): reusing 16 tokens, a
#: cold load took 1.1-1.4x (1,024-token entry) and 3.7-4.3x (4,096-token entry) the time
#: of recomputing them; from 64 tokens it won in 3 of 4 (0.34x, 0.34x; 1.12x, 0.81x).
DEFAULT_MIN_REUSE_TOKENS = 64
# At most this many names are fetched per index key (the chain hashes of a prefix that
# many entries share, a system prompt, name them all; any of them covers that prefix).
SHARED_CANDIDATES = 8
# Seconds a failed index lookup pauses the next ones (doubling while failures go on).
SHARED_PAUSE_MIN = 1.0
SHARED_PAUSE_MAX = 30.0

# Header meta key holding the JSON list of conversations an entry is the checkpoint of, so
# supersession keeps working after a restart.
CONVERSATIONS_META = "kvtrio.conversations"


class WritePolicy(enum.Enum):
    """When an entry is written to the cold tier."""

    WRITE_BACK = "write-back"  # when it is evicted from RAM
    WRITE_THROUGH = "write-through"  # at insert


class Tier(enum.Enum):
    """Where a hit came from."""

    HOT = "hot"
    COLD = "cold"


@attrs.frozen
class ColdEntryInfo:
    """What the cold tier knows of one stored entry (from its header and file)."""

    key: str
    model: ModelKey
    tokens: tuple[int, ...]
    trimmable: bool
    min_reusable_offset: int
    mtime: float
    conversations: tuple[str, ...] = ()  # whose checkpoint it is (see CONVERSATIONS_META)


@attrs.frozen
class StoreResult:
    """A cold write that settled: durable (``written``) or not (dropped or superseded)."""

    written: bool
    disk_bytes: int = 0  # net change of the bytes on disk (a rewrite frees the old file)
    bytes_written: int = 0
    bytes_deduplicated: int = 0


class OwnerLike(Protocol):
    """The MLX owner: runs ``fn(*args)`` on the one thread that may touch MLX."""

    async def run(self, fn: Any, *args: Any) -> Any: ...


class ColdStore(Protocol):
    """The cold tier as the tiered cache uses it (an adapter over the actors' ColdTier)."""

    @property
    def directory(self) -> Path: ...

    async def store(
        self,
        key: str,
        model: ModelKey,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        meta: Mapping[str, str],
    ) -> StoreResult:
        """Write ``caches`` under ``key``; return once it is durable or settled otherwise."""
        ...

    async def fetch(
        self, key: str, *, model: ModelKey, tokens: Sequence[int] | None = None
    ) -> tuple[list[Any], int]:
        """Restored caches (on the owner) and the bytes read; CacheMissError or
        CorruptCacheError when the entry is gone or bad, CacheMismatchError when what
        was read under ``key`` is not ``model``'s, or (given) does not hold ``tokens``."""
        ...

    async def remove(self, key: str) -> int:
        """Delete the entry (absent: nothing); return the disk bytes freed."""
        ...

    async def usage(self) -> int:
        """Bytes the cold tier occupies on disk now."""
        ...

    async def entries(self) -> list[ColdEntryInfo]:
        """Every valid entry on disk."""
        ...


@runtime_checkable
class SharedColdStore(Protocol):
    """A cold store other hosts write to as well, with a prefix index (rule 8)."""

    async def find(self, model: ModelKey, tokens: Sequence[int]) -> list[tuple[str, int]]:
        """Keys of stored entries registered under the query's prefix-index keys, deepest
        first, each with a bound on the tokens of ``tokens`` it can cover (one round
        trip). StoreUnavailableError when the store is out of reach."""
        ...

    async def entry(self, key: str) -> ColdEntryInfo | None:
        """What the store holds under ``key`` (its manifest alone), None when gone."""
        ...

    async def forget(self, key: str, model: ModelKey, tokens: Sequence[int]) -> None:
        """Drop ``key`` from the index keys of ``tokens`` if its manifest is gone (a stale
        registration found by :meth:`find`), so no host reads it again."""
        ...


@attrs.frozen
class Fetched:
    """What ``fetch_nearest`` found: caches to continue from and the tokens still to run.

    ``caches`` is None on a miss (then ``remaining`` is the whole prompt).
    """

    caches: list[Any] | None
    remaining: tuple[int, ...]
    tier: Tier | None
    match: PrefixMatch | None

    @property
    def reused(self) -> int:
        return self.match.reuse if self.match is not None else 0


@attrs.frozen
class TieredStatistics:
    """Counters of a tiered prompt cache."""

    hot_entries: int
    hot_bytes: int
    hot_budget: int
    cold_entries: int
    cold_bytes: int
    cold_budget: int
    hits_hot: int
    hits_cold: int
    misses: int
    bytes_written: int
    bytes_read: int
    bytes_deduplicated: int
    hot_evictions: int
    cold_evictions: int
    drops: int
    superseded: int
    # Shared cold store (rule 8): prefix-index round trips, entries found through them,
    # index entries whose manifest was gone, and whole-catalogue re-reads (the fallback).
    shared_lookups: int = 0
    shared_found: int = 0
    shared_vanished: int = 0
    shared_refreshes: int = 0
    shared_errors: int = 0  # index lookups that failed (store out of reach): then paused
    # OSErrors around the cold tier (EIO on a load, a block replaced by a directory, ...),
    # each turned into a miss or a dropped write: a request never fails for the disk.
    cold_errors: int = 0
    # Cold matches reusing fewer than min_reuse_tokens tokens, not loaded (a miss).
    cold_skipped: int = 0


@attrs.define(eq=False)
class _Record:
    entry: PrefixEntry
    conversations: set[str] = attrs.field(factory=set)
    hot: list[Any] | None = None
    hot_bytes: int = 0
    on_disk: bool = False  # durable in the cold tier
    writing: bool = False
    removed: bool = False
    retired: bool = False  # superseded: never promoted to RAM again
    supersedes: list[_Record] = attrs.field(factory=list)  # deleted once this is durable


def _cache_nbytes(caches: Sequence[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


def _min_reusable_offset(caches: Sequence[Any]) -> int:
    return max([0, *(int(getattr(c, "min_reusable_offset", 0) or 0) for c in caches)])


def _clone(caches: list[Any]) -> list[Any]:
    """Owner thread: an independent deep copy of mlx-lm caches."""
    return copy.deepcopy(caches)


def _clone_trimmed(caches: list[Any], trim: int) -> list[Any]:
    """Owner thread: a deep copy, trimmed back by ``trim`` tokens."""
    from mlx_lm.models.cache import trim_prompt_cache

    out = copy.deepcopy(caches)
    if trim:
        trim_prompt_cache(out, trim)
    return out


def _trim(caches: list[Any], trim: int) -> None:
    """Owner thread: trim ``caches`` back by ``trim`` tokens, in place."""
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(caches, trim)


def _describe(caches: list[Any], n_tokens: int) -> tuple[int, bool, int]:
    """Owner thread: bytes, trimmability and minimum reusable offset of ``caches``, after
    checking that every layer holds ``n_tokens`` tokens (CacheMismatchError)."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    for i, cache in enumerate(caches):
        for path, held in _held_tokens(cache, f"caches[{i}]"):
            if held != n_tokens:
                raise CacheMismatchError(
                    f"{path}.offset: the cache holds {held} tokens, {n_tokens} tokens were given"
                )
    return _cache_nbytes(caches), bool(can_trim_prompt_cache(caches)), _min_reusable_offset(caches)


def _held_tokens(cache: Any, path: str) -> Iterable[tuple[str, int]]:
    """The token count of every layer of ``cache`` that states one: a KV-like cache's
    ``offset`` (rotating, chunked, quantized and paged caches count every token seen, not
    what the window keeps); a CacheList's children; an SSM state (ArraysCache) states
    none and holds any count."""
    children = getattr(cache, "caches", None)
    if isinstance(children, list | tuple):
        for j, child in enumerate(children):
            yield from _held_tokens(child, f"{path}.children[{j}]")
        return
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int) and not isinstance(offset, bool):
        yield path, offset


@attrs.define(eq=False)
class TieredPromptCache:
    """The prompt cache a server embeds. Open with :meth:`open`."""

    owner: OwnerLike
    cold: ColdStore
    model: ModelKey
    hot_budget: int
    cold_budget: int
    policy: WritePolicy = WritePolicy.WRITE_BACK
    min_free_bytes: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    # Seconds between catalogue refreshes from a shared cold store (None: none; a local
    # store, which this process alone writes, has an index authoritative after open).
    shared_refresh: float | None = None
    # Ask the shared cold store's prefix index on lookups without an exact entry (rule 8).
    shared_index: bool = False
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS
    _nursery: trio.Nursery | None = None
    _index: PrefixIndex = attrs.field(init=False)
    _records: dict[str, _Record] = attrs.field(init=False, factory=dict)
    _hot_lru: OrderedDict[str, None] = attrs.field(init=False, factory=OrderedDict)
    _cold_lru: OrderedDict[str, None] = attrs.field(init=False, factory=OrderedDict)
    _conversations: dict[str, str] = attrs.field(init=False, factory=dict)
    _key_tail: dict[str, trio.Event] = attrs.field(init=False, factory=dict)
    _hot_bytes: int = attrs.field(init=False, default=0)
    _cold_bytes: int = attrs.field(init=False, default=0)
    _counts: dict[str, int] = attrs.field(init=False, factory=dict)
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _writes_in_flight: int = attrs.field(init=False, default=0)
    _refreshed_at: float = attrs.field(init=False, default=-math.inf)
    _refreshing: bool = attrs.field(init=False, default=False)
    _shared_paused_until: float = attrs.field(init=False, default=-math.inf)
    _shared_backoff: float = attrs.field(init=False, default=0.0)

    def __attrs_post_init__(self) -> None:
        self._index = PrefixIndex(block_size=self.block_size)
        self._idle.set()

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        owner: OwnerLike,
        cold: ColdStore,
        model: ModelKey,
        *,
        hot_budget: int,
        cold_budget: int,
        policy: WritePolicy = WritePolicy.WRITE_BACK,
        min_free_bytes: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        flush_on_close: bool = True,
        shared_refresh: float | None = None,
        shared_index: bool = False,
        min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS,
    ) -> AsyncIterator[TieredPromptCache]:
        """Rebuild the index from ``cold`` and serve.

        ``min_reuse_tokens``: a cold match reusing fewer tokens is not loaded (a miss,
        counted in ``cold_skipped``): below it a load is slower than recomputing
        (:data:`DEFAULT_MIN_REUSE_TOKENS` says how that was measured). Hot matches are
        always used.

        ``shared_index``: ``cold`` is a :class:`SharedColdStore` (Redis, shared with other
        hosts); a lookup that finds no exact entry first asks its prefix index for a
        longer prefix another host saved (rule 8). ``shared_refresh``: such a lookup also
        re-reads the store's whole catalogue, at most once per ``shared_refresh`` seconds
        (trio's clock): a fallback for entries saved without index registration.

        Leaving the block normally writes the hot entries not yet on disk (with
        ``flush_on_close``, so a graceful restart keeps them) and waits for every write.
        """
        for name, value in (("hot_budget", hot_budget), ("cold_budget", cold_budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"{name}: expected an int >= 0, got {value!r}")
        if isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int):
            raise InvalidInputError(f"min_free_bytes: expected an int, got {min_free_bytes!r}")
        if min_free_bytes < 0:
            raise InvalidInputError(f"min_free_bytes: expected >= 0, got {min_free_bytes}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidInputError(f"block_size: expected an int >= 1, got {block_size!r}")
        if (
            isinstance(min_reuse_tokens, bool)
            or not isinstance(min_reuse_tokens, int)
            or min_reuse_tokens < 0
        ):
            raise InvalidInputError(
                f"min_reuse_tokens: expected an int >= 0, got {min_reuse_tokens!r}"
            )
        self = cls(
            owner,
            cold,
            model,
            hot_budget,
            cold_budget,
            policy,
            min_free_bytes,
            block_size,
            shared_refresh,
            shared_index,
            min_reuse_tokens,
        )
        if shared_index and not isinstance(cold, SharedColdStore):
            raise TypeError("shared_index needs a cold store with find() and entry()")
        await self._load_index()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield self
                if flush_on_close:
                    await self.flush()
                await self.wait_writes_settled()
            finally:
                self._nursery = None

    # -- the server's API ------------------------------------------------------------

    async def fetch_nearest(
        self, tokens: Sequence[int], *, need_logits: bool = False, admit: bool = True
    ) -> Fetched:
        """The caches of the longest reusable prefix of ``tokens`` (see mlx-lm's
        ``LRUPromptCache.fetch_nearest_cache``), and the tokens still to process.

        An exact hit leaves no token to process. With ``need_logits``, at least one is
        left: the exact entry is trimmed by one token when it may be, else the lookup is
        made for ``tokens[:-1]``. ``admit=False``: a disk hit is handed over as loaded
        (trimmed in place, not cloned) and not promoted to RAM (a caller with a RAM tier
        of its own, such as kvtrio.serve's adapter).
        """
        query = tuple(int(t) for t in tokens)
        if self.shared_index or self.shared_refresh is not None:
            found = self._index.lookup(self.model, query)
            if found is None or found.kind is not MatchKind.EXACT:
                # Another host may have saved a better one (rule 8).
                if self.shared_index:
                    await self._find_shared(query, found)
                if self.shared_refresh is not None:
                    await self._refresh_shared()
        for _ in range(8):  # bounded: each retry forgot a bad cold entry
            match = self._index.lookup(self.model, query)
            if need_logits and match is not None and match.kind is MatchKind.EXACT:
                match = self._leave_one(match, query)
            if match is None:
                break
            record = self._records[match.entry.key]
            if record.hot is not None:
                caches = await self.owner.run(_clone_trimmed, record.hot, match.trim)
                self._touch_hot(record)
                self._count("hits_hot")
                return Fetched(caches, query[match.reuse :], Tier.HOT, match)
            if trio.current_time() < self._shared_paused_until:
                break  # the shared store just failed: a miss, not another deadline spent
            if match.reuse < self.min_reuse_tokens:
                # Loading would be slower than recomputing so few tokens (bench reuse);
                # the best match is this one, so no other is worth it either.
                self._count("cold_skipped")
                break
            loaded = await self._load_cold(record)
            if loaded is None:
                continue
            self._count("hits_cold")
            if not admit:
                if match.trim:
                    await self.owner.run(_trim, loaded, match.trim)
                return Fetched(loaded, query[match.reuse :], Tier.COLD, match)
            caches = await self.owner.run(_clone_trimmed, loaded, match.trim)
            await self._admit_hot(record, loaded)
            return Fetched(caches, query[match.reuse :], Tier.COLD, match)
        self._count("misses")
        return Fetched(None, query, None, None)

    def _leave_one(self, exact: PrefixMatch, query: tuple[int, ...]) -> PrefixMatch | None:
        entry = exact.entry
        keep = len(query) - 1
        if entry.trimmable and keep >= max(1, entry.min_reusable_offset):
            return PrefixMatch(entry, MatchKind.LONGER, keep)
        return self._index.lookup(self.model, query[:-1]) if keep else None

    async def insert(
        self,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        conversation: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> str:
        """Cache a copy of ``caches`` (which hold exactly ``tokens``); return its key.

        With ``conversation``, this entry supersedes that conversation's older entries
        whose tokens it extends (a checkpoint during a long generation, or a turn).

        Refused before anything is kept (the tier can only write what it can read back):
        token ids outside ``[0, 2**31)`` or not ints, a ``conversation`` that is not a
        str or ``meta`` that is not str -> str (InvalidInputError); a layer whose offset
        is not ``len(tokens)`` (CacheMismatchError); after the cache closed
        (ShuttingDown).
        """
        if self._nursery is None:
            raise ShuttingDown("tiered prompt cache is closed: insert refused")
        tokens = check_token_ids(tokens)
        if conversation is not None and not isinstance(conversation, str):
            raise InvalidInputError(
                f"conversation: expected a str, got {type(conversation).__name__}"
            )
        meta = check_meta(meta or {})
        nbytes, trimmable, min_offset = await self.owner.run(_describe, caches, len(tokens))
        clone = await self.owner.run(_clone, caches)
        entry = self._index.make_entry(
            self.model, tokens, trimmable=trimmable, min_reusable_offset=min_offset
        )
        previous = self._records.get(entry.key)
        if previous is not None:
            self._drop_hot(previous)
        record = previous or _Record(entry)
        record.entry = entry
        record.removed = False
        self._records[entry.key] = record
        self._index.add(entry)
        record.hot, record.hot_bytes = clone, nbytes
        self._hot_bytes += nbytes
        self._hot_lru[entry.key] = None
        if conversation is not None:
            await self._supersede(conversation, record)
        if self.policy is WritePolicy.WRITE_THROUGH and not (record.on_disk or record.writing):
            self._start_write(record, meta or {})
        await self._enforce_hot_budget(meta or {})
        return entry.key

    def peek(self, tokens: Sequence[int]) -> PrefixMatch | None:
        """What :meth:`fetch_nearest` would reuse for ``tokens`` now (either tier), loading
        nothing (the index alone; a shared store is not asked)."""
        return self._index.lookup(self.model, tuple(int(t) for t in tokens))

    async def spill(
        self, tokens: Sequence[int], caches: list[Any], *, meta: Mapping[str, str] | None = None
    ) -> str:
        """Write ``caches`` (which hold exactly ``tokens``) to the cold tier without keeping
        a copy in RAM; return its key. The caller hands them over: it must not change them
        (a server's own RAM tier evicting an entry). Findable once durable (rule 3); an
        entry already on disk, or being written, is left as it is. Its arguments are
        checked as :meth:`insert` checks them."""
        if self._nursery is None:
            raise ShuttingDown("tiered prompt cache is closed: spill refused")
        tokens = check_token_ids(tokens)
        meta = check_meta(meta or {})
        _nbytes, trimmable, min_offset = await self.owner.run(_describe, caches, len(tokens))
        entry = self._index.make_entry(
            self.model, tokens, trimmable=trimmable, min_reusable_offset=min_offset
        )
        previous = self._records.get(entry.key)
        if previous is not None and not previous.removed:
            if previous.on_disk or previous.writing:
                return entry.key
            self._drop_hot(previous)
        record = previous or _Record(entry)
        record.entry = entry
        record.removed = False
        self._records[entry.key] = record
        record.writing = True
        before, done = self._reserve(entry.key)
        self._spawn(self._write, record, caches, dict(meta or {}), before, done)
        await trio.lowlevel.checkpoint()
        return entry.key

    async def wait_writes_settled(self) -> None:
        """Wait until every cold write started so far has settled."""
        while self._writes_in_flight:
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    async def flush(self) -> None:
        """Write every hot entry not yet on disk to the cold tier, and wait for it."""
        for key in list(self._hot_lru):
            record = self._records[key]
            if not record.on_disk and not record.writing and record.hot is not None:
                self._start_write(record, {})
        await self.wait_writes_settled()

    def statistics(self) -> TieredStatistics:
        c = self._counts.get
        return TieredStatistics(
            hot_entries=len(self._hot_lru),
            hot_bytes=self._hot_bytes,
            hot_budget=self.hot_budget,
            cold_entries=len(self._cold_lru),
            cold_bytes=self._cold_bytes,
            cold_budget=self.cold_budget,
            hits_hot=c("hits_hot", 0),
            hits_cold=c("hits_cold", 0),
            misses=c("misses", 0),
            bytes_written=c("bytes_written", 0),
            bytes_read=c("bytes_read", 0),
            bytes_deduplicated=c("bytes_deduplicated", 0),
            hot_evictions=c("hot_evictions", 0),
            cold_evictions=c("cold_evictions", 0),
            drops=c("drops", 0),
            superseded=c("superseded", 0),
            shared_lookups=c("shared_lookups", 0),
            shared_found=c("shared_found", 0),
            shared_vanished=c("shared_vanished", 0),
            shared_refreshes=c("shared_refreshes", 0),
            shared_errors=c("shared_errors", 0),
            cold_errors=c("cold_errors", 0),
            cold_skipped=c("cold_skipped", 0),
        )

    # -- internals -------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    async def _load_index(self) -> None:
        self._add_cold_entries(await self.cold.entries())
        self._cold_bytes = await self.cold.usage()

    async def _refresh_shared(self) -> None:
        """Add the entries of this model that other hosts stored in the shared cold store
        since the last refresh (at most one per ``shared_refresh`` seconds, one at a time).

        The catalogue is read on the store's worker threads; a store out of reach leaves
        the index as it is (the lookup goes on, at worst a miss).
        """
        assert self.shared_refresh is not None
        now = trio.current_time()
        if self._refreshing or now - self._refreshed_at < self.shared_refresh:
            return
        self._refreshing, self._refreshed_at = True, now
        self._count("shared_refreshes")
        try:
            infos = await self.cold.entries()
        except (KvtrioError, OSError):
            return
        finally:
            self._refreshing = False
        self._add_cold_entries(
            info for info in infos if info.model == self.model and info.key not in self._records
        )

    async def _find_shared(self, query: tuple[int, ...], local: PrefixMatch | None) -> None:
        """Add to the index the entry another host saved with the longest prefix of
        ``query``, if it beats ``local`` (rule 8): one index round trip, then the manifests
        of at most :data:`SHARED_READS` candidates, deepest first, until one does.

        Runs on the store's worker threads; a store out of reach, or a registered entry
        whose manifest is gone, leaves the index as it is (at worst the lookup misses).
        After a failed index lookup, lookups skip the index for a pause (trio's clock) that
        doubles from :data:`SHARED_PAUSE_MIN` up to :data:`SHARED_PAUSE_MAX` seconds while
        the store stays out of reach, so an unreachable Redis (connect timeouts) does not
        delay every request.
        """
        assert isinstance(self.cold, SharedColdStore)
        now = trio.current_time()
        if now < self._shared_paused_until:
            return
        best = local.reuse if local is not None else 0
        try:
            candidates = await self.cold.find(self.model, query)
        except (KvtrioError, OSError):
            self._pause_shared()
            return
        self._shared_backoff = 0.0
        self._count("shared_lookups")
        reads = 0
        for key, bound in candidates:
            if bound <= best or reads >= SHARED_READS:
                break  # deepest first: no later candidate can do better
            if key in self._records:
                continue  # known here: the local lookup already weighed it
            reads += 1
            try:
                info = await self.cold.entry(key)
            except (KvtrioError, OSError):
                return
            if info is None or info.model != self.model:
                self._count("shared_vanished")
                if info is None:  # a stale registration: clean it up for every host
                    self._spawn(self._forget_shared, key, query)
                continue
            if key in self._records:  # added while the manifest was being read
                continue
            self._add_cold_entries([info])
            self._count("shared_found")
            match = self._index.lookup(self.model, query)
            if match is not None and match.reuse > best:
                return

    async def _forget_shared(self, key: str, query: tuple[int, ...]) -> None:
        assert isinstance(self.cold, SharedColdStore)
        try:
            await self.cold.forget(key, self.model, query)
        except (KvtrioError, OSError):
            return  # best effort: the next host to miss on it tries again

    def _add_cold_entries(self, infos: Iterable[ColdEntryInfo]) -> None:
        for info in sorted(infos, key=lambda info: info.mtime):
            entry = PrefixEntry(
                key=info.key,
                model=info.model,
                tokens=info.tokens,
                trimmable=info.trimmable,
                min_reusable_offset=info.min_reusable_offset,
            )
            record = _Record(entry, on_disk=True, conversations=set(info.conversations))
            self._records[info.key] = record
            self._index.add(entry)
            self._cold_lru[info.key] = None
            for conversation in info.conversations:  # the latest checkpoint is the longest
                latest = self._records.get(self._conversations.get(conversation, ""))
                if latest is None or len(latest.entry.tokens) < len(entry.tokens):
                    self._conversations[conversation] = info.key

    def _touch_hot(self, record: _Record) -> None:
        """Mark a hit as most recent in both tiers (it may have left them while cloning)."""
        key = record.entry.key
        if key in self._hot_lru:
            self._hot_lru.move_to_end(key)
        if key in self._cold_lru:
            self._cold_lru.move_to_end(key)

    def _effective_cold_budget(self) -> int:
        try:
            free = shutil.disk_usage(self.cold.directory).free
        except OSError:
            return self.cold_budget
        return min(self.cold_budget, max(0, self._cold_bytes + free - self.min_free_bytes))

    def _pause_shared(self) -> None:
        """The shared store failed: skip its index and its loads for a doubling pause, so
        a stalled store costs a request at most one deadline (issue 15)."""
        self._count("shared_errors")
        self._shared_backoff = min(
            SHARED_PAUSE_MAX, max(SHARED_PAUSE_MIN, 2 * self._shared_backoff)
        )
        self._shared_paused_until = trio.current_time() + self._shared_backoff

    async def _load_cold(self, record: _Record) -> list[Any] | None:
        key = record.entry.key
        try:
            # Content is bound to its key: a manifest replaced by another valid one (a
            # Redis value overwritten, a file copied over) is a mismatch, never a hit.
            caches, nbytes = await self.cold.fetch(
                key, model=self.model, tokens=record.entry.tokens
            )
        except (CacheMissError, CorruptCacheError, CacheMismatchError):
            self._count("drops")
            self._forget_cold(record)
            self._maybe_forget(record)
            self._spawn_removal(key)
            return None
        except StoreUnavailableError:
            # A shared store (Redis) out of reach: a miss for this request. The entry is
            # forgotten here only; it stays in the store for every host (and this one's
            # next open).
            self._count("drops")
            self._pause_shared()
            self._forget_cold(record)
            self._maybe_forget(record)
            return None
        except (OSError, UnknownCacheKindError):
            # The disk failed under this entry (EIO, a directory in its place), or it is of
            # a kind this process has no codec for: a miss, counted. Forgotten here, not
            # deleted: neither proves corruption.
            self._count("drops")
            self._count("cold_errors")
            self._forget_cold(record)
            self._maybe_forget(record)
            return None
        self._count("bytes_read", nbytes)
        if key in self._cold_lru:  # it may have been superseded while loading
            self._cold_lru.move_to_end(key)
        return caches

    async def _admit_hot(self, record: _Record, caches: list[Any]) -> None:
        """Promote a disk hit to RAM, unless the entry changed while it was loading."""
        nbytes = await self.owner.run(_cache_nbytes, caches)
        if (
            record.hot is not None
            or record.retired
            or self._records.get(record.entry.key) is not record
        ):
            return
        record.hot, record.hot_bytes = caches, nbytes
        self._hot_bytes += nbytes
        self._hot_lru[record.entry.key] = None
        await self._enforce_hot_budget({})

    def _drop_hot(self, record: _Record) -> None:
        if record.hot is None:
            return
        self._hot_bytes -= record.hot_bytes
        record.hot, record.hot_bytes = None, 0
        self._hot_lru.pop(record.entry.key, None)

    def _forget_cold(self, record: _Record) -> None:
        record.on_disk = False
        self._cold_lru.pop(record.entry.key, None)

    def _maybe_forget(self, record: _Record) -> None:
        """Rule 3: an entry in neither tier leaves the index."""
        if record.hot is None and not record.on_disk and not record.writing and self._owns(record):
            self._index.remove(record.entry.key)
            del self._records[record.entry.key]
            for conversation in record.conversations:
                if self._conversations.get(conversation) == record.entry.key:
                    del self._conversations[conversation]

    async def _enforce_hot_budget(self, meta: Mapping[str, str]) -> None:
        while self._hot_bytes > self.hot_budget and len(self._hot_lru) > 1:
            key = next(iter(self._hot_lru))
            record = self._records[key]
            if (
                self.policy is WritePolicy.WRITE_BACK
                and not record.on_disk
                and not record.writing
                and record.hot is not None
            ):
                self._start_write(record, meta)
            self._drop_hot(record)
            self._count("hot_evictions")
            if not record.writing:
                self._maybe_forget(record)
            else:
                # Rule 3: not findable until the write is durable.
                self._index.remove(key)
        await trio.lowlevel.checkpoint()

    async def _supersede(self, conversation: str, record: _Record) -> None:
        old_key = self._conversations.get(conversation)
        self._conversations[conversation] = record.entry.key
        record.conversations.add(conversation)
        if old_key is None or old_key == record.entry.key:
            return
        old = self._records.get(old_key)
        if old is None:
            return
        old.conversations.discard(conversation)
        n = len(old.entry.tokens)
        if old.conversations or record.entry.tokens[:n] != old.entry.tokens:
            return  # still another conversation's, or not a prefix of the new checkpoint
        self._count("superseded")
        old.retired = True
        record.supersedes.extend(old.supersedes)
        old.supersedes.clear()
        if record.on_disk:
            await self._remove(old)
            return
        # Rule 4: the old checkpoint leaves RAM now, and the disk once the new one is durable
        # there (a crash in between keeps the old one; the new write shares its blocks).
        self._drop_hot(old)
        if old.on_disk or old.writing:
            record.supersedes.append(old)
        else:
            await self._remove(old)

    def _owns(self, record: _Record) -> bool:
        """Whether ``record`` is still the live record of its key (not replaced)."""
        return self._records.get(record.entry.key) is record

    async def _remove(self, record: _Record) -> None:
        record.removed = True
        self._drop_hot(record)
        if record.on_disk:
            self._forget_cold(record)
            # In the background: the store may be busy with a write (never on the request path).
            self._spawn_removal(record.entry.key)
        if self._owns(record):
            self._index.remove(record.entry.key)
            if not record.writing:
                del self._records[record.entry.key]
        await trio.lowlevel.checkpoint()

    # Rule 7: cold operations on one key run one at a time, in the order they were started
    # (a removal started before a rewrite of the same key must not delete the new file).

    def _reserve(self, key: str) -> tuple[trio.Event | None, trio.Event]:
        previous = self._key_tail.get(key)
        done = self._key_tail[key] = trio.Event()
        return previous, done

    def _release(self, key: str, done: trio.Event) -> None:
        done.set()
        if self._key_tail.get(key) is done:
            del self._key_tail[key]

    def _spawn_removal(self, key: str) -> trio.Event:
        previous, done = self._reserve(key)
        self._spawn(self._removal, key, previous, done)
        return done

    async def _removal(self, key: str, previous: trio.Event | None, done: trio.Event) -> None:
        try:
            if previous is not None:
                await previous.wait()
            await self._remove_cold_file(key)
        finally:
            self._release(key, done)

    async def _remove_cold_file(self, key: str) -> None:
        try:
            freed = await self.cold.remove(key)
            self._cold_bytes -= freed  # not `-= await`: that reads the total before the await
        except KvtrioError:
            self._count("drops")
        except OSError:  # a background removal must never kill the cache
            self._count("drops")
            self._count("cold_errors")

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background; ``wait_writes_settled`` waits for it."""
        if self._nursery is None:
            raise RuntimeError("TieredPromptCache is not open")
        self._writes_in_flight += 1
        if self._idle.is_set():  # keep the event waiters hold while work is in flight
            self._idle = trio.Event()
        self._nursery.start_soon(self._settle, fn, *args)

    async def _settle(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        finally:
            self._writes_in_flight -= 1
            if not self._writes_in_flight:
                self._idle.set()

    def _start_write(self, record: _Record, meta: Mapping[str, str]) -> None:
        assert record.hot is not None
        record.writing = True
        previous, done = self._reserve(record.entry.key)
        self._spawn(self._write, record, record.hot, dict(meta), previous, done)

    async def _write(
        self,
        record: _Record,
        caches: list[Any],
        meta: dict[str, str],
        previous: trio.Event | None,
        done: trio.Event,
    ) -> None:
        key = record.entry.key
        try:
            if previous is not None:
                await previous.wait()
            written = await self._store(record, caches, meta)
        finally:
            record.writing = False
            self._release(key, done)
        if written:
            for old in record.supersedes:
                if self._owns(old):
                    await self._remove(old)
            record.supersedes.clear()
            await self._enforce_cold_budget()
        if record.removed:
            if self._owns(record):
                del self._records[key]
        else:
            self._maybe_forget(record)

    async def _store(self, record: _Record, caches: list[Any], meta: dict[str, str]) -> bool:
        """Write ``record`` (its key's turn held); True when it is now durable and live."""
        key = record.entry.key
        if record.conversations:
            meta[CONVERSATIONS_META] = json.dumps(sorted(record.conversations))
        try:
            result = await self.cold.store(
                key, record.entry.model, record.entry.tokens, caches, meta=meta
            )
        except KvtrioError:
            result = StoreResult(written=False)
        except OSError:
            self._count("cold_errors")
            result = StoreResult(written=False)
        self._cold_bytes += result.disk_bytes  # a failed rewrite may still have freed bytes
        if not result.written:
            self._count("drops")
            return False
        self._count("bytes_written", result.bytes_written)
        self._count("bytes_deduplicated", result.bytes_deduplicated)
        if record.removed or not self._owns(record):
            await self._remove_cold_file(key)
            return False
        record.on_disk = True
        self._cold_lru[key] = None
        if key not in self._index:
            self._index.add(record.entry)
        return True

    async def _enforce_cold_budget(self) -> None:
        while self._cold_bytes > self._effective_cold_budget() and len(self._cold_lru) > 1:
            key = next(iter(self._cold_lru))
            record = self._records[key]
            self._forget_cold(record)
            self._count("cold_evictions")
            self._maybe_forget(record)
            await self._spawn_removal(key).wait()


def _conversations_of(meta: Mapping[str, str]) -> tuple[str, ...]:
    """The conversation ids a header's meta names (none when absent or malformed)."""
    try:
        names = json.loads(meta.get(CONVERSATIONS_META, "[]"))
    except ValueError:
        return ()
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return ()
    return tuple(names)


@attrs.frozen
class _SameModel:
    """A load expectation: the header names this model id and config fingerprint, and
    (when ``tokens`` is given) holds exactly those tokens."""

    model: ModelKey
    tokens: tuple[int, ...] | None = None

    def check(self, header: Header) -> None:
        found = ModelKey(header.model_id or "", header.config_fingerprint or "")
        if found != self.model:
            raise CacheMismatchError(f"cache is for {found}, not {self.model}")
        if self.tokens is not None and header.tokens != self.tokens:
            raise CacheMismatchError(
                f"tokens: the entry read holds {len(header.tokens)} other tokens than the "
                f"{len(self.tokens)} its key names"
            )


@attrs.define(eq=False)
class ColdTierStore:
    """:class:`ColdStore` over the actors' :class:`~kvtrio.actors.tier.ColdTier`.

    In the blocks layout, entries sharing a prefix share blocks, so deleting a manifest
    frees only the blocks no other manifest names. The store keeps a reference count per
    block (rebuilt from the manifests at :meth:`create`, when unreferenced blocks from
    earlier runs are swept) and deletes a block when its count drops to zero. Writes and
    sweeps take one lock: a write may re-reference a block a sweep is about to delete.

    On a shared (Redis) tier it is also a :class:`SharedColdStore`: created with
    ``index_block_size``, every manifest the tier publishes is registered in the store's
    prefix index under its chain hashes at that block size, and :meth:`find` asks that
    index (block reference counts stay local: see docs/shared-tier.md).
    """

    tier: ColdTier
    _blocks: LocalBlockStore
    _refs: dict[str, int] = attrs.field(factory=dict)
    _block_sizes: dict[str, int] = attrs.field(factory=dict)
    _entry_blocks: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    _entry_bytes: dict[str, int] = attrs.field(factory=dict)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _usage: int = 0
    _shared: ManifestStore | None = None  # the shared manifest store with a prefix index
    _index_block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    async def create(cls, tier: ColdTier, *, index_block_size: int | None = None) -> ColdTierStore:
        """Index the tier's files and sweep blocks that no manifest names.

        ``index_block_size``: on a shared tier, register every published manifest in the
        store's prefix index, with chain hashes of token blocks of this size (the
        :class:`TieredPromptCache`'s ``block_size``), and answer :meth:`find`.
        """
        self = cls(tier, LocalBlockStore(str(tier.block_dir)))
        file_ops = tier.file_ops
        if (
            index_block_size is not None
            and isinstance(file_ops, ManifestFileOps)
            and file_ops.manifests.shared
        ):
            self._shared = file_ops.manifests
            self._index_block_size = index_block_size
            file_ops.index_keys_of = _ManifestIndexKeys(index_block_size)
        for entry in await tier.list():
            self._note(entry.key, entry.header, entry.disk_bytes)
        stored = await trio.to_thread.run_sync(lambda: list(self._blocks.iter_blocks()))
        orphans = [b.name for b in stored if b.name not in self._refs]
        if orphans:
            await trio.to_thread.run_sync(self._blocks.delete_many, orphans)
        for info in stored:
            if info.name in self._refs:
                self._block_sizes[info.name] = info.size
        self._usage = sum(self._entry_bytes.values()) + sum(self._block_sizes.values())
        return self

    @property
    def directory(self) -> Path:
        return self.tier.root

    def _note(self, key: str, header: Header, file_bytes: int) -> list[str]:
        names = tuple(ref.sha256 for slot in header.slots() for ref in slot.blocks or ())
        fresh = []
        for name, size in (
            (ref.sha256, ref.nbytes) for slot in header.slots() for ref in slot.blocks or ()
        ):
            if name not in self._refs:
                fresh.append(name)
                self._refs[name] = 0
                self._block_sizes[name] = size
            self._refs[name] += 1
        self._entry_blocks[key] = names
        self._entry_bytes[key] = file_bytes
        return fresh

    async def store(
        self,
        key: str,
        model: ModelKey,
        tokens: Sequence[int],
        caches: list[Any],
        *,
        meta: Mapping[str, str],
    ) -> StoreResult:
        async with self._lock:
            freed = await self._remove_locked(key) if key in self._entry_bytes else 0
            try:
                ticket = await self.tier.save(
                    key,
                    tokens,
                    caches,
                    meta=meta,
                    model_id=model.model_id,
                    config_fingerprint=model.fingerprint,
                )
                result = await ticket.wait()
            except KvtrioError:
                return StoreResult(written=False, disk_bytes=-freed)
            if not result.written or result.write is None:
                return StoreResult(written=False, disk_bytes=-freed)
            write = result.write
            fresh = self._note(key, write.header, write.file_bytes)
            new_bytes = write.file_bytes + sum(self._block_sizes[name] for name in fresh)
            self._usage += new_bytes
            dedup = 0
            if write.header.layout == "blocks":
                dedup = max(0, write.header.nbytes - write.new_block_bytes)
            return StoreResult(
                written=True,
                disk_bytes=new_bytes - freed,
                bytes_written=write.file_bytes + write.new_block_bytes,
                bytes_deduplicated=dedup,
            )

    async def fetch(
        self, key: str, *, model: ModelKey, tokens: Sequence[int] | None = None
    ) -> tuple[list[Any], int]:
        expect = _SameModel(model, None if tokens is None else tuple(tokens))
        restored = await self.tier.load(key, expect=expect)
        return restored.caches, restored.header.nbytes

    async def remove(self, key: str) -> int:
        async with self._lock:
            return await self._remove_locked(key)

    async def _remove_locked(self, key: str) -> int:
        freed = await self.tier.delete(key)
        self._entry_bytes.pop(key, None)
        orphans = []
        for name in self._entry_blocks.pop(key, ()):
            self._refs[name] -= 1
            if self._refs[name] == 0:
                del self._refs[name]
                orphans.append(name)
        if orphans:
            await trio.to_thread.run_sync(self._blocks.delete_many, orphans)
            freed += sum(self._block_sizes.pop(name) for name in orphans)
        self._usage -= freed
        return freed

    async def usage(self) -> int:
        return self._usage

    async def entries(self) -> list[ColdEntryInfo]:
        return [_entry_info(entry) for entry in await self.tier.list()]

    async def find(self, model: ModelKey, tokens: Sequence[int]) -> list[tuple[str, int]]:
        """:meth:`SharedColdStore.find`: one pipelined round trip to the prefix index."""
        if self._shared is None:
            return []
        probes = probe_keys(model, tokens, self._index_block_size)
        lookup = functools.partial(self._shared.lookup_each, limit=SHARED_CANDIDATES)
        # Abandoned on cancel: the lookup holds no borrowed buffer, and a stalled store
        # must not hold a cancelled request for its deadline.
        names = await trio.to_thread.run_sync(
            lookup, [key for key, _ in probes], abandon_on_cancel=True
        )
        found: dict[str, int] = {}
        for (_, bound), members in zip(probes, names, strict=True):
            for name in members:
                if name.endswith(SUFFIX):
                    found.setdefault(name[: -len(SUFFIX)], bound)  # deepest first
        return list(found.items())

    async def entry(self, key: str) -> ColdEntryInfo | None:
        """:meth:`SharedColdStore.entry`: the entry's manifest alone (None: gone or bad)."""
        try:
            return _entry_info(await self.tier.entry(key))
        except (CacheMissError, CorruptCacheError, ValueError):
            return None

    async def forget(self, key: str, model: ModelKey, tokens: Sequence[int]) -> None:
        """:meth:`SharedColdStore.forget`: unregister a vanished manifest (if still gone)."""
        if self._shared is None:
            return
        keys = [k for k, _ in probe_keys(model, tokens, self._index_block_size)]
        await trio.to_thread.run_sync(self._shared.unregister, key + SUFFIX, keys)


def _entry_info(entry: TierEntry) -> ColdEntryInfo:
    header = entry.header
    return ColdEntryInfo(
        key=entry.key,
        model=ModelKey(header.model_id or "", header.config_fingerprint or ""),
        tokens=header.tokens,
        trimmable=header.trimmable,
        min_reusable_offset=header.min_reusable_offset,
        mtime=entry.mtime,
        conversations=_conversations_of(header.meta),
    )


@attrs.frozen
class _ManifestIndexKeys:
    """The prefix-index keys of a manifest being published (``ManifestFileOps.index_keys_of``):
    the chain hashes of its tokens, of its model. Runs on the writer's worker thread."""

    block_size: int

    def __call__(self, name: str, data: bytes) -> list[str]:
        preamble = parse_preamble(data[: PREAMBLE.size], len(data))
        body = data[PREAMBLE.size : PREAMBLE.size + preamble.header_len]
        header = parse_header(body, preamble, len(data))
        model = ModelKey(header.model_id or "", header.config_fingerprint or "")
        return index_keys(model, header.tokens, self.block_size)


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
    min_free_bytes: int = 0,
    shutdown_grace: float = 10.0,
    shared_index: bool = True,
    shared_refresh: float | None = None,
    options: IoOptions = DEFAULT_IO_OPTIONS,
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS,
) -> AsyncIterator[TieredPromptCache]:
    """A :class:`TieredPromptCache` over a :class:`ColdTier` at ``directory``.

    ``owner`` is the server's MLX owner (model steps and cache work share its thread).
    The blocks layout stores a shared prefix once; ``block_size`` tokens are both the
    index's hash-chain block and the layout's token block. On a ``redis://`` URL the
    cold tier is shared: every save is registered in Redis's prefix index, and a lookup
    without an exact hit asks that index for longer prefixes other hosts saved (with
    ``shared_index``, the default; rule 8 of :class:`TieredPromptCache`). ``shared_refresh``
    seconds: also re-read the whole shared catalogue at most that often on such lookups
    (off by default; for entries saved without index registration). ``options``: the
    cold tier's I/O tuning (:class:`~kvtrio.storage.options.IoOptions`, docs/tuning.md).
    """
    shared = is_redis_url(os.fspath(directory))
    opened = False
    try:
        async with ColdTier.open(
            directory,
            layout=layout,
            block_tokens=block_size,
            owner=owner,
            shutdown_grace=shutdown_grace,
            options=options,
        ) as tier:
            store = await ColdTierStore.create(
                tier, index_block_size=block_size if shared else None
            )
            async with TieredPromptCache.open(
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
                min_reuse_tokens=min_reuse_tokens,
            ) as cache:
                opened = True
                yield cache
    except BaseExceptionGroup as group:
        # Errors of the open itself reach the caller as the one typed kvtrio error they
        # are, not wrapped in the nurseries' ExceptionGroups (issue 15).
        cause = None if opened else _sole_kvtrio_error(group)
        if cause is None:
            raise
        raise cause from cause.__cause__


def _sole_kvtrio_error(group: BaseExceptionGroup[BaseException]) -> KvtrioError | None:
    """The group's only leaf exception, when there is one and it is a KvtrioError."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if len(leaves) == 1 and isinstance(leaves[0], KvtrioError):
        return leaves[0]
    return None
