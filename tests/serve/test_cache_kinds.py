"""Every cache class of the installed mlx_lm.models.cache is either saved by kvtrio (a codec,
or extraction to a per-sequence cache first) or refused with a typed error naming it."""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import pytest
from kvtrio.errors import UnsupportedCacheError
from kvtrio.serve.adapter import per_sequence, saveable
from mlx_lm.models import cache as mlx_cache

# How to build one of each class (the test fails when mlx-lm adds a class not listed).
MAKERS: dict[str, Any] = {
    "KVCache": lambda: mlx_cache.KVCache(),
    "RotatingKVCache": lambda: mlx_cache.RotatingKVCache(max_size=8),
    "QuantizedKVCache": lambda: mlx_cache.QuantizedKVCache(),
    "ChunkedKVCache": lambda: mlx_cache.ChunkedKVCache(8),
    "ArraysCache": lambda: mlx_cache.ArraysCache(2),
    "CacheList": lambda: mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.KVCache()),
    "ConcatenateKVCache": lambda: mlx_cache.ConcatenateKVCache(),
    "BatchKVCache": lambda: mlx_cache.BatchKVCache([0]),
    "BatchRotatingKVCache": lambda: mlx_cache.BatchRotatingKVCache(8, [0]),
}
SAVED = {
    "ConcatenateKVCache",
    "KVCache",
    "RotatingKVCache",
    "QuantizedKVCache",
    "ChunkedKVCache",
    "ArraysCache",
    "CacheList",
    "BatchKVCache",
    "BatchRotatingKVCache",
}


def _cache_classes() -> set[str]:
    base = mlx_cache._BaseCache
    return {
        name
        for name, cls in inspect.getmembers(mlx_cache, inspect.isclass)
        if issubclass(cls, base) and cls is not base and cls.__module__ == mlx_cache.__name__
    }


def test_every_cache_class_is_listed() -> None:
    assert _cache_classes() == set(MAKERS)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_each_class_is_saved_or_refused_by_name(name: str) -> None:
    caches = [MAKERS[name]()]
    if name in SAVED:
        saveable(per_sequence(caches))
        return
    with pytest.raises(UnsupportedCacheError) as info:
        saveable(per_sequence(caches))
    assert info.value.cache_class == name


def test_a_batch_of_several_sequences_is_refused_by_name() -> None:
    batch = mlx_cache.BatchKVCache([0, 0])
    keys = mx.ones((2, 1, 4, 8))
    batch.update_and_fetch(keys, keys)
    with pytest.raises(UnsupportedCacheError) as info:
        per_sequence([batch])
    assert info.value.cache_class == "BatchKVCache"


def test_a_one_sequence_batch_is_extracted_without_losing_a_token() -> None:
    batch = mlx_cache.BatchKVCache([2])
    keys = mx.arange(1 * 1 * 6 * 4, dtype=mx.float32).reshape(1, 1, 6, 4)
    batch.update_and_fetch(keys, keys + 1)
    (single,) = per_sequence([batch])
    assert type(single) is mlx_cache.KVCache and single.offset == 4
    k, v = single.keys_and_values()
    assert mx.array_equal(k, keys[:, :, 2:]) and mx.array_equal(v, keys[:, :, 2:] + 1)


def test_a_concatenate_cache_round_trips_bit_exact(tmp_path: Any) -> None:
    from kvtrio.api import load_cache, save_cache

    cache = mlx_cache.ConcatenateKVCache()
    keys = mx.arange(2 * 6 * 4, dtype=mx.float32).reshape(1, 2, 6, 4)
    cache.update_and_fetch(keys, keys * 2)
    save_cache(tmp_path / "c.kvc", list(range(6)), [cache])
    back: Any = load_cache(tmp_path / "c.kvc").caches[0]
    assert type(back) is mlx_cache.ConcatenateKVCache and back.offset == 6
    stored_keys, stored_values = back.keys_and_values()
    assert mx.array_equal(stored_keys, keys) and mx.array_equal(stored_values, keys * 2)


class _CacheOfAnotherLibrary(mlx_cache._BaseCache):
    """A cache class kvtrio has no codec for (a model's own, a newer mlx-lm's)."""


def test_a_cache_class_without_a_codec_is_refused_by_name() -> None:
    """The refusal the classes above never reach: a class kvtrio cannot store, alone or
    inside a CacheList, is UnsupportedCacheError naming that class (never a TypeError
    from the codec registry, never the container's name)."""
    for caches in (
        [mlx_cache.KVCache(), _CacheOfAnotherLibrary()],
        [mlx_cache.CacheList(mlx_cache.KVCache(), _CacheOfAnotherLibrary())],
    ):
        with pytest.raises(UnsupportedCacheError) as info:
            saveable(per_sequence(caches))
        assert info.value.cache_class == "_CacheOfAnotherLibrary"


def test_a_one_sequence_rotating_batch_is_extracted_and_stored_without_losing_a_token(
    tmp_path: Any,
) -> None:
    """BatchRotatingKVCache's twin of the BatchKVCache test above, through the disk: the
    extracted RotatingKVCache keeps the sequence's tokens (its left padding dropped), and
    kvtrio's codec gives them back bit-exact."""
    from kvtrio.api import load_cache, save_cache

    batch = mlx_cache.BatchRotatingKVCache(8, [2])
    keys = mx.arange(1 * 1 * 6 * 4, dtype=mx.float32).reshape(1, 1, 6, 4)
    batch.update_and_fetch(keys, keys + 1)
    (single,) = per_sequence([batch])
    assert type(single) is mlx_cache.RotatingKVCache and single.offset == 4
    save_cache(tmp_path / "r.kvc", list(range(4)), [single])
    back: Any = load_cache(tmp_path / "r.kvc").caches[0]
    assert type(back) is mlx_cache.RotatingKVCache and back.offset == 4
    stored_keys, stored_values = back.state[:2]
    assert mx.array_equal(stored_keys[:, :, :4], keys[:, :, 2:])
    assert mx.array_equal(stored_values[:, :, :4], keys[:, :, 2:] + 1)


def _filled(n: int) -> Any:
    cache = mlx_cache.KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
    return cache


def test_caches_holding_fewer_tokens_than_the_key_are_stored_under_what_all_hold() -> None:
    """A draft model's entry (kvtrio.serve.cachekinds rule 3): the model's caches hold the
    key's 10 tokens, the draft's 9; the longer ones are trimmed to 9 and the entry keyed
    by the first 9 tokens. Caches that agree with the key are left as they are."""
    from kvtrio.serve.cachekinds import held_prefix

    tokens = list(range(100, 110))
    caches = [_filled(10), _filled(10), _filled(9)]
    assert held_prefix(caches, tokens) == tokens[:9]
    assert [cache.offset for cache in caches] == [9, 9, 9]
    agreeing = [_filled(10), _filled(10)]
    assert held_prefix(agreeing, tokens) is tokens
    assert [cache.offset for cache in agreeing] == [10, 10]
    # A hybrid model's SSM state states no count (it agrees with any), and a CacheList's
    # count is its children's: such entries are stored as they are.
    hybrid = [_filled(10), mlx_cache.ArraysCache(2), mlx_cache.CacheList(_filled(10))]
    assert held_prefix(hybrid, tokens) is tokens


@pytest.mark.parametrize(
    "make",
    [
        lambda: [_filled(10), _filled(9), mlx_cache.ArraysCache(2)],  # a state: no trim
        lambda: [_filled(11), _filled(10)],  # more tokens than the key
        lambda: [_filled(10), mlx_cache.RotatingKVCache(max_size=4)],  # nothing held
    ],
)
def test_caches_that_cannot_agree_on_their_tokens_are_refused_typed(make: Any) -> None:
    from kvtrio.serve.cachekinds import held_prefix

    caches = make()
    with pytest.raises(UnsupportedCacheError):
        held_prefix(caches, list(range(10)))
