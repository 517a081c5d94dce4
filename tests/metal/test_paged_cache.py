"""PagedKVCache and its reference attention path on the CPU, through a tiny mlx-lm llama.

The reference path must be bit-exact with mlx-lm's own caches: logits ``array_equal`` after
a prefill and 32 decode steps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from kvtrio.metal import (
    BlockPool,
    BlockPoolExhausted,
    PagedKVCache,
    QuantizedPagedKVCache,
    make_paged_cache,
    use_paged_attention,
)
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 32
PROMPT = [3, 17, 42, 8, 99, 5, 61, 23, 77, 12, 4, 56, 31]


pytestmark = pytest.mark.usefixtures("on_cpu")


def _model(dtype: mx.Dtype = mx.float32) -> Any:
    mx.random.seed(7)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=LAYERS,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        vocab_size=128,
        head_dim=HEAD_DIM,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _generate(model: Any, caches: list[Any], prompt: list[int], steps: int = 32) -> list[mx.array]:
    """Logits of a prefill, then of ``steps`` greedy decode steps."""
    logits = model(mx.array([prompt]), cache=caches)
    out = [logits]
    token = mx.argmax(logits[:, -1:], axis=-1)
    for _ in range(steps):
        logits = model(token, cache=caches)
        out.append(logits)
        token = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(out)
    return out


def _pools(dtype: mx.Dtype, block_size: int, *, bits: int | None = None) -> list[BlockPool]:
    return [
        BlockPool(64, KV_HEADS, block_size, HEAD_DIM, dtype=dtype, bits=bits, group_size=32)
        for _ in range(LAYERS)
    ]


def _same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_path_bit_exact_with_kvcache(dtype: mx.Dtype, block_size: int) -> None:
    model = _model(dtype)
    want = _generate(model, [KVCache() for _ in range(LAYERS)], PROMPT)
    got = _generate(model, [make_paged_cache(p) for p in _pools(dtype, block_size)], PROMPT)
    assert _same(got, want)


def test_drop_in_attention_bit_exact_on_cpu() -> None:
    """The drop-in attention reads the cache's view; on the CPU that is the reference path."""
    model = _model()
    want = _generate(model, [KVCache() for _ in range(LAYERS)], PROMPT)
    with use_paged_attention(llama):
        got = _generate(model, [make_paged_cache(p) for p in _pools(mx.float32, 4)], PROMPT)
    assert _same(got, want)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_pool_bit_exact_with_quantized_kvcache(bits: int) -> None:
    model = _model()
    want = _generate(
        model, [QuantizedKVCache(group_size=32, bits=bits) for _ in range(LAYERS)], PROMPT
    )
    caches = [make_paged_cache(p) for p in _pools(mx.float32, 4, bits=bits)]
    assert isinstance(caches[0], QuantizedPagedKVCache)
    assert caches[0].bits == bits
    got = _generate(model, caches, PROMPT)
    assert _same(got, want)


def test_shared_prefix_sequences_are_bit_exact_and_share_blocks() -> None:
    """Two sequences forked after a 13-token prompt (a partial last block) each match a
    private KVCache; the prefix's full blocks are stored once, the partial one is copied."""
    model = _model()
    pools = _pools(mx.float32, 4)
    first = [make_paged_cache(p) for p in pools]
    mx.eval(model(mx.array([PROMPT]), cache=first))
    second = [c.fork() for c in first]
    shared_full_blocks = len(PROMPT) // 4
    assert pools[0].statistics().shared_blocks == shared_full_blocks + 1
    ref_a = [KVCache() for _ in range(LAYERS)]
    mx.eval(model(mx.array([PROMPT]), cache=ref_a))
    ref_b = [KVCache() for _ in range(LAYERS)]
    mx.eval(model(mx.array([PROMPT]), cache=ref_b))
    want_a = _generate(model, ref_a, [1, 2, 3])
    want_b = _generate(model, ref_b, [9, 8])
    got_a = _generate(model, first, [1, 2, 3])
    got_b = _generate(model, second, [9, 8])
    assert _same(got_a, want_a)
    assert _same(got_b, want_b)
    stats = pools[0].statistics()
    assert stats.shared_blocks == shared_full_blocks
    tokens = len(PROMPT) + 3 + 32, len(PROMPT) + 2 + 32
    private_blocks = sum(-(-t // 4) for t in tokens)
    assert stats.used_blocks == private_blocks - shared_full_blocks


def test_trim_matches_kvcache_and_releases_blocks() -> None:
    model = _model()
    pools = _pools(mx.float32, 4)
    paged = [make_paged_cache(p) for p in pools]
    plain = [KVCache() for _ in range(LAYERS)]
    for caches in (paged, plain):
        mx.eval(model(mx.array([PROMPT]), cache=caches))
    assert [c.trim(7) for c in paged] == [c.trim(7) for c in plain] == [7, 7]
    assert paged[0].offset == len(PROMPT) - 7
    assert pools[0].statistics().used_blocks == 2
    assert _same(_generate(model, paged, [5, 6]), _generate(model, plain, [5, 6]))
    remaining = paged[0].offset
    assert paged[0].trim(1000) == remaining
    assert paged[0].empty()


def test_trim_all_empties_the_cache() -> None:
    pool = BlockPool(8, KV_HEADS, 4, HEAD_DIM)
    cache = PagedKVCache(pool)
    keys = mx.ones((1, KV_HEADS, 10, HEAD_DIM))
    cache.update_and_fetch(keys, keys)
    assert cache.trim(100) == 10
    assert cache.empty()
    assert cache.nbytes == 0
    assert pool.statistics().free_blocks == 8


def test_view_is_immutable_after_appends_cow_and_release() -> None:
    """docs/design.md invariant 1: a view taken now keeps its contents whatever the sequence does
    next."""
    pool = BlockPool(16, KV_HEADS, 4, HEAD_DIM, dtype=mx.float16)
    cache = PagedKVCache(pool)
    first = mx.random.normal((1, KV_HEADS, 6, HEAD_DIM)).astype(mx.float16)
    cache.update_and_fetch(first, first * 2)
    view = cache.attention_view()
    before = view.gather()
    mx.eval(before)
    fork = cache.fork()
    more = mx.random.normal((1, KV_HEADS, 9, HEAD_DIM)).astype(mx.float16)
    cache.update_and_fetch(more, more)
    fork.update_and_fetch(more * 3, more)
    cache.release()
    other = PagedKVCache(pool)
    other.update_and_fetch(more, more)
    after = view.gather()
    assert mx.array_equal(after[0], before[0]).item()
    assert mx.array_equal(after[1], before[1]).item()
    assert mx.array_equal(after[0], first).item()


def test_pool_allocates_lowest_first_and_reports_exhaustion() -> None:
    pool = BlockPool(3, 1, 2, 8)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(BlockPoolExhausted, match=r"^all 3 blocks are in use$"):
        pool.allocate()
    pool.retain(1)
    pool.release(1)
    assert pool.refcount(1) == 1
    pool.release(1)
    pool.release(0)
    assert pool.allocate() == 0
    assert pool.allocate() == 1
    with pytest.raises(ValueError, match=r"^block 2 is not a free block of this pool$"):
        pool.claim(2)


def test_cache_protocol_fields() -> None:
    pool = BlockPool(8, KV_HEADS, 4, HEAD_DIM, dtype=mx.float32)
    cache = make_paged_cache(pool)
    assert cache.empty() and cache.is_trimmable() and cache.nbytes == 0
    keys = mx.random.normal((1, KV_HEADS, 5, HEAD_DIM))
    cache.update_and_fetch(keys, keys)
    assert cache.offset == cache.size() == 5
    assert cache.nbytes == 2 * pool.block_nbytes
    assert cache.make_mask(1) is None
    assert cache.make_mask(3) == "causal"
    k, v = cache.state
    restored = make_paged_cache(pool)
    restored.state = (k, v)
    assert mx.array_equal(restored.state[0], keys).item()
    assert not hasattr(cache, "bits")
