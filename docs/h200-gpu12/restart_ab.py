# mypy: ignore-errors
"""Turn 2 after a restart, old kvtrio against new kvtrio and the naive baseline, alternated
in one process (gpu12). The bench's own restart phase (``kvtrio.bench.serve_restart``,
from the tree on PYTHONPATH: turn 1 on each server, SIGTERM, then per round a fresh start,
settle, the ``--restart-warmup`` request, turn 2 streamed) with the servers named on the
command line.

Usage: python3 restart_ab.py ROOT MODEL LENGTH ROUNDS SPEC...
SPEC: ``mlx_lm``, ``naive``, ``kvtrio`` (kvtrio serve from the tree on PYTHONPATH) or
``NAME=TREE`` (kvtrio serve with TREE, a folder holding ``kvtrio/``, first on its
PYTHONPATH). mlx_lm is sent naive's turn 2, as in the bench. One JSON line per turn 2 to
stdout (``round``, ``kind``, ``position``, ``ttft_s``, ``cached_tokens``, ``answer``,
the tier's lookup metrics for kvtrio servers, the load average, UTC).
"""

import json
import os
import sys
import time
from pathlib import Path

from kvtrio.bench.serve_harness import Server, prompt_words, round_order
from kvtrio.bench.serve_restart import NAIVE_SAVE_S, QUESTION, _turn2


def main() -> None:
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    length, rounds = int(sys.argv[3]), int(sys.argv[4])
    specs = sys.argv[5:] or ["naive", "kvtrio"]
    root.mkdir(parents=True, exist_ok=True)
    log = root / "servers.log"
    base = os.environ.get("PYTHONPATH", "")
    kinds: list[str] = []
    paths: dict[str, str] = {}
    server_kind: dict[str, str] = {}
    for spec in specs:
        name, _, tree = spec.partition("=")
        kinds.append(name)
        parts = (str(Path(tree).resolve()) if tree else "", base)
        paths[name] = os.pathsep.join(p for p in parts if p)
        server_kind[name] = name if name in ("mlx_lm", "naive") else "kvtrio"
    document = prompt_words(model, length)
    turns1 = [[{"role": "user", "content": f"Conversation {r}. {document}"}] for r in range(rounds)]
    turns2: dict[str, list] = {}
    for kind in kinds:
        if kind == "mlx_lm":
            continue
        os.environ["PYTHONPATH"] = paths[kind]
        began = time.perf_counter()
        server = Server(server_kind[kind], model, root / f"{kind}-{length}", log)
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
    if "mlx_lm" in kinds:
        turns2["mlx_lm"] = turns2["naive"]
    for r in range(rounds):
        for position, kind in enumerate(round_order(kinds, r)):
            os.environ["PYTHONPATH"] = paths[kind]
            load = os.getloadavg()[0]
            utc = time.strftime("%H:%M:%S", time.gmtime())
            work = root / f"{kind}-{length}"
            run = _turn2(server_kind[kind], model, work, turns2[kind][r], 3.0, log, True)
            run.update(round=r, kind=kind, position=position, load=load, utc=utc)
            print(json.dumps(run), flush=True)
    os.environ["PYTHONPATH"] = base


if __name__ == "__main__":
    main()
