"""The spill phase of ``kvtrio bench serve``: inter-token latency of a stream while other
requests make the server save large entries, against the same without a save (see
:func:`spill`), and its ratios (:func:`spill_ratios`)."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

from kvtrio.bench.serve_harness import (
    Server,
    itl,
    median,
    no_eos,
    pct,
    prompt_words,
    round_order,
    running,
)
from kvtrio.bench.serve_restart import QUESTION
from kvtrio.serve.savetrace import SaveSpan

__all__ = ["SPILL_SERVERS", "spill", "spill_ratios", "spilled"]


#: The spill phase's servers: (label, server kind, --prompt-cache-size). With two
#: entries in RAM the continuation is a RAM hit on every server and the next request's
#: insert evicts a large entry (kvtrio saves it then); "kvtrio_nosave" is kvtrio serve
#: with room for every entry of the phase: the same requests, no save.
SPILL_SERVERS = (
    ("mlx_lm", "mlx_lm", 2),
    ("naive", "naive", 2),
    ("kvtrio", "kvtrio", 2),
    ("kvtrio_nosave", "kvtrio", 64),
)

#: Seconds of the stream measured after the saving requests end, on every server: kvtrio's
#: save goes on after the eviction (owner jobs, worker threads), its write-back waiting up
#: to ``--write-defer`` (2 s) while S decodes, and the window must hold it.
SPILL_TAIL_S = 3.0

#: Longest wait past the window for a save the server recorded as not yet settled: the
#: window then stretches to the save's end (``window_stretched_s``).
SPILL_SETTLE_S = 10.0

#: max_tokens of the spill phase's stream S, which the client ends once the window is over.
SPILL_STREAM_CAP = 100_000


def spilled(server: Server) -> int | None:
    """kvtrio serve's count of RAM entries handed to disk so far (None for the others)."""
    if server.kind != "kvtrio":
        return None
    for line in server.metrics().splitlines():
        if line.startswith("kvtrio_serve_spilled_total"):
            return int(float(line.split()[-1]))
    return None


def _cached(result: dict[str, Any]) -> int:
    return int((result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _spill_round(
    server: Server, label: str, document: str, tokens: int, r: int, bias: dict[str, float]
) -> tuple[list[float], list[float], list[float], dict[str, Any]]:
    """One round of the spill phase on ``server`` (see :func:`_spill`): the quiet stream's
    gaps, the "during" gaps, those overlapping a save, and the round's checks."""
    alone = server.chat([{"role": "user", "content": f"Quiet stream {r}."}], tokens)
    big = [{"role": "user", "content": f"Round {r}. {document}"}]
    answer = server.chat(big, 1)["text"]
    more = [*big, {"role": "assistant", "content": answer}]
    more.append({"role": "user", "content": QUESTION})
    stream: dict[str, Any] = {}
    started, leave = threading.Event(), threading.Event()
    busy = [{"role": "user", "content": f"Busy stream {r}."}]
    # S runs until the window has ended (the client then leaves): with a fixed length a
    # fast server finished it before the window began (no samples).
    thread = threading.Thread(
        target=lambda out=stream, go=started, ask=busy, quit=leave: out.update(
            server.chat_watching(ask, SPILL_STREAM_CAP, 8, go, stop=quit, logit_bias=bias)
        )
    )
    spilled_before, since = spilled(server), time.perf_counter()
    thread.start()
    if not started.wait(600):
        raise RuntimeError(f"{label}: the stream did not start")
    continued = server.chat(more, 1)
    evicting = server.chat([{"role": "user", "content": f"Evict {r}."}], 1)
    begin, end = continued["headers"], evicting["done"] + SPILL_TAIL_S
    time.sleep(max(0.0, end - time.perf_counter()))
    spans, stretched = _settled_saves(server, (spilled_before, since), begin, end)
    end += stretched
    time.sleep(max(0.0, end - time.perf_counter()) + 0.1)
    leave.set()
    thread.join()
    spilled_after = spilled(server)
    arrivals = [t for t in stream["arrivals"] if begin <= t <= end]
    during = itl(arrivals)
    # "While an entry is saved": S's gaps that overlap one of the server's save spans
    # (hand-over to settled), and those that overlap an entry's own store.
    gaps = list(itertools.pairwise(arrivals))
    saving = [b - a for a, b in gaps if any(span.overlaps(a, b) for span in spans)]
    writing = [b - a for a, b in gaps if any(span.write_overlaps(a, b) for span in spans)]
    check = {
        "continued_cached_tokens": _cached(continued),
        "continued_prompt_tokens": int(continued["usage"].get("prompt_tokens", 0)),
        "spilled_while_streaming": (
            None
            if spilled_before is None or spilled_after is None
            else spilled_after - spilled_before
        ),
        "window_s": end - begin,
        "stream_outlived_window": bool(stream["arrivals"]) and stream["arrivals"][-1] > end,
        "samples": len(during),
        "itl_p99_ms_during": 1e3 * pct(during, 0.99),
        "itl_max_ms_during": 1e3 * max(during, default=float("nan")),
        "saves": len(spans),
        "save_ms": [round(1e3 * (span.end - span.start), 1) for span in spans],
        "window_stretched_s": stretched,
        "samples_saving": len(saving),
        "itl_max_ms_saving": 1e3 * max(saving, default=float("nan")),
        "write_ms": [
            round(1e3 * (span.write_end - span.write_start), 1)
            for span in spans
            if span.write_start is not None and span.write_end is not None
        ],
        "samples_writing": len(writing),
        "itl_max_ms_writing": 1e3 * max(writing, default=float("nan")),
    }
    return itl(alone["arrivals"]), during, saving, check


def _settled_saves(
    server: Server, before: tuple[int | None, float], begin: float, end: float
) -> tuple[list[SaveSpan], float]:
    """The server's saves that overlap the window [begin, end], once every entry kvtrio
    handed to disk since ``before`` (its count of them, and when it was read) has its
    span (at most :data:`SPILL_SETTLE_S` later), and the seconds the window must stretch
    to hold the last of them."""
    spilled_now, (spilled_before, since) = spilled(server), before
    handed = 0 if spilled_now is None or spilled_before is None else spilled_now - spilled_before
    deadline = time.perf_counter() + SPILL_SETTLE_S
    spans = server.save_spans()
    while sum(span.start >= since for span in spans) < handed and time.perf_counter() < deadline:
        time.sleep(0.05)
        spans = server.save_spans()
    spans = [span for span in spans if span.overlaps(begin, end)]
    return spans, max(0.0, max((span.end for span in spans), default=end) - end)


def spill(
    model: Path, root: Path, length: int, tokens: int, rounds: int, log: Path
) -> dict[str, dict[str, Any]]:
    """Inter-token latency of a stream S while other requests make the server save large
    entries, and of a stream alone, on every server of :data:`SPILL_SERVERS`: each round
    runs them one at a time in :func:`round_order` (reversed every other round), each
    started afresh, warmed up, measured and stopped before the next starts (with several
    running, which server started first moved its decode rate on the H200).

    Each round: a quiet stream (``tokens`` tokens, nothing else running); a
    ``length``-token prompt answered with one token (entry B in RAM); then S and, once S
    has decoded 8 tokens, B's conversation continued (C: a RAM hit, a few tokens to
    prefill; its inserts are ``length``-token entries, which the naive baseline saves at
    once, on the generation thread) and then a short unrelated request E (with two
    entries in RAM its insert evicts B: kvtrio saves it then). The "during" sample is
    S's latencies from the moment the server took C (C's headers arrived: mlx-lm decodes
    a batch for up to 0.5 s before it looks at new requests) to :data:`SPILL_TAIL_S`
    after E ended, stretched to the end of any save that overlaps it and had not
    settled by then; S runs until then (its client leaves after the window). The
    "saving" sample is the part of it while an entry is saved: S's gaps that overlap a
    save span the server recorded (``kvtrio serve --save-trace``, the naive baseline's
    synchronous saves the same way; :mod:`kvtrio.serve.savetrace`). Plain
    mlx_lm.server runs the same requests and saves nothing, and so does kvtrio with a
    RAM cache large enough for every entry (``kvtrio_nosave``): the same load without a
    save, the reference of the check. Per server: p50/p99/max over all rounds' samples,
    and per round its p99, the tokens C reused (a hit on every server, or the round
    would measure a recompute), for kvtrio the entries spilled while S ran, and whether
    S outlived the window, with the server's ``position`` in the round's order, its
    ``pid`` and when it was ``alive``.
    """
    bias = no_eos(model)  # S must not end on its own
    document = prompt_words(model, length)
    quiet: dict[str, list[float]] = {label: [] for label, _, _ in SPILL_SERVERS}
    during: dict[str, list[float]] = {label: [] for label, _, _ in SPILL_SERVERS}
    saving: dict[str, list[float]] = {label: [] for label, _, _ in SPILL_SERVERS}
    checks: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in SPILL_SERVERS}
    specs = {label: (kind, size) for label, kind, size in SPILL_SERVERS}
    for r in range(rounds):
        for position, label in enumerate(round_order(list(specs), r)):
            kind, size = specs[label]
            extra = ("--prompt-cache-size", str(size))
            work = root / f"{label}-spill-{r}"
            with running(kind, model, work, log, extra, trace_saves=True) as server:
                server.chat([{"role": "user", "content": f"warm up {r}"}], 4)
                server.wait_cold_ready()
                alone, gaps, saved, check = _spill_round(
                    server, label, document, tokens, r, bias
                )
            quiet[label] += alone
            during[label] += gaps
            saving[label] += saved
            checks[label].append({**check, "position": position, **server.tags()})
    return {
        label: {
            "itl_p50_ms_quiet": 1e3 * pct(quiet[label], 0.5),
            "itl_p99_ms_quiet": 1e3 * pct(quiet[label], 0.99),
            "itl_p50_ms_during": 1e3 * pct(during[label], 0.5),
            "itl_p99_ms_during": 1e3 * pct(during[label], 0.99),
            "itl_max_ms_during": 1e3 * max(during[label], default=float("nan")),
            "samples_during": len(during[label]),
            "itl_p99_ms_saving": 1e3 * pct(saving[label], 0.99),
            "itl_max_ms_saving": 1e3 * max(saving[label], default=float("nan")),
            "samples_saving": len(saving[label]),
            "itl_max_ms_writing": max(
                (r["itl_max_ms_writing"] for r in checks[label] if r["samples_writing"]),
                default=float("nan"),
            ),
            "rounds": checks[label],
        }
        for label in quiet
    }


def spill_ratios(spill: dict[str, Any]) -> dict[str, Any]:
    """The spill phase's ratios, every one of the same run."""
    kv, naive, plain = spill["kvtrio"], spill["naive"], spill["mlx_lm"]
    nosave = spill["kvtrio_nosave"]
    return {
        # The check: the same streams and requests, with a save and without one.
        "itl_p99_kvtrio_during_vs_nosave": kv["itl_p99_ms_during"]
        / nosave["itl_p99_ms_during"],
        # The same per round (kvtrio's p99 over kvtrio_nosave's, rounds run back to
        # back), and their median: how much of the pooled ratio is one round's noise.
        "itl_p99_kvtrio_during_vs_nosave_per_round": (
            per_round := _per_round(kv, nosave, "itl_p99_ms_during")
        ),
        "itl_p99_kvtrio_during_vs_nosave_round_median": median(per_round),
        "itl_p99_kvtrio_during_vs_quiet": kv["itl_p99_ms_during"] / kv["itl_p99_ms_quiet"],
        "itl_p99_kvtrio_vs_mlx_lm_during": kv["itl_p99_ms_during"] / plain["itl_p99_ms_during"],
        "itl_p99_naive_vs_kvtrio_during": naive["itl_p99_ms_during"] / kv["itl_p99_ms_during"],
        # The "2x better than naive during a save" check, per round and its median.
        "itl_p99_naive_vs_kvtrio_during_per_round": (
            naive_round := _per_round(naive, kv, "itl_p99_ms_during")
        ),
        "itl_p99_naive_vs_kvtrio_during_round_median": median(naive_round),
        "itl_p99_naive_during_vs_quiet": naive["itl_p99_ms_during"] / naive["itl_p99_ms_quiet"],
        # The same check read while an entry is saved (S's gaps overlapping a save
        # span): the largest such gap, pooled and per round, and the pooled p99.
        "itl_max_naive_vs_kvtrio_saving": naive["itl_max_ms_saving"]
        / kv["itl_max_ms_saving"],
        "itl_max_naive_vs_kvtrio_saving_per_round": (
            saving_round := _per_round(naive, kv, "itl_max_ms_saving")
        ),
        "itl_max_naive_vs_kvtrio_saving_round_median": median(saving_round),
        "itl_p99_naive_vs_kvtrio_saving": naive["itl_p99_ms_saving"]
        / kv["itl_p99_ms_saving"],
        # ... and while an entry's own store runs (naive's save is its store).
        "itl_max_naive_vs_kvtrio_writing": naive["itl_max_ms_writing"]
        / kv["itl_max_ms_writing"],
        "itl_max_naive_vs_kvtrio_writing_per_round": (
            writing_round := _per_round(naive, kv, "itl_max_ms_writing")
        ),
        "itl_max_naive_vs_kvtrio_writing_round_median": median(writing_round),
    }


def _per_round(top: dict[str, Any], bottom: dict[str, Any], key: str) -> list[float]:
    """``top``'s figure over ``bottom``'s, round by round (rounds run back to back)."""
    return [a[key] / b[key] for a, b in zip(top["rounds"], bottom["rounds"], strict=True)]
