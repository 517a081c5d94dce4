# mypy: ignore-errors
"""Where ``_enter_rows``'s time goes, pass by pass (thirteenth session, issue 14).

``.venv/bin/python docs/open13/enter_passes.py DIR`` opens ``DIR`` as the bench's
``--child-open`` does, with the cache's ``_enter_rows`` replaced by one that does the same
work split into passes over each batch (the keys, the store's or interned; the records made;
the costs; the ranks into the by-order list; the ledger's FOUND; the cold policy's insert; the
index's keys), each pass's thread CPU summed; and the index's runs and the store's open
timed whole. One JSON line. The split changes what is in the CPU's caches between the
passes a little: read the ratios between 10k and 100k, not the absolute times."""

import importlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from kvtrio.bench import scale

for _name in scale.OPEN_IMPORTS:
    importlib.import_module(_name)

import trio  # noqa: E402
from kvtrio.actors import tieredload  # noqa: E402
from kvtrio.actors.coldside import CacheRecord  # noqa: E402
from kvtrio.actors.storeopen import CatalogueOpen  # noqa: E402

CPU = defaultdict(float)
T = time.thread_time


def _timed(name, fn):
    def wrapper(*a, **k):
        s = T()
        try:
            return fn(*a, **k)
        finally:
            CPU[name] += T() - s

    return wrapper


def _enter_rows(self, batch, by_order, young, models):
    records, ledger = self._records, self._ledger
    rows = batch.scanned.rows
    ranks = batch.scanned.ranks
    model = self.model
    s = T()
    known, keys = batch.keys, []
    for row in rows:
        stored = None if known is None else next(known, None)
        keys.append(stored if stored is not None and stored == row[0] else sys.intern(row[0]))
    CPU["a keys"] += T() - s
    s = T()
    fresh = [key not in records for key in keys]
    CPU["b records probe"] += T() - s
    s = T()
    new_entry = tieredload.entry_of_checked
    made = []
    for key, row, ok in zip(keys, rows, fresh, strict=True):
        if ok:
            entry = new_entry(key, model, row[3], row[4] != 0, row[5])
            made.append(CacheRecord(key, 0, entry=entry))
    CPU["c records made"] += T() - s
    s = T()
    for record in made:
        records[record.key] = record
    CPU["d records insert"] += T() - s
    s = T()
    cost = self._cold_cost(made[0])
    arrivals = [(r.key, cost) for r in made]
    CPU["e arrivals"] += T() - s
    s = T()
    for record, row in zip(made, rows, strict=True):
        rank = ranks[row[9]]
        if rank >= len(by_order):
            by_order.extend([None] * (rank + 1 - len(by_order)))
        by_order[rank] = record.entry
    CPU["f ranks"] += T() - s
    s = T()
    ledger.found_many(made)
    CPU["g ledger"] += T() - s
    s = T()
    self.cold_policy.insert_found(arrivals)
    CPU["h policy"] += T() - s
    s = T()
    self._index.add_keys([record.entry for record in made])
    CPU["h2 index keys"] += T() - s
    s = T()
    young.after_batch()
    CPU["i young"] += T() - s


tieredload.IndexAndLoadMixin._enter_rows = _enter_rows
_MIXIN = tieredload.IndexAndLoadMixin
_MIXIN._index_found = _timed("j index", _MIXIN._index_found)
CatalogueOpen.run = _timed("store open", CatalogueOpen.run)


async def main(directory):
    from kvtrio.actors.owner import MlxOwner

    model = scale._model_of(directory)
    async with MlxOwner.inline() as owner:
        opened = await scale._timed_open(directory, model, owner)
    print(json.dumps({
        "n": opened["entries"], "cpu_s": round(opened["cpu_s"], 4), "load": os.getloadavg()[0],
        "steps_cpu_ms": {k: round(v * 1e3, 1) for k, v in sorted(CPU.items())},
    }))


trio.run(main, Path(sys.argv[1]))
