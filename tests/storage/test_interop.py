"""Interop with mlx-lm's safetensors prompt-cache files, and load_cache(expect=...)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvtrio
import pytest
from kvtrio.api import Expect, export_mlx_lm, import_mlx_lm
from kvtrio.errors import CacheMismatchError
from kvtrio.storage.structure import cache_structure
from mlx_lm.models import cache as _mlx_cache_module
from mlx_lm.models import llama

from .conftest import BUILDERS, assert_same, logical_state, tokens_for

mlx_cache: Any = _mlx_cache_module

KINDS = ["kv", "rotating", "rotating_wrapped", "quantized", "chunked", "arrays", "list"]


@pytest.mark.parametrize("kind", KINDS)
def test_import_mlx_lm_prompt_cache(tmp_path: Path, kind: str) -> None:
    original = BUILDERS[kind]()
    mlx_cache.save_prompt_cache(str(tmp_path / "p.safetensors"), [original], {"model": "m"})
    tokens = tokens_for([original])
    import_mlx_lm(tmp_path / "p.safetensors", tmp_path / "p.kvt", tokens=tokens)
    loaded = kvtrio.load_cache(tmp_path / "p.kvt")
    assert list(loaded.tokens) == tokens and loaded.header.meta["model"] == "m"
    assert_same(logical_state(loaded.caches[0]), logical_state(original))


@pytest.mark.parametrize("kind", KINDS)
def test_export_to_mlx_lm_prompt_cache(tmp_path: Path, kind: str) -> None:
    original = BUILDERS[kind]()
    tokens = tokens_for([original])
    kvtrio.save_cache(tmp_path / "c.kvt", tokens, [original], meta={"model_id": "tiny"})
    export_mlx_lm(tmp_path / "c.kvt", tmp_path / "c.safetensors")
    caches, metadata = mlx_cache.load_prompt_cache(
        str(tmp_path / "c.safetensors"), return_metadata=True
    )
    assert metadata["model_id"] == "tiny" and json.loads(metadata["tokens"]) == tokens
    assert_same(logical_state(caches[0]), logical_state(original))


def _model(**overrides: Any) -> Any:
    args: dict[str, Any] = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=100,
    )
    args.update(overrides)
    return llama.Model(llama.ModelArgs(**args))


def test_expect_checks_model_id_fingerprint_and_structure(tmp_path: Path) -> None:
    model = _model()
    caches = mlx_cache.make_prompt_cache(model)
    kvtrio.save_cache(
        tmp_path / "c.kvt", [], caches, meta={"model_id": "tiny", "config_fingerprint": "fp1"}
    )
    ok = Expect.for_model(model, model_id="tiny", config_fingerprint="fp1")
    assert len(kvtrio.load_cache(tmp_path / "c.kvt", expect=ok).caches) == 2
    with pytest.raises(CacheMismatchError, match=r"^model_id: cache is for 'tiny', expected 'x'$"):
        kvtrio.load_cache(tmp_path / "c.kvt", expect=Expect(model_id="x"))
    with pytest.raises(
        CacheMismatchError, match=r"^config_fingerprint: cache has 'fp1', expected 'fp2'$"
    ):
        kvtrio.load_cache(tmp_path / "c.kvt", expect=Expect(config_fingerprint="fp2"))
    deeper = Expect.for_model(_model(num_hidden_layers=3))
    with pytest.raises(
        CacheMismatchError, match=r"^structure: cache has 2 layers, the model has 3$"
    ):
        kvtrio.load_cache(tmp_path / "c.kvt", expect=deeper)
    windowed = Expect(structure=cache_structure([mlx_cache.RotatingKVCache(64)] * 2))
    with pytest.raises(CacheMismatchError, match=r"^structure: layer 0 is \('kv', "):
        kvtrio.load_cache(tmp_path / "c.kvt", expect=windowed)


def test_config_fingerprint_covers_graph_fields_and_kv_quantization() -> None:
    from kvtrio.storage.fingerprint import config_fingerprint

    base = {"model_type": "llama", "hidden_size": 64, "eos_token_id": 2}
    fp = config_fingerprint(base)
    assert fp.startswith("sha256:") and fp == config_fingerprint(dict(reversed(base.items())))
    assert config_fingerprint({**base, "eos_token_id": 7}) == fp  # not graph-shaping
    assert config_fingerprint({**base, "hidden_size": 65}) != fp
    assert config_fingerprint({**base, "sliding_window": 512}) != fp
    assert config_fingerprint(base, kv_bits=4, kv_group_size=64) != fp
    assert config_fingerprint(base, kv_bits=4, kv_group_size=64) != config_fingerprint(
        base, kv_bits=8, kv_group_size=64
    )


def test_expect_for_a_server_that_quantizes_its_kv_cache(tmp_path: Path) -> None:
    model = _model(hidden_size=128, num_attention_heads=2)
    caches = [
        mlx_cache.QuantizedKVCache(group_size=32, bits=8)
        for _ in mlx_cache.make_prompt_cache(model)
    ]
    kvtrio.save_cache(tmp_path / "q.kvt", [], caches)
    quantized = Expect.for_model(model, kv_bits=8, kv_group_size=32)
    assert len(kvtrio.load_cache(tmp_path / "q.kvt", expect=quantized).caches) == 2
    with pytest.raises(CacheMismatchError, match=r"^structure: layer 0 is \('quantized', "):
        kvtrio.load_cache(tmp_path / "q.kvt", expect=Expect.for_model(model))
    with pytest.raises(CacheMismatchError, match=r"^structure: layer 0 is "):
        kvtrio.load_cache(tmp_path / "q.kvt", expect=Expect.for_model(model, kv_bits=4))
