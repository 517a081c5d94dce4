"""The random-weight model directories of ``kvtrio.serve.modeldir``: a weight dtype, and
the SmolLM2-135M shape ``kvtrio bench serve --model-shape smollm2-135m`` builds."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kvtrio.serve.modeldir import MODEL_CONFIG, SHAPES, SMOLLM2_135M_CONFIG, write_tiny_model_dir

pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")


def _kv_bytes_per_token(config: Mapping[str, Any], itemsize: int) -> int:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return int(
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * itemsize
    )


def test_a_float16_model_dir_has_float16_weights_and_a_float16_kv_cache(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    out = write_tiny_model_dir(tmp_path / "m", dtype="float16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    weights: dict[str, mx.array] = {}
    for f in out.glob("model*.safetensors"):
        weights |= dict(mx.load(str(f)).items())  # type: ignore[union-attr]
    assert weights and {w.dtype for w in weights.values()} == {mx.float16}
    model = load(str(out))[0]
    caches = make_prompt_cache(model)
    model(mx.array([[5] * 40]), cache=caches)
    keys = caches[0].state[0]
    assert keys.dtype == mx.float16
    per_token = sum(a.nbytes // a.shape[2] for c in caches for a in c.state[:2])
    assert per_token == _kv_bytes_per_token(MODEL_CONFIG, 2)


def test_the_smollm2_shape_makes_a_94_mb_float16_entry_of_4096_tokens() -> None:
    assert SHAPES["smollm2-135m"] == {"config": SMOLLM2_135M_CONFIG, "dtype": "float16"}
    assert _kv_bytes_per_token(SMOLLM2_135M_CONFIG, 2) * 4096 == 94_371_840
    assert SHAPES["tiny"] == {"config": MODEL_CONFIG}


def test_bench_serve_takes_a_model_shape() -> None:
    from kvtrio.bench.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).model_shape == "tiny"
    assert parser.parse_args(["--model-shape", "smollm2-135m"]).model_shape == "smollm2-135m"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-shape", "gpt-9"])
