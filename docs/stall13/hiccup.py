# mypy: ignore-errors
"""A machine-wide stall detector beside the opens (thirteenth session, issue 14).

``python docs/stall13/hiccup.py SECONDS OUT.json``: a separate, idle process that sleeps
1 ms at a time and keeps every wake more than 5 ms late (its start on CLOCK_MONOTONIC,
the clock of ``time.perf_counter`` in every process, so its events line up with
:mod:`gc_probe`'s late ticks), with the machine's stolen CPU time (``/proc/stat``'s steal,
in jiffies) over each. A wake this process sees late at the same moment as an open's loop
is the machine's (another process, the hypervisor), not the open's code.

``python docs/stall13/hiccup.py correlate LOOP_OUT OUT.json``: each late tick (> 10 ms)
of a ``gc_probe.py loop`` run's output beside the detector's late wakes that overlap it
(their start relative to the tick's, in ms; their lateness; stolen jiffies)."""

import json
import sys
import time


def _steal():
    with open("/proc/stat", "rb") as f:
        return int(f.readline().split()[8])


def main(seconds, out):
    events, end = [], time.perf_counter() + seconds
    steal, read = _steal(), time.perf_counter()
    while (before := time.perf_counter()) < end:
        time.sleep(0.001)
        late = time.perf_counter() - before - 0.001
        if late > 0.005:
            now = _steal()
            events.append([before, late, now - steal])
            steal, read = now, time.perf_counter()
        elif before - read > 0.1:  # every 100 ms, so a late wake's steal is about its own
            steal, read = _steal(), before
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "events": events, "steal_total": _steal()}, f)


def correlate(loop_out, hiccups):
    """Each open of ``gc_probe.py loop``'s output (``loop_out``) whose loop was late by
    more than 10 ms, with the detector's late wakes (``hiccups``) that overlap that tick."""
    events = json.load(open(hiccups))["events"]
    for line in open(loop_out):
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        for start, ms, *sched in row["late_over_10ms"]:
            end = start + ms / 1e3 + 0.001
            seen = [
                [round((e[0] - start) * 1e3, 1), round(e[1] * 1e3, 1), e[2]]
                for e in events
                if e[0] < end and e[0] + e[1] + 0.001 > start
            ]
            print(json.dumps({"i": row["i"], "late_ms": ms, "sched": sched, "detector": seen}))
    print(f"detector: {len(events)} wakes > 5 ms late in total")


if __name__ == "__main__":
    if sys.argv[1] == "correlate":
        correlate(sys.argv[2], sys.argv[3])
    else:
        main(float(sys.argv[1]), sys.argv[2])
