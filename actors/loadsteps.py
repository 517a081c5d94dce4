"""A cold load's reads, step by step: the owner allocates, worker threads read.

:func:`read_pipelined` is :meth:`kvtrio.actors.tier.ColdTier.load`'s middle part, after
the header and before the caches are assembled. Its rules:

1. A step is one tensor, or several small ones up to
   :data:`~kvtrio.actors.owner.STEP_BYTES` (:func:`~kvtrio.actors.owner.steps`); each
   step's destinations are one owner job and one backing
   (:func:`kvtrio.storage.hostbuffers.allocate_slots`).
2. The owner allocates the next step while the previous ones are read on worker threads,
   ``streams`` reads at once (within the offload's ``io_threads``;
   :func:`~kvtrio.storage.options.default_tier_load_streams` says how many by default). With
   ``streams`` > 1 a step is itself read as up to ``streams`` reads of consecutive
   tensors (:func:`read_parts`, each at least :data:`MIN_READ_BYTES`): a served entry is
   usually one step, and its reads and hashes would otherwise run on one thread.
3. With ``scatter`` (a block store that reads into runs), a tensor of several kv heads is
   allocated whole and each block read into its runs of it: nothing to join. Otherwise
   its token blocks are joined on the owner (:meth:`MlxOwner.join`, one job per tensor)
   as soon as their step is read, while the next step is read.
4. The first failing slot, in slot order, raises; the other reads stop at their next
   boundary and are waited for (a worker holding lent buffers is never abandoned,
   docs/design.md invariant 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import trio
from kvtrio.actors.owner import MlxOwner, steps
from kvtrio.actors.reader import Reader
from kvtrio.storage.fileops import Piece
from kvtrio.storage.hostbuffers import LoadBuffers
from kvtrio.storage.options import IoOptions
from kvtrio.storage.reader import CacheFile

__all__ = ["MIN_READ_BYTES", "read_parts", "read_pipelined"]

#: Bytes of a step per read it is split into: on a 16-CPU host (docs/load13/) a 4 MB
#: entry loaded fastest in 2 reads (9.1 ms, against 11.0 in one and 10.0 in four of 1
#: MiB), a 94 MB one in 4 (107 ms, against 179 in one and 127 in eight).
MIN_READ_BYTES = 2 * 1024 * 1024


def read_parts(step: range, sizes: Sequence[int], streams: int) -> list[range]:
    """``step`` as consecutive ranges of about equal bytes, one tensor at least each, at
    most ``streams`` of them and one per :data:`MIN_READ_BYTES` of the step (so one
    range for a small step, or a step of one tensor). ``sizes`` are every slot's bytes."""
    total = sum(sizes[i] for i in step)
    parts = max(1, min(streams, len(step), total // MIN_READ_BYTES))
    if parts == 1:
        return [step]
    bounds = [step.start]
    done = 0
    for index in step[:-1]:  # the last tensor always ends the last range
        done += sizes[index]
        if done * parts >= total * len(bounds):
            bounds.append(index + 1)
            if len(bounds) == parts:
                break
    bounds.append(step.stop)
    return [range(a, b) for a, b in pairwise(bounds)]


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
    sizes = [slot.nbytes for slot in slots]
    arrays: list[tuple[Any, ...]] = []
    buffers: list[tuple[Piece, ...]] = []
    errors: list[tuple[int, Exception]] = []

    reading = trio.Semaphore(streams)

    async def read(step: range, views: Sequence[tuple[Piece, ...]]) -> None:
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
        for step in steps(sizes):
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
            for part in read_parts(step, sizes, streams):
                await reading.acquire()
                offset = part.start - step.start
                nursery.start_soon(read, part, views[offset : offset + len(part)])
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return LoadBuffers(arrays=tuple(arrays), buffers=tuple(buffers))
