# mypy: ignore-errors
"""Turn 2 after a restart for named servers, each with its own tree and environment
(gpu15, issue 17; docs/h200-gpu14/restart14.py with a deadline): the bench's restart
phase (``kvtrio.bench.serve_restart._turn2``: start,
settle 3 s after listening and the cold tier open, turn 2 streamed, SIGTERM), servers
alternated in ``round_order`` (reversed every other round).

Usage: [R15_WARMUP=1] python3 restart15.py ROOT MODEL LENGTH ROUNDS G SPEC...
SPEC: ``NAME=KIND[@TREE][+VAR=VALUE...][:FLAG,FLAG...]``: KIND ``mlx_lm``, ``naive``,
``kvtrio`` or ``floor`` (plain mlx_lm.server answering turn 1 then turn 2 in one process:
the bench's ``mlx_lm_never_restarted``); TREE: a kvtrio tree ``G/src-TREE`` put first on
the server's PYTHONPATH (default main); VAR=VALUE: the server's environment (e.g.
``MLX_CUDA_USE_CUDNN_SDPA=0``); FLAGs: the server's extra flags (``--restore-bytes=0``).
Turn 1 runs on the naive baseline and on the first kvtrio server of each tree; the other
kvtrio servers of a tree start from a copy of its directory after it exited (same
prompts at temperature 0: the same entries); all are sent the first turn 1's turn 2.
``R15_WARMUP=1``: every server first answers the bench's warm-up request
(``--restart-warmup``). ``G15_DEADLINE`` (epoch seconds): no round is begun that would
end after it (a round's length guessed as the longest so far, ``R15_ROUND_S`` before
the first); SIGTERM stops the server in hand and exits.

One JSON line per turn 2 to stdout (``round``, ``name``, ``position``, ``ttft_s``,
``restart_s``, ``cached_tokens``, ``answer``, the tier's metrics for kvtrio servers, the
load average, UTC), flushed as they come (a run cut by its time limit keeps its rounds).
"""

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from kvtrio.bench import serve_restart
from kvtrio.bench.serve_harness import Server, compile_kvtrio, prompt_words, round_order
from kvtrio.bench.serve_restart import NAIVE_SAVE_S, NEVER_RESTARTED, QUESTION, _turn2

_ENV: dict[str, str] = {}


class EnvServer(Server):
    """The bench's Server, spawned with ``_ENV`` over this process's environment."""

    def __init__(self, *args, **kwargs):
        saved = dict(os.environ)
        os.environ.update(_ENV)
        try:
            super().__init__(*args, **kwargs)
        finally:
            os.environ.clear()
            os.environ.update(saved)


def parse(spec, g):
    name, _, rest = spec.partition("=")
    rest, _, flags = rest.partition(":")
    kind, *envs = rest.split("+")
    kind, _, tree = kind.partition("@")
    env = dict(e.split("=", 1) for e in envs)
    base = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and "/src-" not in p]
    probe = [p for p in base if p.endswith("/probe")]
    others = [p for p in base if not p.endswith("/probe")]
    env["PYTHONPATH"] = ":".join([*probe, f"{g}/src-{tree or 'main'}", *others])
    if kind not in ("mlx_lm", "naive", "kvtrio", "floor"):
        raise SystemExit(f"unknown kind in {spec!r}")
    return name, kind, env, tuple(f for f in flags.split(",") if f), tree or "main"


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped by their finally
    deadline = float(os.environ.get("G15_DEADLINE", "inf"))
    longest = float(os.environ.get("R15_ROUND_S", "60"))
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    length, rounds, g = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    warmup = os.environ.get("R15_WARMUP") == "1"
    servers = [parse(s, g) for s in sys.argv[6:]]
    root.mkdir(parents=True, exist_ok=True)
    log = root / "servers.log"
    head = {"compiled": compile_kvtrio(), "servers": servers, "warmup": warmup}
    print(json.dumps(head), flush=True)
    document = prompt_words(model, length)
    turns1 = [[{"role": "user", "content": f"Conversation {r}. {document}"}] for r in range(rounds)]
    serve_restart.Server = EnvServer
    turns2 = None
    firsts = {}  # a kvtrio tree's first server: its turn 1 written by that tree
    for name, kind, env, flags, tree in servers:
        if kind == "kvtrio" and tree in firsts:
            shutil.copytree(root / firsts[tree], root / name)
            print(json.dumps({"turn1": name, "copied_from": firsts[tree]}), flush=True)
            continue
        if kind not in ("kvtrio", "naive"):
            continue
        if kind == "kvtrio":
            firsts.setdefault(tree, name)
        _ENV.clear()
        _ENV.update(env)
        began = time.perf_counter()
        server = EnvServer(kind, model, root / name, log, flags)
        try:
            mine = []
            for turn1 in turns1:
                one = server.chat(turn1, 8)
                answer = {"role": "assistant", "content": one["text"]}
                mine.append([*turn1, answer, {"role": "user", "content": QUESTION}])
            time.sleep(NAIVE_SAVE_S if kind == "naive" else 0.0)
        finally:
            server.stop()
        turns2 = turns2 or mine
        took = time.perf_counter() - began
        exit_ = server.exit_counters() if kind == "kvtrio" else {}
        same = mine == turns2
        print(json.dumps({"turn1": name, "s": took, "same_turn2": same, "exit": exit_}), flush=True)
    by_name = {s[0]: s for s in servers}
    names = list(by_name)
    for r in range(rounds):
        if time.time() + longest > deadline:
            print(json.dumps({"stopped_before_round": r, "longest_s": longest}), flush=True)
            break
        began_round = time.time()
        for position, name in enumerate(round_order(names, r)):
            _, kind, env, flags, tree = by_name[name]
            _ENV.clear()
            _ENV.update(env)
            load, utc = os.getloadavg()[0], time.strftime("%H:%M:%S", time.gmtime())
            kind2 = NEVER_RESTARTED if kind == "floor" else kind
            prime = turns1[r] if kind == "floor" else None
            work = root / name
            run = _turn2(kind2, model, work, turns2[r], 3.0, log, warmup, prime, flags)
            run.update(round=r, name=name, kind=kind, position=position, load=load, utc=utc)
            run.update(
                tree=tree, flags=flags, env={k: v for k, v in env.items() if k != "PYTHONPATH"}
            )
            print(json.dumps(run), flush=True)
        longest = max(longest if r else 0.0, time.time() - began_round)


if __name__ == "__main__":
    main()
