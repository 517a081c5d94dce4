"""TierThread: a tiered cache's trio loop on a background thread, owned by a threaded server.

mlx-lm's server is threaded: its generation thread makes every MLX call and calls the
prompt cache synchronously. kvtrio's tier is async (trio actors, worker threads for I/O).
This module joins them, keeping docs/design.md invariant 8: the generation thread is the
tier's MLX owner, and no other thread makes an MLX call.

Theory of operation:

1. :meth:`TierThread.start` starts a thread running ``trio.run``: it opens the cold tier
   (:func:`~kvtrio.actors.tiered.open_tiered_cache`, the index rebuilt from disk) with an
   :class:`~kvtrio.actors.owner.MlxOwner` over an
   :class:`~kvtrio.runtime.external.ExternalThreadExecutor`: the tier's MLX jobs
   (snapshots, materialize, allocation and adoption of loads) are queued for the server's
   generation thread, which runs them when it pumps (:meth:`pump`) or waits
   (:meth:`call`). No MLX call is made on the tier's thread or its workers.
2. :meth:`submit` hands a coroutine to the loop and returns at once (a save: the
   generation thread never waits for the disk). Its failure is logged and counted; the
   cold tier is best effort. Once the loop is closing it refuses (returns False).
3. :meth:`call` runs a coroutine on the loop and waits for its result, running owner jobs
   meanwhile (a cold load needs them). Given ``timeout``, it cancels the coroutine when it
   runs out and raises :class:`TimeoutError`; the caller then treats the lookup as a miss.
   :meth:`peek` runs a plain function on the loop the same way.
5. :meth:`lookup` answers what the cold index holds for a prompt on the calling thread,
   with no round trip to the loop: the index takes a lock of its own
   (:class:`~kvtrio.actors.prefix.PrefixIndex`, rule 4), held for one lookup's hashes
   or one entry's add or remove, so the generation thread never waits for the loop's
   other work (a save's Python steps, the writer) to answer a lookup.
4. :meth:`close` (generation thread) stops the loop: the tier writes what it holds within
   its shutdown grace (owner jobs pumped here meanwhile) and the thread ends. A close that
   outlives ``timeout`` gives up: the thread is a daemon, and a write in flight leaves at
   worst a tmp file, which the next open removes.
6. :meth:`set_foreground` tells the tier when the server decodes: its write-backs then
   wait to start, for up to ``TierOptions.write_defer`` seconds
   (:mod:`kvtrio.actors.writegate`), so evicted entries are written between bursts of
   decoding rather than during them; at close nothing waits.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, TypeVarTuple

import attrs
import trio
from kvtrio.actors.callerchecks import DEFAULT_MIN_REUSE_TOKENS
from kvtrio.actors.coldside import DEFAULT_PENDING_BYTES
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.policy import AdmissionPolicy, PolicyKind
from kvtrio.actors.prefix import DEFAULT_BLOCK_SIZE, ModelKey, PrefixMatch
from kvtrio.actors.tiered import TieredPromptCache, WritePolicy, open_tiered_cache
from kvtrio.actors.writegate import DEFAULT_WRITE_DEFER
from kvtrio.errors import ShuttingDown
from kvtrio.runtime.external import ExternalThreadExecutor, Reply
from kvtrio.storage.options import IoOptions

__all__ = ["TierOptions", "TierThread"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@attrs.frozen
class TierOptions:
    """Where the cold tier lives and how it behaves."""

    directory: str  # a directory, or a redis:// URL (the shared tier)
    model: ModelKey
    cold_budget: int = 8 << 30
    block_size: int = DEFAULT_BLOCK_SIZE
    shutdown_grace: float = 10.0
    policy: WritePolicy = WritePolicy.WRITE_BACK
    # Cold matches reusing fewer tokens are not loaded (slower than recomputing them).
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS
    eviction: PolicyKind = PolicyKind.COST
    admission: AdmissionPolicy | None = None  # None: default_admission()
    # Seconds a write-back waits to start while the server decodes (set_foreground).
    write_defer: float = DEFAULT_WRITE_DEFER
    # Byte cap of the write-backs waiting for the writer (RAM evictions; at shutdown
    # every RAM entry is written whatever it says).
    pending_budget: int = DEFAULT_PENDING_BYTES
    # Reads one disk load runs at once (IoOptions.load_streams; None: the tier's default).
    load_streams: int | None = None


class TierThread:
    """The tier's trio loop on its own thread (see the module doc)."""

    def __init__(self, options: TierOptions) -> None:
        self.options = options
        self.executor = ExternalThreadExecutor(name="mlx-generation")
        self.cache: TieredPromptCache | None = None
        self.submit_failures = 0
        self._thread = threading.Thread(target=self._main, name="kvtrio-tier", daemon=True)
        self._ready = threading.Event()
        self._done: Reply[None] = Reply()
        self._failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._closed = False
        self._foreground = False

    # -- lifecycle (the owner thread) --------------------------------------------------

    def start(self, *, timeout: float = 60.0) -> None:
        """Start the loop and open the tier (the index rebuilt from disk); the calling
        thread is the owner until :meth:`bind` names another."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the cold tier did not open within {timeout:g}s")
        if self._failure is not None:
            raise self._failure

    def bind(self) -> None:
        """Make the calling thread (the generation thread) the MLX owner."""
        self.executor.bind()

    def close(self, *, timeout: float | None = None) -> bool:
        """Stop the loop, writing what the tier holds; True when it ended in time."""
        if self._closed or self._token is None:
            return True
        self._closed = True
        stop = self._stop
        assert stop is not None
        try:
            self._token.run_sync_soon(stop.set)
        except trio.RunFinishedError:
            return True
        ended = self.executor.wait(self._done, timeout=timeout)
        if not ended:
            self._done.abandoned = True
            logger.warning("kvtrio: the cold tier did not close within %ss", timeout)
            return False
        self._thread.join()
        return True

    @property
    def alive(self) -> bool:
        return self._token is not None and not self._closed

    # -- calls (the owner thread) ------------------------------------------------------

    def pump(self, budget: float = 0.005) -> int:
        """Run the tier's queued MLX jobs for up to ``budget`` seconds (owner thread)."""
        return self.executor.pump(budget)

    def set_foreground(self, busy: bool) -> None:
        """The server decodes (``busy``) or not (rule 6); only a change reaches the loop.
        Any one thread (the generation thread)."""
        token, cache = self._token, self.cache
        if busy == self._foreground or not self.alive or token is None or cache is None:
            return
        self._foreground = busy
        try:
            token.run_sync_soon(
                functools.partial(cache.set_foreground, busy, defer=self.options.write_defer)
            )
        except trio.RunFinishedError:
            pass

    def pending(self) -> bool:
        """Whether MLX jobs of the tier wait for the owner (cheap; any thread)."""
        return self.executor.pending()

    def submit(self, fn: Callable[[*Ts], Awaitable[object]], *args: *Ts) -> bool:
        """Run ``fn(*args)`` on the loop; return at once (rule 2). False (and nothing
        runs) once the loop is closing or gone."""
        nursery, token = self._nursery, self._token
        if not self.alive or nursery is None or token is None:
            return False

        async def run() -> None:
            try:
                await fn(*args)
            except Exception:
                self.submit_failures += 1
                logger.exception("kvtrio: a cold-tier task failed")

        try:
            token.run_sync_soon(nursery.start_soon, run)
        except trio.RunFinishedError:
            return False
        return True

    def call(
        self,
        fn: Callable[[*Ts], Awaitable[T]],
        *args: *Ts,
        timeout: float | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the loop and return its result, pumping owner jobs while
        waiting (rule 3)."""
        if not self.alive:
            raise ShuttingDown("the cold tier is closed")
        nursery, token = self._nursery, self._token
        assert nursery is not None and token is not None
        reply: Reply[T] = Reply()
        scope = trio.CancelScope()

        async def run() -> None:
            try:
                with scope:
                    value = await fn(*args)
                    self.executor.post(reply, value)
                    return
                self.executor.post(reply, error=TimeoutError("cancelled"))
            except BaseException as exc:
                self.executor.post(reply, error=exc)
                if not isinstance(exc, Exception):
                    raise

        try:
            token.run_sync_soon(nursery.start_soon, run)
        except trio.RunFinishedError:
            raise ShuttingDown("the cold tier is closed") from None
        if not self.executor.wait(reply, timeout=timeout):
            reply.abandoned = True
            token.run_sync_soon(scope.cancel)
            raise TimeoutError(f"the cold tier did not answer within {timeout:g}s")
        return reply.unwrap()

    def peek(self, fn: Callable[[*Ts], T], *args: *Ts, timeout: float = 5.0) -> T:
        """Run the plain function ``fn(*args)`` on the loop's thread and return its result
        (TimeoutError after ``timeout`` seconds: the loop is gone or stuck)."""
        if not self.alive:
            raise ShuttingDown("the cold tier is closed")
        token = self._token
        assert token is not None
        reply: Reply[T] = Reply()

        def run() -> None:
            try:
                self.executor.post(reply, fn(*args))
            except Exception as exc:
                self.executor.post(reply, error=exc)

        try:
            token.run_sync_soon(run)
        except trio.RunFinishedError:
            raise ShuttingDown("the cold tier is closed") from None
        if not self.executor.wait(reply, timeout=timeout):
            reply.abandoned = True
            raise TimeoutError(f"the cold tier did not answer within {timeout:g}s")
        return reply.unwrap()

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch | None:
        """What the cold tier would reuse for ``tokens`` (its index alone, loading
        nothing), read on the calling thread without waiting for the loop (rule 5).
        ShuttingDown once the loop is closed or gone."""
        cache = self.cache
        if not self.alive or cache is None:
            raise ShuttingDown("the cold tier is closed")
        return cache.peek(tokens)

    def read(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run the plain function ``fn(*args)`` on the loop's thread and return its result,
        from any thread but the owner's and the loop's (an HTTP handler reading the
        statistics; the exit lines, after a close that gave up while the loop still runs):
        it waits for the loop, pumping nothing. ShuttingDown once the loop is gone."""
        token = self._token
        if token is None:
            raise ShuttingDown("the cold tier is closed")
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            raise ShuttingDown("the cold tier is closed") from None

    # -- the loop's thread -------------------------------------------------------------

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:
            if not self._ready.is_set():
                self._failure = exc
            else:
                logger.exception("kvtrio: the cold tier's loop failed")
        finally:
            self._ready.set()
            self.executor.close()
            # Nobody waits for it unless close() does: a loop that died on its own.
            self._done.abandoned = not self._closed
            self.executor.post(self._done)

    async def _run(self) -> None:
        options = self.options
        owner = MlxOwner.external(self.executor)
        async with open_tiered_cache(
            options.directory,
            options.model,
            owner=owner,
            hot_budget=0,
            cold_budget=options.cold_budget,
            policy=options.policy,
            block_size=options.block_size,
            shutdown_grace=options.shutdown_grace,
            min_reuse_tokens=options.min_reuse_tokens,
            eviction=options.eviction,
            admission=options.admission,
            pending_budget=options.pending_budget,
            options=IoOptions(load_streams=options.load_streams),
        ) as cache:
            async with trio.open_nursery() as nursery:
                self.cache = cache
                self._nursery = nursery
                self._stop = trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
