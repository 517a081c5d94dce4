"""Start probe runner (start11): alternating starts of mlx_lm.server, the naive baseline,
kvtrio serve from an old tree and from the tree on PYTHONPATH, each probed by
``site/sitecustomize.py`` (beside this file).

Usage: python3 ab.py ROOT MODEL ROUNDS [OLD_TREE]  (OLD_TREE: a folder holding ``kvtrio/``;
without it the ``kvmain`` server is left out). Fills ``ROOT/{naive,kvtrio}-entries`` with
1,000 entries (kvtrio's bench fill) unless there; ``kvmain`` starts on a copy of
kvtrio's. One JSON line per start to stdout: seconds from the spawn to listening, to the
first answer (a one-token chat sent once it listens; it opens with random letters, so the
entries past starts saved share only the chat template with it), to kvtrio's cold tier
open, the server's CPU seconds at its answer, the load average, and the probe's marks
(each ``[seconds from spawn, process CPU, thread CPU, thread]``, first occurrence).
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from kvtrio.bench.serve import _first_answer
from kvtrio.bench.serve_fill import fill as _fill
from kvtrio.bench.serve_harness import round_order, running

SITE = str(Path(__file__).resolve().parent / "site")


def main() -> None:
    root, model, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    old = sys.argv[4] if len(sys.argv) > 4 else None
    root.mkdir(parents=True, exist_ok=True)
    (root / "mlx_lm-entries").mkdir(exist_ok=True)
    for kind in ("naive", "kvtrio"):
        if not (root / f"{kind}-entries").exists():
            print(kind, "fill", _fill(kind, model, root / f"{kind}-entries", 1000), file=sys.stderr)
    kinds = ["mlx_lm", "naive", "kvtrio"]
    base = os.environ.get("PYTHONPATH", "")
    paths = {kind: os.pathsep.join(p for p in (SITE, base) if p) for kind in kinds}
    if old is not None:
        kinds.append("kvmain")
        paths["kvmain"] = os.pathsep.join(p for p in (SITE, old, base) if p)
        if not (root / "kvmain-entries").exists():
            shutil.copytree(root / "kvtrio-entries", root / "kvmain-entries")
    for r in range(rounds):
        for position, kind in enumerate(round_order(kinds, r)):
            os.environ["PYTHONPATH"] = paths[kind]
            marks = root / f"marks-{r}-{kind}.txt"
            marks.unlink(missing_ok=True)
            os.environ["START11_LOG"] = str(marks)
            spawn = time.time()
            server_kind = "kvtrio" if kind == "kvmain" else kind
            with running(server_kind, model, root / f"{kind}-entries", root / "servers.log") as s:
                answer = _first_answer(s, f"{os.urandom(6).hex()} hi")  # no shared prefix
                cpu = s.cpu_s()
                cold = s.wait_cold_ready() if server_kind == "kvtrio" else s.start_s
                time.sleep(1.0)
            found: dict[str, list[object]] = {}
            for line in marks.read_text().splitlines():
                name, wall, process, thread, who = line.split(" ", 4)
                at = round(float(wall) - spawn, 4)
                found.setdefault(name, [at, float(process), float(thread), who])
            run = {"round": r, "kind": kind, "position": position, "listen": s.start_s}
            run.update(answer=answer, cpu=cpu, cold=cold, load=os.getloadavg()[0], marks=found)
            print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main()
