"""The actor system: spawns actors into one nursery, supervises them, and shuts them down.

Theory of operation (shutdown, after Akka's CoordinatedShutdown; all phases share one
deadline, ``grace`` seconds after ``shutdown`` is called):

1. Stop intake. ``spawn`` and every tell/ask from outside the system's actors raise
   :class:`~kvtrio.errors.ShuttingDown` (messages between actors still flow, see
   :mod:`kvtrio.runtime.actor` rule 3).
2. Drain and stop, in reverse start order, one actor at a time: close the mailbox's send
   side (blocked and later senders get ShuttingDown), let the actor handle every message
   it had accepted until the channel reports the end, run its ``on_stop``. Closing the
   *receive* side instead would silently discard buffered messages, so it is never done
   before the drain. An actor spawned with ``stop_timeout`` is cancelled when that runs out
   (never later than the deadline), and the next actor's turn begins.
3. At the deadline, cancel every actor still running; messages they had accepted but not
   handled are counted as dropped and their replies fail with ShuttingDown.

Leaving ``async with ActorSystem()`` normally runs ``shutdown()`` with the system's default
grace; leaving it with an exception cancels everything at once, as a nursery does.

``on_stop`` runs once for every actor instance whose ``on_start`` returned, whichever way
it stops: after its drain; after a crash (before the restart's backoff, or before the crash
escalates); when it is cancelled (at a deadline, by :meth:`ActorSystem.cancel`, or because a
sibling escalated). Off the drain path it runs shielded from the cancellation but for at
most ``on_stop_timeout`` seconds, and an error it raises is traced (``stop_failed``) and
dropped: the crash or cancellation already decides what happens next.

Supervision (see :mod:`kvtrio.runtime.supervision`): a crash under :class:`Escalate`
stops the actor (its queued replies fail with ActorCrashed) and raises
:class:`~kvtrio.errors.ActorCrashed` into the system's nursery, cancelling the rest.
Under :class:`Restart` the actor's mailbox is kept and a fresh instance (when ``spawn`` got
a factory) or the same one restarts after the backoff, until the intensity limit is hit.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio
from kvtrio.errors import ActorCrashed, KvtrioError, ShuttingDown
from kvtrio.runtime.actor import (
    CURRENT_SYSTEM,
    Actor,
    ActorRef,
    ActorState,
    ActorStatistics,
    Intake,
    Mailbox,
    replies_in,
)
from kvtrio.runtime.supervision import ESCALATE, Restart, RestartTracker, Supervision

__all__ = ["ActorSystem", "SystemStatistics", "Tracer"]

M = TypeVar("M")

# Messages an actor may handle from a non-empty mailbox before it must checkpoint.
_NOWAIT_BUDGET = 16


class Tracer(Protocol):
    """Receives one call per actor event; :class:`kvtrio.runtime.testing.Trace` is one."""

    def record(self, actor: str, event: str, message: object) -> None: ...


@attrs.frozen
class SystemStatistics:
    """A snapshot of the system: its phase and each actor's statistics, in start order."""

    accepting: bool
    shutting_down: bool
    actors: tuple[ActorStatistics, ...]


@attrs.define(eq=False)
class _Cell(Generic[M]):
    """What the system keeps per actor."""

    mailbox: Mailbox[M]
    ref: ActorRef[M]
    make_actor: Callable[[], Actor[M]]
    tracker: RestartTracker | None
    stop_timeout: float | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    stopped: trio.Event = attrs.field(factory=trio.Event)
    current: object = None  # the message being handled, if any


class ActorSystem:
    """Runs actors in one nursery: ``async with ActorSystem() as system:``.

    ``grace`` is the default shutdown deadline in seconds; ``seed`` seeds the backoff
    jitter (for exact tests); ``trace`` receives every actor event. ``on_stop_timeout``
    bounds an ``on_stop`` that runs after a crash or a cancellation (it is shielded from
    the cancellation, so without a bound a hanging one would hang shutdown).
    """

    def __init__(
        self,
        *,
        name: str = "kvtrio",
        grace: float = 5.0,
        seed: int | None = None,
        trace: Tracer | None = None,
        on_stop_timeout: float = 1.0,
    ) -> None:
        self.name = name
        self.grace = grace
        self.on_stop_timeout = on_stop_timeout
        self.random = random.Random(seed)
        self.trace = trace
        self._intake = Intake(owner=self)
        self._cells: dict[str, _Cell[Any]] = {}
        self._nursery: trio.Nursery | None = None
        self._shutdown_started = False
        self._stopped = trio.Event()
        self._context: Any = None

    # -- entering and leaving ----------------------------------------------------------------

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[ActorSystem]:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield self
            except BaseException:
                self.cancel()
                raise
            await self.shutdown()

    async def __aenter__(self) -> ActorSystem:
        if self._context is not None:
            raise RuntimeError(f"actor system {self.name!r} was already entered")
        self._context = self._running()
        system: ActorSystem = await self._context.__aenter__()
        return system

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        result: bool | None = await self._context.__aexit__(exc_type, exc, tb)
        return result

    # -- spawning ----------------------------------------------------------------------------

    async def spawn(
        self,
        actor: Actor[M] | Callable[[], Actor[M]],
        *,
        name: str,
        mailbox_size: int = 64,
        supervision: Supervision = ESCALATE,
        stop_timeout: float | None = None,
    ) -> ActorRef[M]:
        """Start an actor and return its reference once its ``on_start`` has returned.

        Pass a zero-argument factory instead of an instance to get a fresh instance on each
        supervised restart. ``stop_timeout`` bounds this actor's own drain during shutdown
        (within the shutdown's deadline), so one slow actor cannot use up everyone's grace.
        Raises ShuttingDown once shutdown began, and ActorCrashed (with the cause) if the
        first ``on_start`` raises.
        """
        if self._nursery is None:
            raise RuntimeError(f"actor system {self.name!r} is not running (use async with)")
        if not self._intake.open:
            raise ShuttingDown(f"actor system {self.name!r} is shutting down: cannot spawn")
        if name in self._cells:
            raise ValueError(f"an actor named {name!r} already exists")
        if mailbox_size < 1:
            raise ValueError(f"mailbox_size must be at least 1, not {mailbox_size}")
        make_actor = (lambda: actor) if isinstance(actor, Actor) else actor
        mailbox: Mailbox[M] = Mailbox.create(name, mailbox_size, self._intake)
        tracker = (
            RestartTracker(supervision, self.random) if isinstance(supervision, Restart) else None
        )
        cell = _Cell(
            mailbox=mailbox,
            ref=ActorRef(mailbox),
            make_actor=make_actor,
            tracker=tracker,
            stop_timeout=stop_timeout,
        )
        self._cells[name] = cell
        await self._nursery.start(self._run, cell)
        return cell.ref

    def lookup(self, name: str) -> ActorRef[Any]:
        """The reference of the actor spawned under ``name`` (KeyError if none)."""
        return self._cells[name].ref

    # -- one actor's life --------------------------------------------------------------------

    async def _run(self, cell: _Cell[M], *, task_status: trio.TaskStatus[None]) -> None:
        CURRENT_SYSTEM.set(self)
        mailbox = cell.mailbox
        leftover_error: KvtrioError = ShuttingDown(
            f"actor {mailbox.name!r} was cancelled before handling the message"
        )
        try:
            with cell.scope:
                await self._live(cell, task_status)
        except ActorCrashed as crash:
            leftover_error = crash
            raise
        finally:
            self._retire(cell, leftover_error)

    async def _live(self, cell: _Cell[M], task_status: trio.TaskStatus[None]) -> None:
        mailbox = cell.mailbox
        started = False
        while True:
            actor = cell.make_actor()
            actor.ref, actor.name, actor.system = cell.ref, mailbox.name, self
            # on_stop runs once per instance whose on_start returned, on every path out.
            needs_stop = False
            try:
                await actor.on_start()
                needs_stop = True
                mailbox.state = ActorState.DRAINING if mailbox.closed else ActorState.RUNNING
                if not started:
                    started = True
                    task_status.started()
                await self._handle_until_closed(cell, actor)
                needs_stop = False
                await actor.on_stop()
                return
            except Exception as exc:
                try:
                    delay = self._on_crash(cell, exc, first_start=not started)
                finally:
                    if needs_stop:
                        await self._final_on_stop(actor)
            except BaseException:
                if needs_stop:  # cancelled: at the deadline, by cancel(), or by a sibling
                    await self._final_on_stop(actor)
                raise
            mailbox.state = ActorState.RESTARTING
            await trio.sleep(delay)
            mailbox.restarts += 1
            self._record(mailbox.name, "restarted", None)

    async def _handle_until_closed(self, cell: _Cell[M], actor: Actor[M]) -> None:
        mailbox = cell.mailbox
        receive = mailbox.receive
        handle = actor.handle
        trace = self.trace
        name = mailbox.name
        budget = _NOWAIT_BUDGET
        while True:
            # Fast path: take queued messages without a scheduler round trip, but checkpoint
            # at least every _NOWAIT_BUDGET messages so a busy actor stays cancellable and
            # fair. depth > 0 proves the buffer is not empty (senders count a message only
            # after it is in the buffer, and we count every message we took), so the nowait
            # call cannot raise WouldBlock; an empty mailbox goes straight to the wait.
            if mailbox.depth > 0:
                msg = receive.receive_nowait()
            else:
                try:
                    msg = await receive.receive()
                except trio.EndOfChannel:
                    return
                budget = _NOWAIT_BUDGET
            mailbox.depth -= 1
            cell.current = msg
            if trace is not None:
                trace.record(name, "handled", msg)
            await handle(msg)
            cell.current = None
            mailbox.processed += 1
            budget -= 1
            if not budget:
                budget = _NOWAIT_BUDGET
                await trio.lowlevel.checkpoint()

    async def _final_on_stop(self, actor: Actor[Any]) -> None:
        """Run ``on_stop`` of an instance that crashed or was cancelled: shielded from the
        cancellation, but at most ``on_stop_timeout`` seconds; an error it raises is traced
        (event ``stop_failed``) and dropped, as the crash or cancellation already wins."""
        with trio.CancelScope(
            shield=True, deadline=trio.current_time() + self.on_stop_timeout
        ) as scope:
            try:
                await actor.on_stop()
            except Exception as exc:
                self._record(actor.name, "stop_failed", exc)
        if scope.cancelled_caught:
            self._record(actor.name, "stop_timed_out", None)

    def _on_crash(self, cell: _Cell[M], exc: Exception, *, first_start: bool) -> float:
        """Count a crash, fail the reply it leaves hanging; the backoff, or raise to escalate."""
        mailbox = cell.mailbox
        mailbox.failures += 1
        crash = ActorCrashed(mailbox.name)
        crash.__cause__ = exc
        failed, cell.current = cell.current, None
        for reply in replies_in(failed):
            reply.fail(crash)
        self._record(mailbox.name, "crashed", failed)
        delay = None
        if cell.tracker is not None and not first_start:
            delay = cell.tracker.on_crash(trio.current_time())
        if delay is None:
            self._record(mailbox.name, "escalated", failed)
            raise crash from exc
        return delay

    def _retire(self, cell: _Cell[M], error: KvtrioError) -> None:
        """The actor's task is ending: refuse new messages and settle every accepted one."""
        mailbox = cell.mailbox
        if not mailbox.closed:
            mailbox.close()
        unhandled, cell.current = cell.current, None
        if unhandled is not None:
            mailbox.dropped += 1
            for reply in replies_in(unhandled):
                reply.fail(error)
        while True:
            try:
                msg = mailbox.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            mailbox.depth -= 1
            mailbox.dropped += 1
            self._record(mailbox.name, "dropped", msg)
            for reply in replies_in(msg):
                reply.fail(error)
        mailbox.receive.close()
        mailbox.state = ActorState.STOPPED
        cell.stopped.set()
        self._note_stopped()

    def _record(self, actor: str, event: str, message: object) -> None:
        if self.trace is not None:
            self.trace.record(actor, event, message)

    # -- stopping ----------------------------------------------------------------------------

    async def stop(self, ref: ActorRef[Any], *, grace: float | None = None) -> None:
        """Drain and stop one actor; later tells to it raise ActorStopped."""
        cell = self._cells[ref.name]
        deadline = trio.current_time() + (self.grace if grace is None else grace)
        await self._drain(cell, self._stop_deadline(cell, deadline))

    @staticmethod
    def _stop_deadline(cell: _Cell[Any], deadline: float) -> float:
        if cell.stop_timeout is None:
            return deadline
        return min(deadline, trio.current_time() + cell.stop_timeout)

    async def _drain(self, cell: _Cell[Any], deadline: float) -> None:
        mailbox = cell.mailbox
        if not mailbox.closed:
            if mailbox.state is ActorState.RUNNING:
                mailbox.state = ActorState.DRAINING
            mailbox.close()
        with trio.move_on_at(deadline):
            await cell.stopped.wait()
        if not cell.stopped.is_set():
            cell.scope.cancel()
            with trio.CancelScope(shield=True):
                await cell.stopped.wait()

    async def shutdown(self, *, grace: float | None = None) -> None:
        """Shut down in phases (module docstring) within ``grace`` seconds; idempotent."""
        if self._shutdown_started:
            await self._stopped.wait()
            return
        self._shutdown_started = True
        deadline = trio.current_time() + (self.grace if grace is None else grace)
        self._stop_intake()
        cells = list(self._cells.values())
        with trio.move_on_at(deadline):
            for cell in reversed(cells):
                await self._drain(cell, self._stop_deadline(cell, deadline))
        for cell in cells:
            cell.scope.cancel()
        with trio.CancelScope(shield=True):
            for cell in cells:
                await cell.stopped.wait()
        self._stopped.set()

    def request_shutdown(self, *, grace: float | None = None) -> None:
        """Start :meth:`shutdown` in the background and return at once.

        This is how an actor shuts the system down: awaiting ``shutdown`` inside a handler
        would wait for that very handler to finish.
        """
        if self._nursery is None:
            raise RuntimeError(f"actor system {self.name!r} is not running (use async with)")
        self._nursery.start_soon(self._shutdown_task, grace)

    async def _shutdown_task(self, grace: float | None) -> None:
        await self.shutdown(grace=grace)

    def cancel(self) -> None:
        """Stop intake and cancel every actor now, without draining."""
        self._shutdown_started = True
        self._stop_intake()
        for cell in self._cells.values():
            cell.scope.cancel()
        self._note_stopped()

    def _note_stopped(self) -> None:
        """Once shutdown began and every actor has stopped, wake ``wait_stopped``."""
        if self._shutdown_started and all(c.stopped.is_set() for c in self._cells.values()):
            self._stopped.set()

    def _stop_intake(self) -> None:
        self._intake.open = False
        for cell in self._cells.values():
            cell.mailbox.accepting = False

    async def wait_stopped(self) -> None:
        """Wait until a shutdown (graceful or not) has stopped every actor."""
        await self._stopped.wait()

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_started

    def statistics(self) -> SystemStatistics:
        return SystemStatistics(
            accepting=self._intake.open,
            shutting_down=self._shutdown_started,
            actors=tuple(cell.ref.statistics() for cell in self._cells.values()),
        )
