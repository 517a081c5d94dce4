"""Fingerprints that tell weights apart (issue 15, item 8).

On the landed code the README's recipe fingerprinted the config alone: a fine-tune or an
adapter of the same base (same config.json) loaded the base model's caches silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import kvtrio
import pytest
from kvtrio.errors import CacheMismatchError, InvalidInputError
from kvtrio.storage.fingerprint import config_fingerprint, model_fingerprint, weights_fingerprint

from .conftest import make_kv

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}


def _model_dir(path: Path, weights: bytes, config: dict[str, object] = CONFIG) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_fine_tune_with_the_same_config_gets_another_fingerprint(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", b"base weights")
    tuned = _model_dir(tmp_path / "tuned", b"tuned weights")
    copy = _model_dir(tmp_path / "copy", b"base weights")
    assert model_fingerprint(base) != model_fingerprint(tuned)
    assert model_fingerprint(base) == model_fingerprint(copy)  # content, not place
    assert config_fingerprint(CONFIG) != model_fingerprint(base)


def test_an_adapter_changes_the_fingerprint(tmp_path: Path) -> None:
    base = _model_dir(tmp_path / "base", b"base weights")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapters.safetensors").write_bytes(b"lora")
    (adapter / "adapter_config.json").write_text('{"rank": 8}')
    with_adapter = model_fingerprint(base, adapter_path=adapter)
    assert with_adapter != model_fingerprint(base)
    (adapter / "adapter_config.json").write_text('{"rank": 16}')
    assert model_fingerprint(base, adapter_path=adapter) != with_adapter


def test_a_hugging_face_snapshot_is_identified_by_its_blob_names(tmp_path: Path) -> None:
    """The cache's blobs are named by the sha256 of their content: no need to read them."""
    name = "ab" * 32
    for i, contents in enumerate((b"one", b"two")):
        blobs = tmp_path / f"hub{i}" / "blobs"
        blobs.mkdir(parents=True)
        (blobs / name).write_bytes(contents)
        snapshot = tmp_path / f"hub{i}" / "snapshots" / "rev"
        snapshot.mkdir(parents=True)
        os.symlink(blobs / name, snapshot / "model.safetensors")
    first = weights_fingerprint(tmp_path / "hub0" / "snapshots" / "rev")
    assert first == weights_fingerprint(tmp_path / "hub1" / "snapshots" / "rev")


def test_another_architecture_of_the_same_shape_never_matches() -> None:
    assert config_fingerprint(CONFIG) != config_fingerprint({**CONFIG, "model_type": "mistral"})


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(InvalidInputError, match=r"no weights file found$"):
        model_fingerprint(tmp_path)
    with pytest.raises(InvalidInputError, match=r"config\.json'.*no readable config"):
        model_fingerprint(tmp_path / "absent")


def test_a_cache_of_the_base_model_is_refused_for_the_fine_tune(tmp_path: Path) -> None:
    base = model_fingerprint(_model_dir(tmp_path / "base", b"base weights"))
    tuned = model_fingerprint(_model_dir(tmp_path / "tuned", b"tuned weights"))
    path = tmp_path / "c.kvt"
    kvtrio.save_cache(path, [1], [make_kv([1])], meta={"config_fingerprint": base})
    kvtrio.load_cache(path, expect=kvtrio.Expect(config_fingerprint=base))
    with pytest.raises(CacheMismatchError, match=r"^config_fingerprint: "):
        kvtrio.load_cache(path, expect=kvtrio.Expect(config_fingerprint=tuned))
