# mypy: ignore-errors
"""Turn 2 after a restart for named servers, each with its own tree and environment
(gpu14, issue 17): the bench's restart phase (``kvtrio.bench.serve_restart._turn2``: start,
settle 3 s after listening and the cold tier open, turn 2 streamed, SIGTERM), servers
alternated in ``round_order`` (reversed every other round).

Usage: python3 restart14.py ROOT MODEL LENGTH ROUNDS G SPEC...
SPEC: ``NAME=KIND[@TREE][+VAR=VALUE...]``: KIND ``mlx_lm``, ``kvtrio`` or ``floor`` (plain
mlx_lm.server answering turn 1 then turn 2 in one process: the bench's
``mlx_lm_never_restarted``); TREE: a kvtrio tree ``G/src-TREE`` put first on the server's
PYTHONPATH (default main); VAR=VALUE: the server's environment (e.g.
``MLX_CUDA_USE_CUDNN_SDPA=0``). Turn 1 runs once, on the first kvtrio server; the other
kvtrio servers start from a copy of its directory after it exited (same prompts at
temperature 0: the same entries); mlx_lm and the floor are sent its turn 2.

One JSON line per turn 2 to stdout (``round``, ``name``, ``position``, ``ttft_s``,
``restart_s``, ``cached_tokens``, ``answer``, the tier's metrics for kvtrio servers, the
load average, UTC), flushed as they come (a run cut by its time limit keeps its rounds).
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from kvtrio.bench import serve_restart
from kvtrio.bench.serve_harness import Server, compile_kvtrio, prompt_words, round_order
from kvtrio.bench.serve_restart import NEVER_RESTARTED, QUESTION, _turn2

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
    kind, *envs = rest.split("+")
    kind, _, tree = kind.partition("@")
    env = dict(e.split("=", 1) for e in envs)
    base = os.environ.get("PYTHONPATH", "").split(":")
    base = [p for p in base if p and "/src-" not in p]
    env["PYTHONPATH"] = ":".join(
        [
            *(p for p in base if p.endswith("/probe")),
            f"{g}/src-{tree or 'main'}",
            *(p for p in base if not p.endswith("/probe")),
        ]
    )
    if kind not in ("mlx_lm", "kvtrio", "floor"):
        raise SystemExit(f"unknown kind in {spec!r}")
    return name, kind, env


def main() -> None:
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    length, rounds, g = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    servers = [parse(s, g) for s in sys.argv[6:]]
    root.mkdir(parents=True, exist_ok=True)
    log = root / "servers.log"
    print(json.dumps({"compiled": compile_kvtrio(), "servers": servers}), flush=True)
    document = prompt_words(model, length)
    turns1 = [[{"role": "user", "content": f"Conversation {r}. {document}"}] for r in range(rounds)]
    serve_restart.Server = EnvServer
    kvtrios = [(n, e) for n, k, e in servers if k == "kvtrio"]
    first, env1 = kvtrios[0]
    _ENV.clear()
    _ENV.update(env1)
    began = time.perf_counter()
    server = EnvServer("kvtrio", model, root / first, log)
    try:
        turns2 = []
        for turn1 in turns1:
            one = server.chat(turn1, 8)
            turns2.append(
                [
                    *turn1,
                    {"role": "assistant", "content": one["text"]},
                    {"role": "user", "content": QUESTION},
                ]
            )
    finally:
        server.stop()
    print(
        json.dumps(
            {"turn1": first, "s": time.perf_counter() - began, "exit": server.exit_counters()}
        ),
        flush=True,
    )
    for name, _ in kvtrios[1:]:
        shutil.copytree(root / first, root / name)
    names = [s[0] for s in servers]
    by_name = {s[0]: s for s in servers}
    for r in range(rounds):
        for position, name in enumerate(round_order(names, r)):
            _, kind, env = by_name[name]
            _ENV.clear()
            _ENV.update(env)
            load, utc = os.getloadavg()[0], time.strftime("%H:%M:%S", time.gmtime())
            kind2 = NEVER_RESTARTED if kind == "floor" else kind
            prime = turns1[r] if kind == "floor" else None
            run = _turn2(kind2, model, root / name, turns2[r], 3.0, log, False, prime)
            run.update(round=r, name=name, kind=kind, position=position, load=load, utc=utc)
            print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main()
