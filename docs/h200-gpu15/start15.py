# mypy: ignore-errors
"""Restart time with 1,000 entries on disk, the naive baseline against kvtrio serve, in
rounds that can span several device calls (gpu15, issue 17).

Usage: python3 start15.py ROOT MODEL FIRST_ROUND ROUNDS [ENTRIES]

The bench's start phase (``kvtrio bench serve --phases start``, :func:`_starts`) for the
two servers its check compares: each kind's ``ENTRIES`` (1000) entries are written once
by the bench's :func:`fill` under ROOT (skipped when ROOT already holds them from an
earlier call on the same machine), then rounds FIRST_ROUND .. FIRST_ROUND+ROUNDS-1, each
starting both servers one at a time in the bench's :func:`round_order` (reversed every
other round): seconds from the spawn to listening, to the answer of a one-token chat sent
once it listens, kvtrio's to its cold tier open, the CPU time to the answer; then 1 s,
SIGTERM. Plain mlx_lm.server (the bench's third server, no entries) is left out: the
check is kvtrio / naive, and a third server costs a third more device time.

One JSON line per fill and per server start to stdout, flushed (a run cut by its time
limit keeps its rounds). ``G15_DEADLINE`` (epoch seconds): no round is begun that would
end after it (a round's length guessed as the longest so far, ``START_ROUND_S`` before
the first); SIGTERM stops the server in hand and exits. ROOT/next holds the next round's
number for a later call.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from kvtrio.bench.serve import _first_answer
from kvtrio.bench.serve_fill import fill
from kvtrio.bench.serve_harness import compile_kvtrio, round_order, running

KINDS = ("naive", "kvtrio")


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped by `running`
    deadline = float(os.environ.get("G15_DEADLINE", "inf"))
    longest = float(os.environ.get("START_ROUND_S", "45"))
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    first, rounds = int(sys.argv[3]), int(sys.argv[4])
    entries = int(sys.argv[5]) if len(sys.argv) > 5 else 1000
    root.mkdir(parents=True, exist_ok=True)
    log = root / "servers.log"
    print(json.dumps({"compiled": compile_kvtrio(), "entries": entries}), flush=True)
    for kind in KINDS:
        done = root / f"{kind}-filled"
        if done.exists():
            continue
        took = fill(kind, model, root / f"{kind}-entries", entries)
        done.write_text(str(took))
        print(json.dumps({"fill": kind, "s": took}), flush=True)
    for r in range(first, first + rounds):
        if time.time() + longest > deadline:
            print(json.dumps({"stopped_before_round": r, "longest_s": longest}), flush=True)
            break
        began_round = time.time()
        for position, kind in enumerate(round_order(list(KINDS), r)):
            load, utc = os.getloadavg()[0], time.strftime("%H:%M:%S", time.gmtime())
            with running(kind, model, root / f"{kind}-entries", log) as server:
                answer = _first_answer(server, f"hi {r}")
                cpu = server.cpu_s()
                ready = server.wait_cold_ready() if kind == "kvtrio" else server.start_s
                time.sleep(1.0)  # the naive baseline saves after answering: not torn by a stop
            run = {"listen_s": server.start_s, "answer_s": answer, "cold_s": ready, "cpu_s": cpu}
            run.update(round=r, kind=kind, position=position, load=load, utc=utc)
            print(json.dumps(run), flush=True)
        longest = max(longest if r > first else 0.0, time.time() - began_round)
        (root / "next").write_text(str(r + 1))


if __name__ == "__main__":
    main()
