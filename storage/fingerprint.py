"""A model's config fingerprint: sha256 over every graph-shaping field of its config.

Stored in each cache header; ``load_cache(expect=...)`` and the tier refuse a cache whose
fingerprint differs, so a changed model (layers, heads, rope, sliding windows, dtype,
kv quantization, ...) invalidates old files cleanly instead of producing garbage.

Rather than listing the fields that shape the graph (a list that goes stale with every
new architecture), the fingerprint covers the whole config except a short denylist of
fields known not to affect the computation (token ids, bookkeeping, output switches).
KV-cache quantization is not part of a Hugging Face config, so it is passed explicitly.

A config does not tell two weight sets apart (a fine-tune, a merge, an adapter share
their base model's config): :func:`weights_fingerprint` identifies the weights files
themselves, and :func:`model_fingerprint` is the one call a server makes for a model
directory (its ``config.json`` and its weights, plus any adapter). Pure Python: no MLX.

Where the config comes from with mlx-lm: ``model, tokenizer, config =
mlx_lm.load(path, return_config=True)`` (``config_fingerprint(model.args)`` is not it:
``args`` is a dataclass, not the config mapping).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from kvtrio.errors import InvalidInputError

__all__ = [
    "IGNORED_CONFIG_KEYS",
    "config_fingerprint",
    "model_fingerprint",
    "weights_fingerprint",
]

# Weight files, and the adapter files mlx-lm writes (adapters.safetensors, adapter_config.json).
_WEIGHT_SUFFIXES: Final = (".safetensors", ".npz", ".gguf", ".bin")
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_READ: Final = 8 * 1024 * 1024

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


def _file_identity(path: Path) -> str:
    """The sha256 of a weights file's bytes: free for a Hugging Face cache snapshot (the
    file is a link to ``blobs/<sha256>``, named by its content), else hashed."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _HEX64.fullmatch(target.name):
            return target.name
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_files(directory: Path) -> list[Path]:
    if directory.is_file():
        return [directory]
    files = sorted(
        p for p in directory.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)
    )
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files.append(index)
    adapter_config = directory / "adapter_config.json"
    if adapter_config.is_file():
        files.append(adapter_config)
    return files


def weights_fingerprint(
    model_path: str | os.PathLike[str], *, adapter_path: str | os.PathLike[str] | None = None
) -> str:
    """``"sha256:<hex>"`` identifying the weights in ``model_path`` (a model directory or
    one weights file) and, when given, the adapter at ``adapter_path``.

    Every weights file (``*.safetensors``, ``*.npz``, ``*.gguf``, ``*.bin``, the
    safetensors index, an adapter's config) is identified by the sha256 of its bytes: read
    from the name of the Hugging Face cache blob it links to when it is one (no read), else
    computed (about a second per GB). Two weight sets of one architecture and config (a
    fine-tune, an adapter) get different fingerprints; the same files, copied anywhere, the
    same one. InvalidInputError when there is no weights file to identify.
    """
    parts: list[tuple[str, str, str]] = []
    for role, where in (("model", model_path), ("adapter", adapter_path)):
        if where is None:
            continue
        directory = Path(where)
        files = _weight_files(directory) if directory.exists() else []
        if not files:
            raise InvalidInputError(f"{role} path {os.fspath(where)!r}: no weights file found")
        parts.extend((role, p.name, _file_identity(p)) for p in files)
    raw = json.dumps(parts, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def model_fingerprint(
    model_path: str | os.PathLike[str],
    *,
    adapter_path: str | os.PathLike[str] | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    max_kv_size: int | None = None,
) -> str:
    """The fingerprint a server stores and expects for the model at ``model_path`` (a
    model directory with ``config.json``, as ``mlx_lm.load`` reads): its config's
    :func:`config_fingerprint` with :func:`weights_fingerprint` as ``weights_id``, so a
    cache is reused only by the same architecture, config, weights and adapter."""
    config_path = Path(model_path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{os.fspath(config_path)!r}: no readable config ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidInputError(f"{os.fspath(config_path)!r}: not a JSON object")
    return config_fingerprint(
        config,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        max_kv_size=max_kv_size,
        weights_id=weights_fingerprint(model_path, adapter_path=adapter_path),
    )
