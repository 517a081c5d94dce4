"""Logits parity: a decode step from a loaded cache equals the step from the live cache.

Tiny random-weight mlx-lm models: a llama (KVCache; and with a quantized KV cache), a
gemma3 text model whose cache mixes sliding-window RotatingKVCache layers (wrapped) with
full KVCache layers, and an lfm2 hybrid mixing KVCache with ArraysCache conv state.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.storage.format import Layout
from mlx_lm.models import cache as _mlx_cache_module
from mlx_lm.models import gemma3_text, lfm2, llama

mlx_cache: Any = _mlx_cache_module


def _llama(hidden_size: int = 64) -> Any:
    return llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=hidden_size,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=97,
        )
    )


def _gemma3() -> Any:
    return gemma3_text.Model(
        gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=3,
            intermediate_size=128,
            num_attention_heads=2,
            head_dim=32,
            num_key_value_heads=1,
            vocab_size=97,
            sliding_window=16,
            sliding_window_pattern=3,
            query_pre_attn_scalar=32,
        )
    )


def _lfm2() -> Any:
    return lfm2.Model(
        lfm2.ModelArgs(
            model_type="lfm2",
            vocab_size=97,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            block_ff_dim=128,
            full_attn_idxs=[1],
        )
    )


MODELS = {"llama": _llama, "gemma3": _gemma3, "lfm2": _lfm2}


def _decode(model: Any, caches: list[Any], token: int) -> Any:
    logits = model(mx.array([[token]]), cache=caches)
    mx.eval(logits)
    return logits


def _check_parity(tmp_path: Path, model: Any, caches: list[Any], layout: Layout) -> list[str]:
    path = tmp_path / "c.kvt"
    kvtrio.save_cache(path, list(range(40)), caches, layout=layout, block_tokens=8)
    loaded = kvtrio.load_cache(path).caches
    for token in (3, 11, 7):
        live = _decode(model, caches, token)
        again = _decode(model, loaded, token)
        assert mx.array_equal(live, again).item(), token
    return [type(c).__name__ for c in loaded]


@pytest.mark.parametrize("layout", ["single", "blocks"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_logits_from_loaded_cache_equal_live(
    tmp_path: Path, name: str, layout: Layout
) -> None:
    mx.random.seed(0)
    model = MODELS[name]()
    mx.eval(model.parameters())
    caches = mlx_cache.make_prompt_cache(model)
    prompt = mx.random.randint(0, 97, (1, 40))
    mx.eval(model(prompt, cache=caches))
    kinds = _check_parity(tmp_path, model, caches, layout)
    expected = {
        "llama": {"KVCache"},
        "gemma3": {"KVCache", "RotatingKVCache"},
        "lfm2": {"KVCache", "ArraysCache"},
    }[name]
    assert set(kinds) == expected


def test_quantized_kv_cache_logits_parity(tmp_path: Path) -> None:
    mx.random.seed(1)
    model = _llama(hidden_size=128)  # head_dim 32: a quantization group
    mx.eval(model.parameters())
    caches = mlx_cache.make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 97, (1, 40)), cache=caches))
    quantized = [c.to_quantized(group_size=32, bits=8) for c in caches]
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        # MLX's CUDA build lacks quantized_matmul for this decode shape, in mlx-lm's own live
        # decode (before kvtrio is involved): skip with MLX's words rather than fail.
        try:
            _decode(model, [copy.deepcopy(c) for c in quantized], 3)
        except (ValueError, RuntimeError) as exc:  # how MLX reports an unsupported shape
            pytest.skip(f"MLX CUDA gap in mlx-lm's quantized decode: {exc}")
    assert _check_parity(tmp_path, model, quantized, "single") == ["QuantizedKVCache"] * 2
