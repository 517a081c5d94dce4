"""MlxOwner: the one thread that touches MLX.

Keeps docs/design.md invariant 8 (one MLX thread).

Theory of operation (docs/design.md "Threads, and who may touch what"):

1. Every ``mlx.core`` call kvtrio makes runs as a job on the owner's executor: one
   dedicated OS thread in production (:meth:`MlxOwner.dedicated`), the trio thread in
   deterministic tests (:meth:`MlxOwner.inline`). Jobs run FIFO, so a server that runs its
   own model steps through ``await owner.run(step, ...)`` gets snapshot preparation
   serialized with decoding instead of racing it.
2. Work is cut into short jobs so the owner interleaves with the server's steps and the
   event loop never waits long: ``snapshot`` is one job (lazy views only, O(1) memory);
   ``materialize`` runs tensor pieces (a tensor, or one token block of it in the block
   layout) in jobs of at most :data:`SAVE_STEP_BYTES` (at least one piece), planned by
   bytes from the header as a load's steps are, and ends a job early once
   :data:`JOB_BUDGET` seconds have passed (a zero-copy piece takes microseconds, a copied
   one its copy; a job round trip costs more than most of them, so one job per tensor
   cost a save of 64 tensors about 20 ms); one ``mx.eval`` per tensor of a job;
   ``release`` frees a save's host tensors the same way; ``allocate_slots`` allocates a
   step of tensors up to :data:`STEP_BYTES` from one backing (the pages are not touched).
3. Loads never copy tensor bytes: ``allocate`` makes each destination array on the owner
   and lends its memory (a writable, zero-copy memoryview) to a worker thread that reads
   the file straight into it (a block of several kv heads into its runs of the tensor,
   where the store scatters); the caches are then built from those arrays on the owner
   (``join``, one job per tensor of several token blocks a store could not scatter, as
   soon as its step is read; then ``restore``).
4. A job whose caller was cancelled before it started never runs; a started job finishes
   and its result is dropped (the executor's rules).
5. kvtrio's threads are background threads to the scheduler: the owner thread (and the
   MLX stream threads it starts, which inherit it) and every I/O job ask Linux for a long
   time slice (:data:`BACKGROUND_SLICE`, see :func:`background_slice`). Since Linux 6.12
   (EEVDF custom slices) a thread waking with a shorter slice, such as the event loop's,
   preempts them at once instead of waiting in the run queue for their slice to end;
   their share of the CPU is unchanged. Elsewhere it is a no-op (:mod:`kvtrio.actors.sched`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar, TypeVarTuple

import kvtrio.metal.codec  # noqa: F401  (registers the paged codec: every built-in kind loads)
import mlx.core as mx
from kvtrio.actors.sched import BACKGROUND_SLICE, set_thread_slice
from kvtrio.actors.snapshot import Snapshot, SnapshotLedger
from kvtrio.runtime.executor import DedicatedThreadExecutor, InlineExecutor
from kvtrio.runtime.external import ExternalThreadExecutor
from kvtrio.storage import cacheio, hostbuffers
from kvtrio.storage.cacheio import AttachmentData, CacheSnapshot, HostTensor, Restored
from kvtrio.storage.fileops import Piece
from kvtrio.storage.format import Header, TensorSlot
from kvtrio.storage.hostbuffers import LoadBuffers
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions

__all__ = [
    "JOB_BUDGET",
    "SAVE_STEP_BYTES",
    "STEP_BYTES",
    "MlxOwner",
    "release_thread_streams",
    "save_steps",
    "steps",
]

#: Work per owner job when materializing: one tensor, or a run of small ones up to this.
STEP_BYTES = 32 * 1024 * 1024

#: Bytes of tensor pieces one owner job of a save materializes (at least one piece): what
#: a job costs the generation thread when a piece must be copied (about 1 ms per 4 MiB
#: here), and a bound whatever the machine's clock does.
SAVE_STEP_BYTES = 4 * 1024 * 1024

#: How long (seconds) one owner job of kvtrio's runs tensors before handing the thread
#: back (a job finishes the tensor it is on). Python work in such a job holds the GIL, so
#: this also bounds how long the event loop can wait for it.
JOB_BUDGET = 0.001

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

AnyExecutor = DedicatedThreadExecutor | InlineExecutor | ExternalThreadExecutor


def release_thread_streams() -> None:
    """Finish and free the calling thread's MLX streams (run on the owner before it ends).

    MLX keeps per-thread streams whose worker threads are otherwise torn down at process
    exit, which aborts the process now and then ("terminate called without an active
    exception", about 1 run in 5 here); ``mx.clear_streams`` is MLX's API for this.
    """
    mx.synchronize()
    mx.clear_streams()


class MlxOwner:
    """Runs MLX work on one thread. Open with ``async with MlxOwner.dedicated() as owner``."""

    def __init__(self, executor: AnyExecutor) -> None:
        self.executor = executor

    @classmethod
    @asynccontextmanager
    async def dedicated(
        cls, *, name: str = "mlx-owner", background: float | None = BACKGROUND_SLICE
    ) -> AsyncIterator[MlxOwner]:
        """An owner on its own OS thread (production). ``background``: the time slice the
        owner thread asks for before its first MLX call, so the MLX stream threads it
        starts inherit it (:mod:`kvtrio.actors.sched`; None leaves the thread alone)."""
        async with DedicatedThreadExecutor(
            name=name, on_thread_exit=release_thread_streams
        ) as executor:
            if background is not None:
                await executor.run(set_thread_slice, background)
            yield cls(executor)

    @classmethod
    @asynccontextmanager
    async def inline(cls) -> AsyncIterator[MlxOwner]:
        """An owner that runs jobs on the calling trio thread (deterministic tests)."""
        async with InlineExecutor(name="mlx-owner-inline") as executor:
            yield cls(executor)

    @classmethod
    def external(cls, executor: ExternalThreadExecutor) -> MlxOwner:
        """An owner whose jobs run on a thread the server already has (mlx-lm's generation
        thread), when that thread pumps ``executor`` (:mod:`kvtrio.runtime.external`)."""
        return cls(executor)

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
            cacheio.snapshot,
            caches,
            tokens,
            model_id=model_id,
            config_fingerprint=config_fingerprint,
            meta=meta,
            attachments=attachments,
        )
        return Snapshot.own(key, await self.run(job), ledger)

    async def materialize(
        self,
        snapshot: Snapshot,
        *,
        block_tokens: int | None = None,
        options: IoOptions = DEFAULT_IO_OPTIONS,
    ) -> list[HostTensor]:
        """Evaluate every tensor of ``snapshot`` into host memoryviews (zero-copy where the
        strides allow and ``options.zero_copy``).

        Each owner job runs tensors until :data:`JOB_BUDGET` has passed (at least one), so
        zero-copy tensors share a job and a copied one gets its own.
        """
        views = snapshot.views
        sizes = cacheio.piece_sizes(views, block_tokens=block_tokens)
        units = [(t, p) for t, pieces in enumerate(sizes) for p in range(len(pieces))]
        done: list[tuple[tuple[memoryview, ...], Any]] = []
        for step in save_steps([n for pieces in sizes for n in pieces]):
            start = step.start
            while start < step.stop:  # a job cut short by JOB_BUDGET: the rest next
                job = functools.partial(
                    _materialize_units, views, units[start : step.stop], block_tokens, options
                )
                got = await self.run(job)
                done.extend(got)
                start += len(got)
        out: list[HostTensor] = []
        at = 0
        for pieces in sizes:
            mine = done[at : at + len(pieces)]
            at += len(pieces)
            out.append(
                HostTensor(
                    segments=tuple(s for s, _ in mine), keepalive=tuple(k for _, k in mine)
                )
            )
        return out

    async def release(self, host: list[HostTensor], snapshot: Snapshot) -> None:
        """Free a save's host tensors (emptying ``host``) and then the snapshot's views, on
        the owner: in jobs of at most :data:`JOB_BUDGET` (and one tensor), since unmapping
        a large copy at once holds the kernel's memory-map lock long enough to stall every
        thread that faults a page, the event loop's included."""
        while True:
            if await self.run(_release_some, host, snapshot):
                return

    # -- load ------------------------------------------------------------------------------

    async def allocate(
        self, header: Header, *, options: IoOptions = DEFAULT_IO_OPTIONS
    ) -> LoadBuffers:
        """Destination memory for a read of ``header``'s tensors, one owner job per tensor
        (see :meth:`allocate_slot`)."""
        arrays: list[tuple[Any, ...]] = []
        buffers: list[tuple[memoryview, ...]] = []
        for index in range(sum(1 for _ in header.slots())):
            slot_arrays, slot_buffers = await self.allocate_slot(header, index, options=options)
            arrays.append(slot_arrays)
            buffers.append(slot_buffers)
        return LoadBuffers(arrays=tuple(arrays), buffers=tuple(buffers))

    async def allocate_slot(
        self, header: Header, index: int, *, options: IoOptions = DEFAULT_IO_OPTIONS
    ) -> tuple[tuple[Any, ...], tuple[memoryview, ...]]:
        """Destination memory for slot ``index`` (one owner job): MLX arrays made here, and
        writable zero-copy views of them for the reader thread, so the read lands in MLX
        memory and nothing is copied (without a fill unless ``options.alloc_untouched`` is
        off)."""
        return await self.run(
            functools.partial(hostbuffers.allocate_slot, header, index, options=options)
        )

    async def allocate_slots(
        self,
        header: Header,
        indices: Sequence[int],
        *,
        options: IoOptions = DEFAULT_IO_OPTIONS,
        scatter: bool = False,
    ) -> list[tuple[tuple[Any, ...], tuple[Piece, ...]]]:
        """:meth:`allocate_slot` for several slots in one owner job (a step of
        :func:`steps`), from one backing; ``scatter`` as for
        :func:`kvtrio.storage.hostbuffers.allocate_slots`."""
        return await self.run(_allocate_group, header, indices, options, scatter)

    async def join(self, slot: TensorSlot, pieces: Sequence[Any]) -> Any:
        """Slot ``slot``'s tensor from its filled pieces: the one piece itself, or the
        block layout's token blocks joined in one owner job (one copy of the tensor)."""
        if len(pieces) == 1:
            return pieces[0]
        axis = slot.token_axis if slot.token_axis is not None else 0
        return await self.run(_join, pieces, axis)

    async def restore(self, header: Header, loaded: LoadBuffers) -> Restored:
        """Build the caches from filled buffers: :meth:`join` of each tensor not joined
        yet (a load that joins step by step leaves one piece per tensor), then one job
        that evaluates the (zero-copy) views of the rest and assembles the caches."""
        arrays = [
            await self.join(slot, pieces)
            for slot, pieces in zip(header.slots(), loaded.arrays, strict=True)
        ]
        return await self.run(_assemble, header, arrays)


def _assemble(header: Header, arrays: list[Any]) -> Restored:
    import mlx.core as mx

    mx.eval(arrays)
    return cacheio.assemble(header, arrays)


def steps(sizes: Sequence[int], *, limit: int | None = None) -> list[range]:
    """Consecutive index ranges, each one tensor or several adding up to <= ``limit``
    (default :data:`STEP_BYTES`: a load's steps)."""
    if limit is None:
        limit = STEP_BYTES
    steps: list[range] = []
    start = 0
    total = 0
    for index, size in enumerate(sizes):
        if index > start and total + size > limit:
            steps.append(range(start, index))
            start, total = index, 0
        total += size
    if start < len(sizes):
        steps.append(range(start, len(sizes)))
    return steps


def _allocate_group(
    header: Header, indices: Sequence[int], options: IoOptions, scatter: bool
) -> list[tuple[tuple[Any, ...], tuple[Piece, ...]]]:
    return hostbuffers.allocate_slots(header, indices, options=options, scatter=scatter)


def save_steps(sizes: Sequence[int]) -> list[range]:
    """:func:`steps` for a save's pieces, at :data:`SAVE_STEP_BYTES`: consecutive index
    ranges, each one piece or several adding up to <= SAVE_STEP_BYTES."""
    return steps(sizes, limit=SAVE_STEP_BYTES)


def _materialize_units(
    views: CacheSnapshot,
    units: Sequence[tuple[int, int]],
    block_tokens: int | None,
    options: IoOptions,
) -> list[tuple[tuple[memoryview, ...], Any]]:
    """Materialize ``units`` ((tensor, piece) pairs, in order) until JOB_BUDGET has
    passed (at least one tensor's run of them); the pieces done, in order."""
    deadline = time.perf_counter() + JOB_BUDGET
    out: list[tuple[tuple[memoryview, ...], Any]] = []
    at = 0
    while at < len(units):
        tensor = units[at][0]
        end = at
        while end < len(units) and units[end][0] == tensor:
            end += 1
        segments, keepalive = cacheio.materialize_pieces(
            views,
            tensor,
            [p for _, p in units[at:end]],
            block_tokens=block_tokens,
            options=options,
        )
        out.extend(zip(segments, keepalive, strict=True))
        at = end
        if time.perf_counter() >= deadline:
            break
    return out


def _release_some(host: list[HostTensor], snapshot: Snapshot) -> bool:
    """Drop tensors from the end of ``host`` for up to JOB_BUDGET; True once all are gone
    (the snapshot's views then too). The last reference goes here, on the owner thread."""
    deadline = time.perf_counter() + JOB_BUDGET
    while host:
        del host[-1]
        if time.perf_counter() >= deadline:
            return False
    snapshot.drop_views()
    return True


def _join(pieces: Sequence[Any], axis: int) -> Any:
    import mlx.core as mx

    out = mx.concatenate(list(pieces), axis=axis)
    mx.eval(out)
    return out
