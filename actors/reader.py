"""Reader: validated header reads and tensor reads into lent buffers, on worker threads.

Like the writer, the reader sees only host memory and never imports MLX. A load is two
offload jobs: :meth:`Reader.read_header` (open, check the preamble and the header hash,
validate every field; for a tier's load also its ``check`` of the header and, in the
blocks layout, every block's presence and size) and :meth:`Reader.read_tensors` (fill
the buffers the owner allocated, checking every tensor's xxh3 or every block (its
manifest's xxh3 on a local store, its sha256 name on a shared one) when asked to verify,
docs/design.md invariant 4). Reads are cancellable at every
tensor, chunk and block boundary; the worker is never abandoned while it holds the lent
buffers (invariant 6). Tensor reads run on a long scheduler time slice (``background``,
see :func:`kvtrio.actors.sched.background_slice`), so the event loop preempts them on
waking.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import trio
from kvtrio.actors.sched import BACKGROUND_SLICE, background_slice
from kvtrio.runtime.offload import CancelToken, Offload
from kvtrio.storage.blockstore import BlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, FileOps, Piece
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

__all__ = ["HeaderCheck", "Reader", "ReaderStatistics"]

#: A load's checks of a validated header before anything it names is touched (raising
#: CacheMismatchError, UnknownCacheKindError, ...); plain CPU work, run on a worker thread.
HeaderCheck = Callable[[Header], None]


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

    async def read_header(self, path: str, *, check: HeaderCheck | None = None) -> CacheFile:
        """The validated header of the file at ``path`` (FileNotFoundError when absent).
        With ``check``, a load's first step in one worker job: the header, then
        ``check(header)`` (a load's expectations, raising before anything else is
        touched), then :meth:`check_blocks`'s look at the blocks."""
        return await self.offload.run(self._header_job, path, check)

    async def read_manifest(self, name: str, *, check: HeaderCheck | None = None) -> CacheFile:
        """The validated header of manifest ``name`` of ``manifests`` (FileNotFoundError
        when absent); ``check`` as for :meth:`read_header`."""
        if self.manifests is None:
            raise ValueError("this reader has no manifest store")
        return await self.offload.run(self._manifest_job, self.manifests, name, check)

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
        buffers: Sequence[Sequence[Piece]],
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
        self._bytes += sum(piece.nbytes for pieces in buffers for piece in pieces)

    def statistics(self) -> ReaderStatistics:
        return ReaderStatistics(
            running=self._running,
            read=self._read,
            cancelled=self._cancelled,
            failed=self._failed,
            bytes_read=self._bytes,
        )

    def _header_job(self, token: CancelToken, path: str, check: HeaderCheck | None) -> CacheFile:
        token.check()
        cache_file = read_header(path, file_ops=self.file_ops, follow_links=False)
        return self._checked(token, cache_file, check)

    def _manifest_job(
        self, token: CancelToken, manifests: ManifestStore, name: str, check: HeaderCheck | None
    ) -> CacheFile:
        token.check()
        return self._checked(token, read_manifest(manifests, name), check)

    def _checked(
        self, token: CancelToken, cache_file: CacheFile, check: HeaderCheck | None
    ) -> CacheFile:
        """``check(header)``, then the blocks' presence and sizes (:meth:`check_blocks`),
        on the job's thread: no return to the loop and second job between them."""
        if check is None:
            return cache_file
        check(cache_file.header)
        if cache_file.header.layout == "blocks" and self.block_store is not None:
            token.check()
            check_blocks(cache_file.header, self.block_store)
        return cache_file

    def _tensors_job(
        self,
        token: CancelToken,
        cache_file: CacheFile,
        buffers: Sequence[Sequence[Piece]],
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
