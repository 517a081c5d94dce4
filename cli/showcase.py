"""``kvtrio showcase`` (and, until the full demo lands, ``kvtrio demo``): the runtime, live.

A few actors really run for a couple of seconds and the program prints what happened:

1. backpressure: a fast producer feeds a slow hasher through a 4-slot mailbox, so
   ``tell`` waits; the hasher offloads hashing to worker threads;
2. supervision: a validator crashes on a poisoned record, is restarted with backoff under
   an intensity limit, and keeps serving; the asker of the poisoned record gets ActorCrashed;
3. graceful shutdown: work still queued when ``shutdown(grace=...)`` starts is drained,
   actors stop in reverse start order, and a late message is refused with ShuttingDown.
"""

from __future__ import annotations

import argparse
import hashlib
import math

import attrs
import trio
from kvtrio.errors import ActorCrashed, ShuttingDown
from kvtrio.runtime.actor import Actor, ActorRef, Reply
from kvtrio.runtime.offload import CancelToken, ThreadOffload
from kvtrio.runtime.supervision import Restart
from kvtrio.runtime.system import ActorSystem
from rich.console import Console
from rich.table import Table

__all__ = ["add_arguments", "run", "run_showcase"]


@attrs.frozen
class Record:
    key: int
    payload: bytes


@attrs.frozen
class Digest:
    key: int
    hexdigest: str


@attrs.frozen
class Total:
    reply: Reply[int]


@attrs.frozen
class Validate:
    record: Record
    reply: Reply[bool]


class _Timeline:
    """Prints numbered events with their time since the start."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.start = trio.current_time()

    def __call__(self, who: str, what: str) -> None:
        at = trio.current_time() - self.start
        self.console.print(f"[dim]{at:6.3f}s[/] [bold cyan]{who:<10}[/] {what}")


class Ledger(Actor[Digest | Total]):
    """Started first, stopped last: collects digests from the hasher."""

    def __init__(self, timeline: _Timeline) -> None:
        self.timeline = timeline
        self.digests: dict[int, str] = {}

    async def handle(self, msg: Digest | Total) -> None:
        if isinstance(msg, Digest):
            self.digests[msg.key] = msg.hexdigest
        else:
            msg.reply.send(len(self.digests))

    async def on_stop(self) -> None:
        self.timeline(self.name, f"stopped with {len(self.digests)} digests")


def _hash(token: CancelToken, payload: bytes) -> str:
    """A blocking job: hash in chunks, checking the cancel token between chunks."""
    digest = hashlib.sha256()
    view = memoryview(payload)
    for offset in range(0, len(view), 64 * 1024):
        token.check()
        digest.update(view[offset : offset + 64 * 1024])
    return digest.hexdigest()


class Hasher(Actor[Record]):
    """Slow on purpose: hashes each record in a worker thread, then pauses."""

    def __init__(self, ledger: ActorRef[Digest | Total], timeline: _Timeline) -> None:
        self.ledger = ledger
        self.timeline = timeline
        self.offload = ThreadOffload(2)

    async def handle(self, msg: Record) -> None:
        hexdigest = await self.offload.run(_hash, msg.payload)
        await trio.sleep(0.02)
        await self.ledger.tell(Digest(msg.key, hexdigest))

    async def on_stop(self) -> None:
        self.timeline(self.name, "drained its mailbox and stopped")


class Validator(Actor[Validate]):
    """Crashes on poisoned records; supervised with Restart."""

    def __init__(self, timeline: _Timeline) -> None:
        self.timeline = timeline

    async def on_start(self) -> None:
        self.timeline(self.name, "started")

    async def handle(self, msg: Validate) -> None:
        if msg.record.payload.startswith(b"POISON"):
            raise ValueError(f"record {msg.record.key} is poisoned")
        msg.reply.send(True)

    async def on_stop(self) -> None:
        self.timeline(self.name, "stopped")


async def _backpressure(
    hasher: ActorRef[Record], timeline: _Timeline, records: int
) -> tuple[int, float]:
    """Tell records as fast as possible; count the tells that had to wait for space."""
    waited = 0
    longest = 0.0
    payload = bytes(range(256)) * 1024
    for key in range(records):
        try:
            hasher.tell_nowait(Record(key, payload))
        except trio.WouldBlock:
            waited += 1
            before = trio.current_time()
            await hasher.tell(Record(key, payload))
            longest = max(longest, trio.current_time() - before)
    timeline("producer", f"sent {records} records; {waited} tells waited for mailbox space")
    return waited, longest


async def _supervision(validator: ActorRef[Validate], timeline: _Timeline) -> None:
    for key, payload in enumerate([b"ok", b"POISON!", b"ok again", b"POISON?", b"fine"]):
        record = Record(100 + key, payload)
        try:
            await validator.ask(lambda reply, r=record: Validate(r, reply))  # type: ignore[misc]
            timeline("client", f"record {record.key} validated")
        except ActorCrashed as exc:
            timeline("client", f"record {record.key}: [red]{exc}[/] (cause: {exc.__cause__})")


async def run_showcase(console: Console, *, records: int = 40, grace: float = 5.0) -> int:
    """Run the showcase, printing as it goes; returns the exit status."""
    timeline = _Timeline(console)
    console.rule("[bold]kvtrio runtime showcase")
    async with ActorSystem(name="showcase", grace=grace, seed=1) as system:
        ledger: ActorRef[Digest | Total] = await system.spawn(Ledger(timeline), name="ledger")
        hasher = await system.spawn(
            Hasher(ledger, timeline), name="hasher", mailbox_size=MAILBOX_SLOTS
        )
        console.rule("1. backpressure: 4-slot mailbox, slow consumer")
        waited, longest = await _backpressure(hasher, timeline, records)
        timeline("producer", f"longest wait for space: {longest * 1000:.0f} ms")

        console.rule("2. supervision: crash, backoff, restart")
        policy = Restart(max_restarts=3, within=5.0, backoff_initial=0.05, jitter=0.2)
        validator = await system.spawn(
            lambda: Validator(timeline), name="validator", supervision=policy
        )
        await _supervision(validator, timeline)

        console.rule("3. graceful shutdown: drain, reverse order, refuse late work")
        queued = 0
        while True:
            try:
                hasher.tell_nowait(Record(records + queued, b"last words"))
            except trio.WouldBlock:
                break
            queued += 1
        depth = hasher.statistics().mailbox_depth
        timeline("system", f"shutdown(grace={grace}) with {depth} records still queued")
        await system.shutdown(grace=grace)
        try:
            await hasher.tell(Record(-1, b"late"))
        except ShuttingDown as exc:
            timeline("client", f"late tell refused: [yellow]{exc}[/]")
        stats = system.statistics()

    table = Table(title="actor statistics")
    for column in ("actor", "processed", "peak depth", "failures", "restarts", "dropped"):
        table.add_column(column, justify="left" if column == "actor" else "right")
    for actor in stats.actors:
        table.add_row(
            actor.name,
            str(actor.processed),
            f"{actor.peak_depth}/{actor.mailbox_size}",
            str(actor.failures),
            str(actor.restarts),
            str(actor.dropped),
        )
    console.print(table)
    by_name = {actor.name: actor for actor in stats.actors}
    lost = records + queued - by_name["ledger"].processed
    restarts = by_name["validator"].restarts
    dropped = sum(actor.dropped for actor in stats.actors)
    problems = [
        f"{lost} records lost" if lost else "",
        "no tell waited for mailbox space" if waited == 0 else "",
        f"the validator restarted {restarts} times, not 2" if restarts != 2 else "",
        f"{dropped} messages dropped" if dropped else "",
    ]
    problem = "; ".join(p for p in problems if p)
    verdict = "[green]every accepted record was hashed and recorded[/]"
    console.print(f"[red]unexpected outcome: {problem}[/]" if problem else verdict)
    return 1 if problem else 0


#: The hasher's mailbox slots; a tell waits (backpressure shown) only past them.
MAILBOX_SLOTS = 4


def _records(text: str) -> int:
    """--records: more than the hasher holds (its mailbox and the record it handles), or
    no tell waits and the showcase fails."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value <= MAILBOX_SLOTS + 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number > {MAILBOX_SLOTS + 1} (what the hasher holds), got {text!r}"
        )
    return value


def _grace(text: str) -> float:
    """--grace: finite seconds > 0 (0 cancels the drain: records lost, exit 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--records", type=_records, default=40, help="records the producer sends (> 5)"
    )
    parser.add_argument("--grace", type=_grace, default=5.0, help="shutdown deadline, seconds")


def run(args: argparse.Namespace) -> int:
    console = Console()
    return trio.run(lambda: run_showcase(console, records=args.records, grace=args.grace))
