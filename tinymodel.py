"""A tiny random-weight mlx-lm model, for the demo, the examples and the tests.

Model weights cannot be downloaded here, and none are needed to exercise a prompt
cache: a llama built from a config dict with a fixed seed has the real attention and
cache code paths of mlx-lm. Every function below calls MLX, so it must run on the
MLX owner thread (``await owner.run(prefill, model, caches, tokens)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "TINY_CONFIG",
    "TinyModel",
    "build_tiny_model",
    "config_fingerprint",
    "decode_greedy",
    "make_caches",
    "prefill",
]

# Small enough that a 4k-token prefill takes a few seconds on two CPU cores, large
# enough that recomputing a long prompt is visibly slower than loading its cache.
TINY_CONFIG: Mapping[str, Any] = {
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


def config_fingerprint(config: Mapping[str, Any], *, seed: int) -> str:
    """The storage fingerprint of the config, with the weight seed as the weights' id."""
    from kvtrio.storage.fingerprint import config_fingerprint as fingerprint

    return fingerprint(config, weights_id=f"random-seed:{seed}")


@attrs.frozen
class TinyModel:
    """An mlx-lm model with its identity (model id and config fingerprint)."""

    model: Any
    model_id: str
    fingerprint: str
    vocab_size: int


def build_tiny_model(
    config: Mapping[str, Any] = TINY_CONFIG, *, seed: int = 0, model_id: str = "kvtrio/tiny-llama"
) -> TinyModel:
    """Build the model with weights drawn from ``seed`` (owner thread only)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    from_dict: Any = llama.ModelArgs.from_dict
    args = from_dict(dict(config))
    model = llama.Model(args)
    mx.eval(model.parameters())
    return TinyModel(
        model=model,
        model_id=model_id,
        fingerprint=config_fingerprint(config, seed=seed),
        vocab_size=int(config["vocab_size"]),
    )


def make_caches(tiny: TinyModel) -> list[Any]:
    """Fresh, empty mlx-lm caches for ``tiny`` (owner thread only)."""
    from mlx_lm.models.cache import make_prompt_cache

    return list(make_prompt_cache(tiny.model))


def prefill(tiny: TinyModel, caches: list[Any], tokens: Sequence[int], *, chunk: int = 512) -> Any:
    """Run ``tokens`` through the model into ``caches``; return the last position's logits.

    The logits come back evaluated, float32, shape ``(vocab,)``. ``tokens`` must not be
    empty, and every id must be in ``[0, vocab_size)``: MLX's embedding gather does not
    check its indices, and an id past the table reads (and sometimes segfaults on) memory
    outside it. Chunks bound the attention working set; note that a different chunking is
    not bit-identical (the reductions differ), only close.
    """
    import mlx.core as mx

    if not tokens:
        raise ValueError("prefill needs at least one token")
    bad = next((t for t in tokens if not 0 <= t < tiny.vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {tiny.vocab_size})")
    logits = None
    for start in range(0, len(tokens), chunk):
        piece = mx.array([list(tokens[start : start + chunk])], dtype=mx.uint32)
        logits = tiny.model(piece, cache=caches)[:, -1, :]
        mx.eval(logits, [c.state for c in caches])
    assert logits is not None
    out = logits[0].astype(mx.float32)
    mx.eval(out)
    return out


def decode_greedy(tiny: TinyModel, caches: list[Any], logits: Any, steps: int) -> list[int]:
    """Greedy-decode ``steps`` tokens, starting from ``logits`` of the last prompt token."""
    import mlx.core as mx

    out: list[int] = []
    for _ in range(steps):
        token = mx.argmax(logits).item()
        assert isinstance(token, int)
        out.append(token)
        logits = prefill(tiny, caches, [token])
    return out
