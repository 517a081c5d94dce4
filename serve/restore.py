"""Warm restart: after a start, load the most recently used disk entries back into RAM
while the server is idle, so a conversation's next turn after a restart is a RAM hit.

Theory of operation:

1. Once the cold tier is open (``kvtrio serve`` opens it after the model, rule 6 of
   :mod:`kvtrio.serve.server`), :class:`Restore` asks the tier once for its model's
   entries on disk, most recently used first (the catalogue keeps the order across
   restarts: :meth:`TieredPromptCache.recent_entries`), as many as fit in
   ``--restore-bytes``, RAM's byte budget and its entry count (``--prompt-cache-size``).
2. Only while idle: one entry at a time, each started by :meth:`Restore.step` on the
   generation thread (the MLX owner) after it checks that no request is in flight,
   queued, or set aside (``idle()``). A request arriving meanwhile finds at most the one
   load already running; one for that same entry joins it (the adapter's rule 7: one
   read per entry, the request released by the load's admission); the restore goes
   on at the next idle moment, and the entries RAM has by then are skipped (the adapter's
   prefetch loads only what serves better than RAM).
3. The load is the adapter's :meth:`~kvtrio.serve.adapter.TieredLRUPromptCache.prefetch`
   (``restore=True``, its rule 10): no second load path; integrity checks as for any
   disk hit. It stops at the first entry that would push RAM past its budget: it never
   evicts anything to make room.
4. When it ends it prints ``kvtrio serve: restored K entries (B bytes) to RAM in S s``;
   ``kvtrio_serve_restored_total`` and ``kvtrio_serve_restored_bytes_total`` count it.
5. Then, when it restored an entry and the model is known, it warms the process up for
   the turn it expects: :data:`WARM_TOKENS` tokens over a copy of the newest restored
   entry's caches (trimmed by as many), as a conversation's next turn runs its new
   tokens over a RAM hit, and the copy is dropped. When mlx-lm's server batches (its
   ``is_batchable``: no draft model), the turn goes the way a request's does, through an
   mlx-lm ``BatchGenerator`` of its own (the caches merged into a batch cache, the
   prefill under its array mask, the split into a generation batch, decode steps to the
   first token), else as one model call. A fresh process pays for its first such turn
   (buffers allocated; on a GPU, kernels loaded and compiled) on the request that makes
   it; this pays it while idle (on the H200 the one model call left 0.31 s on a 4k
   turn 2, the BatchGenerator's turn 0.16 s: docs/bench/serve.md, fourteenth session).
   What no warm-up pays: on CUDA, MLX builds a cuDNN attention graph for every new
   (query, key) shape (40-80 ms there), and a next turn's shape is always new. RAM's
   entries, their order and the counters are left as they were; the seconds it took are
   printed on the line above.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from kvtrio.serve.adapter import TieredLRUPromptCache

__all__ = ["DEFAULT_RESTORE_BYTES", "WARM_TOKENS", "Restore", "warm_up"]

logger = logging.getLogger(__name__)

#: ``--restore-bytes``'s default (further bounded by ``--hot-bytes`` and the entry count):
#: a start reads at most 1 GiB back (about a second of an SSD's reads, only while idle),
#: and RAM holds no more than that of entries nobody may ask for again.
DEFAULT_RESTORE_BYTES = 1 << 30

#: Rule 5: the tokens the warm-up runs over the newest restored entry (a short turn).
WARM_TOKENS = 16


@attrs.define(eq=False)
class Restore:
    """The warm restart of one server's start (generation thread only)."""

    adapter: TieredLRUPromptCache
    cap: int  # --restore-bytes
    idle: Callable[[], bool]  # no request in flight, queued or set aside (rule 2)
    model: Callable[[], Any] = lambda: None  # the loaded model, or None (rule 5)
    batched: Callable[[], bool] = lambda: False  # mlx-lm's server batches (rule 5)
    done: bool = False
    loading: bool = False
    restored: int = 0
    restored_bytes: int = 0
    _todo: list[tuple[tuple[int, ...], int]] | None = None
    _started: float = 0.0
    _listed_bytes: int = 0  # the restored entries' bytes on disk (rule 3's estimate)
    _loading_bytes: int = 0
    _newest: tuple[int, ...] | None = None  # the first entry restored (rule 5)
    _loading_tokens: tuple[int, ...] = ()

    @classmethod
    def of(cls, adapter: TieredLRUPromptCache, provider: Any, idle: Callable[[], bool]) -> Restore:
        """The restore of mlx-lm's ``provider`` (its flags; its model once loaded)."""
        cap = getattr(provider.cli_args, "restore_bytes", DEFAULT_RESTORE_BYTES)
        cap = DEFAULT_RESTORE_BYTES if cap is None else cap
        return cls(
            adapter,
            cap,
            idle,
            lambda: getattr(provider, "model", None),
            lambda: bool(getattr(provider, "is_batchable", False)),
            done=cap == 0,
        )

    def step(self) -> bool:
        """Start the next entry's load when idle and none is running (rule 2); whether one
        started. Cheap once done."""
        if self.done or self.loading or not self.idle():
            return False
        adapter = self.adapter
        tier = adapter.tier
        if tier is None or not tier.alive or tier.cache is None:
            if tier is not None and not tier.alive and self._todo is not None:
                self._finish()  # closed under it
            return False  # not open yet (rule 1)
        if self._todo is None:
            self._started = time.monotonic()
            try:
                self._todo = tier.peek(tier.cache.recent_entries, self.cap, adapter.max_size)
            except Exception:  # best effort: a tier out of reach restores nothing
                logger.exception("kvtrio serve: the warm restart could not list the entries")
                self._todo = []
            self._todo.reverse()  # taken from the end: newest first
        while self._todo:
            tokens, nbytes = self._todo.pop()
            if not self._fits(nbytes):
                break
            if adapter.prefetch(adapter.tier_model, list(tokens), self._loaded, restore=True):
                self.loading = True
                self._loading_bytes = nbytes
                self._loading_tokens = tokens
                return True
        self._finish()
        return False

    def _fits(self, stored: int) -> bool:
        """Rule 3: within the cap, RAM's byte budget and its entry count. ``stored`` is
        the entry's bytes on disk; its bytes in RAM are estimated from the loads so far
        (RAM bytes per stored byte: an entry may take more room in RAM than on disk)."""
        adapter = self.adapter
        nbytes = stored
        if self._listed_bytes:
            nbytes = stored * self.restored_bytes // self._listed_bytes
        return (
            self.restored_bytes + nbytes <= self.cap
            and adapter.nbytes + nbytes <= adapter.max_bytes
            and len(adapter) < adapter.max_size
        )

    def _loaded(self, loaded: bool) -> None:
        """The adapter's ``on_done``: in a pump on the generation thread; the next load
        starts here when still idle."""
        self.loading = False
        stats = self.adapter.statistics()
        self.restored, self.restored_bytes = stats.restored, stats.restored_bytes
        if loaded:
            self._listed_bytes += self._loading_bytes
            if self._newest is None:
                self._newest = self._loading_tokens
        self.step()

    def _finish(self) -> None:
        self.done = True
        self._todo = []
        seconds = time.monotonic() - self._started
        warmed = ""
        model = self.model()
        if self._newest is not None and model is not None:
            try:  # best effort (rule 5): a warm-up that fails costs the first request only
                took = warm_up(self.adapter, model, self._newest, batched=self.batched())
            except Exception:
                logger.exception("kvtrio serve: the warm-up after the restore failed")
                took = None
            if took is not None:
                warmed = f", warmed up in {took:.3f} s"
        print(
            f"kvtrio serve: restored {self.restored} entries ({self.restored_bytes} bytes) "
            f"to RAM in {seconds:.2f} s{warmed}",
            flush=True,
        )


def warm_up(
    adapter: TieredLRUPromptCache, model: Any, tokens: tuple[int, ...], *, batched: bool = False
) -> float | None:
    """Rule 5 (generation thread): run the model over a copy of RAM's entry for
    ``tokens``, its last :data:`WARM_TOKENS` tokens trimmed off and fed again (``batched``:
    through an mlx-lm BatchGenerator to the first generated token, as mlx-lm's server runs
    a request); the seconds it took, or None when the entry is not in RAM or cannot be
    trimmed. RAM's entry, its place and the counters are not touched (no lookup is made)."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    try:
        entry = adapter._trie.get(adapter.tier_model, list(tokens))
    except KeyError:  # evicted since (a request's entry took its place)
        return None
    layers = len(mlx_cache.make_prompt_cache(model))  # a draft model's caches follow
    caches = entry.prompt_cache[:layers]
    n = min(WARM_TOKENS, len(tokens) - 1)
    if n <= 0 or len(caches) != layers or not mlx_cache.can_trim_prompt_cache(caches):
        return None
    started = time.perf_counter()
    copies = copy.deepcopy(caches)
    mlx_cache.trim_prompt_cache(copies, n)
    if batched:
        _batched_turn(model, copies, list(tokens[-n:]))
    else:
        mx.eval(model(mx.array(list(tokens[-n:]))[None], cache=copies))
    return time.perf_counter() - started


def _batched_turn(model: Any, caches: list[Any], tokens: list[int]) -> None:
    """``tokens`` over ``caches`` as mlx-lm's server runs a request's turn, on this
    thread's default stream (the server's generation stream): a BatchGenerator of its own
    prefills all but the last token, splits the sequence into a generation batch and
    decodes to the first token; then it is closed and dropped, caches and all."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    generator: Any = BatchGenerator(model, stream=mx.default_stream(mx.default_device()))
    try:
        generator.insert([tokens], max_tokens=[2], caches=[caches])
        for _ in range(8):  # a prefill step, the split, the first token: 3 in mlx-lm 0.32
            _, generated = generator.next()
            if generated:
                return
    finally:
        generator.close()
