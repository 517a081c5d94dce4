"""A tiny server for the signal drills: run it, wait for "ready", send SIGTERM.

Usage: python signal_drill_app.py MESSAGES SECONDS_PER_MESSAGE GRACE

It queues MESSAGES slow jobs into one actor, prints "ready", and serves until signalled.
On exit it prints "handled=<n> dropped=<m> signal=<name>" and exits 0 when everything
accepted was handled, 1 when the shutdown had to drop accepted messages.
"""

from __future__ import annotations

import signal
import sys

import attrs
import trio
from kvtrio.runtime.actor import Actor
from kvtrio.runtime.signals import shutdown_on_signals
from kvtrio.runtime.system import ActorSystem


@attrs.frozen
class Job:
    seconds: float


class Worker(Actor[Job]):
    async def handle(self, msg: Job) -> None:
        await trio.sleep(msg.seconds)


async def main(messages: int, seconds: float, grace: float) -> int:
    received: list[signal.Signals | None] = []
    async with ActorSystem(grace=grace) as system:
        worker = await system.spawn(Worker(), name="worker", mailbox_size=max(1, messages))
        for _ in range(messages):
            worker.tell_nowait(Job(seconds))

        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            received.append(await shutdown_on_signals(system, grace=grace, task_status=task_status))

        async with trio.open_nursery() as nursery:
            await nursery.start(serve)
            print("ready", flush=True)
        stats = worker.statistics()
    name = received[0].name if received and received[0] is not None else "none"
    print(f"handled={stats.processed} dropped={stats.dropped} signal={name}", flush=True)
    return 0 if stats.dropped == 0 else 1


if __name__ == "__main__":
    # The drills resend SIGTERM until the process ends (signals sent together may coalesce).
    # trio restores the handler it found once shutdown_on_signals returns, so a resend that
    # lands after that, while the summary line is printed, must find SIG_IGN rather than
    # the default action (which would kill the process with -15 after a clean shutdown).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    count, per_message, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    sys.exit(trio.run(main, count, per_message, grace_s))
