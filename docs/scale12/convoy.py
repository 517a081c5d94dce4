# mypy: ignore-errors
"""The GIL convoy, alone (twelfth session, issue 14).

``.venv/bin/python docs/scale12/convoy.py DIR WORK [turns]``: a trio loop with a 1 ms
heartbeat, and for 3 s a worker thread (``trio.to_thread.run_sync``) that stats the files
of DIR one after another with WORK iterations of pure Python between two stats (WORK 1000:
about 40 microseconds; a rebuild reads a manifest in four system calls around a parse of
100-200 microseconds). With ``turns``, the worker offers the loop a turn after each stat
(kvtrio.actors.loopturns.LoopTurns, every 5 ms). Prints the stats done, the heartbeat's
ticks, its five worst lateness values and its median, in ms."""

import os
import sys
import time

import trio
from kvtrio.actors.loopturns import LoopTurns

DIRECTORY, WORK = sys.argv[1], int(sys.argv[2])
TURNS = len(sys.argv) > 3 and sys.argv[3] == "turns"


def work():
    names = [os.path.join(DIRECTORY, n) for n in os.listdir(DIRECTORY)[:20000]]
    turns = LoopTurns() if TURNS else None
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < 3:
        for name in names:
            os.stat(name)
            sum(i * i for i in range(WORK))
            done += 1
            if turns is not None:
                turns.offer()
    return done


async def main():
    late, stop = [], trio.Event()

    async def heartbeat():
        while not stop.is_set():
            before = time.perf_counter()
            await trio.sleep(0.001)
            late.append(time.perf_counter() - before - 0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        done = await trio.to_thread.run_sync(work)
        stop.set()
    late.sort()
    worst = [round(x * 1e3, 1) for x in late[-5:]]
    median = round(late[len(late) // 2] * 1e3, 2)
    print(f"work {WORK} turns {TURNS}: {done} stats, {len(late)} ticks,")
    print(f"    worst {worst}, p50 {median}")


trio.run(main)
