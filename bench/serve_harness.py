"""The client side of ``kvtrio bench serve``: a server process of one kind (plain
mlx_lm.server, the naive baseline, kvtrio serve) on a free port, timed chat requests
against it, and the percentiles the phases report (:mod:`kvtrio.bench.serve`)."""

from __future__ import annotations

import compileall
import http.client
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtrio.serve.savetrace import SaveSpan, read_save_trace

__all__ = [
    "Server",
    "compile_kvtrio",
    "exit_counters",
    "first_vs_last",
    "free_port",
    "itl",
    "median",
    "no_eos",
    "paired",
    "pct",
    "prompt_words",
    "round_order",
    "running",
    "sign_test_p",
    "start_pairs",
    "steady_rate",
    "workdir",
]


#: Seconds between two attempts to connect to a starting server: the resolution of its
#: time to listening, and so of the first answer sent then (it was 50 ms, as large as
#: what the start phase compares).
LISTEN_POLL = 0.005


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(
        self,
        kind: str,
        model: Path,
        work: Path,
        log: Path,
        extra: Sequence[str] = (),
        *,
        trace_saves: bool = False,
    ) -> None:
        self.kind = kind
        self.port = free_port()
        common = ["--model", str(model), "--port", str(self.port), "--log-level", "WARNING"]
        common += extra
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVTRIO_NAIVE_DIR": str(work / "naive")}
        # Where the server records when each save ran (kvtrio.serve.savetrace): kvtrio
        # serve's --save-trace, the naive baseline's variable; plain mlx_lm saves nothing.
        self.save_trace = work / "saves.jsonl" if trace_saves else None
        env.pop("KVTRIO_NAIVE_SAVE_TRACE", None)
        if self.save_trace is not None:
            work.mkdir(parents=True, exist_ok=True)
            self.save_trace.unlink(missing_ok=True)
            if kind == "naive":
                env["KVTRIO_NAIVE_SAVE_TRACE"] = str(self.save_trace)
            elif kind == "kvtrio":
                common += ["--save-trace", str(self.save_trace)]
        exe = sys.executable
        argv = {
            "mlx_lm": [exe, "-m", "mlx_lm", "server", *common],
            "naive": [exe, "-m", "kvtrio.bench.serve_naive", *common],
            "kvtrio": [exe, "-m", "kvtrio", "serve", *common, "--cache-dir", str(work / "kv")],
        }[kind]
        self.log = log
        self.log_from = log.stat().st_size if log.exists() else 0
        started = time.perf_counter()
        with log.open("a") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{kind} server exited; see {log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(LISTEN_POLL)
        self.started = started
        self.start_s = time.perf_counter() - started
        self.stopped = float("nan")

    def metrics(self) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request("GET", "/metrics")
            return connection.getresponse().read().decode()
        finally:
            connection.close()

    def wait_cold_ready(self, timeout: float = 300.0) -> float:
        """kvtrio serve: seconds from the spawn until its cold tier is open (it opens in
        the background while the server answers); 0 for the others."""
        if self.kind != "kvtrio":
            return 0.0
        deadline = time.perf_counter() + timeout
        # The sample's own line: its HELP text ("1 once ... is open") would match too.
        while "kvtrio_serve_cold_ready 1" not in self.metrics().splitlines():
            if time.perf_counter() > deadline:
                raise RuntimeError("kvtrio serve: the cold tier did not open")
            time.sleep(0.02)
        return time.perf_counter() - self.started

    def save_spans(self) -> list[SaveSpan]:
        """The saves this server recorded so far (none without ``trace_saves``)."""
        return [] if self.save_trace is None else read_save_trace(self.save_trace)

    def output(self) -> str:
        """What this server wrote to the log so far (the bench runs one at a time)."""
        with self.log.open("rb") as f:
            f.seek(self.log_from)
            return f.read().decode(errors="replace")

    def exit_counters(self) -> dict[str, dict[str, float]]:
        """kvtrio serve's lines at exit (:func:`exit_counters`), once it stopped."""
        return exit_counters(self.output())

    def settle(self, seconds: float) -> None:
        """Wait until the cold tier is open and ``seconds`` have passed since the server
        listened (its model has loaded): turn 2 then measures the lookup, not the start."""
        self.wait_cold_ready()
        time.sleep(max(0.0, self.started + self.start_s + seconds - time.perf_counter()))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stopped = time.perf_counter()

    def cpu_s(self) -> float:
        """CPU seconds the server has used so far, all its threads (nan without Linux's
        /proc): the work of a start, less moved by other processes than its wall time."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1]
        except OSError:
            return float("nan")
        utime, stime = fields.split()[11:13]  # fields 14 and 15 of proc(5)
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

    def tags(self) -> dict[str, Any]:
        """Which process a round ran on, and when it was alive (spawn to exit, perf-counter
        seconds of the bench's process): rounds that must not overlap can be checked."""
        return {"pid": self.process.pid, "alive": [self.started, self.stopped]}

    def chat(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        *,
        logit_bias: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Stream a temperature-0 chat turn: when it was sent, when its headers came (the
        server has taken the request and looked it up), its tokens' arrival times, its
        text and usage."""
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if logit_bias:
            body["logit_bias"] = logit_bias
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        sent = time.perf_counter()
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        headers = time.perf_counter()
        cache = response.getheader("X-Kvtrio-Cache")  # kvtrio serve: hot, cold or miss
        arrivals: list[float] = []
        text, usage = "", {}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content is not None:
                    arrivals.append(time.perf_counter())
                    text += content
        connection.close()
        done = time.perf_counter()
        return {
            "sent": sent,
            "headers": headers,
            "arrivals": arrivals,
            "done": done,
            "text": text,
            "usage": usage,
            "cache": cache,
        }

    def chat_watching(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        after: int,
        started: threading.Event,
        *,
        stop: threading.Event | None = None,
        logit_bias: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """:meth:`chat`, setting ``started`` once ``after`` tokens have arrived; with
        ``stop``, the client leaves (closes the stream) at the first token after it is set."""
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        if logit_bias:
            body["logit_bias"] = logit_bias
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        arrivals: list[float] = []
        response = connection.getresponse()
        try:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("delta", {}).get("content") is not None:
                        arrivals.append(time.perf_counter())
                        if len(arrivals) == after:
                            started.set()
                if stop is not None and stop.is_set():
                    break
        finally:
            started.set()
            response.close()  # the response holds the socket: close both to leave
            connection.close()
        return {"arrivals": arrivals}


@contextmanager
def running(
    kind: str,
    model: Path,
    work: Path,
    log: Path,
    extra: Sequence[str] = (),
    *,
    trace_saves: bool = False,
) -> Iterator[Server]:
    """A :class:`Server` started for the block and stopped (exited) when it ends."""
    server = Server(kind, model, work, log, extra, trace_saves=trace_saves)
    try:
        yield server
    finally:
        server.stop()


def exit_counters(text: str) -> dict[str, dict[str, float]]:
    """kvtrio serve's counting lines (``kvtrio serve: LABEL (NAME VALUE, ...)``: "stopped",
    "cold tier at exit", "disk wear") as {LABEL: {NAME: VALUE}}: what a restart found or
    lost is in them (RAM entries written, pending writes dropped, entries on disk)."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = re.match(r"kvtrio serve: ([^(]+?) \((.*)\)$", line.strip())
        if match is None:
            continue
        counts: dict[str, float] = {}
        for item in match.group(2).split(", "):
            name, _, value = item.rpartition(" ")
            try:
                counts[name.rstrip(":")] = float(value)
            except ValueError:
                continue
        if counts:
            found[match.group(1)] = counts
    return found


@contextmanager
def workdir(parent: str | None) -> Iterator[Path]:
    """The bench's working directory: a new one under ``parent``, kept (its servers.log
    and cold tiers explain a run afterwards), or a temporary one, removed."""
    if parent is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
    else:
        Path(parent).mkdir(parents=True, exist_ok=True)
        kept = Path(tempfile.mkdtemp(dir=parent))
        print(f"kvtrio bench: working directory {kept} (kept)", file=sys.stderr, flush=True)
        yield kept


def no_eos(model: Path) -> dict[str, float]:
    """A logit bias that keeps ``model`` from ending a stream on its own (its EOS ids)."""
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return {str(i): -1000.0 for i in ids}


def steady_rate(streams: Sequence[Sequence[float]]) -> float:
    """Tokens per second while every stream decodes: the tokens that arrived between the
    last stream's first token and the first stream's last one, over that window (what a
    batch decodes, without its prefill and its stragglers); 0 when the window is empty."""
    if not streams or any(len(s) < 2 for s in streams):
        return 0.0
    begin, end = max(s[0] for s in streams), min(s[-1] for s in streams)
    if end <= begin:
        return 0.0
    return sum(sum(1 for t in s if begin < t <= end) for s in streams) / (end - begin)


def prompt_words(model: Path, tokens: int) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = [f"item{i % 97} value{i % 13}." for i in range(tokens)]
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words whose text has at least `tokens` tokens
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(words[:mid])).ids) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def round_order(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order of ``names``: as given in even rounds, reversed in odd ones
    (every phase starts and measures its servers in this order, so over two rounds each
    of the first and last servers is started first once: on the H200 the first-started
    server decoded about 10% faster than the others)."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def itl(arrivals: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals)]


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return (ordered[n // 2] + ordered[(n - 1) // 2]) / 2 if n else float("nan")


def first_vs_last(runs: list[dict[str, Any]], key: str) -> float:
    """Median ``key`` of the rounds a server was started first over that of the rounds it
    was started last (nan without both)."""
    last = max((run["position"] for run in runs), default=0)
    first = [run[key] for run in runs if run["position"] == 0]
    later = [run[key] for run in runs if run["position"] == last and last > 0]
    if not first or not later or not median(later):
        return float("nan")
    return median(first) / median(later)


def compile_kvtrio() -> bool:
    """Write the bytecode of kvtrio's own modules (not its tests), so that the servers
    start from it as an installed package would: an editable install run with
    ``PYTHONDONTWRITEBYTECODE`` (this VM's environment) has none, and every start of
    ``kvtrio serve`` compiled its modules from source (about 20 ms more of its start, 5 ms
    of the naive baseline's, none of mlx-lm's, which pip compiled). True when every module
    has its bytecode (False where the package's directory cannot be written)."""
    import kvtrio

    root = Path(kvtrio.__file__).parent
    skip = re.compile(re.escape(str(root)) + r"[/\\](\.|tests|build)")
    return bool(compileall.compile_dir(root, quiet=2, rx=skip))


def sign_test_p(lower: int, rounds: int) -> float:
    """One-sided sign test: the chance of at least ``lower`` of ``rounds`` paired rounds
    going one way if either way were a coin toss (1.0 for no rounds)."""
    return sum(math.comb(rounds, k) for k in range(lower, rounds + 1)) / (1 << rounds)


def paired(
    runs: Sequence[dict[str, Any]], references: Sequence[dict[str, Any]], key: str
) -> dict[str, Any]:
    """Round by round, ``key`` of ``runs`` over that of ``references`` (the server each
    was started next to, in the same round): the ratios, their median, in how many rounds
    it was lower, and :func:`sign_test_p` of that count."""
    ratios = [a[key] / b[key] for a, b in zip(runs, references, strict=True)]
    lower = sum(1 for ratio in ratios if ratio < 1)
    return {
        "per_round": ratios,
        "round_median": median(ratios),
        "lower_rounds": lower,
        "rounds": len(ratios),
        "lower_sign_test_p": sign_test_p(lower, len(ratios)),
    }


def start_pairs(starts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The start phase's rounds, paired (:func:`paired`) with the naive baseline started
    next to them: kvtrio's first answer, listener and CPU seconds to its first answer, and
    mlx_lm.server's first answer and CPU seconds, the control (it does less than the naive
    baseline: no index to read, none of kvtrio's modules)."""
    out: dict[str, Any] = {}
    for kind, key, name in (
        ("kvtrio", "answer_s", "first_answer"),
        ("kvtrio", "listen_s", "listen"),
        ("kvtrio", "cpu_s", "first_answer_cpu"),
        ("mlx_lm", "answer_s", "first_answer"),
        ("mlx_lm", "cpu_s", "first_answer_cpu"),
    ):
        pairs = paired(starts[kind]["runs"], starts["naive"]["runs"], key)
        out |= {f"{name}_{kind}_vs_naive_{k}": v for k, v in pairs.items() if k != "rounds"}
    return out
