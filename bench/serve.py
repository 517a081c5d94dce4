"""``kvtrio bench serve``: plain mlx_lm.server, a naive persistence baseline and kvtrio serve,
on one model directory in one run.

For each conversation length: turn 1, a server restart (SIGTERM, start again), then turn 2
(turn 1, its answer, a new question) streamed, in ``--restart-rounds`` rounds that
alternate the servers' order (:mod:`kvtrio.bench.serve_restart`): the time to its first
token is the headline, per round and as medians (plain mlx_lm.server recomputes the whole
prompt; the naive baseline loads the file mlx-lm's ``save_prompt_cache`` wrote on every
insert, on the generation thread; kvtrio serves it from its cold tier). Then decode
tokens/s and inter-token latency, one stream and 8 at once, and the inter-token latency
of a stream while other requests make the server save large entries (the spill phase).
Ratios are against plain mlx_lm.server in the same run, and kvtrio's against the naive
baseline's. The default model is the tiny random-weight llama of
:mod:`kvtrio.serve.modeldir` (or ``--model DIR``): on a CPU, MLX's matmuls are slow, so
recompute times measured here are MLX-CPU bound.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvtrio.bench.argtypes import whole, wholes
from kvtrio.bench.serve_fill import fill
from kvtrio.bench.serve_harness import (
    Server,
    compile_kvtrio,
    first_vs_last,
    itl,
    median,
    no_eos,
    pct,
    prompt_words,
    round_order,
    running,
    start_pairs,
    steady_rate,
    workdir,
)
from kvtrio.bench.serve_restart import KINDS, QUESTION, restart, restart_ratios
from kvtrio.bench.serve_spill import spill, spill_ratios, spilled
from kvtrio.serve.modeldir import SHAPES

__all__ = ["add_arguments", "measure", "model_dir", "render"]

PHASES = ("restart", "decode", "spill", "disk", "start", "prefetch")


def _model(text: str) -> str:
    """``--model``: a GGUF file, or a directory holding an mlx-lm model's config.json
    (else the servers died at start and the bench with a traceback)."""
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return str(path)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no GGUF file, nor a directory with config.json")
    return str(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths",
        type=wholes,
        default="1024,4096",
        help="turn-1 prompt lengths in tokens (1024,4096)",
    )
    parser.add_argument(
        "--model",
        type=_model,
        help="a model directory, or a llama GGUF file converted once into the work directory"
        " (default: --model-shape, built)",
    )
    parser.add_argument(
        "--model-shape", default="tiny", choices=sorted(SHAPES), help="random llama built (tiny)"
    )
    parser.add_argument(
        "--decode-tokens", type=whole, default=128, help="tokens per decode stream (128)"
    )
    parser.add_argument("--streams", type=whole, default=8, help="concurrent streams (8)")
    parser.add_argument(
        "--dir", help="parent of the working directory, which is kept (default: a tmp dir)"
    )
    parser.add_argument(
        "--entries", type=int, default=1000, help="entries on disk for the restart time (1000)"
    )
    parser.add_argument(
        "--rounds", type=whole, default=5, help="decode rounds per server, alternating (5; median)"
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"which phases to run ({','.join(PHASES)}: all)",
    )
    parser.add_argument(
        "--spill-length",
        type=whole,
        default=4096,
        help="tokens of each entry saved during the spill phase (4096)",
    )
    parser.add_argument(
        "--spill-rounds",
        type=whole,
        default=5,
        help="spill rounds per server, alternating (5)",
    )
    parser.add_argument(
        "--spill-tokens",
        type=whole,
        default=512,
        help="tokens of the spill phase's quiet streams (512; the stream measured during "
        "the saves runs until its window ends)",
    )
    parser.add_argument(
        "--start-rounds", type=whole, default=3, help="starts per server, alternating (3; median)"
    )
    parser.add_argument(
        "--restart-rounds",
        type=whole,
        default=3,
        help="restarts per server and length, alternating (3; median)",
    )
    parser.add_argument(
        "--restart-warmup", action="store_true", help="each server answers a warm-up first"
    )
    parser.add_argument(
        "--restart-floor",
        action="store_true",
        help="add plain mlx_lm.server answering turn 2 without a restart (the floor)",
    )
    parser.add_argument(
        "--kvtrio-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for every kvtrio serve of the restart phase, repeatable; one word each "
        "(--kvtrio-arg=--restore-bytes=0)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds after a restarted server listens (and kvtrio's cold tier is open) "
        "before turn 2 is sent: the model has loaded (3)",
    )
    parser.add_argument(
        "--prefetch-length",
        type=whole,
        default=2048,
        help="tokens of the cold conversation in the prefetch phase (2048)",
    )
    parser.add_argument(
        "--prefetch-rounds", type=whole, default=5, help="queued cold hits per setting (5)"
    )


def _decode_round(server: Server, tokens: int, streams: int, bias: dict[str, float], r: int) -> Any:
    """One stream, then ``streams`` at once, on ``server``: rates and latencies. Round
    ``r``'s prompts are its own: no round reuses another's entries (a cache hit, or for
    kvtrio a disk load, where the phase measures decode)."""
    one = server.chat(
        [{"role": "user", "content": f"Round {r}: tell me about caches."}], tokens, logit_bias=bias
    )
    results: list[dict[str, Any]] = []

    def ask(i: int) -> None:
        ask = [{"role": "user", "content": f"Round {r}, stream {i}."}]
        results.append(server.chat(ask, tokens, logit_bias=bias))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(streams)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    single = one["arrivals"]
    gaps = [x for r in results for x in itl(r["arrivals"])]
    return {
        "tok_s_1": steady_rate([single]),
        "itl_p50_ms_1": 1e3 * pct(itl(single), 0.5),
        "itl_p99_ms_1": 1e3 * pct(itl(single), 0.99),
        f"tok_s_{streams}": sum(len(r["arrivals"]) for r in results) / wall,
        f"tok_s_{streams}_steady": steady_rate([r["arrivals"] for r in results]),
        f"itl_p50_ms_{streams}": 1e3 * pct(gaps, 0.5),
        f"itl_p99_ms_{streams}": 1e3 * pct(gaps, 0.99),
    }


#: Keys of a round's record that are not figures (no median is taken of them).
ROUND_TAGS = ("position", "pid", "alive")


def _decode(
    model: Path, root: Path, tokens: int, streams: int, rounds: int, log: Path
) -> dict[str, Any]:
    """Decode of one stream and of ``streams`` at once on each server, in ``rounds``
    rounds, no stream ending before ``tokens`` tokens (EOS biased away). Each round runs
    the servers one at a time, in :func:`round_order` (reversed every other round): each
    is started afresh, warmed up (a short round, not counted: kernels, caches), measured
    and stopped before the next starts (on the H200, with all three running, the server
    started first decoded about 10% faster than the others, whichever it was). One
    stream's rate is steady (first token to last); the streams' is the burst's, every
    token over the time from sending the requests to the last token (mlx-lm takes
    requests that arrive while it decodes only between decode time slices of up to 0.5
    s, so the streams do not all start together; ``_steady`` is :func:`steady_rate`, 0
    when they never all decoded at once); each figure is the median over the rounds, and
    ``runs`` keeps every round (with the server's ``position`` in that round's order, its
    ``pid`` and the perf-counter times it was ``alive``). For kvtrio serve it counts the
    RAM entries it handed to disk during the measured rounds (mlx-lm's evictions, which
    the others drop)."""
    bias = no_eos(model)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    handed = 0
    for r in range(rounds):
        for position, kind in enumerate(round_order(KINDS, r)):
            with running(kind, model, root / f"{kind}-decode-{r}", log) as server:
                _decode_round(server, 8, streams, bias, -1 - r)  # warm-up, not counted
                server.wait_cold_ready()  # kvtrio's open is not measured (0 s for the others)
                before = spilled(server)
                run = _decode_round(server, tokens, streams, bias, r)
                after = spilled(server)
            if before is not None and after is not None:
                handed += after - before
            runs[kind].append({**run, "position": position, **server.tags()})
    out: dict[str, Any] = {}
    for kind in KINDS:
        keys = [k for k in (runs[kind][0] if runs[kind] else ()) if k not in ROUND_TAGS]
        out[kind] = {key: median([run[key] for run in runs[kind]]) for key in keys}
        out[kind]["runs"] = runs[kind]
    out["kvtrio"]["spilled_during_rounds"] = handed
    return out


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _shared_system_prompt(kind: str, model: Path, work: Path, log: Path, n: int) -> int:
    """Bytes on disk after ``n`` conversations sharing a 1k-token system prompt."""
    system = prompt_words(model, 1024)
    server = Server(kind, model, work, log)
    for i in range(n):
        question = f"Question {i}: what is item {i}?"
        server.chat(
            [{"role": "system", "content": system}, {"role": "user", "content": question}], 4
        )
    server.stop()
    return _disk_bytes(work / ("kv" if kind == "kvtrio" else "naive"))


def _first_answer(server: Server, text: str) -> float:
    """Seconds from the spawn until the server has answered a one-token chat request
    (``text``: a new one per start, or the naive baseline finds an exact hit on disk,
    which leaves mlx-lm nothing to prefill)."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0.0}
    )
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"{server.kind}: the first request failed ({response.status})")
    return time.perf_counter() - server.started


def _starts(
    model: Path, root: Path, entries: int, rounds: int, log: Path
) -> dict[str, dict[str, Any]]:
    """Each server started ``rounds`` times, alternating, on ``entries`` entries of its own
    on disk (none for mlx_lm.server): seconds from the spawn until it listens, until it
    has answered its first request (a one-token chat, sent once it listens; ``cpu_s``: the
    CPU time it used to then), and kvtrio's until its cold tier is open (naive's index is
    read before it listens). One server at a time, in :func:`round_order` (reversed every
    other round). Medians, and every run (with its ``position`` in the round's order)."""
    fills = {kind: fill(kind, model, root / f"{kind}-entries", entries) for kind in KINDS}
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for r in range(rounds):
        for position, kind in enumerate(round_order(KINDS, r)):  # alternating, as decode's
            with running(kind, model, root / f"{kind}-entries", log) as server:
                answer = _first_answer(server, f"hi {r}")
                cpu = server.cpu_s()  # the CPU time of the start, to its first answer
                ready = server.wait_cold_ready() if kind == "kvtrio" else server.start_s
                time.sleep(1.0)  # the naive baseline saves after answering: not torn by a stop
            run = {"listen_s": server.start_s, "answer_s": answer, "cold_s": ready, "cpu_s": cpu}
            runs[kind].append({**run, "position": position})
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        out[kind] = {"fill_s": fills[kind], "runs": runs[kind]}
        for key in ("listen_s", "answer_s", "cold_s", "cpu_s"):
            out[kind][key] = median([r[key] for r in runs[kind]])
    return out


def _prefetch(
    model: Path, root: Path, length: int, rounds: int, settle: float, log: Path
) -> dict[str, Any]:
    """A queued request's cold hit, with the disk load started as it arrives (kvtrio
    serve's default) and with ``--no-prefetch`` (the load starts when the generation
    thread looks the request up, and that thread waits for it).

    Each setting: ``rounds`` conversations of ``length`` tokens (turn 1), a restart, then
    per round a long stream A and, once A has decoded 8 tokens, turn 2 of one
    conversation (B: its prefix is on disk only). B waits in the queue until the
    generation thread takes it (mlx-lm's decode time slice of A: up to 0.5 s). Without
    prefetch B's time to first token is that wait, the load (A's decode stalled) and B's
    prefill; with it the load starts on arrival and its first MLX job ends A's time slice.
    The load time is measured on the same server, idle: a cold hit's time to first token
    less a RAM hit's of the same request.
    """
    document = prompt_words(model, length)
    out: dict[str, Any] = {}
    for setting, extra in (("prefetch", ()), ("no_prefetch", ("--no-prefetch",))):
        flags = tuple(extra)
        work = root / f"prefetch-{setting}"
        turn1 = [
            [{"role": "user", "content": f"Conversation {r}. {document}"}]
            for r in range(rounds + 1)
        ]
        server = Server("kvtrio", model, work, log, extra=flags)
        turn2 = []
        for messages in turn1:
            answer = server.chat(messages, 4)["text"]
            more = [*messages, {"role": "assistant", "content": answer}]
            turn2.append([*more, {"role": "user", "content": QUESTION}])
        server.stop()
        server = Server("kvtrio", model, work, log, extra=flags)
        ttft: list[float] = []
        try:
            server.settle(settle)
            for r in range(rounds):
                started = threading.Event()
                stream: dict[str, Any] = {}
                long = [{"role": "user", "content": f"Long stream {r}."}]
                thread = threading.Thread(
                    target=lambda out=stream, go=started, ask=long, to=server: out.update(
                        to.chat_watching(ask, 160, 8, go)
                    )
                )
                thread.start()
                if not started.wait(600):
                    raise RuntimeError("the long stream did not start")
                two = server.chat(turn2[r], 4)
                thread.join()
                ttft.append(two["arrivals"][0] - two["sent"])
            cold = server.chat(turn2[rounds], 4)  # idle: the load time
            hot = server.chat(turn2[rounds], 4)
        finally:
            server.stop()
        out[setting] = {
            "ttft_s": median(ttft),
            "ttft_runs_s": ttft,
            "idle_cold_ttft_s": cold["arrivals"][0] - cold["sent"],
            "idle_hot_ttft_s": hot["arrivals"][0] - hot["sent"],
        }
    load = [out[s]["idle_cold_ttft_s"] - out[s]["idle_hot_ttft_s"] for s in out]
    out["load_s"] = median(load)
    return out


def _phases(text: str) -> set[str]:
    phases = {x for x in str(text).split(",") if x}
    unknown = phases - set(PHASES)
    if unknown:
        raise SystemExit(f"kvtrio bench serve: unknown phases {sorted(unknown)} ({PHASES})")
    return phases


def model_dir(path: Path, root: Path) -> Path:
    """``--model``: a model directory as given, or a llama GGUF file (``*.gguf``, as
    ``kvtrio serve --model`` takes it) converted once under the work directory's ``gguf/``
    (:func:`kvtrio.serve.gguf.gguf_model_dir`): plain mlx_lm.server reads no GGUF, so every
    server of the run loads that converted directory."""
    if path.suffix.lower() != ".gguf":
        return path
    from kvtrio.serve.gguf import gguf_model_dir

    return gguf_model_dir(path, root / "gguf")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in str(args.lengths).split(",") if x]
    phases = _phases(args.phases)
    figures: dict[str, Any] = {"kvtrio_bytecode": compile_kvtrio()}  # as installed: no compiles
    with workdir(args.dir) as root:
        log = root / "servers.log"
        if args.model:
            model = model_dir(Path(args.model), root)
        else:
            from kvtrio.serve.modeldir import write_tiny_model_dir

            model = write_tiny_model_dir(root / "llama", **SHAPES[args.model_shape])
        if "restart" in phases:
            warm = args.restart_warmup  # every server's turn 2 after a warm-up request
            figures["restart"] = {
                str(length): restart(
                    model,
                    *(root, length, args.restart_rounds, args.settle, log),
                    warmup=warm,
                    floor=args.restart_floor,
                    kvtrio_args=tuple(args.kvtrio_arg),
                )
                for length in lengths
            }
        if "decode" in phases:
            figures["decode"] = _decode(
                model, root, args.decode_tokens, args.streams, args.rounds, log
            )
        if "spill" in phases:
            figures["spill"] = spill(
                model, root, args.spill_length, args.spill_tokens, args.spill_rounds, log
            )
        if "disk" in phases:
            figures["shared_system_prompt_disk_bytes"] = {
                kind: _shared_system_prompt(kind, model, root / f"{kind}-shared", log, 8)
                for kind in ("naive", "kvtrio")
            }
        if "start" in phases:
            figures[f"start_with_{args.entries}_entries"] = _starts(
                model, root, args.entries, args.start_rounds, log
            )
        if "prefetch" in phases:
            figures["prefetch"] = _prefetch(
                model, root, args.prefetch_length, args.prefetch_rounds, args.settle, log
            )
    return {
        "model": str(args.model or f"{args.model_shape} random llama (kvtrio.serve.modeldir)"),
        **figures,
        "ratios": _ratios(figures, args),
        "command": "kvtrio bench serve " + " ".join(sys.argv[3:]),
    }


def _ratios(figures: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The run's ratios (kvtrio against mlx_lm.server and against the naive baseline);
    drops the answers it compared."""
    ratios: dict[str, Any] = {}
    for name, by_kind in figures.get("restart", {}).items():
        ratios[name] = restart_ratios(by_kind)
    if "decode" in figures:
        decode, streams = figures["decode"], args.streams
        ratios["decode"] = {}
        for key in ("tok_s_1", f"tok_s_{streams}", f"tok_s_{streams}_steady"):
            base = decode["mlx_lm"][key]
            # Medians over the rounds; per round, each server against mlx_lm measured in
            # the same round (naive's is the reference's own spread: mlx-lm's decode path).
            for kind in ("kvtrio", "naive"):  # a steady rate may be 0 (no common window)
                ratios["decode"][f"{key}_{kind}_vs_mlx_lm"] = (
                    decode[kind][key] / base if base else float("nan")
                )
            for kind in ("kvtrio", "naive"):
                ratios["decode"][f"{key}_{kind}_vs_mlx_lm_per_round"] = (
                    per_round := [
                        a[key] / b[key] if b[key] else float("nan")
                        for a, b in zip(decode[kind]["runs"], decode["mlx_lm"]["runs"], strict=True)
                    ]
                )
                ratios["decode"][f"{key}_{kind}_vs_mlx_lm_round_median"] = median(per_round)
            # The start-order effect in this run: a server's median rate in the rounds it
            # was started first over its median in the rounds it was started last.
            for kind in ("mlx_lm", "kvtrio"):
                ratios["decode"][f"{key}_{kind}_started_first_vs_last"] = first_vs_last(
                    decode[kind]["runs"], key
                )
    if "spill" in figures:
        ratios["spill"] = spill_ratios(figures["spill"])
    if "shared_system_prompt_disk_bytes" in figures:
        disk = figures["shared_system_prompt_disk_bytes"]
        ratios["disk_bytes_naive_vs_kvtrio"] = disk["naive"] / max(1, disk["kvtrio"])
    starts = figures.get(f"start_with_{args.entries}_entries")
    if starts is not None:
        kv, naive = starts["kvtrio"], starts["naive"]
        ratios[f"start_with_{args.entries}_entries"] = {
            "first_answer_kvtrio_vs_naive": kv["answer_s"] / naive["answer_s"],
            "first_answer_kvtrio_vs_mlx_lm": kv["answer_s"] / starts["mlx_lm"]["answer_s"],
            "listen_kvtrio_vs_naive": kv["listen_s"] / naive["listen_s"],
            "cold_ready_kvtrio_vs_naive": kv["cold_s"] / naive["cold_s"],
        }
        ratios[f"start_with_{args.entries}_entries"] |= start_pairs(starts)
    if "prefetch" in figures:
        pre = figures["prefetch"]
        drop = pre["no_prefetch"]["ttft_s"] - pre["prefetch"]["ttft_s"]
        ratios["prefetch"] = {
            "queued_cold_ttft_prefetch_vs_off": pre["prefetch"]["ttft_s"]
            / pre["no_prefetch"]["ttft_s"],
            "ttft_drop_s": drop,
            "ttft_drop_vs_load": drop / pre["load_s"] if pre["load_s"] > 0 else float("nan"),
        }
    return ratios


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"after a restart: turn 2 ({figures['model']})")
    columns = ("length", "server", "TTFT s", "vs mlx_lm", "cached", "prompt", "start s", "rounds s")
    for column in columns:
        table.add_column(column)
    for length, by_kind in figures.get("restart", {}).items():
        plain = by_kind["mlx_lm"]["ttft_s"]  # medians over the rounds
        for kind, f in by_kind.items():
            table.add_row(
                length,
                kind,
                f"{f['ttft_s']:.3f}",
                f"{f['ttft_s'] / plain:.3f}x",
                str(f["cached_tokens"]),
                str(f["prompt_tokens"]),
                f"{f['restart_s']:.2f}",
                " ".join(f"{run['ttft_s']:.3f}" for run in f["runs"]),
            )
    console.print(table)
    for phase in ("decode", "spill"):
        if phase not in figures:
            continue
        by_kind = figures[phase]
        keys = [k for k, v in next(iter(by_kind.values())).items() if isinstance(v, float | int)]
        out = Table(title=phase)
        out.add_column("server")
        for key in keys:
            out.add_column(key)
        for kind, f in by_kind.items():
            out.add_row(kind, *(f"{f[k]:.2f}" for k in keys))
        console.print(out)
    extra = {
        k: v for k, v in figures.items() if k.startswith(("shared_", "start_with_", "prefetch"))
    }
    console.print_json(json.dumps(extra))
    console.print_json(json.dumps(figures["ratios"]))
