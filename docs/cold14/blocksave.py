# mypy: ignore-errors
"""A blocks-layout save and load of the SmolLM2-135M-shaped 4k entry, with whichever
kvtrio is first on ``PYTHONPATH`` (cold14: old against new, process by process).

    PYTHONPATH=<tree> python docs/cold14/blocksave.py ROUNDS [TOKENS]

Per round, in a fresh directory: ``kvtrio.save_cache(layout="blocks")`` (every block
new: hash, write, fsync), the same save again (every block exists: the hashes and a
utime per block, what a growing conversation's shared prefix costs), then
``kvtrio.load_cache`` (every block verified) with the page cache warm. Prints one JSON
line: the medians in ms and the format version written.
"""

import json
import os
import statistics
import sys
import tempfile
import time

import kvtrio
import mlx.core as mx
from kvtrio.bench.loadcost import make_caches
from kvtrio.storage.reader import read_header


def main() -> None:
    rounds = int(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    caches = make_caches(tokens)
    ids = list(range(2, 2 + tokens))
    times = {"save_new": [], "save_again": [], "load": []}
    version = None
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="kvtrio-blocksave-", dir="/tmp") as root:
            path = os.path.join(root, "entry.kvt")
            for name in ("save_new", "save_again"):
                start = time.perf_counter()
                kvtrio.save_cache(path, ids, caches, layout="blocks")
                times[name].append(time.perf_counter() - start)
            version = read_header(path).header.format_version
            start = time.perf_counter()
            loaded = kvtrio.load_cache(path)
            mx.eval([a for c in loaded.caches for a in (c.keys, c.values)])
            times["load"].append(time.perf_counter() - start)
            del loaded
    out = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    out["format_version"] = version
    print(json.dumps(out))


if __name__ == "__main__":
    main()
