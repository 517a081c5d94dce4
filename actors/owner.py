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

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar, TypeVarTuple

from kvtrio.runtime.executor import DedicatedThreadExecutor, InlineExecutor

__all__ = ["MlxOwner"]

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
