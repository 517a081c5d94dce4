# mypy: ignore-errors
"""Per thread, in each window of a ``perf sched timehist -w`` listing: CPU time, run-queue
wait (sch delay) and wake-ups (twelfth session, issue 14; see ``sched_probe.py``).

``python3 docs/scale12/late_windows.py TIMEHIST FROM:TO ...``: a late tick whose event-loop
thread shows a long sch delay waited for a CPU (the machine's load); one whose loop thread
was woken many times, running microseconds each, while a worker of the same process ran,
waited for the GIL behind that worker (the convoy: kvtrio.actors.loopturns)."""

import collections
import re
import sys

EVENT = re.compile(
    r"\s*\S+\s+\[(\d+)\]\s+(.+?)\[([\d/]+)\]\s+(awakened: (.+)|([\d.]+)\s+([\d.]+)\s+([\d.]+))"
)


def main(path, windows):
    rows = []
    for line in open(path):
        parts = line.split()
        try:
            rows.append((float(parts[0]), line))
        except (ValueError, IndexError):
            continue
    for a, b in windows:
        run, wakes, delay = collections.Counter(), collections.Counter(), collections.Counter()
        for t, line in rows:
            if not a <= t <= b:
                continue
            m = EVENT.match(line)
            if not m:
                continue
            name = m.group(2).strip()[:14] + "[" + m.group(3) + "]"
            if m.group(5):
                wakes[m.group(5).strip()] += 1
            else:
                run[name] += float(m.group(8))
                delay[name] += float(m.group(7))
        print(f"window {a}-{b} ({(b - a) * 1e3:.1f} ms)")
        for name, ran in run.most_common(8):
            print(f"   run {ran:7.3f} ms  sch delay {delay[name]:6.3f}  {name}")
        print("   wakes:", wakes.most_common(4))


main(sys.argv[1], [tuple(map(float, w.split(":"))) for w in sys.argv[2:]])
