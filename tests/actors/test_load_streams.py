"""A tier's load split among several reads: how a step is cut, that the reads run at once,
that every block is still checked (docs/design.md invariant 4) and that a failing read
leaves nothing behind (invariant 6), and the default's dependence on the CPU count."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from kvtrio.actors.loadsteps import MIN_READ_BYTES, read_parts
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.reader import Reader
from kvtrio.actors.tier import ColdTier
from kvtrio.errors import CorruptCacheError
from kvtrio.storage import options as options_module
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.options import IoOptions, default_tier_load_streams
from kvtrio.storage.reader import read_header

MIB = 1 << 20


def test_a_step_is_cut_into_consecutive_reads_of_about_equal_bytes() -> None:
    sizes = [3 * MIB // 2] * 60  # SmolLM2-135M's 30 layers of keys and values, 4k tokens
    parts = read_parts(range(20, 40), sizes, 4)
    assert parts == [range(20, 25), range(25, 30), range(30, 35), range(35, 40)]


@pytest.mark.parametrize(
    ("sizes", "streams", "want"),
    [
        ([2 * MIB] * 4, 1, [range(0, 4)]),  # one stream: the step whole
        ([2 * MIB] * 4, 2, [range(0, 2), range(2, 4)]),
        ([2 * MIB] * 4, 8, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),  # one each
        ([MIB] * 4, 4, [range(0, 2), range(2, 4)]),  # one read per MIN_READ_BYTES
        ([2 * MIB - 1], 4, [range(0, 1)]),  # a small step
        ([8 * MIB, 1, 1], 4, [range(0, 1), range(1, 2), range(2, 3)]),  # never an empty read
    ],
)
def test_a_split_step_covers_every_tensor_once_in_order(
    sizes: list[int], streams: int, want: list[range]
) -> None:
    got = read_parts(range(len(sizes)), sizes, streams)
    assert got == want
    assert [i for part in got for i in part] == list(range(len(sizes)))
    assert MIN_READ_BYTES == 2 * MIB


@pytest.mark.parametrize(("cpus", "streams"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 4)])
def test_a_tier_reads_one_stream_below_eight_cpus_and_one_per_four_above(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpus: int, streams: int
) -> None:
    monkeypatch.setattr(options_module, "usable_cpus", lambda: cpus)
    assert default_tier_load_streams() == streams

    async def opened() -> int:
        async with ColdTier.open(tmp_path, inline=True) as tier:
            return tier.load_streams

    assert trio.run(opened) == streams


def _caches(layers: int, tokens: int) -> list[Any]:
    """KV caches of [1, 4, tokens, 128] float32 tensors (owner thread): 2 MiB per tensor
    at 1,024 tokens, so a load's one step is split among the reads."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for _ in range(layers):
        cache: Any = KVCache()
        shape = (1, 4, tokens, 128)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        caches.append(cache)
    return caches


def _kv_bytes(caches: Sequence[Any]) -> list[bytes]:
    import numpy as np

    return [
        np.array(a[..., : c.offset, :]).tobytes() for c in caches for a in (c.keys, c.values)
    ]


@pytest.mark.parametrize("streams", [2, 4])
async def test_one_step_is_read_by_load_streams_reads_at_once_and_reads_back_bit_exact(
    tmp_path: Path, streams: int
) -> None:
    running = 0
    peak = 0
    calls: list[list[int]] = []
    async with MlxOwner.dedicated() as owner:
        options = IoOptions(load_streams=streams)
        async with ColdTier.open(
            tmp_path, owner=owner, layout="blocks", block_tokens=256, options=options
        ) as tier:
            caches = await owner.run(_caches, 2, 1024)
            want = await owner.run(_kv_bytes, caches)
            assert (await (await tier.save("k", list(range(1024)), caches)).wait()).written
            read_tensors = Reader.read_tensors

            async def slow_read(self: Reader, *args: Any, **kwargs: Any) -> None:
                nonlocal running, peak
                calls.append(list(kwargs["indices"]))
                running += 1
                peak = max(peak, running)
                try:
                    await trio.sleep(0.05)
                    await read_tensors(self, *args, **kwargs)
                finally:
                    running -= 1

            with pytest.MonkeyPatch.context() as monkey:
                monkey.setattr(Reader, "read_tensors", slow_read)
                loaded = await tier.load("k")
            got = await owner.run(_kv_bytes, loaded.caches)
    assert got == want
    assert peak == streams
    assert sorted(i for call in calls for i in call) == [0, 1, 2, 3]


async def test_a_corrupt_block_fails_a_split_load_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    """Invariant 4: the corrupt block is found whichever read holds it, and the load
    raises; invariant 6: the other read is waited for, no read is left running, no
    lent buffer kept, and the tier's other entries load as before."""
    async with MlxOwner.dedicated() as owner:
        options = IoOptions(load_streams=2)
        async with ColdTier.open(
            tmp_path, owner=owner, layout="blocks", block_tokens=256, options=options
        ) as tier:
            caches = await owner.run(_caches, 2, 1024)
            want = await owner.run(_kv_bytes, caches)
            assert (await (await tier.save("k", list(range(1024)), caches)).wait()).written
            other = await owner.run(_caches, 2, 1024)
            other_want = await owner.run(_kv_bytes, other)
            assert (await (await tier.save("j", list(range(5000, 6024)), other)).wait()).written
            slots = list(read_header(str(tier.path_of("k"))).header.slots())
            blocks = slots[-1].blocks
            assert blocks is not None
            sha = blocks[-1].sha256  # the second read's last block
            store = tier.block_store
            assert isinstance(store, LocalBlockStore)
            block = Path(store.path_of(sha))
            data = bytearray(block.read_bytes())
            data[0] ^= 0x01
            block.write_bytes(bytes(data))
            with pytest.raises(CorruptCacheError, match=r"\.xxh3: block content does not match"):
                await tier.load("k")
            assert tier.reader.statistics().running == 0
            got = await owner.run(_kv_bytes, (await tier.load("j")).caches)
            data[0] ^= 0x01
            block.write_bytes(bytes(data))
            again = await owner.run(_kv_bytes, (await tier.load("k")).caches)
    assert got == other_want
    assert again == want
    stats = tier.statistics()
    assert (stats.loads, stats.load_failures) == (3, 1)
    assert stats.snapshots.live == 0
