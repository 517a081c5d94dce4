"""The codec registration hook (the paged cache registers its codec through it).

The toy codec is registered for each test that needs it and unregistered after, so no
other test of the run sees it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.errors import UnknownCacheKindError
from kvtrio.storage.codecs import (
    CodecState,
    TensorView,
    codec_for_kind,
    expect_shape,
    field_int,
    register_codec,
    unregister_codec,
)
from kvtrio.storage.format import CacheEntry, Layout


class ToyPagedCache:
    """A stand-in for a third-party cache: a block pool plus a block table."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pool = mx.arange(4 * block_size * 8, dtype=mx.float32).reshape(4, block_size, 8)
        self.table = [2, 0]
        self.offset = block_size + 3

    def is_trimmable(self) -> bool:
        return True


class ToyPagedCodec:
    kind = "toy-paged"
    cache_types: tuple[type, ...] = (ToyPagedCache,)
    structure_fields: tuple[str, ...] = ("block_size",)

    def snapshot(self, cache: Any) -> CodecState:
        fields = {"block_size": cache.block_size, "table": tuple(cache.table)}
        return CodecState(cache.offset, True, fields, (TensorView(cache.pool),))

    def restore(self, entry: CacheEntry, arrays: Sequence[Any], children: Sequence[Any]) -> Any:
        cache = ToyPagedCache(field_int(entry, "block_size", 1, 4096))
        (pool,) = arrays
        expect_shape(pool, (None, cache.block_size, 8), "tensors[0]")
        cache.pool = pool
        table = entry.fields["table"]
        assert isinstance(table, tuple)
        cache.table = [int(b) for b in table if isinstance(b, int)]
        cache.offset = entry.offset
        return cache


@pytest.fixture
def toy_codec() -> Iterator[ToyPagedCodec]:
    codec = ToyPagedCodec()
    register_codec(codec)
    yield codec
    unregister_codec(codec)


@pytest.mark.usefixtures("toy_codec")
@pytest.mark.parametrize("layout", ["single", "blocks"])
def test_registered_codec_round_trips(tmp_path: Path, layout: Layout) -> None:
    original = ToyPagedCache(16)
    kvtrio.save_cache(tmp_path / "p.kvt", [], [original], layout=layout)
    (loaded,) = kvtrio.load_cache(tmp_path / "p.kvt").caches
    assert isinstance(loaded, ToyPagedCache)
    assert loaded.table == [2, 0] and loaded.offset == 19
    assert mx.array_equal(loaded.pool, original.pool).item()


@pytest.mark.usefixtures("toy_codec")
def test_a_kind_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match=r"^a codec for kind 'toy-paged' is already registered$"):
        register_codec(ToyPagedCodec())


def test_codec_field_checks_name_the_field() -> None:
    entry = CacheEntry("toy-paged", 1, 0, True, {"block_size": -1}, ())
    with pytest.raises(kvtrio.CorruptCacheError, match=r"^fields\.block_size: -1 is not an "):
        ToyPagedCodec().restore(entry, [], [])


def test_an_unregistered_codec_no_longer_encodes_or_decodes(tmp_path: Path) -> None:
    codec = ToyPagedCodec()
    register_codec(codec)
    kvtrio.save_cache(tmp_path / "p.kvt", [], [ToyPagedCache(16)])
    unregister_codec(codec)
    with pytest.raises(TypeError, match=r"^no kvtrio codec for cache type ToyPagedCache$"):
        kvtrio.save_cache(tmp_path / "q.kvt", [], [ToyPagedCache(16)])
    with pytest.raises(UnknownCacheKindError, match=r"^kind: no codec for cache kind 'toy-"):
        codec_for_kind("toy-paged")
    with pytest.raises(UnknownCacheKindError, match=r"kind 'toy-paged'"):
        kvtrio.load_cache(tmp_path / "p.kvt")
    with pytest.raises(KeyError, match=r"toy-paged"):
        unregister_codec(codec)
