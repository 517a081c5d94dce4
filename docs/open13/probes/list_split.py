# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
import itertools
import os
import sys
import time

from kvtrio.actors import tier as T

d = sys.argv[1]
names = None
for _rep in range(3):
    t0 = time.thread_time()
    names = os.listdir(os.path.join(d, "caches"))
    t1 = time.thread_time()
    keys = [n[:-4] for n in names if n.endswith(".kvc")]
    t2 = time.thread_time()
    for s in range(0, len(keys), T._KEYS_BATCH):
        T._KEYS_RE.fullmatch("\n".join(keys[s : s + T._KEYS_BATCH]))
    t3 = time.thread_time()
    out = {}
    for s in range(0, len(keys), T._KEYS_BATCH):
        out.update(zip(keys[s : s + T._KEYS_BATCH], itertools.repeat(None)))
    t4 = time.thread_time()
    print(
        len(keys),
        f"listdir {(t1 - t0) * 1e3:.1f} slice {(t2 - t1) * 1e3:.1f} regex {(t3 - t2) * 1e3:.1f} dict {(t4 - t3) * 1e3:.1f}",
    )
