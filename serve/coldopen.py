"""The cold tier of ``kvtrio serve``, opened while the server already serves.

Theory of operation:

1. :class:`ColdOpening` opens the tier (:class:`~kvtrio.serve.bridge.TierThread`: its
   modules imported, the directory locked, the index rebuilt from the catalogue) on a
   thread of its own, started by the generation thread once the model has loaded and no
   request is in flight (:func:`open_now`; the listener is open by then): the first
   request waits for the model, as in mlx-lm, not for the index, and the open does not
   compete for the GIL with the model's load or the requests already waiting.
2. :class:`ServeCache` is the adapter (:class:`~kvtrio.serve.adapter.TieredLRUPromptCache`)
   with no tier until the open ends. The generation thread takes the tier (binds it as
   the MLX owner) at its next pump or lookup after that. Until then a lookup of the
   tier's model is RAM's answer, counted by reason (``opening``; ``failed`` when the open
   failed), and what RAM evicts is held in RAM, then written once the tier is there.
3. :meth:`ServeCache.close` waits for an open still in progress (its timeout bounds the
   wait and the writes together), so RAM entries still reach the disk at shutdown; if
   the tier is still opening then, each RAM entry is reported ``cold tier not open``.
4. With ``freeze`` (``kvtrio serve``, which owns its process), Python's automatic
   collections stay paused from the open's start to its end, and the objects the open
   made (the index: a few per entry) are frozen (``gc.freeze``) before they resume. The
   open leaves the collector's full pass due, and that pass would traverse every entry's
   objects on whichever thread allocates next: 112 ms at 100,000 entries against 0.4 ms
   once frozen (``docs/gc13/full_pass.py``; docs/bench/scale.md, thirteenth session), a
   stall of the generation thread and of the tier's loop alike. Frozen objects are still
   freed by their reference counts when an entry leaves; only a reference cycle among
   them would never be collected (the tier breaks its own).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtrio.actors.collector import collector_paused
from kvtrio.serve.adapter import TieredLRUPromptCache
from kvtrio.serve.flushreport import FlushedEntry, HandOver
from kvtrio.serve.savetrace import SaveTrace

if TYPE_CHECKING:
    from kvtrio.serve.bridge import TierOptions, TierThread

__all__ = ["OPEN_DEFER", "ColdOpening", "ServeCache", "open_now"]

logger = logging.getLogger(__name__)

#: Seconds after the first answer by which the cold tier's open starts even if requests
#: keep the generation thread busy (it starts as soon as none is in flight; rule 1).
OPEN_DEFER = 2.0


def open_now(
    *, request_taken: bool, in_flight: int, now: float, first_answer: float | None
) -> bool:
    """Rule 1: whether the generation thread starts the cold tier's open now (the model has
    loaded): it has taken no request this time and none is in flight (arrived and not yet
    answered), or ``OPEN_DEFER`` seconds have passed since the server's first answer
    (``first_answer``, None before it). Never while the first request is in flight, however
    long its prefill: the open's imports and index would share the GIL and the CPU with it
    (on a CPU-bound prefill the deadline, once counted from the model's load, fell inside
    the first request and its answer paid for the open)."""
    if not request_taken and in_flight == 0:
        return True
    return first_answer is not None and now > first_answer + OPEN_DEFER


class ColdOpening:
    """The tier, opening on its own thread (rule 1). ``make_options`` runs there too."""

    def __init__(self, make_options: Callable[[], TierOptions], *, freeze: bool = False) -> None:
        self.make_options = make_options
        self.freeze = freeze  # rule 4
        self.tier: TierThread | None = None
        self.failure: BaseException | None = None
        self.seconds: float | None = None  # how long the open took, once done
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._open, name="kvtrio-open", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        self._thread.start()

    def _open(self) -> None:
        started = time.perf_counter()
        # Rule 4: no automatic collection until the index is frozen (as the start's imports).
        paused = collector_paused() if self.freeze else contextlib.nullcontext()
        try:
            with paused:
                from kvtrio.serve.bridge import TierThread

                tier = TierThread(self.make_options())
                tier.start()
                if self.freeze:
                    gc.freeze()
            self.tier = tier
        except BaseException as exc:  # reported by whoever waits (kvtrio serve stops)
            self.failure = exc
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()


class ServeCache(TieredLRUPromptCache):
    """The adapter over a tier that is still opening (rules 2 and 3)."""

    def __init__(
        self,
        max_size: int,
        max_bytes: int,
        *,
        opening: ColdOpening,
        tier_model: Any,
        load_timeout: float,
        load_in_lookup: bool = True,
        save_trace: SaveTrace | None = None,
    ) -> None:
        super().__init__(
            max_size,
            max_bytes,
            tier=None,
            tier_model=tier_model,
            load_timeout=load_timeout,
            load_in_lookup=load_in_lookup,
            save_trace=save_trace,
        )
        self.opening = opening
        # Runs on the generation thread when it takes the tier (kvtrio serve wires wakes).
        self.on_attach: Callable[[TierThread], object] | None = None

    @property
    def lookups_before_open(self) -> int:
        """Lookups of the tier's model answered by RAM alone: the tier was not open."""
        return self._counts.get("cold_opening", 0) + self._counts.get("cold_failed", 0)

    @property
    def cold_ready(self) -> bool:
        return self.tier is not None

    def attach(self) -> bool:
        """Generation thread: take the tier if its open has ended (rule 2); whether it is
        taken now."""
        if self.tier is not None:
            return True
        if not self.opening.done.is_set() or self.opening.tier is None:
            return False
        tier = self.opening.tier
        tier.bind()
        self.tier = tier
        if self.on_attach is not None:
            self.on_attach(tier)
        self._spill_evicted()  # what RAM evicted while the tier opened
        return True

    def pump(self, budget: float | None = None) -> int:
        self.attach()
        return super().pump(budget)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        if not self.attach() and model == self.tier_model:
            self._count("cold_failed" if self.opening.done.is_set() else "cold_opening")
        return super().fetch_nearest_cache(model, tokens)

    def _spill_evicted(self) -> None:
        # Take the tier first: an open that ended since the last pump or lookup must not
        # find these entries with no tier to hand them to (they would be lost).
        if not self.attach() and not self.opening.done.is_set():
            return  # held in the trie's list until the tier is there (rule 2)
        super()._spill_evicted()

    def close(self, *, timeout: float | None = None) -> bool:
        """Rule 3; the open's wait and the writes share the one ``timeout``."""
        due = None if timeout is None else time.monotonic() + timeout
        if self.tier is None and self.opening.started:
            self.opening.done.wait(timeout)
            self.attach()
        left = None if due is None else max(0.0, due - time.monotonic())
        closed = super().close(timeout=left)
        if self.tier is None:  # still opening: RAM's entries stay held, and are reported
            for model, tokens, _ in self._trie.evicted:
                if model == self.tier_model and tokens:
                    self._flushed.append(FlushedEntry(len(tokens), why=HandOver.TIER_NOT_OPEN))
        return closed

    def metrics_text(self) -> str:
        from kvtrio.actors.metrics import MetricFamily, render

        count = self._counts.get
        families = [
            MetricFamily(
                "kvtrio_serve_cold_ready",
                "gauge",
                "1 once kvtrio serve's cold tier is open (its index built), else 0.",
                (("", (), int(self.cold_ready)),),
            ),
            MetricFamily(
                "kvtrio_serve_cold_unavailable_total",
                "counter",
                "Lookups answered by RAM alone because the cold tier was not open, by reason.",
                tuple(
                    ("", (("reason", reason),), count(f"cold_{reason}", 0))
                    for reason in ("opening", "failed")
                ),
            ),
        ]
        return render(families) + super().metrics_text()
