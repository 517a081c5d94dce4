"""Build a random-weight llama of SmolLM2-135M's shape as an mlx-lm model directory.

Usage: python3 build_model.py DIR [float16|bfloat16|float32]
Calls kvtrio.serve.modeldir.write_tiny_model_dir with SmolLM2-135M's config (its
weights come out float32), then casts every weight file to DTYPE (the KV cache of
mlx-lm follows the activations' dtype, so float16 weights give a float16 cache).
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 16384,
}


def main() -> None:
    import mlx.core as mx
    from kvtrio.serve.modeldir import write_tiny_model_dir

    path = Path(sys.argv[1])
    dtype_name = sys.argv[2] if len(sys.argv) > 2 else "float16"
    dtype = getattr(mx, dtype_name)
    began = time.perf_counter()
    out = write_tiny_model_dir(path, config=SMOLLM2_135M)
    total = 0
    for f in sorted(out.glob("model*.safetensors")):
        loaded: Any = mx.load(str(f))
        weights = {k: v.astype(dtype) for k, v in loaded.items()}
        mx.eval(weights)
        total += sum(v.nbytes for v in weights.values())
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    # The KV cache dtype and bytes of a 4096-token entry, as mlx-lm's server makes it.
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model = load(str(out))[0]
    caches = make_prompt_cache(model)
    probe = int(os.environ.get("KV_PROBE", "4096"))
    model(mx.array([[5] * probe]), cache=caches)
    arrays = [a for c in caches for a in c.state if isinstance(a, mx.array)]
    mx.eval(arrays)
    kv = sum(a.nbytes // a.shape[2] for a in arrays) * probe  # state may be the whole buffer
    buffers = sum(a.nbytes for a in arrays)
    kinds = sorted({type(c).__name__ for c in caches})
    print(
        json.dumps(
            {
                "model_dir": str(out),
                "weights_dtype": dtype_name,
                "weights_bytes": total,
                "kv_dtype": str(arrays[0].dtype),
                "cache_types": kinds,
                "kv_probe_tokens": probe,
                "kv_bytes_4096": kv * 4096 // probe,
                "kv_buffer_bytes_at_probe": buffers,
                "build_s": round(time.perf_counter() - began, 1),
                "mlx": getattr(mx, "__version__", "?"),
                "device": str(mx.default_device()),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
