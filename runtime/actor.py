"""Actors, their references and mailboxes, and the reply slot of ``ask``.

An :class:`Actor` handles one message at a time from a bounded mailbox (a trio memory
channel). Callers hold an :class:`ActorRef`: ``tell`` waits while the mailbox is full (real
backpressure), ``tell_nowait`` raises :class:`trio.WouldBlock` instead, and ``ask`` sends a
message carrying a :class:`Reply` slot and waits for the answer.

Theory of operation:

1. A message is *accepted* once it is in the mailbox. Every accepted message is handled,
   or - if the actor is cancelled at the shutdown deadline or escalates a crash - counted
   as dropped with any :class:`Reply` it carries failed. Nothing is dropped silently.
2. A message that is not accepted raises at the sender: :class:`~kvtrio.errors.ShuttingDown`
   while the system shuts down, :class:`~kvtrio.errors.ActorStopped` once the actor stopped.
3. Once the system stops intake, only senders running inside one of its actors (their
   handlers and the tasks they start) may still tell actors whose mailbox is open: an actor
   being drained may still talk to the actors that stop after it.
4. A :class:`Reply` is settled at most once. If the asker left (timeout or cancellation),
   a late ``send``/``fail`` is discarded quietly.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import trio
from kvtrio.errors import ActorStopped, AskTimeout, ShuttingDown

if TYPE_CHECKING:
    from kvtrio.runtime.system import ActorSystem

__all__ = ["Actor", "ActorRef", "ActorState", "ActorStatistics", "Reply"]

M = TypeVar("M")
T = TypeVar("T")

# Which system the current task works for; set in each actor's task (rule 3).
CURRENT_SYSTEM: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "kvtrio_current_system", default=None
)

_PENDING, _WAITING, _SETTLED, _ABANDONED = range(4)


class Reply(Generic[T]):
    """The slot an ``ask`` message carries; the handler answers with ``send`` or ``fail``.

    Call it from the trio thread (a handler, or a task the handler started). Settling twice
    is a bug and raises RuntimeError; settling after the asker left is quietly ignored.
    """

    __slots__ = ("_error", "_state", "_task", "_value")

    def __init__(self) -> None:
        self._state = _PENDING
        self._task: trio.lowlevel.Task | None = None
        self._value: T | None = None
        self._error: BaseException | None = None

    @property
    def settled(self) -> bool:
        """True once ``send`` or ``fail`` was called (or the asker left)."""
        return self._state >= _SETTLED

    def send(self, value: T) -> None:
        """Deliver ``value`` to the asker."""
        state = self._state
        if state == _ABANDONED:
            return
        if state == _SETTLED:
            raise RuntimeError("reply already settled")
        self._value = value
        self._state = _SETTLED
        if state == _WAITING:
            trio.lowlevel.reschedule(self._task)  # type: ignore[arg-type]

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` in the asker."""
        state = self._state
        if state == _ABANDONED:
            return
        if state == _SETTLED:
            raise RuntimeError("reply already settled")
        self._error = error
        self._state = _SETTLED
        if state == _WAITING:
            trio.lowlevel.reschedule(self._task)  # type: ignore[arg-type]

    async def wait(self) -> T:
        """Wait for the answer (``ask`` does this for you). Leaving early abandons the slot."""
        if self._state == _PENDING:
            self._task = trio.lowlevel.current_task()
            self._state = _WAITING
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        elif self._state != _SETTLED:
            raise RuntimeError("reply already abandoned")
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._value  # type: ignore[return-value]

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        if self._state == _SETTLED:
            return trio.lowlevel.Abort.FAILED  # the wake-up is already queued
        self._state = _ABANDONED
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED


def replies_in(msg: object) -> list[Reply[Any]]:
    """The Reply slots a message carries (its attrs fields, or the message itself)."""
    if isinstance(msg, Reply):
        return [msg]
    cls = type(msg)
    if attrs.has(cls):
        values = (getattr(msg, field.name) for field in attrs.fields(cls))
        return [v for v in values if isinstance(v, Reply)]
    if isinstance(msg, tuple):
        return [v for v in msg if isinstance(v, Reply)]
    return []


class Actor(Generic[M]):
    """Base class: override :meth:`handle`; optionally :meth:`on_start` and :meth:`on_stop`.

    Handlers run one at a time on the trio thread. ``self.ref``, ``self.name`` and
    ``self.system`` are set before ``on_start`` runs.
    """

    ref: ActorRef[M]
    name: str
    system: ActorSystem

    async def on_start(self) -> None:
        """Runs before the first message, and again after each supervised restart."""

    async def handle(self, msg: M) -> None:
        """Handle one message. Raising is a crash, handled by the actor's supervision."""
        raise NotImplementedError

    async def on_stop(self) -> None:
        """Runs once when this instance retires, if its ``on_start`` returned: after a drain,
        after a crash (before a restart or escalation), or when it is cancelled. Off the drain
        path it is shielded but bounded by the system's ``on_stop_timeout``."""


class ActorState(enum.Enum):
    """Where an actor is in its life."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    DRAINING = "draining"
    STOPPED = "stopped"


@attrs.frozen
class ActorStatistics:
    """A snapshot of one actor's counters."""

    name: str
    state: ActorState
    mailbox_size: int
    mailbox_depth: int  # messages accepted and waiting in the mailbox now
    peak_depth: int  # the highest mailbox_depth seen
    senders_waiting: int  # tasks blocked in tell because the mailbox is full
    processed: int  # messages whose handler returned normally
    failures: int  # handler (or on_start) crashes
    restarts: int  # supervised restarts performed
    dropped: int  # accepted messages never handled (cancelled at a deadline, escalation)


@attrs.define(eq=False)
class Intake:
    """System-wide intake switch shared by every mailbox of one system."""

    owner: object
    open: bool = True


@attrs.define(eq=False)
class Mailbox(Generic[M]):
    """One actor's mailbox and counters; the system runs the receive side."""

    name: str
    size: int
    intake: Intake
    send: trio.MemorySendChannel[M]
    receive: trio.MemoryReceiveChannel[M]
    # Fast-path flag: False once intake stopped or the mailbox closed (then ask why).
    accepting: bool = True
    closed: bool = False
    state: ActorState = ActorState.STARTING
    depth: int = 0
    peak: int = 0
    processed: int = 0
    failures: int = 0
    restarts: int = 0
    dropped: int = 0

    @classmethod
    def create(cls, name: str, size: int, intake: Intake) -> Mailbox[M]:
        send, receive = trio.open_memory_channel[M](size)
        return cls(name=name, size=size, intake=intake, send=send, receive=receive)

    def refusal(self) -> Exception:
        """The error for a message this mailbox does not accept (rule 2)."""
        if not self.intake.open:
            return ShuttingDown(f"actor {self.name!r} refused a message: shutting down")
        return ActorStopped(f"actor {self.name!r} is stopped")

    def check_intake(self) -> None:
        """Slow path of the sender: raise unless rule 3 lets this sender through."""
        if self.closed or CURRENT_SYSTEM.get() is not self.intake.owner:
            raise self.refusal()

    def close(self) -> None:
        """Close the send side: blocked and later senders are refused; buffered messages stay."""
        self.accepting = False
        self.closed = True
        self.send.close()

    def accepted(self) -> None:
        """Count a message into the mailbox. A sender woken from a full mailbox may count
        before the receiver counts the message it took out, so clamp the peak to the size
        (the true depth at that moment)."""
        depth = self.depth + 1
        self.depth = depth
        if depth > self.peak:
            self.peak = min(depth, self.size)


class ActorRef(Generic[M]):
    """The handle callers use to message one actor."""

    __slots__ = ("_mailbox", "name")

    def __init__(self, mailbox: Mailbox[M]) -> None:
        self._mailbox = mailbox
        self.name = mailbox.name

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r})"

    async def tell(self, msg: M) -> None:
        """Put ``msg`` in the mailbox, waiting while it is full (backpressure)."""
        mailbox = self._mailbox
        if not mailbox.accepting:
            mailbox.check_intake()
        # MemorySendChannel.send, unrolled: one coroutine frame less per message, and the
        # message is counted before the yield, so the receiver sees the depth at once.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            mailbox.send.send_nowait(msg)
        except trio.WouldBlock:
            try:
                await mailbox.send.send(msg)
            except trio.ClosedResourceError:
                raise mailbox.refusal() from None
            mailbox.accepted()
            return
        except trio.ClosedResourceError:
            raise mailbox.refusal() from None
        mailbox.accepted()
        await trio.lowlevel.cancel_shielded_checkpoint()

    def tell_nowait(self, msg: M) -> None:
        """Put ``msg`` in the mailbox or raise :class:`trio.WouldBlock` if it is full."""
        mailbox = self._mailbox
        if not mailbox.accepting:
            mailbox.check_intake()
        try:
            mailbox.send.send_nowait(msg)
        except trio.ClosedResourceError:
            raise mailbox.refusal() from None
        mailbox.accepted()

    async def ask(self, make_msg: Callable[[Reply[T]], M], *, timeout: float | None = None) -> T:
        """Send ``make_msg(reply)`` and wait for the handler's ``reply.send(value)``.

        Raises :class:`~kvtrio.errors.AskTimeout` when no reply came within ``timeout``
        seconds (waiting for mailbox space included); the late reply is then discarded.
        """
        reply: Reply[T] = Reply()
        msg = make_msg(reply)
        if timeout is None:
            await self.tell(msg)
            return await reply.wait()
        with trio.move_on_after(timeout):
            await self.tell(msg)
            return await reply.wait()
        raise AskTimeout(f"ask to actor {self.name!r} timed out after {timeout:g}s")

    def statistics(self) -> ActorStatistics:
        mailbox = self._mailbox
        channel = mailbox.receive.statistics()
        return ActorStatistics(
            name=mailbox.name,
            state=mailbox.state,
            mailbox_size=mailbox.size,
            mailbox_depth=channel.current_buffer_used,
            peak_depth=mailbox.peak,
            senders_waiting=channel.tasks_waiting_send,
            processed=mailbox.processed,
            failures=mailbox.failures,
            restarts=mailbox.restarts,
            dropped=mailbox.dropped,
        )
