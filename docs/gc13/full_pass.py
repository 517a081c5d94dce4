# mypy: ignore-errors
"""The full collection that follows an open of N entries, with and without ``gc.freeze``.

    python docs/gc13/full_pass.py DIR ROUNDS     # DIR: docs/stall13/gc_probe.py populate

Each round is a fresh process doing what ``kvtrio bench scale``'s timed open does
(:func:`kvtrio.bench.scale._timed_open`, the imports first), then, once the cache is
open, one full ``gc.collect()`` timed: as is (what the first automatic full pass after
open costs), or after ``gc.freeze()`` (what ``kvtrio serve`` now does once its tier has
opened). Rounds alternate; prints each and the medians."""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(directory: str, freeze: bool) -> None:
    import gc
    import importlib

    import trio
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.bench import scale

    for name in scale.OPEN_IMPORTS:
        importlib.import_module(name)
    out = {}

    async def main() -> None:
        model = scale._model_of(Path(directory))
        async with MlxOwner.inline() as owner:

            def with_open(cache) -> None:
                if freeze:
                    start = time.perf_counter()
                    gc.freeze()
                    out["freeze_s"] = time.perf_counter() - start
                start = time.perf_counter()
                gc.collect()
                out["full_gc_s"] = time.perf_counter() - start
                out["entries"] = cache.statistics().cold_entries

            await scale._timed_open(Path(directory), model, owner, with_open)

    trio.run(main)
    print(json.dumps(out))


def main() -> None:
    directory, rounds = sys.argv[1], int(sys.argv[2])
    got = {"as is": [], "frozen": []}
    for r in range(2 * rounds):
        freeze = (r + r // 2) % 2 == 1
        line = (
            subprocess.run(
                [sys.executable, __file__, "--child", directory, "1" if freeze else "0"],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        sample = json.loads(line)
        got["frozen" if freeze else "as is"].append(sample["full_gc_s"])
        print(
            "frozen" if freeze else "as is",
            r,
            f"{sample['full_gc_s'] * 1e3:.1f} ms",
            f"freeze {sample.get('freeze_s', 0) * 1e3:.2f} ms",
            sample["entries"],
            flush=True,
        )
    for name, values in got.items():
        print(
            name,
            "median",
            f"{statistics.median(values) * 1e3:.1f} ms",
            [round(v * 1e3, 1) for v in values],
        )


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] == "1")
    else:
        main()
