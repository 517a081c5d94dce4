"""A llama GGUF file (llama.cpp's format) as an mlx-lm model directory.

``convert_gguf(path, out)`` reads the file with ``mx.load(path, return_metadata=True)``
(MLX reads GGUF: Q4_0/Q4_1/Q8_0 tensors come back as MLX-quantized weight, scales and
biases) and writes what ``mlx_lm.load`` (and so ``kvtrio serve``) reads:

- ``model.safetensors``: every tensor under mlx-lm's llama name (``blk.N.attn_q`` ->
  ``model.layers.N.self_attn.q_proj``, ...);
- ``config.json``: the llama hyper-parameters from the metadata, ``rope_traditional:
  true`` (llama.cpp stores q and k for the interleaved rotation), and the quantization
  of each quantized tensor (its bits follow from its shape; group size 32);
- ``tokenizer.json`` / ``tokenizer_config.json``: the byte-level BPE tokenizer built from
  ``tokenizer.ggml.tokens`` and ``merges`` (control tokens as special tokens) with the
  file's chat template.

Only llama architectures with a GPT-2-style (byte-level BPE) vocabulary are converted;
anything else is refused with :class:`~kvtrio.errors.UnsupportedModelError`. Calls MLX:
run it on the thread that owns MLX (before a server starts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtrio.errors import UnsupportedModelError

__all__ = ["GGUF_GROUP_SIZE", "convert_gguf", "gguf_model_dir"]

GGUF_GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONTROL = 3  # llama.cpp's token type of control (special) tokens


def _mlx_name(name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)", name)
    if match is not None and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    base, _, part = name.rpartition(".")
    if base in _TOP_NAMES and part in ("weight", "scales", "biases"):
        return f"{_TOP_NAMES[base]}.{part}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no llama counterpart in mlx-lm")


def _scalar(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModelError(f"GGUF metadata lacks {key!r}")
    value = meta[key]
    return value.item() if hasattr(value, "item") else value


def _config(meta: Mapping[str, Any], weights: Mapping[str, Any]) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture {arch!r}: only llama is converted")
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": int(_scalar(meta, "llama.embedding_length")),
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": int(_scalar(meta, "llama.attention.head_count")),
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(tokens),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        "rope_traditional": True,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    quantization: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": 4}
    for name, weight in weights.items():
        if not name.endswith(".scales"):
            continue
        module = _mlx_name(name).removesuffix(".scales")
        packed = weights[name.removesuffix(".scales") + ".weight"]
        in_features = int(weight.shape[-1]) * GGUF_GROUP_SIZE
        quantization[module] = {
            "group_size": GGUF_GROUP_SIZE,
            "bits": int(packed.shape[-1]) * 32 // in_features,
        }
    if len(quantization) > 2:
        config["quantization"] = quantization
    return config


def _tokenizer(meta: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """The byte-level BPE tokenizer of the file and its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    kind = _scalar(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer {kind!r}: only byte-level BPE (gpt2)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    tokenizer.add_special_tokens(special)
    return tokenizer, special


def convert_gguf(path: str | Path, out: str | Path) -> Path:
    """Write the mlx-lm model directory of the GGUF file ``path`` at ``out``; return it."""
    import mlx.core as mx

    try:
        loaded: Any = mx.load(str(path), return_metadata=True)
    except RuntimeError as exc:  # MLX's gguf_init: not a GGUF file, or one it cannot read
        raise UnsupportedModelError(f"{path}: MLX cannot read it as GGUF ({exc})") from None
    weights, meta = loaded
    config = _config(meta, weights)
    tokenizer, special = _tokenizer(meta)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(target / "model.safetensors"),
        {_mlx_name(name): value for name, value in weights.items()},
        metadata={"format": "mlx"},
    )
    tokens = meta["tokenizer.ggml.tokens"]
    tokenizer.save(str(target / "tokenizer.json"))
    bos, eos = tokens[config["bos_token_id"]], tokens[config["eos_token_id"]]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": tokens[int(_scalar(meta, "tokenizer.ggml.padding_token_id"))]
        if "tokenizer.ggml.padding_token_id" in meta
        else eos,
        "unk_token": None,
        "additional_special_tokens": [t for t in special if t not in (bos, eos)],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token"))
        if "tokenizer.ggml.add_bos_token" in meta
        else False,
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = str(meta["tokenizer.chat_template"])
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return target


def gguf_model_dir(path: str | Path, cache_root: str | Path) -> Path:
    """The converted directory of ``path`` under ``cache_root`` (converted on first use;
    named by the file's name and size, so a changed file converts again)."""
    source = Path(path)
    target = Path(cache_root) / f"{source.stem}-{source.stat().st_size}"
    if not (target / "config.json").exists():
        convert_gguf(source, target)
    return target
