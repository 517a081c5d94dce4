# mypy: ignore-errors
"""Turn 2 after a restart, the bench's restart phase with a fourth server (gpu13): plain
mlx_lm.server, the naive baseline, kvtrio serve (warm restart on, its default) and kvtrio
serve with the warm restart off (``--restore-bytes 0``), alternated in one process.

It is ``kvtrio.bench.serve_restart.restart`` (turn 1 on each server that keeps a cache,
SIGTERM; then per round each server started afresh, settled, answered the warm-up request
when ``--warmup``, sent turn 2 streamed, stopped) with the servers named on the command
line and ``round_order`` over them (the order reversed every other round). Each round's
turn 2 runs through the bench's own ``_turn2``; a server's extra flags reach it through
``Server``'s ``extra``.

Usage: python3 restart13.py ROOT MODEL LENGTH ROUNDS [--warmup] [--copy-turn1] SPEC...
SPEC: ``mlx_lm``, ``naive``, ``kvtrio``, or ``NAME=kvtrio:FLAG,FLAG...`` (kvtrio serve
with extra flags, e.g. ``kvcold=kvtrio:--restore-bytes,0``). mlx_lm is sent naive's turn 2,
as in the bench. ``--copy-turn1``: a kvtrio server with extra flags starts from a copy of
plain kvtrio's directory after its turn 1 (the same code and prompts at temperature 0
write the same entries; one server start less) instead of its own turn 1.

One JSON line per turn 2 to stdout (``round``, ``kind``, ``position``, ``ttft_s``,
``restart_s``, ``cached_tokens``, ``answer``, ``warmup_s``, the tier's metrics for kvtrio
servers, the load average, UTC), one per turn 1 (``turn1``), flushed as they come (a run
cut by its time limit keeps its finished rounds).
"""

import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

from kvtrio.bench import serve_restart
from kvtrio.bench.serve_harness import Server, compile_kvtrio, prompt_words, round_order
from kvtrio.bench.serve_restart import NAIVE_SAVE_S, QUESTION, _turn2


def parse(specs):
    kinds, server_kind, extra = [], {}, {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        kind, _, flags = rest.partition(":")
        kinds.append(name)
        server_kind[name] = kind or name
        extra[name] = tuple(f for f in flags.split(",") if f)
        if server_kind[name] not in ("mlx_lm", "naive", "kvtrio"):
            raise SystemExit(f"unknown server kind in {spec!r}")
    return kinds, server_kind, extra


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--") or "=" in a]
    warmup = "--warmup" in sys.argv[1:]
    copy_turn1 = "--copy-turn1" in sys.argv[1:]
    root, model = Path(args[0]), Path(args[1])
    length, rounds = int(args[2]), int(args[3])
    kinds, server_kind, extra = parse(args[4:] or ["mlx_lm", "naive", "kvtrio"])
    root.mkdir(parents=True, exist_ok=True)
    log = root / "servers.log"
    print(json.dumps({"compiled": compile_kvtrio(), "kinds": kinds, "extra": extra}), flush=True)
    document = prompt_words(model, length)
    turns1 = [[{"role": "user", "content": f"Conversation {r}. {document}"}] for r in range(rounds)]
    turns2 = {}
    copies = []
    for kind in kinds:
        if kind == "mlx_lm":
            continue
        if copy_turn1 and server_kind[kind] == "kvtrio" and extra[kind] and "kvtrio" in kinds:
            copies.append(kind)
            continue
        began = time.perf_counter()
        server = Server(server_kind[kind], model, root / f"{kind}-{length}", log, extra[kind])
        try:
            turns2[kind] = []
            for turn1 in turns1:
                one = server.chat(turn1, 8)
                more = [*turn1, {"role": "assistant", "content": one["text"]}]
                turns2[kind].append([*more, {"role": "user", "content": QUESTION}])
            time.sleep(NAIVE_SAVE_S if kind == "naive" else 0.0)
        finally:
            server.stop()
        exit_ = server.exit_counters() if server_kind[kind] == "kvtrio" else {}
        took = time.perf_counter() - began
        print(json.dumps({"turn1": kind, "s": took, "exit": exit_}), flush=True)
    for kind in copies:  # the same entries as plain kvtrio's turn 1, copied once it exited
        shutil.copytree(root / f"kvtrio-{length}", root / f"{kind}-{length}")
        turns2[kind] = turns2["kvtrio"]
        print(json.dumps({"turn1": kind, "copied_from": "kvtrio"}), flush=True)
    if "mlx_lm" in kinds:
        turns2["mlx_lm"] = turns2["naive"]
    real_server = serve_restart.Server
    try:
        for r in range(rounds):
            for position, kind in enumerate(round_order(kinds, r)):
                # _turn2 builds its Server with the module's name: this kind's flags go in.
                serve_restart.Server = functools.partial(real_server, extra=extra[kind])
                load = os.getloadavg()[0]
                utc = time.strftime("%H:%M:%S", time.gmtime())
                work = root / f"{kind}-{length}"
                run = _turn2(server_kind[kind], model, work, turns2[kind][r], 3.0, log, warmup)
                run.update(round=r, kind=kind, position=position, load=load, utc=utc)
                print(json.dumps(run), flush=True)
    finally:
        serve_restart.Server = real_server


if __name__ == "__main__":
    main()
