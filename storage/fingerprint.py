"""A model's config fingerprint: sha256 over every graph-shaping field of its config.

Stored in each cache header; ``load_cache(expect=...)`` and the tier refuse a cache whose
fingerprint differs, so a changed model (layers, heads, rope, sliding windows, dtype,
kv quantization, ...) invalidates old files cleanly instead of producing garbage.

Rather than listing the fields that shape the graph (a list that goes stale with every
new architecture), the fingerprint covers the whole config except a short denylist of
fields known not to affect the computation (token ids, bookkeeping, output switches).
KV-cache quantization is not part of a Hugging Face config, so it is passed explicitly.
Pure Python: no MLX.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["IGNORED_CONFIG_KEYS", "config_fingerprint"]

#: Config keys that do not change the model's graph or numerics.
IGNORED_CONFIG_KEYS: Final = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tokenizer_class",
        "task_specific_params",
        "generation_config",
    }
)


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def config_fingerprint(
    config: Mapping[str, Any],
    *,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    max_kv_size: int | None = None,
    weights_id: str | None = None,
) -> str:
    """``"sha256:<hex>"`` over ``config`` (minus :data:`IGNORED_CONFIG_KEYS`) and the options.

    ``kv_bits``/``kv_group_size``/``quantized_kv_start``: the KV quantization scheme the
    server uses (mlx-lm's generate options). ``max_kv_size``: a rotating-cache window the
    server imposes. ``weights_id``: anything identifying the weights (a revision, a
    checksum, a seed), since two checkpoints of one architecture share a config.
    """
    doc = {
        "config": {
            k: _canonical(v) for k, v in config.items() if str(k) not in IGNORED_CONFIG_KEYS
        },
        "kv_bits": kv_bits,
        "kv_group_size": kv_group_size,
        "quantized_kv_start": quantized_kv_start,
        "max_kv_size": max_kv_size,
        "weights_id": weights_id,
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()
