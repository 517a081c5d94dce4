# mypy: ignore-errors
"""Run: .venv/bin/python docs/h200-gpu14/vm/exp14.py 4096 8 [WORKDIR] (repository root).

docs/warm13/exp.py with gpu14's two warm-ups: turn 2 after a restart (the process's first
request, a RAM hit after the warm restart) with the restore's warm-up through a
BatchGenerator (gpu14, ``batched``) and with main's one model call (``onecall``:
KVX_ONECALL=1 through site/sitecustomize.py), alternated in pairs; the same code, one
conversation per round, every conversation's turn 1 answered by one server first."""

import json
import os
import sys
import time
from pathlib import Path

from kvtrio.bench.serve_harness import Server, median, prompt_words
from kvtrio.bench.serve_restart import QUESTION
from kvtrio.serve.modeldir import write_tiny_model_dir

SITE = str(Path(__file__).resolve().parent / "site")


def main() -> None:
    length, rounds = int(sys.argv[1]), int(sys.argv[2])
    root = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/exp14")
    root.mkdir(parents=True, exist_ok=True)
    log, model = root / "log.txt", root / "llama"
    if not model.exists():
        write_tiny_model_dir(model, seed=0)
    doc = prompt_words(model, length)
    extra = ["--prompt-cache-size", str(2 * rounds + 4)]  # every conversation restored
    work = root / f"kv-{length}-{time.time():.0f}"
    turns2 = []
    server = Server("kvtrio", model, work, log, extra)
    server.settle(0.5)
    for r in range(2 * rounds):
        turn1 = [{"role": "user", "content": f"Conversation {r}. {doc}"}]
        one = server.chat(turn1, 8)
        answer = {"role": "assistant", "content": one["text"]}
        turns2.append([*turn1, answer, {"role": "user", "content": QUESTION}])
    server.stop()
    ttft: dict[str, list[float]] = {"batched": [], "onecall": []}
    for r in range(2 * rounds):
        mode = ("batched", "onecall")[(r + r // 2) % 2]  # pairs, the order swapped each pair
        saved = dict(os.environ)
        os.environ["PYTHONPATH"] = SITE
        if mode == "onecall":
            os.environ["KVX_ONECALL"] = "1"
        try:
            server = Server("kvtrio", model, work, log, extra)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        server.settle(4.0)  # the restore (and its warm-up) done
        two = server.chat(turns2[r], 8)
        server.stop()
        lines = [line for line in server.output().splitlines() if "restored" in line]
        ttft[mode].append(two["arrivals"][0] - two["sent"])
        said = lines[-1][-50:] if lines else "-"
        print(mode, r, round(ttft[mode][-1] * 1000, 1), two["cache"], said, flush=True)
    print(json.dumps({k: [round(x * 1000, 1) for x in v] for k, v in ttft.items()}))
    new, old = median(ttft["batched"]), median(ttft["onecall"])
    print(f"median ms batched {new * 1000:.1f} onecall {old * 1000:.1f} ratio {new / old:.3f}")
    pairs = [ttft["batched"][i] / ttft["onecall"][i] for i in range(rounds)]
    print("per pair batched/onecall", " ".join(f"{x:.3f}" for x in pairs))


if __name__ == "__main__":
    main()
