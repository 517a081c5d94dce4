"""mlx_lm.server's flags that change the prompt cache's contents, served by ``kvtrio
serve`` across a restart: with ``--kv-bits`` (QuantizedKVCache entries, the non-batched
path) turn 2 is read from disk and answers as plain mlx_lm.server does with the same
flags; with ``--draft-model`` (speculative decoding) the entry is stored under the tokens
every cache holds and turn 2 is read from disk, answering as plain mlx_lm.server does
after a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvtrio.serve.modeldir import write_tiny_model_dir
from kvtrio.tests.serve.servers import exit_summary, start_kvtrio, start_mlx_lm

pytest.importorskip("openai")

TURN1 = [{"role": "user", "content": "What is the capital of France? " * 12}]


def _chat(server: Any, messages: list[dict[str, str]]) -> tuple[Any, list[Any]]:
    raw = server.client().chat.completions.with_raw_response.create(
        model="default_model",
        messages=messages,
        temperature=0.0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
    )
    content = json.loads(raw.text)["choices"][0]["logprobs"]["content"]
    return raw, [(t["id"], t["logprob"]) for t in content]


def _turn2(answer: Any) -> list[dict[str, str]]:
    text = answer.parse().choices[0].message.content or ""
    return [*TURN1, {"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]


def _restart_then_turn2(
    model: Path, tmp_path: Path, *flags: str
) -> tuple[Any, list[Any], dict[str, int]]:
    first = start_kvtrio(model, tmp_path / "cache", tmp_path / "a.txt", *flags)
    raw, _ = _chat(first, TURN1)
    assert first.stop() == 0, first.output()
    second = start_kvtrio(
        model, tmp_path / "cache", tmp_path / "b.txt", "--restore-bytes", "0", *flags
    )
    raw2, logprobs = _chat(second, _turn2(raw))
    assert second.stop() == 0, second.output()
    return raw2, logprobs, exit_summary(first)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


def test_kv_bits_entries_are_served_from_disk_after_a_restart_as_mlx_lm_answers(
    model_dir: Path, tmp_path: Path
) -> None:
    flags = ("--kv-bits", "8", "--quantized-kv-start", "0")
    raw, logprobs, before = _restart_then_turn2(model_dir, tmp_path, *flags)
    assert before["spilled"] == 1
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
    plain = start_mlx_lm(model_dir, tmp_path / "plain.txt", *flags)
    try:
        one, _ = _chat(plain, TURN1)
        plain_raw, plain_logprobs = _chat(plain, _turn2(one))
    finally:
        plain.stop()
    assert plain_raw.parse().usage.prompt_tokens_details.cached_tokens == cached > 0
    assert plain_logprobs == logprobs


def test_draft_model_entries_are_served_from_disk_after_a_restart_as_mlx_lm_answers(
    model_dir: Path, tmp_path: Path
) -> None:
    """With a draft model mlx-lm's entry holds the model's caches and the draft's, the
    draft's one token short of the key (the model's at most as many as the key): the
    tier takes it under the tokens every cache holds (kvtrio.serve.cachekinds, rule 3),
    so turn 2 after a restart is a cold hit, and its answer is plain mlx_lm.server's
    after a restart. Before, every such write was refused (CacheMismatchError)."""
    draft = write_tiny_model_dir(tmp_path / "draft", seed=1)
    flags = ("--draft-model", str(draft), "--num-draft-tokens", "2")
    raw, logprobs, before = _restart_then_turn2(model_dir, tmp_path, *flags)
    assert before["spilled"] == 1
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0
    plain = start_mlx_lm(model_dir, tmp_path / "plain.txt", *flags)
    try:
        one, _ = _chat(plain, TURN1)
    finally:
        plain.stop()
    restarted = start_mlx_lm(model_dir, tmp_path / "plain2.txt", *flags)
    try:
        plain_raw, plain_logprobs = _chat(restarted, _turn2(one))
    finally:
        restarted.stop()
    assert plain_raw.parse().usage.prompt_tokens_details.cached_tokens == 0
    assert [token for token, _ in plain_logprobs] == [token for token, _ in logprobs]


def test_prompt_cache_bytes_evicts_to_disk_and_turn_two_is_read_back(
    model_dir: Path, tmp_path: Path
) -> None:
    """mlx_lm.server's ``--prompt-cache-bytes`` (RAM's byte budget, applied as each
    request joins the batch) reaches the adapter: with a budget no entry fits in, the
    next request's admission trims RAM, kvtrio writes what leaves to disk, and the same
    process serves conversation A's turn 2, after B's turn 1 pushed A out, from disk
    with the answer plain mlx_lm.server gives (which, its RAM trimmed alike,
    recomputes it)."""
    flags = ("--prompt-cache-bytes", "1")
    other = [{"role": "user", "content": "Name three rivers of Europe. " * 12}]
    server = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "a.txt", *flags)
    try:
        one, _ = _chat(server, TURN1)
        _chat(server, other)
        raw, logprobs = _chat(server, _turn2(one))
    finally:
        assert server.stop() == 0, server.output()
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0
    assert exit_summary(server)["spilled"] >= 2
    plain = start_mlx_lm(model_dir, tmp_path / "plain.txt", *flags)
    try:
        plain_one, _ = _chat(plain, TURN1)
        _chat(plain, other)
        plain_raw, plain_logprobs = _chat(plain, _turn2(plain_one))
    finally:
        plain.stop()
    plain_cached = plain_raw.parse().usage.prompt_tokens_details.cached_tokens
    assert plain_cached < raw.parse().usage.prompt_tokens_details.cached_tokens
    assert [token for token, _ in plain_logprobs] == [token for token, _ in logprobs]


def _write_lora_adapter(model: Path, directory: Path) -> Path:
    """A LoRA adapter for ``model`` as mlx-lm's trainer saves one (adapter_config.json,
    adapters.safetensors), with random non-zero weights so that it changes the answers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lora = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    loaded: Any = load(str(model))[0]
    linear_to_lora_layers(loaded, 2, lora)
    mx.random.seed(7)
    parameters: Any = tree_flatten(loaded.parameters())
    weights = {
        name: mx.random.normal(value.shape) * 0.5
        for name, value in parameters
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def test_adapter_entries_are_served_from_disk_after_a_restart_and_only_with_that_adapter(
    model_dir: Path, tmp_path: Path
) -> None:
    """``--adapter-path`` (a LoRA fine-tune): turn 2 after a restart is read from disk and
    answers as plain mlx_lm.server with the adapter; the base model served from the same
    cache directory does not reuse the adapter's entries (its key differs)."""
    adapter = _write_lora_adapter(model_dir, tmp_path / "adapter")
    flags = ("--adapter-path", str(adapter))
    raw, logprobs, before = _restart_then_turn2(model_dir, tmp_path, *flags)
    assert before["spilled"] == 1
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    plain = start_mlx_lm(model_dir, tmp_path / "plain.txt", *flags)
    try:
        one, _ = _chat(plain, TURN1)
        _, plain_logprobs = _chat(plain, _turn2(one))
    finally:
        plain.stop()
    assert plain_logprobs == logprobs
    base = start_kvtrio(model_dir, tmp_path / "cache", tmp_path / "base.txt")
    try:
        base_raw, base_logprobs = _chat(base, _turn2(one))
    finally:
        assert base.stop() == 0, base.output()
    assert base_raw.headers["X-Kvtrio-Cache"] == "miss"
    assert [t for t, _ in base_logprobs] != [t for t, _ in logprobs]  # the adapter matters
