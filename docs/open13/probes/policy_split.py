# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
import json
import sys
import time
from collections import defaultdict

sys.argv = [sys.argv[0], sys.argv[1]]
from kvtrio.actors import policy as P

CPU = defaultdict(float)
T = time.thread_time


def insert_found(self, arrivals):
    slots, forever = self._slots, float("inf")
    s = T()
    made = [(key, P._Slot(cost, None, forever)) for key, cost in arrivals]
    CPU["slots made"] += T() - s
    s = T()
    batch = dict(made)
    CPU["batch dict"] += T() - s
    s = T()
    len(batch) == len(made) and slots.keys().isdisjoint(batch)
    CPU["isdisjoint"] += T() - s
    s = T()
    slots.update(batch)
    CPU["update"] += T() - s
    s = T()
    self._nbytes += sum(slot.cost.nbytes for slot in batch.values())
    CPU["sum"] += T() - s
    s = T()
    self._order_extend(made)
    CPU["lru extend"] += T() - s


P.EvictionPolicy.insert_found = insert_found
import atexit
import runpy

atexit.register(lambda: print(json.dumps({k: round(v * 1e3, 1) for k, v in CPU.items()})))
runpy.run_path("/work/wt-open13/docs/open13/enter_passes.py", run_name="__main__")
