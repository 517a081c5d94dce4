"""The tiny random-weight model the demo, examples and tier tests run on."""

from __future__ import annotations

import mlx.core as mx
from kvtrio.tinymodel import (
    TINY_CONFIG,
    build_tiny_model,
    config_fingerprint,
    decode_greedy,
    make_caches,
    prefill,
)


def test_same_seed_same_logits_and_caches_carry_the_prompt() -> None:
    a, b = build_tiny_model(seed=3), build_tiny_model(seed=3)
    tokens = list(range(1, 40))
    ca, cb = make_caches(a), make_caches(b)
    la, lb = prefill(a, ca, tokens, chunk=16), prefill(b, cb, tokens, chunk=16)
    assert mx.array_equal(la, lb)
    assert [c.offset for c in ca] == [len(tokens)] * len(ca)
    assert len(decode_greedy(a, ca, la, 3)) == 3
    assert ca[0].offset == len(tokens) + 3


def test_fingerprint_covers_config_and_seed() -> None:
    base = config_fingerprint(TINY_CONFIG, seed=0)
    assert base != config_fingerprint(TINY_CONFIG, seed=1)
    assert base != config_fingerprint({**TINY_CONFIG, "num_hidden_layers": 3}, seed=0)
    assert build_tiny_model(seed=0).fingerprint == base
