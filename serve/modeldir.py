"""A tiny random-weight llama as a real mlx-lm model directory, built here, offline.

``write_tiny_model_dir(path)`` writes what ``mlx_lm.load`` (and so ``mlx_lm.server`` and
``kvtrio serve``) reads: ``config.json``, ``model.safetensors``, and a byte-level BPE
tokenizer trained locally with the ``tokenizers`` package on a small built-in text
(``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template). The answers
mean nothing; every code path (tokenizer, chat template, prefill, decode, caches) is the
real one. Needs the ``tokenizers`` package (kvtrio's test extra). Calls MLX: run it on
the thread that owns MLX in the calling process (before a server starts, typically).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "MODEL_CONFIG",
    "SHAPES",
    "SMOLLM2_135M_CONFIG",
    "SPECIAL_TOKENS",
    "write_tiny_model_dir",
]

#: The llama written by default: the shape of kvtrio.tinymodel's TINY_CONFIG.
MODEL_CONFIG: Mapping[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 16384,
}

#: SmolLM2-135M's shape (random weights; the tokenizer stays the small local one, and the
#: ids it lacks decode as mlx-lm's "!" fallback): a 4,096-token float16 KV cache of it is
#: 94,371,840 bytes (30 layers, 3 kv heads of 64), where the tiny model's is about 4 MB.
SMOLLM2_135M_CONFIG: Mapping[str, Any] = {
    **MODEL_CONFIG,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
}

#: Model shapes by name (``kvtrio bench serve --model-shape``): keyword arguments of
#: :func:`write_tiny_model_dir`.
SHAPES: Mapping[str, Mapping[str, Any]] = {
    "tiny": {"config": MODEL_CONFIG},
    "smollm2-135m": {"config": SMOLLM2_135M_CONFIG, "dtype": "float16"},
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A prompt cache keeps the keys and values "
    "of a conversation so the next turn does not compute them again. Servers restart, "
    "conversations continue; what was computed once is read back from disk. "
    "What is the capital of France? The capital of France is Paris. "
    "system user assistant hello world tokens cache disk memory model answer question "
)


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def write_tiny_model_dir(
    path: str | Path,
    *,
    config: Mapping[str, Any] = MODEL_CONFIG,
    seed: int = 0,
    dtype: str | None = None,
) -> Path:
    """Write the model directory at ``path`` (created); return it. ``dtype`` (an MLX
    floating dtype's name, e.g. ``"float16"``) casts the weights, and so the KV caches
    mlx-lm makes of the model; None keeps MLX's float32."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = int(config["vocab_size"])
    tokenizer = _tokenizer(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    full = {**config, "eos_token_id": eos, "bos_token_id": tokenizer.token_to_id("<|endoftext|>")}
    mx.random.seed(seed)
    from_dict: Any = llama.ModelArgs.from_dict
    model = llama.Model(from_dict(dict(full)))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        full["torch_dtype"] = dtype
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": int(config.get("max_position_embeddings", 16384)),
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    return out
