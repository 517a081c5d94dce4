"""A tiny llama GGUF file, written with MLX's own GGUF writer, for the tests of
:mod:`kvtrio.serve.gguf` that run in every suite (the real SmolLM2 file is opt-in).

Random float16 weights under llama.cpp's tensor names, the llama metadata the converter
reads, and a byte-level BPE vocabulary: the 256 byte tokens of GPT-2's byte alphabet, one
merge (``Ġ t``), and two control tokens the chat template uses."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "write_tiny_gguf"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN, LAYERS, INTERMEDIATE, HEADS, KV_HEADS = 64, 2, 128, 4, 2


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the tiny model at ``path`` (a ``.gguf`` file); return ``path``."""
    import mlx.core as mx

    tokens = [*_byte_alphabet(), "Ġt", "<|im_start|>", "<|im_end|>"]
    kinds = [1] * 257 + [3, 3]  # 1 normal, 3 control (llama.cpp's token types)
    mx.random.seed(seed)

    def normal(*shape: int) -> mx.array:
        return (mx.random.normal(shape) * 0.05).astype(mx.float16)

    kv = KV_HEADS * HIDDEN // HEADS
    weights = {
        "token_embd.weight": normal(len(tokens), HIDDEN),
        "output_norm.weight": mx.ones((HIDDEN,), dtype=mx.float16),
    }
    for layer in range(LAYERS):
        for name, shape in (
            ("attn_q", (HIDDEN, HIDDEN)),
            ("attn_k", (kv, HIDDEN)),
            ("attn_v", (kv, HIDDEN)),
            ("attn_output", (HIDDEN, HIDDEN)),
            ("ffn_gate", (INTERMEDIATE, HIDDEN)),
            ("ffn_up", (INTERMEDIATE, HIDDEN)),
            ("ffn_down", (HIDDEN, INTERMEDIATE)),
        ):
            weights[f"blk.{layer}.{name}.weight"] = normal(*shape)
        for norm in ("attn_norm", "ffn_norm"):
            weights[f"blk.{layer}.{norm}.weight"] = mx.ones((HIDDEN,), dtype=mx.float16)

    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(HIDDEN),
        "llama.block_count": u32(LAYERS),
        "llama.feed_forward_length": u32(INTERMEDIATE),
        "llama.attention.head_count": u32(HEADS),
        "llama.attention.head_count_kv": u32(KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.context_length": u32(4096),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.token_type": mx.array(kinds, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(257),
        "tokenizer.ggml.eos_token_id": u32(258),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    mx.save_gguf(str(path), weights, metadata)  # type: ignore[arg-type]
    return path
