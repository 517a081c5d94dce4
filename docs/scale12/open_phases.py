# mypy: ignore-errors
"""The CPU time of each step of a clean open, in a fresh process (twelfth session, issue 14).

``.venv/bin/python docs/scale12/open_phases.py DIR`` opens ``DIR`` (a directory the bench
populated and opened once, so its catalogue exists) as the bench's ``--child-open`` does
(the imports first, then ``_timed_open``), with each step of the open wrapped: its
thread's CPU seconds (``time.thread_time``) summed per step, the collections run during
the open and their time (``gc.callbacks``), minor page faults, and the wall and CPU time
the bench reports. One JSON line."""

import functools
import gc
import importlib
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

from kvtrio.bench import scale

for _name in scale.OPEN_IMPORTS:
    importlib.import_module(_name)

import trio  # noqa: E402
from kvtrio.actors import collector, tier, tieredload  # noqa: E402
from kvtrio.storage import catalogue  # noqa: E402

CPU = defaultdict(float)
CALLS = defaultdict(int)


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU[name] += time.thread_time() - start
            CALLS[name] += 1

    return wrapper


def _timed_gen(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        it = fn(*args, **kwargs)
        while True:
            start = time.thread_time()
            try:
                item = next(it)
            except StopIteration:
                CPU[name] += time.thread_time() - start
                return
            CPU[name] += time.thread_time() - start
            CALLS[name] += 1
            yield item

    return wrapper


try:  # the store's open: its own module since branch scale12
    from kvtrio.actors.storeopen import CatalogueOpen as _StoreOpen

    _STORE_OPEN = (_StoreOpen, "run")
except ImportError:
    from kvtrio.actors.coldstore import ColdTierStore as _StoreOpen

    _STORE_OPEN = (_StoreOpen, "_open_catalogue")
for owner, attr, name in [
    (catalogue.Catalogue, "open", "catalogue.open"),
    (catalogue.Catalogue, "check", "catalogue.check"),
    (catalogue.Catalogue, "block_sizes", "catalogue.block_sizes"),
    (tier.ColdTier, "list_keys", "tier.list_keys"),
    (*_STORE_OPEN, "store.open (all)"),
    (tieredload.IndexAndLoadMixin, "_enter_found", "cache.enter_rows"),
    (tieredload.IndexAndLoadMixin, "_index_found", "cache.index"),
    (collector.YoungCollections, "after_batch", "young collections"),
]:
    fn = getattr(owner, attr)
    if isinstance(fn, classmethod) or attr == "open":
        setattr(owner, attr, classmethod(_timed(name, fn.__func__)))
    else:
        setattr(owner, attr, _timed(name, fn))
for attr, name in [("block_lists", "catalogue.block_lists"), ("scan", "catalogue.scan")]:
    setattr(catalogue.Catalogue, attr, _timed_gen(name, getattr(catalogue.Catalogue, attr)))

GCS = []


def _on_gc(phase, info):
    if phase == "start":
        _on_gc.t0 = time.perf_counter()
    else:
        GCS.append((info["generation"], time.perf_counter() - _on_gc.t0))


async def main(directory):
    from kvtrio.actors.owner import MlxOwner

    model = scale._model_of(directory)
    async with MlxOwner.inline() as owner:
        gc.callbacks.append(_on_gc)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        opened = await scale._timed_open(directory, model, owner)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        gc.callbacks.remove(_on_gc)
    by_generation = defaultdict(lambda: [0, 0.0])
    for generation, took in GCS:
        by_generation[generation][0] += 1
        by_generation[generation][1] += took
    print(json.dumps({
        "n": opened["entries"], "open_s": round(opened["seconds"], 4),
        "cpu_s": round(opened["cpu_s"], 4), "stall_ms": round(opened["stall_s"] * 1e3, 1),
        "faults": faults, "load": os.getloadavg()[0],
        "hashseed": os.environ.get("PYTHONHASHSEED"),
        "steps_cpu_ms": {k: round(v * 1e3, 1) for k, v in CPU.items()},
        "gc": {g: [c, round(t * 1e3, 1)] for g, (c, t) in sorted(by_generation.items())},
    }))


trio.run(main, Path(sys.argv[1]))
