"""Zero-copy saves: materialize hands out segments of the live buffer, and the files
written from them are byte-identical to those written from contiguous copies."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from kvtrio.storage import hostbuffers
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.cacheio import materialize, snapshot
from kvtrio.storage.fileops import Piece, Scatter
from kvtrio.storage.options import IoOptions
from kvtrio.storage.writer import write_blocks, write_single

from .conftest import H, assert_same, logical_state, make_kv


def _contiguous_bytes(array: Any) -> bytes:
    dense: Any = mx.contiguous(array)
    mx.eval(dense)
    return bytes(memoryview(dense))


def _file_bytes(path: Path) -> bytes:
    return path.read_bytes()


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def test_strided_snapshot_is_segments_of_the_live_buffer() -> None:
    live = make_kv([300, 1, 1])  # 302 tokens in a longer buffer: strided along tokens
    (host_k, host_v) = materialize(snapshot([live], []))
    for host, full in ((host_k, live.keys), (host_v, live.values)):
        (segments,) = host.segments
        assert len(segments) == H  # one run per (batch, head) row
        whole = np.asarray(memoryview(full)).view(np.uint8)  # float16: numpy can parse it
        assert all(np.shares_memory(np.frombuffer(s, np.uint8), whole) for s in segments)
        expected = _contiguous_bytes(full[..., :302, :])
        assert b"".join(segments) == expected == bytes(host.pieces[0])


def test_strides_that_are_not_ordered_runs_fall_back_to_a_copy() -> None:
    base = mx.arange(4 * 64, dtype=mx.float32).reshape(1, 4, 64)
    mx.eval(base)
    for strided in (base[:, ::-1, :], base[..., ::2]):
        segments, owner = hostbuffers.materialize_part(strided)
        assert len(segments) == 1 and owner is not strided
        assert bytes(segments[0]) == _contiguous_bytes(strided)


@pytest.mark.parametrize("direct", [False, True])
def test_written_bytes_equal_the_copying_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    live = make_kv([300, 1, 1])
    snap = snapshot([live], [])  # one header plan (it carries created_at)
    outputs: list[bytes] = []
    for zero_copy in (False, True):
        host = materialize(snap, options=IoOptions(zero_copy=zero_copy))
        assert max(len(h.segments[0]) for h in host) == (H if zero_copy else 1)
        path = tmp_path / f"single-{zero_copy}.kvt"
        write_single(str(path), snap.header, [h.segments[0] for h in host], direct=direct)
        outputs.append(_file_bytes(path))
    assert outputs[0] == outputs[1]


def test_block_layout_bytes_equal_the_copying_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = make_kv([300, 1, 1])
    snap = snapshot([live], [])  # one header plan (it carries created_at)
    trees: list[dict[str, bytes]] = []
    for zero_copy in (False, True):
        root = tmp_path / f"z{zero_copy}"
        os.makedirs(root)
        host = materialize(snap, block_tokens=128, options=IoOptions(zero_copy=zero_copy))
        write_blocks(
            str(root / "m.kvt"),
            snap.header,
            [h.segments for h in host],
            LocalBlockStore(str(root / "blocks")),
            block_tokens=128,
        )
        trees.append(_tree_bytes(root))
    assert trees[0] == trees[1] and len(trees[0]) > 1


def test_setitem_after_materialize_cannot_reach_the_segments() -> None:
    """docs/design.md invariant 1: an in-place write into the live cache after a zero-copy
    materialize
    lands in a new buffer (MLX donates only a buffer with one owner)."""
    live = make_kv([300, 1, 1])
    host: list[Any] = materialize(snapshot([live], []))
    before = [b"".join(h.segments[0]) for h in host]
    live.keys[..., :10, :] = mx.zeros_like(live.keys[..., :10, :])
    live.values[..., :10, :] = mx.zeros_like(live.values[..., :10, :])
    mx.eval(live.keys, live.values)
    assert [b"".join(h.segments[0]) for h in host] == before


@pytest.mark.parametrize("heads", [1, 2])
def test_block_layout_load_fills_one_array_per_tensor_when_pieces_are_consecutive(
    tmp_path: Path, heads: int
) -> None:
    """One sequence and one kv head (mlx-lm's tiny models, every cache of one request with
    a single kv head): a tensor's token blocks are consecutive bytes of it, so a load
    allocates one array per tensor, the reader fills each block's view of it in place, and
    nothing is joined (one copy of the entry fewer, and one allocation per tensor instead
    of one per block). Two heads: blocks are strided in the tensor, one array per block."""
    import kvtrio
    from kvtrio.storage.cacheio import adopt
    from kvtrio.storage.reader import read_header, read_tensors

    cache = mlx_cache_kv(heads, 600)
    path = tmp_path / "m.kvt"
    kvtrio.save_cache(path, [], [cache], layout="blocks", block_tokens=256)
    cache_file = read_header(str(path))
    loaded = hostbuffers.allocate_load_buffers(cache_file.header)
    for arrays, views in zip(loaded.arrays, loaded.buffers, strict=True):
        assert len(views) == 3  # 600 tokens in blocks of 256
        assert len(arrays) == (1 if heads == 1 else 3)
    read_tensors(cache_file, loaded.buffers, store=LocalBlockStore(str(tmp_path / "blocks")))
    restored = adopt(cache_file.header, loaded)
    got = restored.caches[0]
    assert got.keys.dtype == cache.keys.dtype and got.offset == 600
    assert np.array_equal(np.array(got.keys[..., :600, :]), np.array(cache.keys[..., :600, :]))
    assert np.array_equal(np.array(got.values[..., :600, :]), np.array(cache.values[..., :600, :]))
    assert_same(logical_state(kvtrio.load_cache(path).caches[0]), logical_state(cache))


def test_block_layout_load_allocates_once_per_tensor_when_pieces_are_strided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several kv heads (SmolLM2's 3): each token block holds a run of every head, so each
    is read into an array of its own and the tensor is joined after the read; those
    arrays share one backing per tensor. Prevents one allocation per block again, which
    cost a 4k-token entry of 30 layers (1,020 blocks) 0.1-0.2 s of the owner's time
    (about 0.1 ms an allocation, whatever its size). The load stays bit-exact."""
    from kvtrio.storage.cacheio import adopt
    from kvtrio.storage.reader import read_tensors

    caches, cache_file = _saved_pair(tmp_path, 3)
    allocations = _counted_allocations(monkeypatch)
    loaded = hostbuffers.allocate_load_buffers(cache_file.header)
    assert len(allocations) == 4  # two caches' keys and values, of 3 blocks each
    for arrays, views in zip(loaded.arrays, loaded.buffers, strict=True):
        assert len(arrays) == len(views) == 3
        starts = [_address(v) for v in views]
        assert all(start % 4096 == 0 for start in starts)
        assert starts[1] - starts[0] == starts[2] - starts[1] == views[0].nbytes
    read_tensors(cache_file, loaded.buffers, store=LocalBlockStore(str(tmp_path / "blocks")))
    restored = adopt(cache_file.header, loaded)
    _assert_restored(restored.caches, caches)


@pytest.mark.parametrize("heads", [1, 3])
def test_a_load_step_of_several_tensors_allocates_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: int
) -> None:
    """A tier load's step (several tensors up to STEP_BYTES) is carved from one backing:
    one allocation, not one per tensor (about 0.15 ms of the owner's time each, whatever
    the size: the served bench's 4 tensors spent more on allocating than on assembling).
    Every tensor and piece starts at a 4 KiB boundary, and the load stays bit-exact."""
    from kvtrio.storage.cacheio import adopt
    from kvtrio.storage.reader import read_tensors

    caches, cache_file = _saved_pair(tmp_path, heads)
    allocations = _counted_allocations(monkeypatch)
    pairs = hostbuffers.allocate_slots(cache_file.header, range(4))
    assert len(allocations) == 1
    loaded = hostbuffers.LoadBuffers(
        arrays=tuple(a for a, _ in pairs), buffers=tuple(v for _, v in pairs)
    )
    starts = [_address(v) for vs in loaded.buffers for v in vs]
    assert len(starts) == 12 and all(start % 4096 == 0 for start in starts)
    read_tensors(cache_file, loaded.buffers, store=LocalBlockStore(str(tmp_path / "blocks")))
    restored = adopt(cache_file.header, loaded)
    _assert_restored(restored.caches, caches)


def test_a_scattered_load_reads_each_block_into_its_tensor_with_no_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several kv heads and a store that reads into runs (LocalBlockStore): each tensor is
    one array, each block read by one preadv straight into its 3 runs of it (one per
    head) and hashed there. Prevents the pieces-then-join load again (a second copy of
    every byte: 57-73 ms of 94 MB here). The arrays are the backing the blocks were read
    into (no copy after the read), the load is bit-exact, and a block whose bytes do not
    hash to its name, or of the wrong size, still fails the load."""
    from kvtrio.errors import CorruptCacheError
    from kvtrio.storage.cacheio import adopt
    from kvtrio.storage.reader import read_tensors

    caches, cache_file = _saved_pair(tmp_path, 3)
    store = LocalBlockStore(str(tmp_path / "blocks"))
    assert store.supports_scatter_reads
    allocations = _counted_allocations(monkeypatch)
    pairs = hostbuffers.allocate_slots(cache_file.header, range(4), scatter=True)
    assert len(allocations) == 1
    assert [len(arrays) for arrays, _ in pairs] == [1, 1, 1, 1]  # nothing to join
    pieces = [piece for _, views in pairs for piece in views]
    assert all(isinstance(p, Scatter) and len(p.parts) == 3 for p in pieces)
    read_tensors(cache_file, [views for _, views in pairs], store=store)
    loaded = hostbuffers.LoadBuffers(
        arrays=tuple(a for a, _ in pairs), buffers=tuple(v for _, v in pairs)
    )
    restored = adopt(cache_file.header, loaded)
    first = pieces[0]
    assert isinstance(first, Scatter)
    read_into = np.frombuffer(first.parts[0], dtype=np.uint8).ctypes.data
    key_bytes = memoryview(restored.caches[0].keys)
    assert np.frombuffer(key_bytes, dtype=np.uint8).ctypes.data == read_into  # no copy
    _assert_restored(restored.caches, caches)
    ref = next(iter(cache_file.header.slots())).blocks
    assert ref is not None
    block = tmp_path / "blocks" / ref[1].sha256
    data = bytearray(block.read_bytes())
    data[5] ^= 1
    block.write_bytes(bytes(data))
    again = hostbuffers.allocate_slots(cache_file.header, range(4), scatter=True)
    with pytest.raises(
        CorruptCacheError,
        match=r"^caches\[0\]\.tensors\[0\]\.blocks\[1\]\.xxh3: block content does not match",
    ):
        read_tensors(cache_file, [views for _, views in again], store=store)
    block.write_bytes(bytes(data[:-4]))
    wrong_size = rf"^block {ref[1].sha256}: stored size {len(data) - 4} != expected {len(data)}$"
    with pytest.raises(CorruptCacheError, match=wrong_size):
        read_tensors(cache_file, [views for _, views in again], store=store)


def _saved_pair(tmp_path: Path, heads: int) -> tuple[list[Any], Any]:
    """Two caches of ``heads`` kv heads (600 and 513 tokens) saved in 256-token blocks under
    ``tmp_path/blocks``, and the saved file's parsed header."""
    import kvtrio
    from kvtrio.storage.reader import read_header

    caches = [mlx_cache_kv(heads, 600), mlx_cache_kv(heads, 513)]
    path = tmp_path / "m.kvt"
    kvtrio.save_cache(path, [], caches, layout="blocks", block_tokens=256)
    return caches, read_header(str(path))


def _counted_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the load buffers allocated from now on (hostbuffers' one allocator)."""
    allocations: list[int] = []
    untouched = hostbuffers._untouched_uint8

    def counted(nbytes: int, fresh: bool) -> Any:
        allocations.append(nbytes)
        return untouched(nbytes, fresh)

    monkeypatch.setattr(hostbuffers, "_untouched_uint8", counted)
    return allocations


def _assert_restored(restored: Any, caches: list[Any]) -> None:
    for got, cache in zip(restored, caches, strict=True):
        n = cache.offset
        assert got.keys.dtype == cache.keys.dtype and got.offset == n
        assert np.array_equal(np.array(got.keys), np.array(cache.keys[..., :n, :]))
        assert np.array_equal(np.array(got.values), np.array(cache.values[..., :n, :]))


def _address(piece: Piece) -> int:
    assert isinstance(piece, memoryview)
    return int(np.frombuffer(piece, dtype=np.uint8).ctypes.data)


def mlx_cache_kv(heads: int, n: int) -> Any:
    from mlx_lm.models import cache as mlx_cache_module

    cache: Any = mlx_cache_module.KVCache()
    key = mx.random.key(heads)
    k1, k2 = mx.random.split(key)
    cache.update_and_fetch(
        mx.random.normal((1, heads, n, 64), key=k1), mx.random.normal((1, heads, n, 64), key=k2)
    )
    return cache
