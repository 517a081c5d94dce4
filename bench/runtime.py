"""``kvtrio bench runtime``: the actor runtime's overhead against raw trio memory channels.

Two headline ratios, each against a reference measured in the same run with the same
message objects and the same channel capacity:

- ask round-trips/s  vs  a raw ping-pong over two memory channels (send, receive, reply);
- tell messages/s    vs  a raw producer -> consumer stream over one memory channel.

Each figure is the median of ``--rounds`` rounds; the rounds interleave the four programs
so drift in machine load hits all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
from kvtrio.bench.argtypes import whole
from kvtrio.runtime.actor import Actor, Reply
from kvtrio.runtime.system import ActorSystem

__all__ = ["add_arguments", "measure", "render", "run_bench"]

TARGET_ASK = 0.5
TARGET_TELL = 0.7

# Wall time by default; "cpu" counts only this thread's CPU time, which other load on a
# shared machine does not inflate (everything measured runs on the one trio thread).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = CLOCKS["wall"]


@attrs.frozen
class Ping:
    n: int


@attrs.frozen
class Echo:
    n: int
    reply: Reply[int]


class _Sink(Actor[Ping]):
    """Counts tells; sets ``done`` when the expected count arrived."""

    def __init__(self, expected: int, done: trio.Event) -> None:
        self.count = 0
        self.expected = expected
        self.done = done

    async def handle(self, msg: Ping) -> None:
        self.count += 1
        if self.count == self.expected:
            self.done.set()


class _Echo(Actor[Echo]):
    async def handle(self, msg: Echo) -> None:
        msg.reply.send(msg.n)


async def raw_ping_pong(n: int, capacity: int) -> float:
    """Round trips per second over two raw memory channels."""
    to_server, server_inbox = trio.open_memory_channel[Ping](capacity)
    to_client, client_inbox = trio.open_memory_channel[int](capacity)
    messages = [Ping(i) for i in range(n)]

    async def server() -> None:
        async for msg in server_inbox:
            await to_client.send(msg.n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        start = _clock()
        for msg in messages:
            await to_server.send(msg)
            await client_inbox.receive()
        elapsed = _clock() - start
        await to_server.aclose()
    return n / elapsed


async def raw_stream(n: int, capacity: int) -> float:
    """Messages per second from a producer to a consumer over one raw memory channel."""
    send, receive = trio.open_memory_channel[Ping](capacity)
    messages = [Ping(i) for i in range(n)]
    done = trio.Event()

    async def consumer() -> None:
        count = 0
        async for _ in receive:
            count += 1
            if count == n:
                done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        start = _clock()
        for msg in messages:
            await send.send(msg)
        await done.wait()
        elapsed = _clock() - start
        await send.aclose()
    return n / elapsed


async def actor_ask(n: int, capacity: int) -> float:
    """ask round trips per second to an actor that replies at once."""
    async with ActorSystem(name="bench") as system:
        ref = await system.spawn(_Echo(), name="echo", mailbox_size=capacity)
        start = _clock()
        for i in range(n):
            await ref.ask(lambda reply, i=i: Echo(i, reply))  # type: ignore[misc]
        elapsed = _clock() - start
    return n / elapsed


async def actor_tell(n: int, capacity: int) -> float:
    """tell messages per second into an actor, until the actor has handled them all."""
    messages = [Ping(i) for i in range(n)]
    done = trio.Event()
    async with ActorSystem(name="bench") as system:
        ref = await system.spawn(_Sink(n, done), name="sink", mailbox_size=capacity)
        start = _clock()
        for msg in messages:
            await ref.tell(msg)
        await done.wait()
        elapsed = _clock() - start
    return n / elapsed


Program = Callable[[int, int], Awaitable[float]]
PROGRAMS: dict[str, Program] = {
    "raw_ping_pong": raw_ping_pong,
    "ask": actor_ask,
    "raw_stream": raw_stream,
    "tell": actor_tell,
}


def run_bench(
    messages: int, rounds: int, capacity: int, *, clock: str = "wall"
) -> dict[str, float]:
    """Run every program ``rounds`` times (interleaved); medians and ratios by name."""
    global _clock
    _clock = CLOCKS[clock]
    samples: dict[str, list[float]] = {name: [] for name in PROGRAMS}

    async def main() -> None:
        for warm_up in PROGRAMS.values():
            await warm_up(min(messages, 2000), capacity)
        for _ in range(rounds):
            for name, program in PROGRAMS.items():
                samples[name].append(await program(messages, capacity))

    trio.run(main)
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["ask_ratio"] = result["ask"] / result["raw_ping_pong"]
    result["tell_ratio"] = result["tell"] / result["raw_stream"]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--messages", type=whole, default=50_000, help="messages per round")
    parser.add_argument("--rounds", type=whole, default=5, help="rounds; the median is shown")
    parser.add_argument("--capacity", type=whole, default=64, help="mailbox/channel capacity")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this thread's CPU time (steadier on a busy machine)",
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    result = run_bench(args.messages, args.rounds, args.capacity, clock=args.clock)
    return {**result, "messages": args.messages, "rounds": args.rounds, "clock": args.clock}


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    result = figures
    table = Table(
        title=f"kvtrio runtime overhead ({figures['messages']:,} messages, median of "
        f"{figures['rounds']}, {figures['clock']} clock)"
    )
    table.add_column("operation")
    table.add_column("kvtrio", justify="right")
    table.add_column("raw trio channel", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target", justify="right")
    for label, ours, raw, ratio, target in (
        ("ask round-trips/s vs ping-pong", "ask", "raw_ping_pong", "ask_ratio", TARGET_ASK),
        ("tell msgs/s vs stream", "tell", "raw_stream", "tell_ratio", TARGET_TELL),
    ):
        met = "[green]met[/]" if result[ratio] >= target else "[red]missed[/]"
        table.add_row(
            label,
            f"{result[ours]:,.0f}",
            f"{result[raw]:,.0f}",
            f"{result[ratio]:.2f}x",
            f">= {target}x {met}",
        )
    Console().print(table)
