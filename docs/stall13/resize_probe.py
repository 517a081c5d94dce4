# mypy: ignore-errors
"""How long one dict resize of a table of every entry holds the GIL, in fresh processes
(thirteenth session, issue 14): the open's records dict (and the cold policy's slots)
grows past 87,381 entries to a table of 2^18 slots (about 5 MB of new memory, whose
pages are first touched in that one step).

``python docs/stall13/resize_probe.py K``: K fresh processes, each inserting 100,000 str
keys into a dict and timing every insert; prints each process's longest insert (the
resize), its minor page faults, and the count of resizes over 20 ms."""

import json
import resource
import subprocess
import sys
import time


def child():
    keys = [f"{i:064x}" for i in range(100_000)]
    d, worst, at, values = {}, 0.0, 0, object()
    for i, key in enumerate(keys):
        before = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if i == 87_381 else 0
        d[key] = values
        took = time.perf_counter() - before
        if i == 87_381:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if took > worst:
            worst, at = took, i
    print(json.dumps({"worst_ms": round(worst * 1e3, 2), "at": at, "faults": faults}))


def main(k):
    over, worsts = 0, []
    for _ in range(k):
        out = json.loads(
            subprocess.run(
                [sys.executable, __file__, "child"], check=True, capture_output=True, text=True
            ).stdout
        )
        worsts.append(out["worst_ms"])
        over += out["worst_ms"] > 20
        print(json.dumps(out), flush=True)
    worsts.sort()
    print(f"{over} of {k} resizes over 20 ms; median {worsts[k // 2]} ms, max {worsts[-1]} ms")


if __name__ == "__main__":
    child() if sys.argv[1] == "child" else main(int(sys.argv[1]))
