"""A cold load's reads, step by step: the owner allocates, worker threads read.

:func:`read_pipelined` is :meth:`kvtrio.actors.tier.ColdTier.load`'s middle part, after
the header and before the caches are assembled. Its rules:

1. A step is one tensor, or several small ones up to
   :data:`~kvtrio.actors.owner.STEP_BYTES` (:func:`~kvtrio.actors.owner.steps`); each
   step's destinations are one owner job and one backing
   (:func:`kvtrio.storage.hostbuffers.allocate_slots`).
2. The owner allocates the next step while the previous ones are read on worker threads,
   ``streams`` reads at once (within the offload's ``io_threads``;
   :data:`~kvtrio.storage.options.TIER_LOAD_STREAMS` says why one by default).
3. With ``scatter`` (a block store that reads into runs), a tensor of several kv heads is
   allocated whole and each block read into its runs of it: nothing to join. Otherwise
   its token blocks are joined on the owner (:meth:`MlxOwner.join`, one job per tensor)
   as soon as their step is read, while the next step is read.
4. The first failing slot, in slot order, raises; the other reads stop at their next
   boundary and are waited for (a worker holding lent buffers is never abandoned,
   docs/design.md invariant 6).
"""

from __future__ import annotations

from typing import Any

import trio
from kvtrio.actors.owner import MlxOwner, steps
from kvtrio.actors.reader import Reader
from kvtrio.storage.fileops import Piece
from kvtrio.storage.hostbuffers import LoadBuffers
from kvtrio.storage.options import IoOptions
from kvtrio.storage.reader import CacheFile

__all__ = ["read_pipelined"]


async def read_pipelined(
    owner: MlxOwner,
    reader: Reader,
    cache_file: CacheFile,
    *,
    verify: bool,
    streams: int,
    options: IoOptions,
    scatter: bool,
) -> LoadBuffers:
    """The filled destinations of every tensor of ``cache_file`` (see the module doc)."""
    header = cache_file.header
    slots = list(header.slots())
    arrays: list[tuple[Any, ...]] = []
    buffers: list[tuple[Piece, ...]] = []
    errors: list[tuple[int, Exception]] = []

    reading = trio.Semaphore(streams)

    async def read(step: range, views: list[tuple[Piece, ...]]) -> None:
        try:
            await reader.read_tensors(cache_file, views, verify=verify, indices=step)
        except Exception as exc:
            errors.append((step.start, exc))
            nursery.cancel_scope.cancel()
            return
        finally:
            reading.release()
        try:
            for index in step:
                arrays[index] = (await owner.join(slots[index], arrays[index]),)
        except Exception as exc:
            errors.append((step.start, exc))
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for step in steps([slot.nbytes for slot in slots]):
            try:
                allocated = await owner.allocate_slots(
                    header, step, options=options, scatter=scatter
                )
            except Exception as exc:
                errors.append((step.start, exc))
                nursery.cancel_scope.cancel()
                break
            arrays.extend(a for a, _ in allocated)
            views = [v for _, v in allocated]
            buffers.extend(views)
            await reading.acquire()
            nursery.start_soon(read, step, views)
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return LoadBuffers(arrays=tuple(arrays), buffers=tuple(buffers))
