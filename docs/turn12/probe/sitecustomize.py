# mypy: ignore-errors
"""Turn-2 timeline probe (turn12): with $TURN12_PROBE set, every process that imports
this (put this folder first on PYTHONPATH of `kvtrio bench serve`) appends one line per
event to that file: ``pid kind thread label edge ns [extra]``, ``ns`` from
time.perf_counter_ns() (CLOCK_MONOTONIC: one clock for the bench and its servers),
``edge`` b (begin), e (end) or m (a mark). Nothing is patched without the variable.

Server processes (kind naive, kvtrio or mlx_lm, from /proc/self/cmdline) mark the
handler, tokenization, the RAM and cold lookups, the cold load's jobs on every thread,
the naive baseline's file load and saves, mlx-lm's batch steps, the first Response and
the handler's writes; the bench process marks each chat's send, headers and first token
(``client``). docs/turn12/timeline.py turns the file into per-stage medians.
"""

import os

if os.environ.get("TURN12_PROBE"):
    try:
        import turn12probe

        turn12probe.install(os.environ["TURN12_PROBE"])
    except Exception as exc:  # a probe never stops the process it watches
        print("turn12probe: not installed:", exc, flush=True)
