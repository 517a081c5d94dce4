"""TieredLRUPromptCache: mlx-lm's LRUPromptCache, with kvtrio's cold tier beneath its RAM.

A drop-in for ``mlx_lm.models.cache.LRUPromptCache`` in any threaded server (mlx-lm's own
first): same constructor, same synchronous methods (``fetch_nearest_cache``,
``insert_cache``, ``trim_to``, ``nbytes``, ``len()``, ``stats_by_type``), called from the
one thread that makes the server's MLX calls.

::

    tier = TierThread(TierOptions(directory, model_key))
    tier.start()
    cache = TieredLRUPromptCache(max_size=10, tier=tier, tier_model=mlx_model_key)
    # on the generation thread:
    tier.bind()
    cache, rest = cache.fetch_nearest_cache(mlx_model_key, prompt)   # RAM, else disk
    ...
    cache.insert_cache(mlx_model_key, tokens, prompt_cache)          # RAM; evictions spill
    cache.pump()                                                     # between steps
    cache.close()                                                    # at exit: RAM -> disk

Theory of operation:

1. RAM is mlx-lm's: this class *is* an LRUPromptCache (its trie, its per-``cache_type``
   LRU ordering, ``max_size``/``max_bytes``, ``trim_to``); nothing of its semantics
   changes. The trie is replaced by one that records what LRUPromptCache evicts, and
   whose search gives mlx-lm's answers in linear time (:mod:`kvtrio.serve.triesearch`).
2. An entry LRUPromptCache evicts (count, bytes, ``trim_to``) is handed to the cold tier
   (:meth:`TieredPromptCache.spill`): the call returns at once; the snapshot, the
   materialization and the release run later as owner jobs on this thread
   (:meth:`pump`), the write on worker threads. Entries dropped as prefixes of a longer
   trimmable entry are not written: the longer one covers them. With a ``save_trace``
   each hand-over is recorded once the writes settle (:mod:`kvtrio.serve.savetrace`).
3. A lookup asks RAM first, then the cold index (read on this thread: no round trip to
   the tier's loop, no I/O; :meth:`TierThread.lookup`). Only when disk reuses at least
   ``min_reuse_tokens`` more tokens than RAM does it load, on this thread's behalf: the
   caller waits at most ``load_timeout`` seconds (running owner jobs for the load
   meanwhile), then the lookup is RAM's answer (a miss at worst). With
   ``load_in_lookup=False`` (a server that sets such a request aside first, rule 7:
   kvtrio serve) the lookup never loads: it is RAM's answer, counted in
   ``cold_not_loaded``.
4. Only entries of ``tier_model`` (mlx-lm's model key of the model the tier was opened
   for) go to disk; other models stay RAM-only, exactly as in mlx-lm.
5. Caches kvtrio cannot save stay in RAM: a batch cache of one sequence is extracted to
   its per-sequence cache first (``extract(0)``, what mlx-lm's BatchGenerator does); a
   batch cache of several sequences, or a class without a codec, is refused with
   :class:`~kvtrio.errors.UnsupportedCacheError` by :func:`saveable`, counted, and kept
   RAM-only. An entry whose caches hold fewer tokens than its key (a draft model's) is
   written under the tokens they all hold (:mod:`kvtrio.serve.cachekinds`, rule 3).
6. :meth:`close` spills every RAM entry (a flush: never refused by admission, never
   shed), then closes the tier, pumping owner jobs meanwhile, for at most its
   ``timeout``; :meth:`flush_report` then says, entry by entry, which did not land and
   why (:mod:`kvtrio.serve.flushreport`).
7. :meth:`prefetch` is rule 3 without the wait, for a server that can set a request
   aside (kvtrio serve does): it starts the disk load and returns; the loaded entry is
   inserted into RAM by an owner job, and the server's callback then releases the
   request, whose lookup is a RAM hit. Meanwhile the generation thread serves the others.
   One read per entry: a prefetch of an entry whose load is in flight (a warm restart's,
   or another request's) joins it, its callback run by the same admission.
8. :meth:`prefetch_on_arrival` is the same load started earlier, from any thread (an
   HTTP handler, before its request reaches the generation thread's queue): it reads
   RAM's trie under the trie's lock and asks the tier's loop to start
   ``TieredPromptCache.prefetch``; no MLX call is made there, the load's MLX jobs run on
   the owner thread when it pumps, and the later :meth:`prefetch` (or lookup) adopts it.
9. ``min_reuse_tokens`` (the tier's own by default: ``kvtrio serve --min-reuse-tokens``)
   also bounds what RAM copies for a few tokens: mlx-lm serves a prompt from a longer
   entry by deep-copying the whole entry and trimming it back, so a long entry that
   shares only a chat template's first tokens with the prompt costs a copy of all its
   bytes; such a match keeping fewer than ``min_reuse_tokens`` tokens is a miss instead.
   0 (no tier) is mlx-lm's behaviour exactly.
10. A warm restart (``prefetch(..., restore=True)``, driven by
    :mod:`kvtrio.serve.restore` while the server is idle) is rule 7's load of an entry
    nobody asked for yet: the same load path; the entry goes in as RAM's least recently
    used, so restoring newest first leaves RAM's order as it was before the restart.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from kvtrio.errors import ShuttingDown, UnsupportedCacheError
from kvtrio.serve import triesearch
from kvtrio.serve.cachekinds import held_prefix, per_sequence, saveable
from kvtrio.serve.flushreport import FlushedEntry, FlushReport, HandOver
from kvtrio.serve.savetrace import SaveTrace
from mlx_lm.models import cache as _mlx_cache

if TYPE_CHECKING:  # the tier's modules load with the tier: ``kvtrio serve`` starts without
    from kvtrio.actors.prefix import PrefixMatch
    from kvtrio.actors.tiered import Fetched, TieredPromptCache
    from kvtrio.actors.tieredtypes import TieredStatistics
    from kvtrio.actors.wear import WearStatistics
    from kvtrio.serve.bridge import TierThread

__all__ = [
    "CacheTier",
    "FetchInfo",
    "TieredLRUPromptCache",
    "TieredLRUStatistics",
    "per_sequence",
    "saveable",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

mlx_cache: Any = _mlx_cache


class CacheTier(enum.Enum):
    """Where a lookup's reused tokens came from."""

    HOT = "hot"
    COLD = "cold"
    MISS = "miss"


@attrs.frozen
class FetchInfo:
    """The last lookup: its tier and the tokens it reused."""

    tier: CacheTier
    reused: int


@attrs.frozen
class TieredLRUStatistics:
    """Counters of the adapter (RAM side; the tier's own are ``tier.cache.statistics()``)."""

    ram_entries: int
    ram_bytes: int
    hits_hot: int
    hits_cold: int
    misses: int
    spilled: int
    refused: int
    load_timeouts: int
    load_failures: int
    prefetches: int
    cold_not_loaded: int  # disk would have served better; the lookup did not load (rule 3)
    short_reuses_skipped: int  # RAM or disk matches below min_reuse_tokens (rule 9)
    restored: int  # entries a warm restart loaded into RAM (rule 10)
    restored_bytes: int


class _RecordingTrie(mlx_cache.PromptTrie):  # type: ignore[misc]
    """mlx-lm's PromptTrie, noting the entries LRUPromptCache evicts (its only ``pop``
    callers are the eviction loops; prefixes dropped for a longer entry use
    ``pop_prefixes``). Its operations hold a lock: :meth:`TieredLRUPromptCache.
    prefetch_on_arrival` reads it from other threads (rule 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[tuple[Any, list[int], Any]] = []
        self.lock = threading.RLock()

    def add(self, model: Any, tokens: list[int], value: Any) -> Any:
        with self.lock:
            return super().add(model, tokens, value)

    def get(self, model: Any, tokens: list[int]) -> Any:
        with self.lock:
            return super().get(model, tokens)

    def search(self, model: Any, tokens: list[int]) -> Any:
        with self.lock:  # mlx-lm's answer, in linear time (kvtrio.serve.triesearch)
            return triesearch.search(self, model, tokens)

    def pop_prefixes(self, model: Any, tokens: list[int]) -> Any:
        with self.lock:
            return super().pop_prefixes(model, tokens)

    def pop(self, model: Any, tokens: list[int]) -> Any:
        with self.lock:
            value = super().pop(model, tokens)
        self.evicted.append((model, list(tokens), value))
        return value


class TieredLRUPromptCache(mlx_cache.LRUPromptCache):  # type: ignore[misc]
    """mlx-lm's LRUPromptCache over kvtrio's cold tier (see the module doc)."""

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        tier: TierThread | None = None,
        tier_model: Hashable | None = None,
        load_timeout: float = 30.0,
        pump_budget: float = 0.005,
        load_in_lookup: bool = True,
        min_reuse_tokens: int | None = None,
        save_trace: SaveTrace | None = None,
    ) -> None:
        super().__init__(max_size, max_bytes)
        self.save_trace = save_trace  # when each spill ran (kvtrio.serve.savetrace)
        self._trie = _RecordingTrie()
        self.tier = tier
        self.tier_model = tier_model
        self.load_timeout = load_timeout
        self.load_in_lookup = load_in_lookup
        if min_reuse_tokens is None:
            min_reuse_tokens = tier.options.min_reuse_tokens if tier is not None else 0
        self.min_reuse_tokens = min_reuse_tokens
        self.pump_budget = pump_budget
        self.last_fetch: FetchInfo | None = None
        self.fetch_count = 0  # lookups made so far (kvtrio serve tags requests with them)
        self._counts: dict[str, int] = {}
        self._closing = False
        self._flushed: list[FlushedEntry] = []  # the close's RAM entries (rule 6)
        # Rule 7's loads in flight, by entry tokens: their callers (one read per entry).
        self._loading: dict[tuple[int, ...], list[Callable[[bool], object]]] = {}

    # -- mlx-lm's interface ------------------------------------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        self.pump()
        if self._short_longer_match(model, tokens):  # rule 9: no copy for a few tokens
            self._count("short_reuses_skipped")
            cache, rest = None, list(tokens)
        else:
            cache, rest = super().fetch_nearest_cache(model, tokens)
        reused = len(tokens) - len(rest)
        tier = CacheTier.HOT if cache is not None else CacheTier.MISS
        fetched = self._fetch_cold(model, tokens, reused)
        if fetched is not None and fetched.caches is not None:
            cache, rest, tier = fetched.caches, list(fetched.remaining), CacheTier.COLD
            reused = len(tokens) - len(rest)
        self._count({CacheTier.HOT: "hits_hot", CacheTier.COLD: "hits_cold"}.get(tier, "misses"))
        self.last_fetch = FetchInfo(tier, reused)
        self.fetch_count += 1
        return cache, rest

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        try:
            prompt_cache = per_sequence(prompt_cache)
        except UnsupportedCacheError:
            self._count("refused")
            logger.debug("kvtrio: a batch cache of several sequences stays out of the cache")
            return
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        self._spill_evicted()
        self.pump()

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
        self._spill_evicted()

    # -- kvtrio's additions ------------------------------------------------------------

    def prefetch(
        self,
        model: Any,
        tokens: list[int],
        on_done: Callable[[bool], object],
        *,
        restore: bool = False,
    ) -> bool:
        """Start loading, without waiting, the disk entry that would serve ``tokens``
        better than RAM does now (rule 7); False when there is none. Once it is in RAM
        (or the load failed), ``on_done(loaded)`` runs on this thread, in a pump.
        ``restore``: a warm restart's load (rule 10), counted as one, its entry placed
        least recently used in RAM (it was used before everything RAM holds)."""
        tier = self._cold_for(model)
        if tier is None or not tokens:
            return False
        cold = tier.cache
        assert cold is not None
        try:
            match = tier.lookup(tokens)
        except Exception:  # a tier out of reach: no prefetch, the lookup decides
            return False
        if not self._worth_loading(match, self._ram_reuse(model, tokens)):
            return False
        assert match is not None
        entry = tuple(match.entry.tokens)
        if (waiting := self._loading.get(entry)) is not None:
            # That entry's load is in flight (a warm restart's, or another request's): its
            # admission serves this caller too. The tier would not start a second read,
            # but a lookup arriving after the first one took the loaded caches, before
            # they reached RAM, would load them again.
            waiting.append(on_done)
            if not restore:
                self._count("prefetches")
            return True

        def admit(caches: list[Any] | None) -> None:
            callers = self._loading.pop(entry, [on_done])
            if caches is not None:
                self.insert_cache(model, list(entry), caches)
                if restore:
                    self._restored(model, list(entry), sum(c.nbytes for c in caches))
            else:
                self._count("load_failures")
            for caller in callers:
                caller(caches is not None)

        self._loading[entry] = [on_done]
        if not tier.submit(_prefetch, cold, match.entry.tokens, admit):
            del self._loading[entry]
            return False
        if not restore:  # a warm restart's loads are counted as restored (rule 10)
            self._count("prefetches")
        return True

    def _restored(self, model: Any, tokens: list[int], nbytes: int) -> None:
        """Rule 10: a restored entry, counted, and made RAM's least recently used."""
        self._count("restored")
        self._count("restored_bytes", nbytes)
        lru = self._lru._lrus["assistant"]  # insert_cache's cache_type
        if (model, tokens) in lru:
            lru.remove((model, tokens))
            lru.appendleft((model, tokens))

    def prefetch_on_arrival(self, model: Any, tokens: list[int]) -> bool:
        """Any thread (an HTTP handler, as its request arrives): start the tier's prefetch
        (``TieredPromptCache.prefetch``: the load, adopted by the later lookup) of the disk
        entry that serves ``tokens`` better than RAM does now (rule 8). Returns at once;
        False when nothing was asked."""
        tier = self._cold_for(model)
        if tier is None or not tokens:
            return False
        try:
            ram = self._ram_reuse(model, tokens)
        except KeyError:  # an entry left RAM during the walk
            ram = 0
        return tier.submit(_prefetch_on_arrival, tier.cache, list(tokens), ram)

    def _ram_match(self, model: Any, tokens: list[int]) -> tuple[int, bool]:
        """How many tokens LRUPromptCache's ``fetch_nearest_cache`` would reuse from RAM,
        and whether it would copy a longer entry to do so (its rules, without copying)."""
        result = self._trie.search(model, tokens)
        if result.exact is not None:
            return len(tokens), False
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            entry = self._trie.get(result.model, result.longer)
            if mlx_cache.can_trim_prompt_cache(entry.prompt_cache):
                return min(len(tokens) - 1, int(result.common_prefix)), True
        return short, False

    def _copies_for_few(self, reuse: int, copies_longer: bool) -> bool:
        """Rule 9: a RAM match that copies a longer entry to keep fewer than
        ``min_reuse_tokens`` tokens."""
        return copies_longer and reuse < self.min_reuse_tokens

    def _short_longer_match(self, model: Any, tokens: list[int]) -> bool:
        """Rule 9 for ``tokens`` (no trie walk when the bound is off)."""
        return self.min_reuse_tokens > 0 and self._copies_for_few(*self._ram_match(model, tokens))

    def _ram_reuse(self, model: Any, tokens: list[int]) -> int:
        """How many tokens :meth:`fetch_nearest_cache` reuses from RAM (rule 9 applied),
        from one walk of the trie."""
        reuse, copies_longer = self._ram_match(model, tokens)
        return 0 if self._copies_for_few(reuse, copies_longer) else reuse

    def _worth_loading(
        self, match: PrefixMatch | None, ram_reuse: int, *, count: bool = False
    ) -> bool:
        """Rule 3: a disk load only for a match that reuses at least ``min_reuse_tokens``
        tokens, and that many more than RAM does (at least one)."""
        if match is None:
            return False
        gain = match.reuse - ram_reuse
        if gain <= 0:
            return False
        if gain < self.min_reuse_tokens or match.reuse < self.min_reuse_tokens:
            if count:
                self._count("short_reuses_skipped")
            return False
        return True

    def pump(self, budget: float | None = None) -> int:
        """Run the tier's queued MLX jobs (owner thread) for up to ``budget`` seconds
        (``pump_budget`` by default); call it between model steps. It returns at once when
        nothing is queued: a loop that only pumps must also block or sleep, or it holds
        the GIL that the tier's loop and workers need."""
        if self.tier is None:
            return 0
        return self.tier.pump(self.pump_budget if budget is None else budget)

    def close(self, *, timeout: float | None = None) -> bool:
        """Write every RAM entry of the tier's model to disk, close the tier (rule 6);
        True when everything settled within ``timeout``."""
        self._closing = True  # the close's spills are a flush: not subject to admission
        self.trim_to(n_sequences=0)
        if self.tier is None:
            return True
        return self.tier.close(timeout=timeout)

    def flush_report(self) -> FlushReport:
        """Where the writes of the entries :meth:`close` handed over stand (rule 6): read
        on the tier's loop while it runs (its close may have outlived its timeout),
        directly once it ended. Any thread but the owner's while the loop runs."""
        entries = list(self._flushed)
        keys = [entry.key for entry in entries if entry.key is not None]
        landings = self._tier_read(lambda cache: cache.landing(keys)) if keys else None
        return FlushReport.of(entries, landings or {})

    def statistics(self) -> TieredLRUStatistics:
        c = self._counts.get
        return TieredLRUStatistics(
            ram_entries=len(self),
            ram_bytes=self.nbytes,
            hits_hot=c("hits_hot", 0),
            hits_cold=c("hits_cold", 0),
            misses=c("misses", 0),
            spilled=c("spilled", 0),
            refused=c("refused", 0),
            load_timeouts=c("load_timeouts", 0),
            load_failures=c("load_failures", 0),
            prefetches=c("prefetches", 0),
            cold_not_loaded=c("cold_not_loaded", 0),
            short_reuses_skipped=c("short_reuses_skipped", 0),
            restored=c("restored", 0),
            restored_bytes=c("restored_bytes", 0),
        )

    def metrics_text(self) -> str:
        """Prometheus text (format 0.0.4): this RAM tier's lookups by where they were
        served, then the cold tier's own families (TieredPromptCache.metrics_text, read on
        its loop) while it is open. Any thread but the owner's may call it."""
        from kvtrio.actors.metrics import MetricFamily, render

        stats = self.statistics()
        families = [
            MetricFamily(
                "kvtrio_serve_lookups_total",
                "counter",
                "kvtrio serve's prompt lookups, by where they were served (ram, disk, miss).",
                tuple(
                    ("", (("served", name),), value)
                    for name, value in (
                        ("ram", stats.hits_hot),
                        ("disk", stats.hits_cold),
                        ("miss", stats.misses),
                    )
                ),
            ),
            MetricFamily(
                "kvtrio_serve_ram_entries",
                "gauge",
                "Entries in kvtrio serve's RAM tier (mlx-lm's LRUPromptCache).",
                (("", (), stats.ram_entries),),
            ),
            MetricFamily(
                "kvtrio_serve_ram_bytes",
                "gauge",
                "Bytes in kvtrio serve's RAM tier.",
                (("", (), stats.ram_bytes),),
            ),
            MetricFamily(
                "kvtrio_serve_spilled_total",
                "counter",
                "RAM entries handed to the cold tier when RAM evicted them.",
                (("", (), stats.spilled),),
            ),
            MetricFamily(
                "kvtrio_serve_prefetches_total",
                "counter",
                "Disk loads started while a request waited.",
                (("", (), stats.prefetches),),
            ),
            MetricFamily(
                "kvtrio_serve_restored_total",
                "counter",
                "Disk entries loaded back into RAM while idle after a start (--restore-bytes).",
                (("", (), stats.restored),),
            ),
            MetricFamily(
                "kvtrio_serve_restored_bytes_total",
                "counter",
                "Bytes of the entries loaded back into RAM after a start.",
                (("", (), stats.restored_bytes),),
            ),
        ]
        text = render(families)
        tier = self.tier
        if tier is not None and tier.alive and tier.cache is not None:
            try:
                text += tier.read(tier.cache.metrics_text)
            except ShuttingDown:
                pass
        return text

    def wear(self) -> WearStatistics | None:
        """The cold tier's wear (bytes written, read, read back), once it is closed or from
        any thread but the owner's while it is open; None without a tier."""
        return self._tier_read(lambda cache: cache.wear.statistics())

    def cold_statistics(self) -> TieredStatistics | None:
        """The cold tier's counters (entries and bytes on disk, writes dropped by the
        pending byte cap, evictions), once it is closed or from any thread but the owner's
        while it is open; None without a tier."""
        return self._tier_read(lambda cache: cache.statistics())

    def _tier_read(self, fn: Callable[[TieredPromptCache], T]) -> T | None:
        """``fn(cache)`` of the cold tier's cache: on its loop while it is open (from any
        thread but the owner's), directly once it is closed; None without a tier."""
        tier = self.tier
        if tier is None or tier.cache is None:
            return None
        cache = tier.cache
        try:  # on the loop while it runs, even past a close that gave up (rule 6)
            return tier.read(lambda: fn(cache))
        except ShuttingDown:
            return fn(cache)

    # -- internals ---------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    def _cold_for(self, model: Any) -> TierThread | None:
        tier = self.tier
        if tier is None or not tier.alive or model != self.tier_model or tier.cache is None:
            return None
        return tier

    def _fetch_cold(self, model: Any, tokens: list[int], reused: int) -> Fetched | None:
        """Rule 3: a disk load, when the index says disk reuses more than RAM did."""
        tier = self._cold_for(model)
        if tier is None or not tokens:
            return None
        cold = tier.cache
        assert cold is not None
        try:
            match = tier.lookup(tokens)
            if not self._worth_loading(match, reused, count=True):
                return None
            if not self.load_in_lookup:
                self._count("cold_not_loaded")
                return None
            fetched = tier.call(_fetch_unadmitted, cold, tokens, timeout=self.load_timeout)
        except TimeoutError:
            self._count("load_timeouts")
            return None
        except Exception:  # every error around the cold tier is a counted miss
            self._count("load_failures")
            logger.exception("kvtrio: a cold lookup failed; served from RAM")
            return None
        if fetched.caches is None or fetched.reused <= reused:
            return None
        return fetched

    def _spill_evicted(self) -> None:
        trie: _RecordingTrie = self._trie
        evicted, trie.evicted = trie.evicted, []
        handed = time.perf_counter()
        for model, tokens, entry in evicted:
            flushed = None
            if self._closing and model == self.tier_model and tokens:
                flushed = FlushedEntry(len(tokens))
                self._flushed.append(flushed)
            tier = self._cold_for(model)
            if tier is None or not tokens:
                if flushed is not None:
                    not_open = self.tier is None
                    flushed.why = HandOver.TIER_NOT_OPEN if not_open else HandOver.TIER_CLOSED
                continue
            try:
                saveable(entry.prompt_cache)
                tokens = held_prefix(entry.prompt_cache, tokens)  # a draft model's entry
            except UnsupportedCacheError:
                self._count("refused")
                if flushed is not None:
                    flushed.why = HandOver.NOT_SAVEABLE
                continue
            cold = tier.cache
            assert cold is not None
            meta = {"mlx_lm.cache_type": str(entry.cache_type)}
            trace = None if self.save_trace is None else (self.save_trace, handed)
            if tier.submit(_spill, cold, tokens, entry.prompt_cache, meta, flushed, trace):
                self._count("spilled")
            elif flushed is not None:
                flushed.why = HandOver.TIER_CLOSED


async def _fetch_unadmitted(cold: Any, tokens: list[int]) -> Fetched:
    fetched: Fetched = await cold.fetch_nearest(tokens, admit=False)
    return fetched


async def _prefetch_on_arrival(cold: Any, tokens: list[int], ram_reuse: int) -> None:
    # One index lookup (a few thousand tokens hashed, holding the GIL) decides and starts
    # the load: it runs before the load, on the request's path.
    cold.prefetch(tokens, more_than=max(ram_reuse, cold.min_reuse_tokens - 1))


async def _prefetch(
    cold: Any, tokens: tuple[int, ...], admit: Callable[[list[Any] | None], None]
) -> None:
    """Load the entry holding exactly ``tokens`` and hand it to ``admit`` on the owner."""
    caches: list[Any] | None = None
    try:
        cold.prefetch(tokens)  # the library's prefetch: the lookup below adopts its load
        fetched: Fetched = await cold.fetch_nearest(tokens, admit=False)
        if fetched.caches is not None and not fetched.remaining:
            caches = fetched.caches
    finally:
        await cold.owner.run(admit, caches)


async def _spill(
    cold: Any,
    tokens: list[int],
    caches: list[Any],
    meta: dict[str, str],
    flushed: FlushedEntry | None,
    trace: tuple[SaveTrace, float] | None,
) -> None:
    """Hand an entry RAM evicted to the tier; the close's (``flushed``) as a flush. With
    a ``trace`` (the save trace, when RAM handed it over), record the save's span once
    the tier's writes have settled, with its own store's if it was written."""
    if trace is not None:
        cold.on_written = trace[0].note_written
    try:
        key = await cold.spill(tokens, caches, meta=meta, flush=flushed is not None)
    except Exception:
        if flushed is not None:
            flushed.why = HandOver.SPILL_FAILED
        raise
    if flushed is not None:
        flushed.key = key
    if trace is not None:
        import trio  # loaded with the tier, whose loop runs this

        saves, handed = trace
        await cold.wait_writes_settled()
        settled, written = time.perf_counter(), saves.written.pop(key, None)
        await trio.to_thread.run_sync(saves.record, handed, settled, len(tokens), written)
