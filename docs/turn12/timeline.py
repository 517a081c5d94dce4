# mypy: ignore-errors
"""Per-stage medians of turn 2 from the turn12 probe's file (probe/sitecustomize.py).

    python docs/turn12/timeline.py PROBE.log [PROBE2.log ...] [--events]

A round is a chat whose server process served no other chat (the restart phase's turn
2). First the turn's stages, naive against kvtrio (medians over rounds, ms), then
kvtrio's cold load step by step (each job and each hand-off between the tier's loop,
its worker thread and the generation thread). With ``--events``, per server kind: for
each event (label, edge) the median over rounds of its first occurrence after the client
sent turn 2 (quartiles, rounds that had it); each span's duration (its first begin to
the end after it); the time spent, from the send to the first Response, in spans that
repeat (batch steps, inserts, saves, owner jobs, pumps), summed per round.
"""

import collections
import statistics
import sys


def _q(values):
    values = sorted(values)
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def load(paths):
    events = collections.defaultdict(list)
    chats = []
    for path in paths:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6:
                    continue
                pid, _, thread, label, edge, ns = parts[:6]
                extra = parts[6:]
                if label == "client.chat":
                    server, spid, sent, headers, first, cache = extra
                    chats.append(
                        (server, (path, int(spid)), int(sent), int(headers), int(first), cache)
                    )
                else:
                    events[(path, int(pid))].append((int(ns), label, edge, thread, extra))
    return events, chats


def _first(evs, label, edge):
    return next(e[0] for e in evs if e[1] == label and e[2] == edge)


def _rounds(events, chats, kind):
    per_pid = collections.Counter(c[1] for c in chats)
    for c in chats:
        if c[0] == kind and per_pid[c[1]] == 1:
            yield c, sorted(e for e in events[c[1]] if e[0] >= c[2])


# The turn's stages: (name, mark that ends it), each mark (label, edge); the handler's
# tokenization (kvtrio, with the arrival's prefetch) or the generation thread's (naive).
_STAGES = [
    ("send -> tokenized (kvtrio: + the arrival's prefetch asked)", None),
    ("tokenized -> lookup done (GenerationContext made)", ("ctx", "m")),
    ("lookup done -> first batch step done (prefill)", ("bg.next", "e")),
    ("first step -> the prompt's insert done (naive: its save)", ("pc.insert", "e")),
    ("insert -> first Response (the rest of the prefill, 1st decode)", ("response", "m")),
]

# kvtrio's load, mark to mark (the tier's loop, its worker, the generation thread).
_LOAD = [
    ("loop: load begun -> header read asked", "loop.tier.load b", "loop.reader.read_header b"),
    ("  hand-off loop -> worker (header)", "loop.reader.read_header b", "worker.header_job b"),
    (
        "worker: manifest read, parse, checks, block stats",
        "worker.header_job b",
        "worker.header_job e",
    ),
    ("  hand-off worker -> loop (header)", "worker.header_job e", "loop.reader.read_header e"),
    (
        "  loop -> owner job queued (allocation)",
        "loop.reader.read_header e",
        "owner.run._allocate_group b",
    ),
    (
        "  hand-off loop -> generation thread (allocation)",
        "owner.run._allocate_group b",
        "owner.job._allocate_group b",
    ),
    ("generation thread: allocation", "owner.job._allocate_group b", "owner.job._allocate_group e"),
    (
        "  hand-off generation thread -> loop (allocation)",
        "owner.job._allocate_group e",
        "owner.run._allocate_group e",
    ),
    ("  loop -> reads asked", "owner.run._allocate_group e", "loop.reader.read_tensors b"),
    ("  hand-off loop -> worker (reads)", "loop.reader.read_tensors b", "worker.tensors_job b"),
    ("worker: block opens, reads, sha256", "worker.tensors_job b", "worker.tensors_job e"),
    ("  hand-off worker -> loop (reads)", "worker.tensors_job e", "loop.reader.read_tensors e"),
    (
        "  loop -> owner job queued (assembly)",
        "loop.reader.read_tensors e",
        "owner.run._assemble b",
    ),
    (
        "  hand-off loop -> generation thread (assembly)",
        "owner.run._assemble b",
        "owner.job._assemble b",
    ),
    ("generation thread: assembly", "owner.job._assemble b", "owner.job._assemble e"),
    (
        "  hand-off generation thread -> loop (assembly)",
        "owner.job._assemble e",
        "owner.run._assemble e",
    ),
    ("  loop: load done -> lookup's reply posted", "loop.tier.load e", "owner.post b"),
    ("  hand-off loop -> generation thread (reply)", "owner.post b", "owner.wait e"),
    ("  reply -> GenerationContext", "owner.wait e", "ctx m"),
    ("load begun -> GenerationContext (all)", "loop.tier.load b", "ctx m"),
    ("(handler: tokenized -> load begun)", "kv.tier_prompt e", "loop.tier.load b"),
]


def _row(name, values, extra=""):
    lo, mid, hi = _q(values)
    print(f"{name:66} {mid:7.2f} ({lo:.2f}-{hi:.2f}) {extra}")


def stages(events, chats):
    out = {}
    for kind in ("naive", "kvtrio"):
        table = collections.defaultdict(list)
        for (_, _, sent, _, first, _), evs in _rounds(events, chats, kind):
            try:
                tokenized = _first(
                    evs, *(("kv.arrival", "e") if kind == "kvtrio" else ("tokenize", "e"))
                )
                marks = [tokenized] + [_first(evs, *mark) for _, mark in _STAGES[1:]]
            except StopIteration:
                continue
            before = sent
            for (name, _), mark in zip(_STAGES, marks, strict=True):
                table[name].append((mark - before) / 1e6)
                before = mark
            table["first Response -> first token at the client"].append((first - before) / 1e6)
            table["time to first token"].append((first - sent) / 1e6)
        out[kind] = table
    print(f"{'stage (medians over rounds, ms; quartiles)':66} naive | kvtrio")
    for name in out["naive"]:
        a, b = out["naive"][name], out["kvtrio"][name]
        la, ma, ha = _q(a)
        lb, mb, hb = _q(b)
        print(f"{name:66} {ma:6.2f} ({la:.1f}-{ha:.1f}) | {mb:6.2f} ({lb:.1f}-{hb:.1f})")
    print(
        f"rounds: naive {len(out['naive']['time to first token'])}, "
        f"kvtrio {len(out['kvtrio']['time to first token'])}"
    )


def load_steps(events, chats):
    table = collections.defaultdict(list)
    for _, evs in _rounds(events, chats, "kvtrio"):
        for name, a, b in _LOAD:
            try:
                table[name].append((_first(evs, *b.split()) - _first(evs, *a.split())) / 1e6)
            except StopIteration:
                pass
    print(f"\n{'kvtrio load step (ms: median (quartiles))':66}")
    for name, *_ in _LOAD:
        if table[name]:
            _row(name, table[name])


def main(paths):
    verbose = "--events" in paths
    paths = [p for p in paths if p != "--events"]
    events, chats = load(paths)
    stages(events, chats)
    load_steps(events, chats)
    if verbose:
        event_tables(events, chats)


def event_tables(events, chats):
    per_pid = collections.Counter(c[1] for c in chats)
    rounds = [c for c in chats if per_pid[c[1]] == 1]
    by_kind = collections.defaultdict(list)
    for c in rounds:
        by_kind[c[0]].append(c)
    for kind in ("naive", "kvtrio", "mlx_lm"):
        rs = by_kind.get(kind, [])
        if not rs:
            continue
        firsts = collections.defaultdict(list)
        spans = collections.defaultdict(list)
        repeat = collections.defaultdict(list)
        repeat_n = collections.defaultdict(list)
        ttft, headers = [], []
        for _, pid, sent, head, first, _cache in rs:
            ttft.append((first - sent) / 1e6)
            headers.append((head - sent) / 1e6)
            evs = sorted(e for e in events[pid] if e[0] >= sent)
            seen = set()
            opened = {}
            totals = collections.Counter()
            counts = collections.Counter()
            response = next((e[0] for e in evs if e[1] == "response"), first)
            for ns, label, edge, thread, extra in evs:
                if label == "write" and extra and extra[-1] == "1":
                    label = "write.content"
                if label == "bg.next" and edge == "b" and extra:
                    ns = int(extra[0])  # the step's start
                key = (label, edge)
                if key not in seen:
                    seen.add(key)
                    firsts[key].append((ns - sent) / 1e6)
                if edge == "b":
                    opened.setdefault((label, thread), ns)
                elif edge == "e" and (label, thread) in opened:
                    began = opened.pop((label, thread))
                    if (label, "span") not in seen:
                        seen.add((label, "span"))
                        spans[label].append((ns - began) / 1e6)
                    if began < response:
                        totals[label] += (min(ns, response) - began) / 1e6
                        counts[label] += 1
            for label, total in totals.items():
                repeat[label].append(total)
                repeat_n[label].append(counts[label])
        n = len(rs)
        print(
            f"\n== {kind}: {n} rounds; TTFT median {statistics.median(ttft):.1f} ms "
            f"(quartiles {_q(ttft)[0]:.1f}-{_q(ttft)[2]:.1f}); headers "
            f"{statistics.median(headers):.1f} ms"
        )
        print(f"{'event':48} {'q1':>7} {'median':>7} {'q3':>7} rounds   (ms after send)")
        rows = sorted(firsts.items(), key=lambda kv: statistics.median(kv[1]))
        for (label, edge), values in rows:
            lo, mid, hi = _q(values)
            if mid > statistics.median(ttft) + 50:
                continue
            print(f"{label + ' ' + edge:48} {lo:7.2f} {mid:7.2f} {hi:7.2f} {len(values):3}")
        print(f"\n{'span (first occurrence)':48} {'q1':>7} {'median':>7} {'q3':>7} rounds")
        for label, values in sorted(spans.items()):
            lo, mid, hi = _q(values)
            print(f"{label:48} {lo:7.2f} {mid:7.2f} {hi:7.2f} {len(values):3}")
        title = "summed from send to first Response"
        print(f"\n{title:48} {'q1':>7} {'median':>7} {'q3':>7} n/round")
        for label, values in sorted(repeat.items()):
            lo, mid, hi = _q(values)
            count = statistics.median(repeat_n[label])
            print(f"{label:48} {lo:7.2f} {mid:7.2f} {hi:7.2f} {count:5.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
