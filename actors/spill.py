"""Spill: a serial write-behind queue of snapshots under a byte cap.

Theory of operation (docs/design.md invariant 3, the seed's SpillQueue)
------------------------------------------------------------------
Items are immutable snapshots that pin memory until they are stored. The queue
keeps these rules, and :class:`SpillQueue` is the one place that keeps them:

1. Byte cap, soft for the newest item: after an enqueue, queued bytes exceed
   ``cap_bytes`` only if no other item can be shed; the item being enqueued is
   never its own victim (one oversized item may exceed the cap alone rather
   than never being stored).
2. Shedding drops the OLDEST item that is droppable (``can_drop``) and not in
   flight. An in-flight item is never dropped; a ``can_drop`` false item
   (a barrier) survives every shedding.
3. Stores happen strictly in enqueue order, one at a time. A failed store
   settles its ticket FAILED and the queue goes on with the next item (the
   cold tier is best effort).
4. ``cancel_where(pred)`` cancels matching queued items but spares the one in
   flight. A submission with ``supersede=True`` first cancels the queued (not
   in flight) items of the same key: a newer checkpoint of a conversation
   makes its older queued checkpoints worthless.
5. Every item settles exactly once, WRITTEN, DROPPED, CANCELLED or
   FAILED(error), and is released (``release(item)``) exactly once at that
   moment, on every path, shutdown included (invariant 2).

:class:`SpillQueue` is the pure state machine (synchronous, no I/O, no clock);
:class:`Spill` drives it on trio: it runs the stores in one task, offers
``drain`` / ``close`` / ``abort``, and hands out tickets to await. The store task is
either ``Spill.run`` in any nursery, or a :class:`SpillActor` under an
:class:`~kvtrio.runtime.system.ActorSystem`: each submission tells the actor a
:class:`Kick`, and its handler stores until the queue is empty, so the system's phased
shutdown drains the spill like any other actor.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import attrs
import trio
from kvtrio.errors import ActorStopped, ShuttingDown
from kvtrio.runtime.actor import Actor, ActorRef

__all__ = [
    "Kick",
    "Spill",
    "SpillActor",
    "SpillOutcome",
    "SpillQueue",
    "SpillResult",
    "SpillStatistics",
    "SpillTicket",
]

T = TypeVar("T")


class SpillOutcome(enum.Enum):
    """How a queued item settled."""

    WRITTEN = "written"
    DROPPED = "dropped"  # shed by the byte cap
    CANCELLED = "cancelled"  # cancel_where, supersession, abort or shutdown
    FAILED = "failed"  # the store raised; ``SpillResult.error`` says why


@attrs.frozen
class SpillResult:
    """A settled ticket: the outcome, the store's error when it FAILED, and what the store
    returned when it was WRITTEN."""

    outcome: SpillOutcome
    error: BaseException | None = None
    value: object = None


@attrs.define(eq=False)
class SpillTicket(Generic[T]):
    """One submission: the item, its byte size, and (once settled) its result."""

    item: T
    key: Hashable | None
    nbytes: int
    droppable: bool
    seq: int
    _result: SpillResult | None = None
    _settled: trio.Event = attrs.field(factory=trio.Event)

    @property
    def result(self) -> SpillResult | None:
        """The result, or None while the item is queued or in flight."""
        return self._result

    @property
    def outcome(self) -> SpillOutcome | None:
        return None if self._result is None else self._result.outcome

    @property
    def settled(self) -> bool:
        return self._result is not None

    async def wait(self) -> SpillResult:
        """Wait until the item settles; return its result."""
        await self._settled.wait()
        assert self._result is not None
        return self._result


@attrs.frozen
class SpillStatistics:
    """A point-in-time view of a spill queue."""

    pending_items: int  # queued, in flight included
    pending_bytes: int
    high_water_bytes: int  # the most pending bytes ever seen
    in_flight: bool
    cap_bytes: float
    written: int
    dropped: int
    cancelled: int
    failed: int


@attrs.define(eq=False)
class SpillQueue(Generic[T]):
    """The pure state machine of the rules above; callers drive ``start_next``/``finish``."""

    cap_bytes: float
    release: Callable[[T], None]
    _queue: deque[SpillTicket[T]] = attrs.field(factory=deque, init=False)
    _in_flight: SpillTicket[T] | None = attrs.field(default=None, init=False)
    _pending_bytes: int = attrs.field(default=0, init=False)
    _high_water: int = attrs.field(default=0, init=False)
    _next_seq: int = attrs.field(default=0, init=False)
    _counts: dict[SpillOutcome, int] = attrs.field(
        factory=lambda: dict.fromkeys(SpillOutcome, 0), init=False
    )

    def enqueue(
        self,
        item: T,
        *,
        nbytes: int,
        key: Hashable | None = None,
        droppable: bool = True,
        supersede: bool = False,
    ) -> SpillTicket[T]:
        """Queue ``item`` (rules 1, 2 and 4); return its ticket (maybe already settled)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        ticket = SpillTicket(item, key, nbytes, droppable, self._next_seq)
        self._next_seq += 1
        if supersede and key is not None:
            self.cancel_where(lambda t: t.key == key)
        self._queue.append(ticket)
        self._pending_bytes += nbytes
        self._high_water = max(self._high_water, self._pending_bytes)
        while self._pending_bytes > self.cap_bytes:
            victim = next(
                (
                    t
                    for t in self._queue
                    if t is not ticket and t is not self._in_flight and t.droppable
                ),
                None,
            )
            if victim is None:
                break  # only the newest, the in-flight item and barriers remain: soft cap
            self._settle(victim, SpillResult(SpillOutcome.DROPPED))
        return ticket

    def cancel_where(self, pred: Callable[[SpillTicket[T]], bool]) -> int:
        """Cancel the queued items ``pred`` matches, sparing the one in flight; return how many."""
        victims = [t for t in self._queue if t is not self._in_flight and pred(t)]
        for ticket in victims:
            self._settle(ticket, SpillResult(SpillOutcome.CANCELLED))
        return len(victims)

    def start_next(self) -> SpillTicket[T] | None:
        """Mark the oldest queued item in flight and return it (None when idle or busy)."""
        if self._in_flight is not None or not self._queue:
            return None
        self._in_flight = self._queue[0]
        return self._in_flight

    def finish(self, ticket: SpillTicket[T], result: SpillResult) -> None:
        """Settle the in-flight item with the store's result."""
        if ticket is not self._in_flight:
            raise RuntimeError("finish() of an item that is not in flight")
        self._in_flight = None
        self._settle(ticket, result)

    def cancel_all(self) -> int:
        """Cancel every item, the in-flight one included (shutdown after its store stopped)."""
        victims = list(self._queue)
        self._in_flight = None
        for ticket in victims:
            self._settle(ticket, SpillResult(SpillOutcome.CANCELLED))
        return len(victims)

    def pending(self) -> list[SpillTicket[T]]:
        """The unsettled tickets in enqueue order (the in-flight one first, if any)."""
        return list(self._queue)

    @property
    def in_flight(self) -> SpillTicket[T] | None:
        return self._in_flight

    def statistics(self) -> SpillStatistics:
        return SpillStatistics(
            pending_items=len(self._queue),
            pending_bytes=self._pending_bytes,
            high_water_bytes=self._high_water,
            in_flight=self._in_flight is not None,
            cap_bytes=self.cap_bytes,
            written=self._counts[SpillOutcome.WRITTEN],
            dropped=self._counts[SpillOutcome.DROPPED],
            cancelled=self._counts[SpillOutcome.CANCELLED],
            failed=self._counts[SpillOutcome.FAILED],
        )

    def _settle(self, ticket: SpillTicket[T], result: SpillResult) -> None:
        # Rule 5: the one place a ticket settles, so the release happens exactly once.
        self._queue.remove(ticket)
        self._pending_bytes -= ticket.nbytes
        self._counts[result.outcome] += 1
        ticket._result = result
        try:
            self.release(ticket.item)
        finally:
            ticket._settled.set()


Store = Callable[[T], Awaitable[object]]


@attrs.define(eq=False)
class Spill(Generic[T]):
    """A :class:`SpillQueue` driven on trio: one task stores items in order.

    Run it with ``await spill.run()`` in a nursery (``nursery.start(spill.run)``);
    ``submit_nowait`` is synchronous (it never blocks: shedding, not backpressure,
    bounds memory). Cancelling ``run`` cancels the store in flight and cancels
    every queued item, so nothing stays unreleased.
    """

    store: Store[T]
    release: Callable[[T], None]
    cap_bytes: float = math.inf
    bytes_of: Callable[[T], int] | None = None
    can_drop: Callable[[T], bool] | None = None
    _queue: SpillQueue[T] = attrs.field(init=False)
    _wakeup: trio.Event = attrs.field(factory=trio.Event, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _running: bool = attrs.field(default=False, init=False)
    _stopped: bool = attrs.field(default=False, init=False)
    _cancel_in_flight: trio.CancelScope | None = attrs.field(default=None, init=False)
    _actor: ActorRef[Kick] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self._queue = SpillQueue(self.cap_bytes, self.release)

    def submit_nowait(
        self,
        item: T,
        *,
        key: Hashable | None = None,
        nbytes: int | None = None,
        droppable: bool | None = None,
        supersede: bool = False,
    ) -> SpillTicket[T]:
        """Queue ``item``; return its ticket. Raises ShuttingDown after ``close``.

        ``nbytes`` defaults to ``bytes_of(item)`` (0 without one); ``droppable`` to
        ``can_drop(item)`` (True without one). If intake is closed the item is
        released before ShuttingDown is raised: the caller gave its ownership away.
        """
        if self._closed or self._stopped:
            self.release(item)
            raise ShuttingDown("spill queue is closed")
        if nbytes is None:
            nbytes = self.bytes_of(item) if self.bytes_of is not None else 0
        if droppable is None:
            droppable = self.can_drop(item) if self.can_drop is not None else True
        ticket = self._queue.enqueue(
            item, nbytes=nbytes, key=key, droppable=droppable, supersede=supersede
        )
        self._wake()
        return ticket

    def _wake(self) -> None:
        self._wakeup.set()
        if self._actor is not None:
            try:
                self._actor.tell_nowait(KICK)
            except trio.WouldBlock:
                pass  # a kick is already waiting: its handler stores everything queued
            except (ShuttingDown, ActorStopped):
                pass  # the actor is draining or gone; stop() settles whatever it leaves

    def cancel_where(self, pred: Callable[[SpillTicket[T]], bool]) -> int:
        """Cancel matching queued items, sparing the one in flight; return how many."""
        return self._queue.cancel_where(pred)

    async def drain(self) -> None:
        """Wait until everything submitted before this call has settled."""
        for ticket in self._queue.pending():
            await ticket.wait()
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """Stop intake: later submissions raise ShuttingDown; queued items still get stored."""
        self._closed = True
        self._wakeup.set()

    def abort(self) -> None:
        """Cancel every queued item and the store in flight (it stops at its next boundary)."""
        self._closed = True
        self._queue.cancel_where(lambda t: True)
        if self._cancel_in_flight is not None:
            self._cancel_in_flight.cancel()

    def pending(self) -> list[SpillTicket[T]]:
        return self._queue.pending()

    def statistics(self) -> SpillStatistics:
        return self._queue.statistics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Store items in order until closed and empty (or cancelled)."""
        if self._running or self._actor is not None:
            raise RuntimeError("this spill already has a store task")
        self._running = True
        task_status.started()
        try:
            while True:
                await self.store_pending()
                if self._closed:
                    return
                self._wakeup = trio.Event()
                if not self._queue.pending():
                    await self._wakeup.wait()
        finally:
            self.stop()

    async def store_pending(self) -> None:
        """Store queued items, in order, until none is left."""
        while (ticket := self._queue.start_next()) is not None:
            await self._store_one(ticket)

    def stop(self) -> None:
        """The store task is gone: refuse new items, cancel (and release) every one left,
        the in-flight one included. Idempotent."""
        self._stopped = True
        self._queue.cancel_all()

    def attach(self, ref: ActorRef[Kick]) -> None:
        """Let the :class:`SpillActor` behind ``ref`` be the store task."""
        if self._running or self._actor is not None:
            raise RuntimeError("this spill already has a store task")
        self._actor = ref
        if self._queue.pending():
            self._wake()

    async def _store_one(self, ticket: SpillTicket[T]) -> None:
        result: SpillResult
        with trio.CancelScope() as scope:
            self._cancel_in_flight = scope
            try:
                value = await self.store(ticket.item)
            except Exception as exc:
                result = SpillResult(SpillOutcome.FAILED, exc)
            else:
                result = SpillResult(SpillOutcome.WRITTEN, value=value)
            finally:
                self._cancel_in_flight = None
        if scope.cancelled_caught or (
            scope.cancel_called and result.outcome is not SpillOutcome.WRITTEN
        ):
            result = SpillResult(SpillOutcome.CANCELLED)
        self._queue.finish(ticket, result)
        await trio.lowlevel.checkpoint()


@attrs.frozen
class Kick:
    """Tells a :class:`SpillActor` that items are queued."""


KICK = Kick()


class SpillActor(Actor[Kick], Generic[T]):
    """Hosts a :class:`Spill`'s store task under an ActorSystem (spawn it, then
    ``spill.attach(ref)``). Cancelling the actor settles nothing by itself: whoever owns the
    spill calls ``spill.stop()`` once the system is done, releasing what is left."""

    def __init__(self, spill: Spill[T]) -> None:
        self.spill = spill

    async def handle(self, msg: Kick) -> None:
        await self.spill.store_pending()
