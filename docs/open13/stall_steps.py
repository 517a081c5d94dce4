# mypy: ignore-errors
"""Which steps of a clean open were running when the event loop was late (thirteenth
session, issue 14).

``.venv/bin/python docs/open13/stall_steps.py DIR`` opens ``DIR`` (populated and opened
once by the bench, so its catalogue exists) in a fresh process, as the bench's
``--child-open`` does, with a 1 ms heartbeat on the loop and each step of the open
wrapped (its wall interval recorded). It prints one JSON line: the open's CPU seconds,
the worst heartbeat lateness, and for each tick more than 8 ms late, how late it was and
the steps whose intervals overlap its window (by name, with the batch's number)."""

import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path

from kvtrio.bench import scale

for _name in scale.OPEN_IMPORTS:
    importlib.import_module(_name)

import trio  # noqa: E402
from kvtrio.actors import collector, tieredload  # noqa: E402
from kvtrio.actors.storeopen import CatalogueOpen  # noqa: E402
from kvtrio.storage import catalogue  # noqa: E402

SPANS = []  # (name, start, end)


def _spanned(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS.append((name, start, time.perf_counter()))

    return wrapper


def _spanned_gen(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        it = fn(*args, **kwargs)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                SPANS.append((name, start, time.perf_counter()))
                return
            SPANS.append((name, start, time.perf_counter()))
            yield item

    return wrapper


_MIXIN = tieredload.IndexAndLoadMixin
for owner, attr, name in [
    (CatalogueOpen, "run", "store.open"),
    (_MIXIN, "_enter_found", "cache.enter_rows"),
    (_MIXIN, "_index_found", "cache.index"),
    (collector.YoungCollections, "after_batch", "young collection"),
]:
    setattr(owner, attr, _spanned(name, getattr(owner, attr)))
_CAT = catalogue.Catalogue
for attr in ("block_lists", "scan"):
    setattr(_CAT, attr, _spanned_gen(f"catalogue.{attr}", getattr(_CAT, attr)))


async def main(directory):
    from kvtrio.actors.owner import MlxOwner

    model = scale._model_of(directory)
    ticks = []
    async with MlxOwner.inline() as owner:
        async with trio.open_nursery() as nursery:

            async def beat():
                while True:
                    before = time.perf_counter()
                    await trio.sleep(0.001)
                    ticks.append((before, time.perf_counter()))

            nursery.start_soon(beat)
            await trio.sleep(0.05)
            began = time.perf_counter()
            opened = await scale._timed_open(directory, model, owner)
            ended = time.perf_counter()
            nursery.cancel_scope.cancel()
    late = []
    for before, after in ticks:
        if before < began or after > ended + 0.01:
            continue
        lateness = after - before - 0.001
        if lateness > 0.008:
            steps = sorted({n for n, s, e in SPANS if s < after and e > before})
            late.append([round(lateness * 1e3, 1), round((before - began) * 1e3), steps])
    print(json.dumps({
        "n": opened["entries"], "cpu_s": round(opened["cpu_s"], 4),
        "stall_ms": round(opened["stall_s"] * 1e3, 1), "load": os.getloadavg()[0],
        "late": late,
    }))


trio.run(main, Path(sys.argv[1]))
