"""Hashing on helper threads while the caller's thread does the I/O: save, load, Redis.

CPU only (no trio, no MLX). xxhash and hashlib release the GIL on large buffers, so a
helper thread hashing chunk ``k`` overlaps the caller writing or reading chunk ``k + 1``.
Three paths use it: the writer (a save's xxh3, one helper per write), the reader (a
load's xxh3, one helper per read, when asked) and the Redis store (sha256 of a verified
read's blocks, on the store's helpers).

Theory of operation:

1. A :class:`HashPool` owns its threads; ``close()`` (or leaving its ``with`` block)
   waits for them. With one thread, jobs run in the order submitted, so a streaming
   hash may be fed chunk by chunk; with more, jobs must be independent. With none,
   :meth:`HashBatch.submit` runs each job on the caller's thread, at once.
2. One operation's jobs are one :class:`HashBatch` (``with pool.batch() as batch``).
   :meth:`HashBatch.wait` waits for every job submitted so far and raises the first
   failure in submission order.
3. The guarantee: the jobs read the caller's buffers, so no job is still running when
   the batch's ``with`` block is left, however it is left. On an exception (a
   cancellation included) the jobs not yet started are cancelled, every running one is
   waited for, and their own failures are dropped (the operation is failing already);
   the exception propagates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["HashBatch", "HashPool"]


class HashPool:
    """Helper threads for hash jobs (rule 1); ``threads=0`` hashes inline."""

    def __init__(self, threads: int, *, name: str = "kvtrio-hash") -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0, not {threads}")
        self.threads = threads
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def batch(self) -> HashBatch:
        """A new batch of jobs on these threads (rule 2)."""
        return HashBatch(self)

    def _submit(self, fn: Callable[..., object], *args: object) -> Future[object]:
        with self._lock:
            if self._executor is None:  # threads start on the first job, not before
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            return self._executor.submit(fn, *args)

    def close(self) -> None:
        """Wait for every thread to finish its jobs and exit. Idempotent; a later job
        starts new threads."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> HashPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HashBatch:
    """One operation's hash jobs; see the module's rules 2 and 3."""

    __slots__ = ("_futures", "_pool")

    def __init__(self, pool: HashPool) -> None:
        self._pool = pool
        self._futures: list[Future[object]] = []

    @property
    def inline(self) -> bool:
        """Whether jobs run on the caller's thread (a pool of no threads)."""
        return self._pool.threads == 0

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on a helper thread (inline: now, raising what it raises)."""
        if self.inline:
            fn(*args)
            return
        self._futures.append(self._pool._submit(fn, *args))

    def wait(self) -> None:
        """Wait for every job submitted so far; raise the first failure, in submission
        order, once all of them have finished. The batch may be used again after."""
        futures, self._futures = self._futures, []
        first: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as exc:  # every job is waited for before raising
                first = first or exc
        if first is not None:
            raise first

    def abandon(self) -> None:
        """Cancel the jobs not started, wait for the running ones, drop their failures:
        no job reads the caller's buffers after this returns (rule 3)."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.cancel()
        for future in futures:
            try:
                future.result()
            except BaseException:  # cancelled, or failed: the operation is failing anyway
                pass

    def __enter__(self) -> HashBatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.wait()
        else:
            self.abandon()
