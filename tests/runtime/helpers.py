"""Messages and actors shared by the runtime tests."""

from __future__ import annotations

import math

import attrs
import trio
from kvtrio.runtime.actor import Actor, Reply


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Get:
    reply: Reply[int]


@attrs.frozen
class Sleep:
    seconds: float


@attrs.frozen
class Hold:
    """Block the handler until ``release`` is set."""

    release: trio.Event


@attrs.frozen
class Crash:
    why: str = "boom"


@attrs.frozen
class Forward:
    """Tell ``Add(n)`` to the counter referenced by the handler's ``peer``."""

    n: int


Msg = Add | Get | Sleep | Hold | Crash | Forward


class Counter(Actor[Msg]):
    """Sums Add messages; answers Get; sleeps, holds, crashes or forwards on demand."""

    def __init__(self, log: list[str] | None = None, peer: object = None) -> None:
        self.total = 0
        self.log = log if log is not None else []
        self.peer = peer
        self.cancelled_at: float | None = None

    async def on_start(self) -> None:
        self.log.append(f"start {self.name}")

    async def on_stop(self) -> None:
        self.log.append(f"stop {self.name}")

    async def handle(self, msg: Msg) -> None:
        match msg:
            case Add(n):
                self.total += n
            case Get(reply):
                reply.send(self.total)
            case Sleep(seconds):
                try:
                    await trio.sleep(math.inf if seconds == math.inf else seconds)
                except trio.Cancelled:
                    self.cancelled_at = trio.current_time()
                    raise
            case Hold(release):
                await release.wait()
            case Crash(why):
                raise ValueError(why)
            case Forward(n):
                assert self.peer is not None
                await self.peer.tell(Add(n))  # type: ignore[attr-defined]
