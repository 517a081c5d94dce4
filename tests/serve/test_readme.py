"""README.md's "Serve a model" works as written: ``kvtrio serve --model DIR --port PORT``
on a tiny mlx-lm model directory, the README's own OpenAI client block run unchanged but
for the port, and what it says to expect after a restart (SIGTERM exits 0; the same
question again reports ``cached_tokens`` > 0 from the tier the header names, and the same
answer at temperature 0)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvtrio.serve.modeldir import write_tiny_model_dir
from kvtrio.tests.serve.servers import free_port, start_kvtrio

pytest.importorskip("openai")

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _client_block() -> str:
    blocks: list[str] = re.findall(r"(?ms)^```python\n(.*?)^```", _section("Serve a model"))
    (block,) = blocks
    assert "127.0.0.1:8080" in block
    return block


def _run_block(block: str, port: int, tmp_path: Path) -> list[str]:
    script = tmp_path / "client.py"
    script.write_text(block.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    *answer, last = done.stdout.rstrip("\n").split("\n")
    return ["\n".join(answer), *last.split(" ")]


def test_the_readmes_serve_commands_and_client_block_work_as_written(tmp_path: Path) -> None:
    section = _section("Serve a model")
    (command,) = re.findall(r"(?m)^kvtrio serve (--model \S+ --port 8080)$", section)
    assert command.split()[::2] == ["--model", "--port"]
    model = write_tiny_model_dir(tmp_path / "tiny-llama", seed=0)
    block = _client_block()
    port = free_port()

    first = start_kvtrio(model, tmp_path / "cache", tmp_path / "a.txt", port=port)
    answer, tier, cached = _run_block(block, port, tmp_path)
    assert (tier, cached) == ("miss", "0")
    assert first.stop() == 0, first.output()  # SIGTERM: the RAM cache written, exit 0

    second = start_kvtrio(model, tmp_path / "cache", tmp_path / "b.txt", port=port)
    again, tier, cached = _run_block(block, port, tmp_path)
    assert second.stop() == 0, second.output()
    assert tier in ("hot", "cold") and int(cached) > 0
    assert again == answer
