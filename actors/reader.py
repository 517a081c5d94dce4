"""Reader: validated header reads and tensor reads into lent buffers, on worker threads.

Like the writer, the reader sees only host memory and never imports MLX. A load is two
offload jobs: :meth:`Reader.read_header` (open, check the preamble and the header hash,
validate every field) and :meth:`Reader.read_tensors` (fill the buffers the owner
allocated, checking every tensor's xxh3 or every block's sha256 when asked to verify,
docs/design.md invariant 4). Reads are cancellable at every tensor, chunk and block boundary;
the worker is never abandoned while it holds the lent buffers (invariant 6). Tensor reads
run on a long scheduler time slice (``background``, see
:func:`kvtrio.actors.sched.background_slice`), so the event loop preempts them on waking.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio
from kvtrio.actors.sched import BACKGROUND_SLICE, background_slice
from kvtrio.runtime.offload import CancelToken, Offload
from kvtrio.storage.blockstore import BlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, FileOps
from kvtrio.storage.format import Header
from kvtrio.storage.manifeststore import ManifestStore
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.reader import (
    CacheFile,
    check_blocks,
    read_header,
    read_manifest,
    read_tensors,
)

__all__ = ["Reader", "ReaderStatistics"]


@attrs.frozen
class ReaderStatistics:
    """Tensor reads finished, cancelled and failed; bytes read; reads running now."""

    running: int
    read: int
    cancelled: int
    failed: int
    bytes_read: int


@attrs.define(eq=False)
class Reader:
    """Reads cache files and manifests; blocks come from ``block_store``; ``options`` say
    how (:class:`~kvtrio.storage.options.IoOptions`)."""

    offload: Offload
    file_ops: FileOps = OS_FILE_OPS
    block_store: BlockStore | None = None
    # A store whose manifests :meth:`read_manifest` gets (a shared tier's).
    manifests: ManifestStore | None = None
    background: float | None = BACKGROUND_SLICE
    options: IoOptions = DEFAULT_IO_OPTIONS
    _running: int = attrs.field(default=0, init=False)
    _read: int = attrs.field(default=0, init=False)
    _cancelled: int = attrs.field(default=0, init=False)
    _failed: int = attrs.field(default=0, init=False)
    _bytes: int = attrs.field(default=0, init=False)

    async def read_header(self, path: str) -> CacheFile:
        """The validated header of the file at ``path`` (FileNotFoundError when absent)."""
        return await self.offload.run(self._header_job, path)

    async def read_manifest(self, name: str) -> CacheFile:
        """The validated header of manifest ``name`` of ``manifests`` (FileNotFoundError
        when absent)."""
        if self.manifests is None:
            raise ValueError("this reader has no manifest store")
        return await self.offload.run(self._manifest_job, self.manifests, name)

    async def check_blocks(self, cache_file: CacheFile) -> None:
        """Before allocating for a block-layout load: every block the manifest names is in
        the store (CacheMissError), with its size where the store can tell it
        (CorruptCacheError). A crafted manifest thus cannot size an allocation."""
        if cache_file.header.layout != "blocks" or self.block_store is None:
            return
        await self.offload.run(self._check_blocks_job, cache_file.header, self.block_store)

    @staticmethod
    def _check_blocks_job(token: CancelToken, header: Header, store: BlockStore) -> None:
        token.check()
        check_blocks(header, store)

    async def read_tensors(
        self,
        cache_file: CacheFile,
        buffers: Sequence[Sequence[memoryview]],
        *,
        verify: bool,
        indices: Sequence[int] | None = None,
    ) -> None:
        """Fill ``buffers`` (per slot, per piece) with the file's tensors: every slot, or
        slot ``indices[k]`` into ``buffers[k]``."""
        self._running += 1
        try:
            await self.offload.run(self._tensors_job, cache_file, buffers, verify, indices)
        except trio.Cancelled:
            self._cancelled += 1
            raise
        except BaseException:
            self._failed += 1
            raise
        finally:
            self._running -= 1
        self._read += 1
        self._bytes += sum(len(piece) for pieces in buffers for piece in pieces)

    def statistics(self) -> ReaderStatistics:
        return ReaderStatistics(
            running=self._running,
            read=self._read,
            cancelled=self._cancelled,
            failed=self._failed,
            bytes_read=self._bytes,
        )

    def _header_job(self, token: CancelToken, path: str) -> CacheFile:
        token.check()
        return read_header(path, file_ops=self.file_ops, follow_links=False)

    @staticmethod
    def _manifest_job(token: CancelToken, manifests: ManifestStore, name: str) -> CacheFile:
        token.check()
        return read_manifest(manifests, name)

    def _tensors_job(
        self,
        token: CancelToken,
        cache_file: CacheFile,
        buffers: Sequence[Sequence[memoryview]],
        verify: bool,
        indices: Sequence[int] | None,
    ) -> None:
        with background_slice(self.background):
            read_tensors(
                cache_file,
                buffers,
                indices=indices,
                store=self.block_store,
                verify=verify,
                cancel=token,
                file_ops=self.file_ops,
                options=self.options,
            )
