"""Writer: durable cache writes on worker threads, cancellable at tensor and block boundaries.

The writer sees only immutable host bytes (memoryviews the owner materialized) and never
imports MLX. Each write is one job on the runtime's :class:`~kvtrio.runtime.offload.Offload`
(worker threads behind a capacity limit); trio cancellation sets the job's cancel token,
the storage core stops at its next tensor, chunk or block boundary, removes its tmp file
and returns, and only then does the caller see the cancellation (docs/design.md invariant 6).
No final file exists after a cancelled or failed write (invariant 4).

Which write path (``direct``): ``None`` (the default) keeps storage's default, buffered
writes streamed straight from the tensors' segments, for every cache: since storage pads
a tensor's tail before starting its writeback, caches whose segments cut 4 KiB pages
(length not a multiple of 16 tokens) save as fast as page-aligned ones, and faster than
through O_DIRECT (``kvtrio bench storage --tokens 4059 --layers 32 --compare-direct``,
532 MB, development VM: buffered 1.23-1.56 GB/s vs O_DIRECT 1.00-1.19).
``direct=False``/``True`` forces a path; ``options`` (:class:`~kvtrio.storage.options.IoOptions`)
choose the rest (``save_direct`` when ``direct`` is None, the hash thread). A job runs with its
worker thread on a long scheduler time slice (``background``, see
:func:`kvtrio.actors.sched.background_slice`), so the event loop preempts it on waking.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import trio
from kvtrio.actors.sched import BACKGROUND_SLICE, background_slice
from kvtrio.runtime.offload import CancelToken, Offload
from kvtrio.storage.blockstore import BlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, FileOps
from kvtrio.storage.format import Header
from kvtrio.storage.manifeststore import ManifestStore
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.writer import (
    DEFAULT_BLOCK_TOKENS,
    IndexKeysOf,
    Segmented,
    WriteResult,
    write_blocks,
    write_single,
)

__all__ = ["Writer", "WriterStatistics"]

D = TypeVar("D")


@attrs.frozen
class WriterStatistics:
    """Writes finished, cancelled and failed; bytes published; writes running now."""

    running: int
    written: int
    cancelled: int
    failed: int
    bytes_written: int


@attrs.define(eq=False)
class _Box:
    result: WriteResult | None = None


@attrs.define(eq=False)
class Writer:
    """Publishes cache files (``single``) and manifests over blocks (``blocks``).

    A write cancelled after its last boundary (fsync and rename already done) is
    durable: ``write_*`` then returns its result instead of raising, so a caller never
    calls a published file cancelled; the caller's next checkpoint raises Cancelled.
    """

    offload: Offload
    file_ops: FileOps = OS_FILE_OPS
    block_store: BlockStore | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    # Where the blocks layout publishes manifests (``write_blocks``'s ``path`` is then a
    # manifest name); None: the manifest is the file at ``path``.
    manifests: ManifestStore | None = None
    # The prefix-index keys a manifest is registered under (a store with an index).
    index_keys_of: IndexKeysOf | None = None
    background: float | None = BACKGROUND_SLICE
    direct: bool | None = None
    options: IoOptions = DEFAULT_IO_OPTIONS
    _running: int = attrs.field(default=0, init=False)
    _written: int = attrs.field(default=0, init=False)
    _cancelled: int = attrs.field(default=0, init=False)
    _failed: int = attrs.field(default=0, init=False)
    _bytes: int = attrs.field(default=0, init=False)

    async def write_single(
        self, path: str, plan: Header, tensors: Sequence[Segmented]
    ) -> WriteResult:
        """Write one cache file: ``tensors[i]`` holds slot i of ``plan.slots()`` (a buffer, or
        its contiguous segments)."""
        return await self._run(self._single_job, path, plan, tensors)

    async def write_blocks(
        self, path: str, plan: Header, pieces: Sequence[Sequence[Segmented]]
    ) -> WriteResult:
        """Store the pieces as content-addressed blocks, then publish the manifest."""
        if self.block_store is None:
            raise ValueError("this writer has no block store: the blocks layout needs one")
        return await self._run(self._blocks_job, path, plan, pieces)

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            running=self._running,
            written=self._written,
            cancelled=self._cancelled,
            failed=self._failed,
            bytes_written=self._bytes,
        )

    def _single_job(
        self,
        token: CancelToken,
        path: str,
        plan: Header,
        tensors: Sequence[Segmented],
        box: _Box,
    ) -> WriteResult:
        with background_slice(self.background):
            box.result = write_single(
                path,
                plan,
                tensors,
                file_ops=self.file_ops,
                cancel=token,
                direct=self.direct,
                options=self.options,
            )
        return box.result

    def _blocks_job(
        self,
        token: CancelToken,
        path: str,
        plan: Header,
        pieces: Sequence[Sequence[Segmented]],
        box: _Box,
    ) -> WriteResult:
        assert self.block_store is not None
        with background_slice(self.background):
            box.result = write_blocks(
                path,
                plan,
                pieces,
                self.block_store,
                block_tokens=self.block_tokens,
                file_ops=self.file_ops,
                cancel=token,
                manifests=self.manifests,
                index_keys_of=self.index_keys_of,
            )
        return box.result

    async def _run(
        self,
        job: Callable[[CancelToken, str, Header, D, _Box], WriteResult],
        path: str,
        plan: Header,
        data: D,
    ) -> WriteResult:
        self._running += 1
        box = _Box()
        try:
            result = await self.offload.run(job, path, plan, data, box)
        except trio.Cancelled:
            if box.result is None:
                self._cancelled += 1
                raise
            # The job finished (durably) before it could see the cancel: report the truth.
            # The caller's next checkpoint raises the cancellation again.
            result = box.result
        except BaseException:
            self._failed += 1
            raise
        finally:
            self._running -= 1
        self._written += 1
        self._bytes += result.file_bytes + result.new_block_bytes
        return result
