"""Fixtures of the paged-attention tests."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest


@pytest.fixture
def on_cpu() -> Iterator[None]:
    """MLX's default device set to the CPU for one test, put back after: the CPU checks
    run there on a GPU machine too (MLX's CUDA build takes other sdpa kernels for some
    layouts and lacks quantized_matmul for some decode shapes)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)
