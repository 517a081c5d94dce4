# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
# thread-CPU of the rebuild's steps (catalogue deleted), wrapped per call
import importlib
import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from kvtrio.bench import scale

for m in scale.OPEN_IMPORTS:
    importlib.import_module(m)
import trio
from kvtrio.actors import storeopen
from kvtrio.storage import catalogue as cat
from kvtrio.storage import headerparse, reader

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst)
for suffix in ("", "-wal", "-shm"):
    p = dst / (cat.CATALOGUE_NAME + suffix)
    if p.exists():
        p.unlink()
CPU = defaultdict(float)
N = defaultdict(int)
T = time.thread_time


def wrap(owner, attr, name):
    fn = getattr(owner, attr)

    def w(*a, **k):
        s = T()
        try:
            return fn(*a, **k)
        finally:
            CPU[name] += T() - s
            N[name] += 1

    setattr(owner, attr, w)


wrap(storeopen.CatalogueOpen, "_manifest_row", "manifest_row (all)")
wrap(storeopen.CatalogueOpen, "_note_row", "note_row")
wrap(headerparse, "parse_header", "parse_header")
wrap(reader, "parse_header", "parse_header(reader)") if hasattr(reader, "parse_header") else None
wrap(cat.Catalogue, "replace_all", "catalogue.replace_all (all)")
wrap(storeopen.CatalogueOpen, "_present_blocks", "present_blocks")
wrap(storeopen.CatalogueOpen, "run", "store open (all)")


async def main():
    from kvtrio.actors.owner import MlxOwner

    model = scale._model_of(dst)
    async with MlxOwner.inline() as owner:
        opened = await scale._timed_open(dst, model, owner)
    print(
        json.dumps(
            {
                "seconds": round(opened["seconds"], 2),
                "cpu_s": round(opened["cpu_s"], 2),
                "stall_ms": round(opened["stall_s"] * 1e3, 1),
                "steps_cpu_s": {k: round(v, 3) for k, v in CPU.items()},
                "calls": dict(N),
            }
        )
    )


trio.run(main)
