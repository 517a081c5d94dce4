"""Fixtures for the cold-tier tests: a tiny random-weight model's real mlx-lm caches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from kvtrio.tinymodel import TINY_CONFIG, TinyModel, build_tiny_model, make_caches, prefill

# Two small layers keep the tests fast on two cores; the cache code paths are mlx-lm's own.
SMALL_CONFIG = {**TINY_CONFIG, "num_hidden_layers": 2, "hidden_size": 128}

Prefill = Callable[[Sequence[int]], list[Any]]
Snapshot = Callable[[Sequence[Any]], list[bytes]]


@pytest.fixture(scope="session")
def tiny() -> TinyModel:
    """Built on the main thread: MLX arrays are not tied to a thread (streams are)."""
    return build_tiny_model(SMALL_CONFIG, seed=7)


@pytest.fixture
def prefilled(tiny: TinyModel) -> Prefill:
    """``prefilled(tokens)``: fresh caches holding ``tokens`` (call it on the owner)."""

    def make(tokens: Sequence[int]) -> list[Any]:
        caches = make_caches(tiny)
        prefill(tiny, caches, tokens)
        return caches

    return make


@pytest.fixture
def kv_bytes() -> Snapshot:
    """``kv_bytes(caches)``: each KV cache's live keys and values as bytes (on the owner)."""

    def dump(caches: Sequence[Any]) -> list[bytes]:
        import mlx.core as mx

        out: list[bytes] = []
        for cache in caches:
            for array in (cache.keys, cache.values):
                live: Any = mx.contiguous(array[..., : cache.offset, :])
                mx.eval(live)
                out.append(bytes(memoryview(live)))
        return out

    return dump
