# mypy: ignore-errors
"""Start probe runner (gpu12; docs/start11/ab.py with the servers named on the command
line): alternating starts, each probed by ``sitecustomize.py`` of :data:`SITE`.

Usage: python3 ab.py ROOT MODEL ROUNDS SPEC...  (G12_SITE: another probe folder, such as
docs/start12/site, which logs to $START12_LOG: both are set to the start's marks file)
SPEC: ``mlx_lm``, ``naive``, ``kvtrio`` (kvtrio serve from the tree on PYTHONPATH) or
``NAME=TREE`` (kvtrio serve with the folder TREE, holding ``kvtrio/``, first on its
PYTHONPATH). The bench process itself (fill, harness) always runs the tree on PYTHONPATH.

Fills ``ROOT/{naive,kvtrio}-entries`` with 1,000 entries unless there (kvtrio: the bench's
fill with every entry admitted and all written by the close's flush,
``fill_kvtrio_flushed``; G12_FILL=bench for the bench's own fill). Each other kvtrio
server starts on its own copy of kvtrio's, made before the first round. Then one
uncounted start of mlx_lm.server (the machine's first: its compiles; G12_WARMUP=0 leaves
it out). Rounds alternate in :func:`round_order` (reversed every other round).

One JSON line per start to stdout: seconds from the spawn to listening, to the first
answer (a one-token chat sent once it listens; it opens with random letters, so no entry
saved by an earlier start shares more than the chat template with it), to kvtrio's cold
tier open, the server's CPU seconds at its answer, the load average, the entries on disk
before the start, and the probe's marks (``[seconds from spawn, process CPU, thread CPU,
thread]``, first occurrence).
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

_HERE = Path(__file__).resolve().parent
#: The probe: $G12_SITE, else ``site/`` beside this file (as it ran, a copy of
#: docs/start11/site), else docs/start11/site itself.
SITE = os.environ.get("G12_SITE") or str(
    _HERE / "site" if (_HERE / "site").is_dir() else _HERE.parent / "start11" / "site"
)


def fill_kvtrio_flushed(model: Path, work: Path, entries: int) -> float:
    """The bench's kvtrio fill (:func:`kvtrio.bench.serve_fill.fill`: the same tokens, tier
    options and AdmitAll) with a RAM LRU large enough to hold every entry, so that all of
    them are written by the close's flush, which is never shed. (On the H200 the bench's
    fill evicts faster than its writes land and the pending-write byte cap sheds most:
    159 of 1,000 entries reached disk in gpu12's first run.)"""
    import argparse

    import mlx.core as mx
    from kvtrio.actors.policy import AdmitAll
    from kvtrio.serve.adapter import TieredLRUPromptCache
    from kvtrio.serve.bridge import TierOptions, TierThread
    from kvtrio.serve.flags import model_identity
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    llm = load(str(model))[0]
    flags = argparse.Namespace(model=str(model), adapter_path=None, draft_model=None, kv_bits=None)
    options = TierOptions(
        str(work / "kv"), model_identity(flags), shutdown_grace=3600, admission=AdmitAll()
    )
    started = time.perf_counter()
    tier = TierThread(options)
    tier.start()
    tier.bind()
    cache = TieredLRUPromptCache(entries + 64, tier=tier, tier_model=(str(model), None, None))
    for i in range(entries):
        tokens = [1 + i % 500, 1 + i // 500, *range(3, 35)]
        caches = make_prompt_cache(llm)
        llm(mx.array([tokens]), cache=caches)
        mx.eval([c.state for c in caches])
        cache.insert_cache((str(model), None, None), tokens, list(caches))
        cache.pump(0.0)
    cache.close()
    return time.perf_counter() - started


def entries_on_disk(work: Path) -> int:
    naive = work / "naive"
    if naive.is_dir():
        return sum(1 for p in naive.iterdir() if p.suffix == ".safetensors")
    manifests = work / "kv" / "caches"  # kvtrio: one manifest an entry
    return sum(1 for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else 0


def main() -> None:
    root, model, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    specs = sys.argv[4:] or ["mlx_lm", "naive", "kvtrio"]
    root.mkdir(parents=True, exist_ok=True)
    base = os.environ.get("PYTHONPATH", "")
    kinds: list[str] = []
    paths: dict[str, str] = {}
    server_kind: dict[str, str] = {}
    for spec in specs:
        name, _, tree = spec.partition("=")
        kinds.append(name)
        parts = (SITE, str(Path(tree).resolve()) if tree else "", base)
        paths[name] = os.pathsep.join(p for p in parts if p)
        server_kind[name] = name if name in ("mlx_lm", "naive") else "kvtrio"
    (root / "mlx_lm-entries").mkdir(exist_ok=True)
    for kind in ("naive", "kvtrio"):
        if kind in server_kind.values() and not (root / f"{kind}-entries").exists():
            work = root / f"{kind}-entries"
            if kind == "kvtrio" and os.environ.get("G12_FILL", "flushed") == "flushed":
                took = fill_kvtrio_flushed(model, work, 1000)
            else:
                took = _fill(kind, model, work, 1000)
            found = entries_on_disk(work)
            print(json.dumps({"fill": kind, "s": took, "entries": found}), flush=True)
    for name in kinds:
        if server_kind[name] == "kvtrio" and name != "kvtrio":
            if not (root / f"{name}-entries").exists():
                shutil.copytree(root / "kvtrio-entries", root / f"{name}-entries")
    if os.environ.get("G12_WARMUP", "1") == "1":  # the machine's first start, not counted
        os.environ["PYTHONPATH"] = paths[kinds[0]]
        spawn = time.time()
        with running("mlx_lm", model, root / "mlx_lm-entries", root / "servers.log") as s:
            answer = _first_answer(s, f"{os.urandom(6).hex()} hi")
        print(json.dumps({"warmup": "mlx_lm", "listen": s.start_s, "answer": answer}), flush=True)
    for r in range(rounds):
        for position, kind in enumerate(round_order(kinds, r)):
            os.environ["PYTHONPATH"] = paths[kind]
            marks = root / f"marks-{r}-{kind}.txt"
            marks.unlink(missing_ok=True)
            os.environ["START11_LOG"] = os.environ["START12_LOG"] = str(marks)
            work = root / f"{kind}-entries"
            before = entries_on_disk(work)
            load = os.getloadavg()[0]
            spawn = time.time()
            with running(server_kind[kind], model, work, root / "servers.log") as s:
                answer = _first_answer(s, f"{os.urandom(6).hex()} hi")  # no shared prefix
                cpu = s.cpu_s()
                cold = s.wait_cold_ready() if server_kind[kind] == "kvtrio" else s.start_s
                time.sleep(1.0)
            found: dict[str, list[object]] = {}
            if marks.exists():
                for line in marks.read_text().splitlines():
                    name, wall, process, thread, who = line.split(" ", 4)
                    at = round(float(wall) - spawn, 4)
                    found.setdefault(name, [at, float(process), float(thread), who])
            run = {"round": r, "kind": kind, "position": position, "listen": s.start_s}
            run.update(answer=answer, cpu=cpu, cold=cold, load=load, entries=before)
            run.update(utc=time.strftime("%H:%M:%S", time.gmtime(spawn)), marks=found)
            print(json.dumps(run), flush=True)
    os.environ["PYTHONPATH"] = base


if __name__ == "__main__":
    main()
