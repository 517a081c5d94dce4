"""examples/tiered_server.py: a trio HTTP server embedding kvtrio, on loopback.

It serves a conversation, exits 0 on SIGTERM with its cache written, and after a restart
serves the next turn from the cold tier (disk); with ``--model`` (a real mlx-lm model
directory: serve/modeldir.py's tiny one) it takes text through the model's tokenizer
and chat template.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SERVER = Path(__file__).resolve().parents[2] / "examples" / "tiered_server.py"


@contextmanager
def _server(data_dir: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", "--data-dir", str(data_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        for _ in range(50):  # bounded: the first lines are the listening address
            line = proc.stdout.readline()
            if line.startswith("listening on ") or not line:
                break
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield line.split()[-1], proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _post(url: str, body: dict[str, Any], route: str = "/generate") -> dict[str, Any]:
    request = urllib.request.Request(url + route, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        out: dict[str, Any] = json.loads(response.read())
        return out


def _get(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=120) as response:
        out: dict[str, Any] = json.loads(response.read())
        return out


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def test_restart_serves_the_conversation_from_disk(tmp_path: Path) -> None:
    prompt = [(7 * i) % 500 + 2 for i in range(150)]
    with _server(tmp_path) as (url, proc):
        first = _post(url, {"conversation": "c1", "tokens": prompt, "max_tokens": 4})
        assert first["cache"] == "miss" and len(first["reply"]) == 4
        history = prompt + first["reply"] + [11, 12, 13]
        second = _post(url, {"conversation": "c1", "tokens": history, "max_tokens": 4})
        assert (second["cache"], second["reused"]) == ("hot", len(prompt) + 4)
        assert _get(url, "/stats")["hits_hot"] == 1
        try:
            _post(url, {"tokens": [10**6]})
            raise AssertionError("an out-of-vocabulary token was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
        try:
            _post(url, {"messages": [{"role": "user", "content": "hi"}]}, "/chat")
            raise AssertionError("/chat answered without a tokenizer")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        again = _post(url, {"conversation": "c2", "tokens": history, "max_tokens": 4})
        assert again["cache"] == "hot" and again["reused"] == len(history) - 1  # exact hit
        assert "cache written" in _stop(proc)
    with _server(tmp_path) as (url, proc):
        turn3 = history + second["reply"] + [14, 15]
        third = _post(url, {"conversation": "c1", "tokens": turn3, "max_tokens": 4})
        assert (third["cache"], third["reused"]) == ("cold", len(history) + 4)
        stats = _get(url, "/stats")
        assert stats["hits_cold"] == 1 and stats["cold_entries"] >= 1
        _stop(proc)


def test_with_a_model_directory_text_goes_through_its_tokenizer_and_chat_template(
    tmp_path: Path,
) -> None:
    from kvtrio.serve.modeldir import write_tiny_model_dir
    from mlx_lm import load

    model_dir = write_tiny_model_dir(tmp_path / "model")
    tokenizer: Any = load(str(model_dir))[1]
    data = tmp_path / "cache"
    question = [{"role": "user", "content": "What is the capital of France? " * 8}]
    rendered = list(tokenizer.apply_chat_template(question, add_generation_prompt=True))
    with _server(data, "--model", str(model_dir)) as (url, proc):
        first = _post(url, {"conversation": "c1", "messages": question, "max_tokens": 6}, "/chat")
        assert first["cache"] == "miss" and first["prompt_tokens"] == len(rendered)
        assert 1 <= len(first["reply"]) <= 6 and isinstance(first["text"], str)
        turn2 = [
            *question,
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "And of Italy?"},
        ]
        second = _post(url, {"conversation": "c1", "messages": turn2, "max_tokens": 6}, "/chat")
        assert second["cache"] == "hot" and second["reused"] >= len(rendered) - 1
        text = _post(url, {"prompt": "The quick brown fox", "max_tokens": 2})
        assert text["prompt_tokens"] == len(tokenizer.encode("The quick brown fox"))
        assert "cache written" in _stop(proc)
    with _server(data, "--model", str(model_dir)) as (url, proc):
        turn3 = [*turn2, {"role": "assistant", "content": second["text"]}]
        turn3.append({"role": "user", "content": "Thanks."})
        third = _post(url, {"conversation": "c1", "messages": turn3, "max_tokens": 4}, "/chat")
        assert third["cache"] == "cold" and third["reused"] >= len(rendered) - 1
        _stop(proc)


def test_a_model_flag_naming_no_model_directory_is_a_usage_error(tmp_path: Path) -> None:
    """``--model`` naming a directory without config.json, or a GGUF file, ends with exit 2
    and one line naming the flag, before MLX starts; before, mlx_lm.load's traceback."""
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    for model in (tmp_path, tmp_path / "tiny.gguf"):
        argv = [sys.executable, str(SERVER), "--data-dir", str(tmp_path / "d"), "--model"]
        done = subprocess.run([*argv, str(model)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        last = done.stderr.splitlines()[-1]
        assert last.startswith(f"tiered_server.py: error: --model {model}: ")
