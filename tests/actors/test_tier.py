"""ColdTier, threaded, on the real file system with real mlx-lm caches of a tiny model."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.reader import Reader
from kvtrio.actors.testing import mlx_thread_guard
from kvtrio.actors.tier import ColdTier
from kvtrio.errors import CacheMismatchError, CacheMissError, CorruptCacheError, ShuttingDown
from kvtrio.storage.fileops import OS_FILE_OPS, TMP_SUFFIX, FaultyFileOps
from kvtrio.storage.format import Header
from kvtrio.storage.options import IoOptions
from kvtrio.storage.reader import read_header

Prefill = Callable[[Sequence[int]], list[Any]]
Dump = Callable[[Sequence[Any]], list[bytes]]

TOKENS = list(range(1, 300))


@pytest.mark.parametrize("layout", ["single", "blocks"])
async def test_save_then_load_is_bit_exact_and_mlx_stays_on_the_owner(
    tmp_path: Path, prefilled: Prefill, kv_bytes: Dump, layout: str
) -> None:
    """docs/design.md invariant 2 too: no snapshot is left live after the tier closes."""
    async with MlxOwner.dedicated() as owner:
        with mlx_thread_guard(owner.is_owner_thread) as guard:
            async with ColdTier.open(tmp_path, owner=owner, layout=layout) as tier:  # type: ignore[arg-type]
                caches = await owner.run(prefilled, TOKENS)
                want = await owner.run(kv_bytes, caches)
                ticket = await tier.save("conv-1", TOKENS, caches, meta={"model_id": "tiny"})
                result = await ticket.wait()
                assert result.written and result.write is not None
                loaded = await tier.load("conv-1")
                got = await owner.run(kv_bytes, loaded.caches)
                entries = await tier.list()
            stats = tier.statistics()
    assert got == want
    assert loaded.tokens == tuple(TOKENS)
    assert loaded.header.model_id == "tiny"
    assert [e.key for e in entries] == ["conv-1"]
    assert guard.violations == []
    assert stats.snapshots.live == 0 and stats.snapshots.created == 1


async def test_snapshot_is_immutable_until_written(
    tmp_path: Path, prefilled: Prefill, kv_bytes: Dump
) -> None:
    """Invariant 1: after save returns and before the write happens, the live cache is
    trimmed and appended to and overwritten with __setitem__; the file holds the snapshot."""
    first_open = threading.Event()
    release = threading.Event()
    opens = 0

    def hook(op: str) -> None:
        nonlocal opens
        if op == "open":
            opens += 1
            if opens == 1:
                first_open.set()
                release.wait(10)

    ops = FaultyFileOps(OS_FILE_OPS, hook)
    async with MlxOwner.dedicated() as owner:
        async with ColdTier.open(tmp_path, owner=owner, file_ops=ops) as tier:
            blocker = await owner.run(prefilled, [5, 6, 7])
            await tier.save("blocker", [5, 6, 7], blocker)
            await trio.to_thread.run_sync(first_open.wait, 10)
            caches = await owner.run(prefilled, TOKENS)
            want = await owner.run(kv_bytes, caches)
            ticket = await tier.save("victim", TOKENS, caches)

            def mutate() -> None:
                import mlx.core as mx

                for cache in caches:
                    cache.trim(50)
                    shape = list(cache.keys.shape)
                    shape[2] = 20
                    cache.update_and_fetch(mx.ones(shape, cache.keys.dtype), mx.ones(shape))
                    cache.keys[..., 0:4, :] = 7
                    cache.values[..., 0:4, :] = 7
                    mx.eval(cache.keys, cache.values)

            await owner.run(mutate)
            assert await owner.run(kv_bytes, caches) != want
            release.set()
            assert (await ticket.wait()).written
            loaded = await tier.load("victim")
            assert await owner.run(kv_bytes, loaded.caches) == want
    assert tier.statistics().snapshots.live == 0


async def test_missing_entry_is_a_clean_miss(tmp_path: Path) -> None:
    async with ColdTier.open(tmp_path) as tier:
        with pytest.raises(CacheMissError, match=r"^cold tier has no entry 'nope'$"):
            await tier.load("nope")
    assert tier.statistics().load_misses == 1


async def test_expect_mismatch_and_corrupt_file_are_refused(
    tmp_path: Path, prefilled: Prefill
) -> None:
    class WantModel:
        def check(self, header: Header) -> None:
            if header.model_id != "other":
                raise CacheMismatchError(f"model_id: cache is for {header.model_id!r}")

    async with ColdTier.open(tmp_path) as tier:
        caches = await tier.owner.run(prefilled, TOKENS)
        await (await tier.save("k", TOKENS, caches, model_id="tiny")).wait()
        with pytest.raises(CacheMismatchError, match=r"^model_id: cache is for 'tiny'$"):
            await tier.load("k", expect=WantModel())
        path = tier.path_of("k")
        data_start = read_header(str(path)).data_start
        data = bytearray(path.read_bytes())
        data[data_start + 100] ^= 0xFF  # inside the first tensor
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptCacheError, match=r"xxh3: tensor bytes do not match"):
            await tier.load("k")


@pytest.mark.parametrize("layout", ["single", "blocks"])
async def test_a_loads_header_checks_and_block_stats_are_one_worker_job(
    tmp_path: Path, prefilled: Prefill, kv_bytes: Dump, layout: str
) -> None:
    """A cold load's first step (the header, the load's expectation, the kinds and, in the
    blocks layout, every block's presence and size) is one worker job, then the tensor
    reads: one hand-off fewer on a cold hit's path. A failed expectation still ends the
    load before a block is looked at."""
    jobs: list[str] = []

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def run(self, fn: Any, *args: Any) -> Any:
            jobs.append(fn.__name__)
            return await self.inner.run(fn, *args)

    class WantOther:
        def check(self, header: Header) -> None:
            raise CacheMismatchError("not this one")

    async with MlxOwner.dedicated() as owner:
        async with ColdTier.open(tmp_path, owner=owner, layout=layout) as tier:  # type: ignore[arg-type]
            caches = await owner.run(prefilled, TOKENS)
            want = await owner.run(kv_bytes, caches)
            assert (await (await tier.save("k", TOKENS, caches)).wait()).written
            tier.reader.offload = Counting(tier.reader.offload)  # type: ignore[assignment]
            loaded = await tier.load("k")
            assert await owner.run(kv_bytes, loaded.caches) == want  # bit-exact
            assert jobs == ["_header_job", "_tensors_job"]
            jobs.clear()
            checked_blocks: list[int] = []
            store = tier.reader.block_store
            if store is not None:
                stored_sizes = store.stored_sizes

                def sizes(names: Any) -> Any:
                    checked_blocks.append(len(names))
                    return stored_sizes(names)

                store.stored_sizes = sizes  # type: ignore[method-assign]
            with pytest.raises(CacheMismatchError, match=r"^not this one$"):
                await tier.load("k", expect=WantOther())
            assert jobs == ["_header_job"] and checked_blocks == []


async def test_delete_and_debris_collection(tmp_path: Path, prefilled: Prefill) -> None:
    async with ColdTier.open(tmp_path) as tier:
        caches = await tier.owner.run(prefilled, TOKENS)
        await (await tier.save("gone", TOKENS, caches)).wait()
        size = os.path.getsize(tier.path_of("gone"))
        assert await tier.delete("gone") == size
        assert await tier.delete("gone") == 0
        debris = tier.cache_dir / f".x.kvc.0123{TMP_SUFFIX}"
        debris.write_bytes(b"torn")
    async with ColdTier.open(tmp_path) as tier:
        assert tier.statistics().debris_removed == 1
        assert not debris.exists()
        assert await tier.list() == []


async def test_save_after_shutdown_began_is_refused(tmp_path: Path, prefilled: Prefill) -> None:
    async with ColdTier.open(tmp_path) as tier:
        caches = await tier.owner.run(prefilled, [1, 2, 3])
        await tier.aclose()
        with pytest.raises(ShuttingDown, match=r"^cold tier is shutting down: save refused$"):
            await tier.save("late", [1, 2, 3], caches)
    assert not tier.path_of("late").exists()
    assert tier.statistics().snapshots.created == 0


async def test_a_saves_materialized_copies_are_freed_on_the_owner(tmp_path: Path) -> None:
    """Regression: dropping a GiB of MLX copies on the trio thread stalled the event loop
    for 130 ms; the last reference to each materialized tensor must go on the owner."""
    freed_on: list[str] = []
    async with MlxOwner.dedicated(name="mlx-owner") as owner:
        async with ColdTier.open(tmp_path, owner=owner) as tier:
            materialize = owner.materialize

            async def tracked(snap: Any, **options: Any) -> Any:
                host = await materialize(snap, **options)
                for tensor in host:
                    weakref.finalize(
                        tensor, lambda: freed_on.append(threading.current_thread().name)
                    )
                return host

            owner.materialize = tracked  # type: ignore[method-assign,assignment]
            # 8 tensors of 8 MiB: more than one owner step, so the trio thread would hold
            # the last reference to some of them if the tier did not free them itself.
            caches = await owner.run(big_caches, 4, 2048)
            tokens = list(range(2048))
            assert (await (await tier.save("k", tokens, caches)).wait()).written
    assert len(freed_on) == 8
    assert set(freed_on) == {"mlx-owner"}


def big_caches(layers: int, tokens: int) -> list[Any]:
    """KV caches of [1, 8, tokens, 128] float32 tensors (owner thread)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for _ in range(layers):
        cache: Any = KVCache()
        shape = (1, 8, tokens, 128)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        caches.append(cache)
    return caches


@pytest.mark.parametrize("streams", [1, 2])
async def test_a_load_reads_with_load_streams_reads_at_once(
    tmp_path: Path, prefilled: Prefill, kv_bytes: Dump, streams: int
) -> None:
    """One tensor per step (STEP_BYTES=1); a slowed reader shows how many run at once."""
    running = 0
    peak = 0
    async with MlxOwner.dedicated() as owner:
        options = IoOptions(load_streams=streams)
        async with ColdTier.open(tmp_path, owner=owner, options=options) as tier:
            caches = await owner.run(prefilled, TOKENS)
            want = await owner.run(kv_bytes, caches)
            assert (await (await tier.save("conv-1", TOKENS, caches)).wait()).written
            read_tensors = Reader.read_tensors

            async def slow_read(self: Reader, *args: Any, **kwargs: Any) -> None:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                try:
                    await trio.sleep(0.05)
                    await read_tensors(self, *args, **kwargs)
                finally:
                    running -= 1

            with pytest.MonkeyPatch.context() as monkey:
                monkey.setattr("kvtrio.actors.owner.STEP_BYTES", 1)
                monkey.setattr(Reader, "read_tensors", slow_read)
                loaded = await tier.load("conv-1")
            got = await owner.run(kv_bytes, loaded.caches)
    assert got == want
    assert peak == streams


def _three_head_caches(layers: int, tokens: int) -> list[Any]:
    """KVCache layers of 3 kv heads (SmolLM2-135M's): each token block is strided in its
    tensor, so a block-layout load joins the blocks of each tensor after reading them."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    caches = []
    for layer in range(layers):
        cache = mlx_cache.KVCache()
        k1, k2 = mx.random.split(mx.random.key(layer))
        shape = (1, 3, tokens, 64)
        cache.update_and_fetch(mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2))
        caches.append(cache)
    return caches


@pytest.mark.parametrize("scatter", [False, True])
async def test_a_load_joins_each_steps_token_blocks_while_the_next_step_is_read(
    tmp_path: Path, kv_bytes: Dump, scatter: bool
) -> None:
    """One tensor per step (STEP_BYTES=1), reads slowed. A block store that does not read
    into runs (Redis's): the first tensor's join runs before the last tensor's read has
    started, not after every read (a 94 MB entry's joins, about 70 ms on the development
    VM, were all on the load's path after its last read). The local store, which does
    (``supports_scatter_reads``): no join at all, each block read into its tensor. The
    load stays bit-exact."""
    from kvtrio.actors import owner as owner_module
    from kvtrio.storage.blockstore import LocalBlockStore

    events: list[str] = []
    tokens = list(range(1, 601))
    async with MlxOwner.dedicated() as owner:
        async with ColdTier.open(tmp_path, owner=owner, layout="blocks") as tier:
            caches = await owner.run(_three_head_caches, 2, len(tokens))
            want = await owner.run(kv_bytes, caches)
            assert (await (await tier.save("conv-1", tokens, caches)).wait()).written
            read_tensors = Reader.read_tensors
            join = owner_module._join

            async def slow_read(self: Reader, *args: Any, **kwargs: Any) -> None:
                events.append("read")
                await trio.sleep(0.05)
                await read_tensors(self, *args, **kwargs)

            def logged_join(pieces: Sequence[Any], axis: int) -> Any:
                events.append("join")
                return join(pieces, axis)

            with pytest.MonkeyPatch.context() as monkey:
                monkey.setattr("kvtrio.actors.owner.STEP_BYTES", 1)
                monkey.setattr(Reader, "read_tensors", slow_read)
                monkey.setattr(owner_module, "_join", logged_join)
                monkey.setattr(LocalBlockStore, "supports_scatter_reads", scatter)
                loaded = await tier.load("conv-1")
            got = await owner.run(kv_bytes, loaded.caches)
    assert got == want
    assert events.count("read") == 4  # keys and values of 2 layers
    if scatter:
        assert events.count("join") == 0
        return
    assert events.count("join") == 4
    assert events.index("join") < len(events) - 1 - events[::-1].index("read"), events


async def test_load_streams_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^load_streams: expected an int >= 1, got 0$"):
        IoOptions(load_streams=0)


async def test_a_tier_reads_one_stream_by_default_on_two_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvtrio.storage.options.usable_cpus", lambda: 2)
    async with ColdTier.open(tmp_path, inline=True) as tier:
        assert tier.load_streams == 1
    async with ColdTier.open(tmp_path, inline=True, options=IoOptions(load_streams=3)) as tier:
        assert tier.load_streams == 3


async def test_each_owner_job_of_a_save_materializes_at_most_save_step_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/serve.md, what a save costs the generation thread: its owner jobs are planned
    by bytes (SAVE_STEP_BYTES of tensor pieces, or one piece: a token block in the block
    layout kvtrio serve's tier writes), so a large entry is many short jobs, never one
    job per whole tensor; the entry still reads back bit-exact."""
    from kvtrio.actors import owner as owner_module
    from kvtrio.actors.owner import SAVE_STEP_BYTES

    job_bytes: list[int] = []
    real = owner_module._materialize_units

    def counted(*args: Any) -> Any:
        done = real(*args)
        job_bytes.append(sum(len(seg) for segments, _ in done for seg in segments))
        return done

    async with MlxOwner.dedicated(name="mlx-owner") as owner:
        async with ColdTier.open(
            tmp_path, owner=owner, layout="blocks", block_tokens=256
        ) as tier:
            # 4 tensors of [1, 8, 2048, 128] float32: 8 MiB each (pieces of 1 MiB).
            caches = await owner.run(big_caches, 2, 2048)
            expected = await owner.run(_kv_bytes, caches)
            monkeypatch.setattr(owner_module, "_materialize_units", counted)
            assert (await (await tier.save("k", list(range(2048)), caches)).wait()).written
            monkeypatch.undo()
            restored = await tier.load("k")
            got = await owner.run(_kv_bytes, restored.caches)
    assert got == expected
    assert sum(job_bytes) == 32 << 20
    assert len(job_bytes) >= (32 << 20) // SAVE_STEP_BYTES
    assert max(job_bytes) <= SAVE_STEP_BYTES, job_bytes


def _kv_bytes(caches: Sequence[Any]) -> list[bytes]:
    """The live keys' and values' bytes of KV caches (owner thread)."""
    import numpy as np

    return [
        np.array(a[..., : c.offset, :]).tobytes() for c in caches for a in (c.keys, c.values)
    ]
