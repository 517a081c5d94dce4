"""The restart phase of ``kvtrio bench serve`` (:mod:`kvtrio.bench.serve`): turn 2 of a
conversation after a server restart, in alternated rounds on every server, and its
ratios (per round and of the medians)."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

from kvtrio.bench.serve_harness import Server, median, prompt_words

__all__ = [
    "KINDS",
    "NEVER_RESTARTED",
    "QUESTION",
    "WARMUP",
    "metric_samples",
    "restart",
    "restart_ratios",
]

KINDS = ("mlx_lm", "naive", "kvtrio")
QUESTION = "Please summarise the document above in one sentence."
#: ``--restart-warmup``: the unrelated short request every server (all three alike) answers
#: after its start and before turn 2, untimed by the ratios: a restarted production server
#: has served other traffic (MLX's first-request compiles) before a returning conversation.
#: A plain completion, not a chat: with no chat template it shares no token with turn 2,
#: so no server's lookup prefers it (the naive baseline reads its files only when RAM
#: matches nothing, and a warm-up chat's template start would be such a match).
WARMUP = "Warm-up request: say hello."


def restart(
    model: Path,
    root: Path,
    length: int,
    rounds: int,
    settle: float,
    log: Path,
    *,
    warmup: bool = False,
    floor: bool = False,
    kvtrio_args: tuple[str, ...] = (),
) -> dict[str, dict[str, Any]]:
    """Turn 2 after a restart, ``rounds`` times on every server, alternating their order.

    The naive baseline and kvtrio serve first answer turn 1 of ``rounds`` conversations
    of ``length`` tokens (one start each; conversation ``r`` opens with its own number,
    so no round reuses another's entry) and stop (SIGTERM: kvtrio serve writes its RAM
    entries to disk, the naive baseline wrote its files on insert); plain mlx_lm.server,
    which keeps nothing over a restart, is sent the naive baseline's turn 2. Then round
    ``r`` restarts every server in turn (the order reversed every other round, as the
    decode phase's), waits until it has settled (:meth:`Server.settle`) and sends
    conversation ``r``'s turn 2, streamed.
    A server's time to first token and start time are medians over the rounds; ``runs``
    keeps every round (with the server's ``position`` in that round's order; its answer is
    compared with mlx_lm.server's of the same round).
    ``warmup``: every server, once settled, first answers :data:`WARMUP` (8 tokens, not
    streamed; its time kept as the run's ``warmup_s``) and waits NAIVE_SAVE_S, the same
    for all three, so turn 2 is not the process's first request.
    ``floor``: a fourth server in every round, :data:`NEVER_RESTARTED`: plain
    mlx_lm.server answering turn 1 and then turn 2 in one process (turn 2 a hit in its
    own RAM), the time no cache that survives a restart can beat.
    ``kvtrio_args``: flags for every kvtrio serve started here (turn 1's and each
    round's)."""
    document = prompt_words(model, length)
    turns1 = [[{"role": "user", "content": f"Conversation {r}. {document}"}] for r in range(rounds)]
    turns2: dict[str, list[list[dict[str, str]]]] = {}
    turn1_exit: dict[str, dict[str, float]] = {}
    for kind in ("naive", "kvtrio"):  # mlx_lm.server keeps nothing over a restart
        extra = kvtrio_args if kind == "kvtrio" else ()
        server = Server(kind, model, root / f"{kind}-{length}", log, extra)
        try:
            turns2[kind] = []
            for turn1 in turns1:
                one = server.chat(turn1, 8)
                more = [*turn1, {"role": "assistant", "content": one["text"]}]
                turns2[kind].append([*more, {"role": "user", "content": QUESTION}])
            time.sleep(NAIVE_SAVE_S if kind == "naive" else 0.0)
        finally:
            server.stop()
        if kind == "kvtrio":  # its SIGTERM wrote the rounds' entries: how many, and lost
            turn1_exit = server.exit_counters()
    # Plain mlx_lm.server recomputes turn 2 whatever it did before its restart: its turn
    # 2 is the naive baseline's (mlx-lm's own answer to turn 1 at temperature 0).
    turns2["mlx_lm"] = turns2["naive"]
    kinds: tuple[str, ...] = KINDS
    if floor:  # plain mlx_lm.server's turns, turn 1 answered in the same process
        kinds, turns2[NEVER_RESTARTED] = (*KINDS, NEVER_RESTARTED), turns2["naive"]
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for position, kind in enumerate(kinds if r % 2 == 0 else kinds[::-1]):
            work = root / f"{kind}-{length}"
            prime = turns1[r] if kind == NEVER_RESTARTED else None
            extra = kvtrio_args if kind == "kvtrio" else ()
            run = _turn2(kind, model, work, turns2[kind][r], settle, log, warmup, prime, extra)
            runs[kind].append({**run, "position": position})
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        done = runs[kind]
        out[kind] = {
            "ttft_s": median([run["ttft_s"] for run in done]),
            "restart_s": median([run["restart_s"] for run in done]),
            "prompt_tokens": done[0]["prompt_tokens"],
            "cached_tokens": min(run["cached_tokens"] for run in done),
            "answer": done[0]["answer"],
            "runs": done,
        }
    out["kvtrio"]["turn1_exit"] = turn1_exit
    return out


#: Seconds a server is given after its last answer before it is stopped (the naive
#: baseline saves a turn's cache after answering it: not torn by the stop).
NAIVE_SAVE_S = 0.5

#: ``floor``'s server: plain mlx_lm.server whose turn 2 follows turn 1 in one process.
NEVER_RESTARTED = "mlx_lm_never_restarted"


def _turn2(
    kind: str,
    model: Path,
    work: Path,
    turn2: list[dict[str, str]],
    settle: float,
    log: Path,
    warmup: bool = False,
    prime: list[dict[str, str]] | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One round of :func:`_restart` on one server: start, settle, (warm-up,) (``prime``,
    turn 1 answered in the same process, untimed,) turn 2, stop. ``extra``: more flags
    for the server."""
    server = Server("mlx_lm" if kind == NEVER_RESTARTED else kind, model, work, log, extra)
    seen: dict[str, Any] = {}
    warm: float | None = None
    try:
        server.settle(settle)
        if warmup:  # the same for every kind: answered, then the naive save's wait
            warm = _warm(server)
            time.sleep(NAIVE_SAVE_S)
        if prime is not None:  # turn 1 in this process: turn 2 a hit in its own RAM
            server.chat(prime, 8)
        if kind == "kvtrio":  # what the tier held when turn 2 was sent
            seen["before"] = metric_samples(server.metrics(), BEFORE)
        two = server.chat(turn2, 8)
        if kind == "kvtrio":  # how turn 2 was looked up (served, miss reasons, loads)
            seen["after"] = metric_samples(server.metrics(), AFTER)
        time.sleep(NAIVE_SAVE_S if kind == "naive" else 0.0)
    finally:
        server.stop()
    first = two["arrivals"][0] if two["arrivals"] else time.perf_counter()
    details = two["usage"].get("prompt_tokens_details") or {}
    run = {
        "ttft_s": first - two["sent"],
        "restart_s": server.start_s,
        "prompt_tokens": two["usage"].get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0),
        "answer": two["text"],
        "warmup_s": warm,
    }
    if kind == "kvtrio":
        run["tier"] = {**seen, "cache_header": two["cache"], "exit": server.exit_counters()}
    return run


def _warm(server: Server) -> float:
    """Seconds ``server`` took to answer :data:`WARMUP` (a plain completion, 8 tokens)."""
    body = {"prompt": WARMUP, "max_tokens": 8, "temperature": 0.0}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    sent = time.perf_counter()
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    response.read()
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"{server.kind}: the warm-up request failed ({response.status})")
    return time.perf_counter() - sent


#: kvtrio serve's /metrics samples a restart round keeps (name prefixes; zeros left out):
#: before turn 2, what the cold tier held; after it, how the lookup went.
#: (``kvtrio_serve_restored``: what the warm restart had loaded back into RAM by then.)
BEFORE = (
    "kvtrio_serve_cold_ready",
    "kvtrio_cache_entries",
    "kvtrio_cache_bytes",
    "kvtrio_serve_restored",
)
AFTER = (
    "kvtrio_serve_lookups_total",
    "kvtrio_serve_cold_unavailable_total",
    "kvtrio_cache_lookup_reasons_total",
    "kvtrio_cache_hits_total",
    "kvtrio_cold_read_bytes_total",
    "kvtrio_cold_drops_total",
    "kvtrio_serve_prefetches_total",
    "kvtrio_cold_prefetch",  # the arrival's prefetch: started, and its bytes used or wasted
)


def metric_samples(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The non-zero samples of Prometheus ``text`` whose names start with ``prefixes``
    (``name{labels}`` to value)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(prefixes):
            continue
        name, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        if number:
            out[name] = number
    return out


def restart_ratios(by_kind: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One length's ratios (kvtrio against mlx_lm.server and against the naive baseline);
    drops the answers it compared."""
    plain = by_kind["mlx_lm"]["ttft_s"]
    kv_runs, naive_runs = by_kind["kvtrio"]["runs"], by_kind["naive"]["runs"]
    plain_runs = by_kind["mlx_lm"]["runs"]

    def per_round(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[float]:
        return [a["ttft_s"] / b["ttft_s"] for a, b in zip(ours, theirs, strict=True)]

    same = [a["answer"] == b["answer"] for a, b in zip(kv_runs, plain_runs, strict=True)]
    ratios = {
        # Of the servers' medians over the rounds.
        "ttft_kvtrio_vs_mlx_lm": by_kind["kvtrio"]["ttft_s"] / plain,
        "ttft_naive_vs_mlx_lm": by_kind["naive"]["ttft_s"] / plain,
        "ttft_kvtrio_vs_naive": by_kind["kvtrio"]["ttft_s"] / by_kind["naive"]["ttft_s"],
        # Every round's answer, against mlx_lm.server's of the same round.
        "same_answer_as_mlx_lm": all(same),
        # Per round (servers restarted back to back), and their medians.
        "ttft_kvtrio_vs_naive_per_round": (vs_naive := per_round(kv_runs, naive_runs)),
        "ttft_kvtrio_vs_naive_round_median": median(vs_naive),
        "ttft_kvtrio_vs_mlx_lm_per_round": (vs_plain := per_round(kv_runs, plain_runs)),
        "ttft_kvtrio_vs_mlx_lm_round_median": median(vs_plain),
        "same_answer_as_mlx_lm_per_round": same,
    }
    if NEVER_RESTARTED in by_kind:  # the floor: how close to never having restarted
        never = by_kind[NEVER_RESTARTED]
        ratios["ttft_kvtrio_vs_never_restarted"] = by_kind["kvtrio"]["ttft_s"] / never["ttft_s"]
        vs_never = per_round(kv_runs, never["runs"])
        ratios["ttft_kvtrio_vs_never_restarted_per_round"] = vs_never
        ratios["ttft_kvtrio_vs_never_restarted_round_median"] = median(vs_never)
    for measured in by_kind.values():
        measured.pop("answer")
        for run in measured["runs"]:
            run.pop("answer")
    return ratios
