# mypy: ignore-errors
"""Turn 2's stages for every server kind from the turn12 probe's file, the floor included
(gpu14): a round is the last chat a server process answered (the restart phase's turn 2;
the never-restarted floor answers turn 1 first in the same process, so its turn 2 is its
second chat). Stages end at the first mark of each after the client's send; ms, medians
(min-max) over rounds.

    python3 floorstages.py PROBE.log [RESTART14.jsonl]

With restart14.py's lines, each turn 2 is named by its server's name there (the turn-2
chats in the order they were sent, checked against each line's ttft_s), not its kind.
"""

import collections
import json
import statistics
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "turn12"))
from timeline import load

MARKS = [
    ("send -> tokenized", ("tokenize", "e"), ("kv.arrival", "e")),
    ("-> lookup done (GenerationContext)", ("ctx", "m"), None),
    ("-> first batch step done (prefill)", ("bg.next", "e"), None),
    ("-> the prompt's insert done", ("pc.insert", "e"), None),
    ("-> first Response (split, 1st decode)", ("response", "m"), None),
]


def main(path, named=None):
    events, chats = load([path])
    last = {}
    count = collections.Counter(c[1] for c in chats)
    for c in chats:
        last[c[1]] = c  # chats come in order: the last one wins
    names = {}
    if named:
        lines = [json.loads(x) for x in open(named) if x.strip()]
        turns = [x for x in lines if "ttft_s" in x]
        turn1 = {pid for pid, c in last.items() if count[pid] > 1 and c[0] in ("kvtrio", "naive")}
        seconds = sorted((c[2], pid) for pid, c in last.items() if pid not in turn1)
        for (_, pid), line in zip(seconds, turns, strict=True):
            c = last[pid]
            assert abs((c[4] - c[2]) / 1e9 - line["ttft_s"]) < 0.002, (line["name"], c)
            names[pid] = line["name"]
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for pid, c in last.items():
        server, _, sent, _headers, first, _cache = c
        kind = names.get(pid) or server + ("_never_restarted" if count[pid] > 1 else "")
        evs = sorted(e for e in events[pid] if e[0] >= sent)
        prev = sent
        for name, mark, kv_mark in MARKS:
            want = kv_mark if (server == "kvtrio" and kv_mark) else mark
            hit = next((e[0] for e in evs if (e[1], e[2]) == want), None)
            if hit is None:
                continue
            rows[kind][name].append((hit - prev) / 1e6)
            prev = hit
        rows[kind]["-> first token at the client"].append((first - prev) / 1e6)
        rows[kind]["time to first token"].append((first - sent) / 1e6)
    names = [m[0] for m in MARKS] + ["-> first token at the client", "time to first token"]
    kinds = sorted(rows)
    print(f"{'stage (ms, median (min-max))':40s} " + " | ".join(f"{k:>24s}" for k in kinds))
    for name in names:
        cells = []
        for k in kinds:
            v = rows[k].get(name, [])
            cells.append(f"{statistics.median(v):8.2f} ({min(v):.0f}-{max(v):.0f})" if v else "-")
        print(f"{name:40s} " + " | ".join(f"{c:>24s}" for c in cells))
    print("rounds:", {k: len(rows[k]["time to first token"]) for k in kinds})


if __name__ == "__main__":
    main(*sys.argv[1:3])
