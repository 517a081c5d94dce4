"""``kvtrio serve`` with real parts: a tiny random-weight llama saved as an mlx-lm model
directory (tokenizer and chat template built locally), loaded by mlx_lm.load, driven by
the ``openai`` client over HTTP on 127.0.0.1, next to plain ``mlx_lm.server``."""

from __future__ import annotations

import http.client
import json
import logging
import signal
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtrio.bench.serve_harness import exit_counters
from kvtrio.serve.modeldir import write_tiny_model_dir
from kvtrio.tests.serve.servers import (
    Server,
    exit_summary,
    exit_wear,
    start_kvtrio,
    start_mlx_lm,
    wait_line,
)

pytest.importorskip("openai")

#: A second server's flags where turn 2 must be its own disk load: no warm restart.
NO_RESTORE = ("--restore-bytes", "0")

SYSTEM = "You are a helpful assistant. Answer briefly. " * 3
TURN1 = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def shared(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One kvtrio serve for the tests that need no restart."""
    root = tmp_path_factory.mktemp("shared")
    server = start_kvtrio(model_dir, root / "cache", root / "log.txt", "--max-tokens", "16")
    yield server
    assert server.stop() == 0, server.output()


def _chat(
    client: Any, messages: list[dict[str, str]], *, max_tokens: int = 8, **kwargs: Any
) -> Any:
    raw = client.chat.completions.with_raw_response.create(
        model="default_model", messages=messages, temperature=0.0, max_tokens=max_tokens, **kwargs
    )
    return raw, raw.parse()


def _logprobs(raw: Any) -> list[tuple[int, float]]:
    body = json.loads(raw.text)
    return [(t["id"], t["logprob"]) for t in body["choices"][0]["logprobs"]["content"]]


def test_chat_streaming_and_not_and_text_completions(shared: Server) -> None:
    client = shared.client()
    raw, reply = _chat(client, TURN1)
    assert raw.headers["X-Kvtrio-Cache"] == "miss"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    text = reply.choices[0].message.content or ""

    stream = client.chat.completions.create(
        model="default_model",
        messages=TURN1,
        temperature=0.0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[0].prompt_tokens_details.cached_tokens > 0  # the first turn, hot

    completion = client.completions.create(
        model="default_model", prompt="The capital of France is", max_tokens=5, temperature=0.0
    )
    assert completion.choices[0].finish_reason == "length"
    assert isinstance(completion.choices[0].text, str) and completion.usage.completion_tokens == 5


def test_a_restart_between_turns_serves_turn_two_from_disk_as_mlx_lm_would(
    model_dir: Path, tmp_path: Path
) -> None:
    """Turn 2 after a restart: cached tokens from disk, and the same tokens and logprobs at
    temperature 0 as plain mlx_lm.server gives without a restart (turn 1 then turn 2)."""
    options = {"logprobs": True, "top_logprobs": 2}
    first = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "a.txt")
    raw_one, one = _chat(first.client(), TURN1, **options)
    assert first.stop() == 0, first.output()
    assert exit_summary(first)["spilled"] >= 1

    turn2 = [
        *TURN1,
        {"role": "assistant", "content": one.choices[0].message.content or ""},
        {"role": "user", "content": "And of Italy?"},
    ]
    # No warm restart (--restore-bytes 0): turn 2's own lookup loads it.
    second = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "b.txt", *NO_RESTORE)
    raw, two = _chat(second.client(), turn2, **options)
    assert second.stop() == 0, second.output()
    assert "kvtrio serve: restored" not in second.output()
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert cached > 0 and int(raw.headers["X-Kvtrio-Cached-Tokens"]) == cached
    # Nothing else in flight: the lookup itself loaded it (no request was set aside).
    assert exit_summary(second)["hits_cold"] == 1
    assert exit_summary(second)["prefetches"] == 0

    plain = start_mlx_lm(model_dir, tmp_path / "plain.txt")
    try:
        raw_plain_one, _ = _chat(plain.client(), TURN1, **options)
        raw_plain_two, plain_two = _chat(plain.client(), turn2, **options)
    finally:
        plain.stop()
    assert _logprobs(raw_plain_one) == _logprobs(raw_one)
    assert plain_two.usage.prompt_tokens_details.cached_tokens == cached
    assert _logprobs(raw_plain_two) == _logprobs(raw)
    assert plain_two.choices[0].message.content == two.choices[0].message.content


def test_an_idle_restart_restores_the_conversation_and_turn_two_is_a_ram_hit(
    model_dir: Path, tmp_path: Path, plain_turns: dict[str, Any]
) -> None:
    """The warm restart (kvtrio.serve.restore): the server idle after its start loads the
    most recent disk entries back into RAM; turn 2 is then a RAM hit, with plain
    mlx_lm.server's answer at temperature 0."""
    first = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "a.txt")
    _, one = _chat(first.client(), TURN1)
    assert first.stop() == 0, first.output()
    assert one.choices[0].message.content == plain_turns["one"]
    second = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "b.txt")
    try:
        wait_line(second, "kvtrio serve: restored 1 entries (")
        raw, two = _chat(second.client(), plain_turns["turn2"])
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{second.port}/metrics").read()
    finally:
        assert second.stop() == 0, second.output()
    assert raw.headers["X-Kvtrio-Cache"] == "hot"
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached == plain_turns["two"].usage.prompt_tokens_details.cached_tokens > 0
    assert two.choices[0].message.content == plain_turns["two"].choices[0].message.content
    assert b"\nkvtrio_serve_restored_total 1\n" in metrics
    summary = exit_summary(second)
    assert (summary["hits_hot"], summary["hits_cold"], summary["prefetches"]) == (1, 0, 0)


@pytest.fixture(scope="module")
def plain_turns(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Turn 1 and turn 2 from plain mlx_lm.server (no restart, nothing else in flight):
    the answers the busy restart tests must match."""
    root = tmp_path_factory.mktemp("plain")
    plain = start_mlx_lm(model_dir, root / "plain.txt")
    try:
        _, one = _chat(plain.client(), TURN1)
        turn2 = _turn2(one.choices[0].message.content or "")
        _, two = _chat(plain.client(), turn2)
    finally:
        plain.stop()
    return {"one": one.choices[0].message.content, "turn2": turn2, "two": two}


def _turn2(answer: str) -> list[dict[str, str]]:
    return [
        *TURN1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Italy?"},
    ]


def _still_decoding(response: http.client.HTTPResponse) -> None:
    """Read the stream's next token event; it must not be the last."""
    line = b""
    while not line.startswith(b"data: "):  # blank lines and keepalives between events
        line = response.readline()
        assert line, "the long stream ended early"
    assert line != b"data: [DONE]\n", line
    choices = json.loads(line[len(b"data: ") :])["choices"]
    assert choices and choices[0]["finish_reason"] is None, line


def _busy_restart(
    model_dir: Path, tmp_path: Path, plain_turns: dict[str, Any], *extra: str
) -> tuple[Server, Any, Any]:
    """Turn 1 written to disk by a first server; a second server (``extra`` flags) serves
    turn 2 while a long stream of another prompt is still decoding. The second server
    (stopped), turn 2's raw response and its parsed reply."""
    first = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "a.txt")
    _, one = _chat(first.client(), TURN1)
    assert first.stop() == 0, first.output()
    assert exit_summary(first)["spilled"] >= 1
    assert one.choices[0].message.content == plain_turns["one"]

    second = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "b.txt", *NO_RESTORE, *extra)
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    long_body = {
        "messages": [{"role": "user", "content": "Tell me a long story about caches."}],
        "stream": True,
        "max_tokens": 16000,  # far more than turn 2 takes: the stream is cut below
        "temperature": 0,
        "logit_bias": {str(eos): -1000.0},  # no early end of the story
    }
    connection = _post(second.port, long_body)
    response = connection.getresponse()
    try:
        assert response.status == 200
        _still_decoding(response)  # its first token: in flight on the server
        raw, two = _chat(second.client(), plain_turns["turn2"])
        _still_decoding(response)  # far from its max_tokens: in flight all along
    finally:
        response.close()  # mid-stream (the socket closes with both): the server stops it
        connection.close()
    assert second.stop() == 0, second.output()
    return second, raw, two


def test_a_restart_between_turns_serves_turn_two_from_disk_while_busy_by_setting_it_aside(
    model_dir: Path, tmp_path: Path, plain_turns: dict[str, Any]
) -> None:
    """Rule 3 of serve/server.py end to end: another request decoding, turn 2 (its prefix
    on disk) is set aside while its entry loads, then served cold, the same tokens at
    temperature 0 as plain mlx_lm.server's."""
    second, raw, two = _busy_restart(model_dir, tmp_path, plain_turns)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert cached > 0 and int(raw.headers["X-Kvtrio-Cached-Tokens"]) == cached
    assert cached == plain_turns["two"].usage.prompt_tokens_details.cached_tokens
    summary = exit_summary(second)
    assert summary["prefetches"] >= 1, second.output()  # disk loads set aside
    # Released once its entry was in RAM: its lookup was a RAM hit, not a disk load.
    assert summary["hits_cold"] == 0, second.output()
    assert two.choices[0].message.content == plain_turns["two"].choices[0].message.content


def test_no_prefetch_sets_nothing_aside_while_busy_and_still_serves_turn_two_cold(
    model_dir: Path, tmp_path: Path, plain_turns: dict[str, Any]
) -> None:
    """``--no-prefetch``: with another request decoding, turn 2's lookup itself loads its
    disk entry (nothing set aside)."""
    second, raw, two = _busy_restart(model_dir, tmp_path, plain_turns, "--no-prefetch")
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert cached > 0 and int(raw.headers["X-Kvtrio-Cached-Tokens"]) == cached
    summary = exit_summary(second)
    assert summary["prefetches"] == 0, second.output()
    assert summary["hits_cold"] == 1, second.output()
    assert two.choices[0].message.content == plain_turns["two"].choices[0].message.content


def test_eight_concurrent_clients_with_batching(shared: Server) -> None:
    client = shared.client()
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            messages = [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]
            results[i] = _chat(client, messages, max_tokens=12)[1]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and sorted(results) == list(range(8))
    assert all(r.usage.completion_tokens == 12 for r in results.values())


def _post(port: int, body: dict[str, Any]) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    payload = json.dumps(body)
    connection.request(
        "POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"}
    )
    return connection


def test_a_client_that_disconnects_mid_stream_leaves_the_server_serving(shared: Server) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about caches."}]
    connection = _post(
        shared.port, {"messages": messages, "stream": True, "max_tokens": 400, "temperature": 0}
    )
    response = connection.getresponse()
    assert response.status == 200
    seen = 0
    while seen < 3:
        line = response.readline()
        assert line, "stream ended early"
        seen += line.startswith(b"data: ")
    # Mid-stream: the response holds the socket, so closing the connection alone would
    # leave it open (the server would never see the client leave).
    response.close()
    connection.close()
    _, reply = _chat(shared.client(), TURN1)
    assert reply.choices[0].finish_reason == "length"


def test_sigterm_during_a_long_prefill_exits_zero_within_the_grace(
    model_dir: Path, tmp_path: Path
) -> None:
    server = start_kvtrio(
        model_dir,
        tmp_path / "cache",
        tmp_path / "log.txt",
        "--prefill-step-size",
        "16",
        "--grace",
        "1",
    )
    long_text = " ".join(f"word{i}" for i in range(1500))
    connection = _post(
        server.port,
        {"messages": [{"role": "user", "content": long_text}], "stream": True, "max_tokens": 4},
    )
    response = connection.getresponse()
    assert response.status == 200
    line = b""
    while not line.startswith(b": keepalive"):  # the prefill is under way
        line = response.readline()
        assert line, "stream ended before the prefill reported progress"
    started = time.monotonic()
    code = server.stop(signal.SIGTERM, timeout=60)
    elapsed = time.monotonic() - started
    assert code == 0, server.output()
    assert elapsed < 20, elapsed
    connection.close()


def test_a_stream_cut_at_shutdown_ends_with_done_and_the_server_exits_zero(
    model_dir: Path, tmp_path: Path
) -> None:
    """docs/serve.md, "Shutdown", step 2 (kvtrio serve's rule 4): a stream still decoding
    after the grace is cut at its next step, and its client gets the end of a reply (the
    last chunk, then ``data: [DONE]``). Before, mlx-lm's batched loop dropped the cut
    request without ending its response queue: the handler waited until the generation
    thread stopped, a second grace later, and the stream broke off unfinished."""
    server = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "log.txt", "--grace", "1")
    messages = [{"role": "user", "content": "Write a very long essay."}]
    connection = _post(server.port, {"messages": messages, "stream": True, "max_tokens": 100_000})
    response = connection.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"data: "):  # decoding
        pass
    server.process.send_signal(signal.SIGTERM)
    events = [line.strip() for line in response.read().splitlines() if line.startswith(b"data: ")]
    connection.close()
    assert server.process.wait(60) == 0, server.output()
    assert events[-1] == b"data: [DONE]", events[-3:]
    assert json.loads(events[-2][len(b"data: ") :])["choices"][0]["finish_reason"] is not None


def test_the_models_endpoint_answers_where_no_hugging_face_cache_exists(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /v1/models`` (the ``openai`` client's ``models.list()``) on a host that never
    downloaded a model lists the ``--model`` directory. mlx-lm's scan of the missing
    Hugging Face cache raised ``CacheNotFound`` after the 200 header: an empty body, a
    JSONDecodeError in the client and a traceback in the server's log."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub-cache"))
    server = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "log.txt")
    try:
        listed = [model.id for model in server.client().models.list()]
    finally:
        assert server.stop() == 0, server.output()
    assert listed == [str(model_dir.resolve())]


def test_serve_takes_mlx_lm_servers_flags_and_needs_a_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtrio.cli import main

    assert main(["serve", "--decode-concurrency", "4", "--cold-bytes", "1GB"]) == 2
    assert capsys.readouterr().err == (
        "kvtrio serve: --model is required (a model directory or a Hugging Face repo)\n"
    )


def test_a_second_signal_exits_at_once_with_status_one(model_dir: Path, tmp_path: Path) -> None:
    server = start_kvtrio(
        model_dir, tmp_path / "cache", tmp_path / "log.txt", "--prefill-step-size", "16"
    )
    long_text = " ".join(f"word{i}" for i in range(1500))
    connection = _post(
        server.port,
        {"messages": [{"role": "user", "content": long_text}], "stream": True, "max_tokens": 4},
    )
    response = connection.getresponse()
    line = b""
    while not line.startswith(b": keepalive"):
        line = response.readline()
        assert line, "stream ended before the prefill reported progress"
    server.process.send_signal(signal.SIGTERM)  # graceful: --grace 10 for the request
    time.sleep(0.5)
    started = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=30) == 1
    assert time.monotonic() - started < 5
    connection.close()


STALL_MANIFESTS = """\
import os, time
from kvtrio.storage import manifeststore

def put(self, name, data, *, index_keys=()):
    open(os.environ["KVTRIO_TEST_STALLED"], "w").close()  # the close's write is here
    time.sleep(3600)  # its blocks are on disk, its manifest never published

manifeststore.LocalManifestStore.put = put
"""


def test_a_second_signal_during_the_close_exits_at_once_and_tears_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close's write stalls before its manifest is published (a sitecustomize in the
    server only), so the flush cannot end before the second signal, whatever the timing:
    the server exits 1 at once, and the next start opens the directory cleanly, finds no
    entry (none was published: no half-written one) and exits 0."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALL_MANIFESTS)
    stalled = tmp_path / "stalled"
    with monkeypatch.context() as env:
        env.setenv("PYTHONPATH", str(site))
        env.setenv("KVTRIO_TEST_STALLED", str(stalled))
        server = start_kvtrio(
            model_dir, tmp_path / "cache", tmp_path / "a.txt", "--flush-timeout", "600"
        )
    _chat(server.client(), TURN1)
    server.process.send_signal(signal.SIGTERM)
    while not stalled.exists():
        assert server.process.poll() is None, server.output()
        time.sleep(0.05)
    assert server.stop(signal.SIGTERM, timeout=30) == 1, server.output()
    assert "RAM entries at exit" not in server.output()  # not the deadline's exit
    again = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "b.txt")
    assert again.stop() == 0, again.output()
    at_exit = exit_counters(again.output())["cold tier at exit"]
    assert at_exit["entries"] == 0 and at_exit["drops"] == 0, again.output()


FAIL_ONE_WRITE = """\
from kvtrio.actors import owner

materialize = owner.MlxOwner.materialize
calls = [0]

async def failing_once(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:
        raise RuntimeError("injected: a probe's wrapper failed")
    return await materialize(self, *args, **kwargs)

owner.MlxOwner.materialize = failing_once
"""


def test_a_close_whose_write_raised_names_the_entry_and_logs_the_error(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe run's restart miss (4 of 5 RAM entries on disk, 'drops 1', no write
    error, no write shed, exit 0) is what a write that raised gives: reproduced by
    failing the second write's materialization (a sitecustomize in the server only). The
    exit lines now name the entry and say 'failed', the log carries what it raised, and
    the process exits 1: an entry was lost (flush report rule 4)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAIL_ONE_WRITE)
    with monkeypatch.context() as env:
        env.setenv("PYTHONPATH", str(site))
        server = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "a.txt")
    client = server.client()
    for n in range(3):
        _chat(client, [{"role": "user", "content": f"Conversation {n}. " + "word " * 40}])
    assert server.stop() == 1, server.output()
    output = server.output()
    counters = exit_counters(output)
    flushed = counters["RAM entries at exit"]
    handed = flushed["handed"]
    assert flushed == {
        "handed": handed, "on disk": handed - 1, "not landed": 1, "failed": 1
    }, output
    at_exit = counters["cold tier at exit"]
    assert (at_exit["drops"], at_exit["failed"], at_exit["write errors"]) == (1, 1, 0), output
    named = [line for line in output.splitlines() if line.startswith("kvtrio serve: not on disk:")]
    assert len(named) == 1 and named[0].endswith(": failed"), output
    assert "did not land (failed)" in output and "injected: a probe's wrapper failed" in output


def test_metrics_endpoint_parses_and_wear_is_printed_at_shutdown(
    model_dir: Path, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    server = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "log.txt")
    try:
        _chat(server.client(), TURN1)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
    finally:
        assert server.stop() == 0, server.output()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["kvtrio_serve_lookups_total", (("served", "miss"),)] == 1
    assert samples["kvtrio_serve_ram_entries", ()] >= 1
    assert ("kvtrio_cache_lookup_reasons_total", (("reason", "no-entry"),)) in samples
    assert ("kvtrio_cold_written_bytes_total", ()) in samples
    for histogram in ("cold_load", "cold_save", "event_loop_lag"):  # docs/serve.md
        assert (f"kvtrio_{histogram}_seconds_count", ()) in samples
    assert samples["kvtrio_event_loop_lag_seconds_count", ()] >= 1
    wear = exit_wear(server)
    # The close wrote the RAM entry (a flush: not offered to the admission policy).
    assert wear["written"] > 0 and (wear["admitted"], wear["refused"]) == (0, 0)
    # And says what a restart will find: the entry on disk, no write shed or failed.
    at_exit = exit_counters(server.output())["cold tier at exit"]
    assert at_exit["entries"] == 1 and at_exit["bytes"] > 0, server.output()
    assert at_exit["pending writes dropped"] == at_exit["drops"] == 0, server.output()
    assert at_exit["write errors"] == at_exit["pending writes left"] == 0, server.output()
    flushed = exit_counters(server.output())["RAM entries at exit"]
    assert flushed == {"handed": 1, "on disk": 1, "not landed": 0}, server.output()
    unwritten = {
        labels[0][1]: value
        for (name, labels), value in samples.items()
        if name == "kvtrio_cold_unwritten_total"
    }
    assert unwritten == dict.fromkeys(("dropped", "cancelled", "failed", "refused", "error"), 0)


def test_a_close_past_its_flush_deadline_exits_one_and_names_each_entry_not_written(
    model_dir: Path, tmp_path: Path
) -> None:
    """``--flush-timeout 0``: the deadline has passed when the close starts, so no RAM
    entry can reach the disk (their spills wait for owner jobs nobody runs any more),
    whatever the timing. The server exits 1, and its exit lines count the entries by why
    and name each one; the next start finds none of them."""
    server = start_kvtrio(
        model_dir, tmp_path / "cache", tmp_path / "a.txt", "--flush-timeout", "0"
    )
    _chat(server.client(), TURN1)
    assert server.stop() == 1, server.output()
    output = server.output()
    assert "to disk, deadline 0.0s" in output
    flushed = exit_counters(output)["RAM entries at exit"]
    handed = flushed["handed"]
    assert handed >= 1, output
    assert flushed == {
        "handed": handed, "on disk": 0, "not landed": handed, "not queued": handed
    }, output
    named = [line for line in output.splitlines() if line.startswith("kvtrio serve: not on disk:")]
    assert len(named) == handed and all(line.endswith(": not queued") for line in named)
    again = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "b.txt")
    with urllib.request.urlopen(f"http://127.0.0.1:{again.port}/metrics") as response:
        text = response.read().decode()
    assert again.stop() == 0, again.output()
    assert 'kvtrio_cache_entries{tier="cold"} 0' in text


def test_warm_prompts_are_stored_at_start_and_skipped_when_on_disk(
    model_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "warm.txt"
    prompts.write_text("The capital of France is\n\nOnce upon a time, in a land far away\n")
    argv = ("--warm-prompts", str(prompts), "--min-reuse-tokens", "0")  # short prompts
    first = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "a.txt", *argv)
    assert first.stop() == 0, first.output()
    assert "warm prompts stored 2, already on disk 0" in first.output()
    second = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "b.txt", *argv, *NO_RESTORE)
    try:
        completion = second.client().completions.with_raw_response.create(
            model="default_model", prompt="The capital of France is", max_tokens=3
        )
    finally:
        assert second.stop() == 0, second.output()
    assert "warm prompts stored 0, already on disk 2" in second.output()
    assert completion.headers["X-Kvtrio-Cache"] == "cold"


@pytest.mark.parametrize("error", [BrokenPipeError, ConnectionResetError])
def test_a_client_gone_mid_response_is_one_log_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: type[OSError]
) -> None:
    """mlx-lm's handler raises out of its stream loop when the client has left (the H200
    bench's logs had one traceback per such request); kvtrio's handler logs one line, counts
    the request done and closes the connection."""
    from kvtrio.serve.lifecycle import InFlight
    from kvtrio.serve.server import _handler_class, _mlx_server

    def gone(self: Any) -> None:
        assert self.server.kvtrio_in_flight.count == 1  # in flight while mlx-lm writes
        raise error(32, "Broken pipe")

    monkeypatch.setattr(_mlx_server().APIHandler, "do_POST", gone)
    handler_class = _handler_class()
    handler: Any = object.__new__(handler_class)  # no socket: only do_POST is exercised
    handler.server = types.SimpleNamespace(kvtrio_in_flight=InFlight())
    handler.client_address = ("127.0.0.1", 50000)
    handler.close_connection = False
    with caplog.at_level(logging.INFO, logger="kvtrio.serve.server"):
        handler.do_POST()
    assert handler.close_connection and handler.server.kvtrio_in_flight.count == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"kvtrio serve: client 127.0.0.1 left mid-response ({error.__name__})"
    ]
