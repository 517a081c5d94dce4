# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
# profile the rebuild's per-manifest work (CatalogueOpen._manifest_row), cProfile per call
import cProfile, pstats, sys, importlib, shutil, os
from pathlib import Path
from kvtrio.bench import scale
for m in scale.OPEN_IMPORTS: importlib.import_module(m)
import trio
from kvtrio.actors.storeopen import CatalogueOpen
from kvtrio.storage.catalogue import CATALOGUE_NAME
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
for suffix in ("", "-wal", "-shm"):
    p = dst / (CATALOGUE_NAME + suffix)
    if p.exists(): p.unlink()
prof = cProfile.Profile()
real = CatalogueOpen._manifest_row
def row(self, key):
    prof.enable()
    try: return real(self, key)
    finally: prof.disable()
CatalogueOpen._manifest_row = row
async def main():
    from kvtrio.actors.owner import MlxOwner
    model = scale._model_of(dst)
    async with MlxOwner.inline() as owner:
        opened = await scale._timed_open(dst, model, owner)
        print({k: opened[k] for k in ("seconds", "cpu_s", "stall_s")})
trio.run(main)
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(22)
