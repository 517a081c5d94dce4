"""MlxOwner: the one thread that touches MLX.

Theory of operation (DESIGN.md "Threads, and who may touch what"):

1. Every ``mlx.core`` call kvtrio makes runs as a job on the owner's executor: one
   dedicated OS thread in production (:meth:`MlxOwner.dedicated`), the trio thread in
   deterministic tests (:meth:`MlxOwner.inline`). Jobs run FIFO, so a server that runs its
   own model steps through ``await owner.run(step, ...)`` gets snapshot preparation
   serialized with decoding instead of racing it.
2. Work is cut into short jobs so the owner interleaves with the server's steps and the
   event loop never waits long: ``snapshot`` is one job (lazy views only, O(1) memory);
   ``materialize`` is one job per tensor; ``allocate`` is one job per tensor.
3. Loads never copy on the owner: ``allocate`` makes each destination array on the owner
   and lends its memory (a writable, zero-copy memoryview) to a worker thread that reads
   the file straight into it; the caches are then built from those arrays on the owner
   (``restore``). Where MLX cannot lend writable memory, ``allocate`` falls back to plain
   host buffers and ``restore`` copies them in bounded chunks, one chunk per job, so the
   GIL-holding copy never stalls the loop for long.
4. A job whose caller was cancelled before it started never runs; a started job finishes
   and its result is dropped (the executor's rules).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar, TypeVarTuple

import attrs
from kvtrio.actors.snapshot import Snapshot, SnapshotLedger
from kvtrio.runtime.executor import DedicatedThreadExecutor, InlineExecutor
from kvtrio.storage import codecs
from kvtrio.storage.codecs import AttachmentData, HostTensor, Restored
from kvtrio.storage.format import Header, TensorSlot, piece_ranges
from kvtrio.storage.reader import piece_sizes

__all__ = ["ADOPT_CHUNK_BYTES", "LoadBuffers", "MlxOwner"]

#: Fallback adoption copies host bytes into MLX at most this many bytes per owner job
#: (about 4 ms of GIL-holding copy at 2 GB/s), so the event loop never waits long.
ADOPT_CHUNK_BYTES = 8 * 1024 * 1024

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

AnyExecutor = DedicatedThreadExecutor | InlineExecutor


class MlxOwner:
    """Runs MLX work on one thread. Open with ``async with MlxOwner.dedicated() as owner``."""

    def __init__(self, executor: AnyExecutor) -> None:
        self.executor = executor

    @classmethod
    @asynccontextmanager
    async def dedicated(cls, *, name: str = "mlx-owner") -> AsyncIterator[MlxOwner]:
        """An owner on its own OS thread (production)."""
        async with DedicatedThreadExecutor(name=name) as executor:
            yield cls(executor)

    @classmethod
    @asynccontextmanager
    async def inline(cls) -> AsyncIterator[MlxOwner]:
        """An owner that runs jobs on the calling trio thread (deterministic tests)."""
        async with InlineExecutor(name="mlx-owner-inline") as executor:
            yield cls(executor)

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run ``fn(*args)`` on the owner thread (e.g. the server's own model step)."""
        return await self.executor.run(fn, *args)

    def is_owner_thread(self) -> bool:
        return self.executor.is_owner_thread()

    # -- save ------------------------------------------------------------------------------

    async def snapshot(
        self,
        key: Hashable,
        caches: Sequence[Any],
        tokens: Sequence[int],
        *,
        ledger: SnapshotLedger,
        model_id: str | None = None,
        config_fingerprint: str | None = None,
        meta: Mapping[str, str] | None = None,
        attachments: Sequence[AttachmentData] = (),
    ) -> Snapshot:
        """Plan a save of ``caches``: lazy views + header plan, one short owner job."""
        job = functools.partial(
            codecs.snapshot,
            caches,
            tokens,
            model_id=model_id,
            config_fingerprint=config_fingerprint,
            meta=meta,
            attachments=attachments,
        )
        return Snapshot.own(key, await self.run(job), ledger)

    async def materialize(
        self, snapshot: Snapshot, *, block_tokens: int | None = None
    ) -> list[HostTensor]:
        """Evaluate every tensor of ``snapshot`` into host memoryviews, one owner job each."""
        views = snapshot.views
        out: list[HostTensor] = []
        for index in range(views.tensor_count):
            job = functools.partial(
                codecs.materialize_tensor, views, index, block_tokens=block_tokens
            )
            out.append(await self.run(job))
        return out

    # -- load ------------------------------------------------------------------------------

    async def allocate(self, header: Header) -> LoadBuffers:
        """Destination memory for a read of ``header``'s tensors, one owner job per tensor.

        Each piece is an MLX byte array made here; its writable zero-copy memoryview goes
        to the reader thread, so the read lands in MLX memory and nothing is copied again.
        """
        arrays: list[list[Any]] = []
        views: list[list[memoryview]] = []
        for sizes in piece_sizes(header):
            slot_arrays, slot_views = await self.run(_allocate_pieces, sizes)
            arrays.append(slot_arrays)
            views.append(slot_views)
        return LoadBuffers(header, arrays, views)

    async def restore(self, buffers: LoadBuffers) -> Restored:
        """Build the caches from filled ``buffers`` (one owner job per tensor, then one more)."""
        header = buffers.header
        arrays: list[Any] = []
        for slot, pieces, views in zip(header.slots(), buffers.arrays, buffers.views, strict=True):
            ranges = _ranges(header, slot)
            if any(piece is None for piece in pieces):
                pieces = await self._adopt_copies(views)
            arrays.append(await self.run(_restore_slot, slot, ranges, pieces))
        buffers.release()
        return await self.run(codecs.assemble, header, arrays)

    async def _adopt_copies(self, views: Sequence[memoryview]) -> list[Any]:
        # Fallback when MLX could not lend writable memory: copy host bytes in bounded
        # chunks (mx.array holds the GIL while it copies), then join them on the owner.
        pieces: list[Any] = []
        for view in views:
            chunks = [
                await self.run(_copy_chunk, view, start)
                for start in range(0, len(view), ADOPT_CHUNK_BYTES)
            ]
            pieces.append(await self.run(_join_chunks, chunks))
        return pieces


@attrs.define(eq=False)
class LoadBuffers:
    """Where a load's bytes land: per slot, per piece, an MLX byte array (or None for a
    plain host buffer) and the writable memoryview the reader fills."""

    header: Header
    arrays: list[list[Any]]
    views: list[list[memoryview]]

    def release(self) -> None:
        """Drop every reference (after restore, or when the read failed)."""
        self.arrays = []
        self.views = []


def _mlx_dtype(name: str) -> Any:
    import mlx.core as mx

    return mx.bool_ if name == "bool" else getattr(mx, name)


def _allocate_pieces(sizes: Sequence[int]) -> tuple[list[Any], list[memoryview]]:
    import mlx.core as mx

    arrays: list[Any] = []
    views: list[memoryview] = []
    for nbytes in sizes:
        if nbytes == 0:
            arrays.append(None)
            views.append(memoryview(bytearray(0)))
            continue
        array: Any = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(array)
        view = memoryview(array)
        if view.readonly or not view.c_contiguous or view.nbytes != nbytes:
            arrays.append(None)
            views.append(memoryview(bytearray(nbytes)))
        else:
            arrays.append(array)
            views.append(view.cast("B") if view.format != "B" else view)
    return arrays, views


def _ranges(header: Header, slot: TensorSlot) -> list[tuple[int, int]] | None:
    """The token ranges of the slot's pieces, or None when it is one whole piece."""
    if header.layout != "blocks":
        return None
    ranges = piece_ranges(slot, header.block_tokens)
    return ranges if len(ranges) > 1 else None


def _restore_slot(
    slot: TensorSlot, ranges: list[tuple[int, int]] | None, pieces: Sequence[Any]
) -> Any:
    import mlx.core as mx

    dtype = _mlx_dtype(slot.dtype)
    if ranges is None:
        (piece,) = pieces
        if piece is None:  # an empty tensor
            out = mx.zeros(slot.shape, dtype=dtype)
        else:
            out = piece.view(dtype).reshape(slot.shape)
    else:
        axis = slot.token_axis if slot.token_axis is not None else 0
        parts = []
        for piece, (start, stop) in zip(pieces, ranges, strict=True):
            shape = list(slot.shape)
            shape[axis] = stop - start
            parts.append(piece.view(dtype).reshape(shape))
        out = mx.concatenate(parts, axis=axis)
    mx.eval(out)
    return out


def _copy_chunk(view: memoryview, start: int) -> Any:
    import mlx.core as mx
    import numpy as np

    chunk = np.frombuffer(view[start : start + ADOPT_CHUNK_BYTES], dtype=np.uint8)
    array = mx.array(chunk)
    mx.eval(array)
    return array


def _join_chunks(chunks: Sequence[Any]) -> Any:
    import mlx.core as mx

    if not chunks:
        return None
    out = chunks[0] if len(chunks) == 1 else mx.concatenate(list(chunks))
    mx.eval(out)
    return out
