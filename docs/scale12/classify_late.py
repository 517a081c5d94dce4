# mypy: ignore-errors
"""Every late tick of a ``sched_probe.py`` run, by cause, from the scheduler's record
(twelfth session, issue 14).

``python3 docs/scale12/classify_late.py TIMEHIST PROBE_OUTPUT``: TIMEHIST is
``perf sched timehist -w`` of the probe's ``perf sched record``, PROBE_OUTPUT what the probe
printed. Per tick (a window from its start to its end), with the loop thread's run time,
run-queue wait and wake-ups, the run time of the process's other threads (the worker) and
of every other process: "runqueue" (the loop waited for a CPU more than 40% of the
window), "GIL convoy" (the loop was woken 8 times or more while the worker ran more than
60% of it: each time it found the GIL taken again), "starved" (other processes ran more
than 80% of it), "GIL held by the worker" (the worker ran, the loop was not woken), "loop's
own work". Prints the count and the worst lateness of each."""

import bisect
import collections
import re
import sys

EVENT = re.compile(
    r"\s*(\S+)\s+\[(\d+)\]\s+(.+?)\[([\d/]+)\]\s+"
    r"(awakened: (.+)|([\d.]+)\s+([\d.]+)\s+([\d.]+))"
)
LATE = re.compile(r"late ([\d.]+) ms from ([\d.]+) to ([\d.]+)")


def cause(span, loop_delay, loop_wakes, worker_run, other_run, loop_run):
    if loop_delay > 0.4 * span:
        return "runqueue (loop waited for a CPU)"
    if loop_wakes >= 8 and worker_run > 0.6 * span:
        return "GIL convoy (loop woken, lost the GIL)"
    if other_run > 0.8 * span:
        return "starved (other processes on the CPUs)"
    if worker_run > 0.6 * span:
        return "GIL held by the worker (few wakes)"
    if loop_run > 0.4 * span:
        return "loop's own work"
    return "other"


def main(timehist, probe_output):
    out = open(probe_output).read()
    loop = re.search(r"loop tid (\d+)", out).group(1)
    windows = [(float(a), float(b), float(late)) for late, a, b in LATE.findall(out)]
    rows = []
    for line in open(timehist):
        m = EVENT.match(line)
        if m:
            try:
                rows.append((float(m.group(1)), m))
            except ValueError:
                continue
    times = [t for t, _ in rows]
    kinds, worst = collections.Counter(), collections.defaultdict(float)
    for a, b, late in windows:
        loop_delay = loop_run = worker_run = other_run = 0.0
        loop_wakes = 0
        for _, m in rows[bisect.bisect_left(times, a) : bisect.bisect_right(times, b)]:
            ids = m.group(4)
            if m.group(6):
                loop_wakes += m.group(6).endswith(f"[{loop}]")
                continue
            run, delay = float(m.group(9)), float(m.group(8))
            if ids == loop:
                loop_run += run
                loop_delay += delay
            elif ids.endswith("/" + loop):
                worker_run += run
            else:
                other_run += run
        kind = cause((b - a) * 1e3, loop_delay, loop_wakes, worker_run, other_run, loop_run)
        kinds[kind] += 1
        worst[kind] = max(worst[kind], late)
    by_cause = {k: (v, round(worst[k], 1)) for k, v in kinds.items()}
    print(f"late ticks > 8 ms: {len(windows)}; by cause (count, worst ms): {by_cause}")


main(sys.argv[1], sys.argv[2])
