"""Store maintenance: garbage collection of blocks and crash debris, and a full verify.

CPU only; blocking; run on a worker thread or from the command line.

GC theory of operation (git's prune expiry, rustic's two-phase prune):

1. List the store's blocks (with mtimes) *before* reading any manifest.
2. Mark: every block named by a readable manifest in ``manifest_dir`` is live.
3. Sweep: delete a block only if it is unmarked AND older than ``grace_s``. A writer
   stores (or, for a block that already exists, freshens the mtime of) every block
   before publishing the manifest that names it, so a block a concurrent writer is about
   to reference is younger than the grace period and survives. The local store checks
   the mtime again after moving the block aside (``LocalBlockStore.delete_stale``), so a
   freshen that lands after step 1's listing is seen too.
4. Tmp files (``*.kvtrio-tmp``: a crash between create and rename) older than
   ``grace_s`` are removed from ``manifest_dir`` and from a local store's directory.

With ``catalogue_dir`` (the tier's root), step 2 takes the blocks of a manifest from the
tier's catalogue (:mod:`kvtrio.storage.catalogue`) instead of reading the manifest, when
the catalogue is there, readable and was closed cleanly (its rows then match the
manifests, rule 2 there) and its row for that manifest has the manifest's size and
mtime (a manifest rewritten since, even to the same size, is read); any
other manifest is read, as all are without a usable catalogue (missing, unclean after a
crash or beside a live owner, corrupt, another schema). The grace period applies either
way. A row whose manifest is gone marks nothing.

A manifest that fails validation marks nothing (its blocks were unusable anyway) and is
reported; a manifest that cannot be *read* (an I/O error) aborts the pass before anything
is deleted. A missing block is never an error here: a load that needs it is a clean miss.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

import attrs
from kvtrio.errors import CacheMissError, CorruptCacheError, NewerFormatError
from kvtrio.storage.blockstore import BlockStore, LocalBlockStore, read_block_verified
from kvtrio.storage.catalogue import CATALOGUE_NAME, Catalogue
from kvtrio.storage.fileops import (
    O_NONBLOCK,
    OS_FILE_OPS,
    TMP_SUFFIX,
    FileOps,
    not_a_real_directory,
    pread_full,
)
from kvtrio.storage.format import MAGIC
from kvtrio.storage.reader import allocate_buffers, read_header, read_tensors

__all__ = [
    "GcReport",
    "VerifyReport",
    "collect_garbage",
    "is_kvtrio_file",
    "list_cache_files",
    "verify_tree",
]

_SUFFIX = ".kvc"  # a tier's manifest names: <key>.kvc, as its catalogue keys them


@attrs.frozen
class GcReport:
    """What one GC pass found and did."""

    manifests: int
    live_blocks: int
    deleted_blocks: int
    deleted_bytes: int
    young_unreferenced: int  # unreferenced but inside the grace period: kept
    tmp_removed: int
    unreadable: tuple[str, ...]  # manifests or cache files that failed validation
    foreign: tuple[str, ...] = ()  # files that are not kvtrio's (no kvtrio magic): left alone
    catalogued: int = 0  # manifests whose blocks the catalogue gave (not read)
    newer: tuple[str, ...] = ()  # manifests of a newer kvtrio's format: no block swept


@attrs.frozen
class VerifyReport:
    """The result of rechecking every cache file and block."""

    files_ok: int
    blocks_ok: int
    bad_files: tuple[tuple[str, str], ...]  # (path, error)
    bad_blocks: tuple[tuple[str, str], ...]  # (block name, error)
    missing_blocks: tuple[tuple[str, str], ...]  # (manifest path, block name)
    # Files that are not kvtrio's at all (no kvtrio magic: a conversations.json, an mlx-lm
    # .safetensors beside the caches): listed apart, never counted as corruption.
    foreign_files: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.bad_files or self.bad_blocks or self.missing_blocks)


def is_kvtrio_file(path: str, file_ops: FileOps = OS_FILE_OPS) -> bool:
    """Whether ``path`` starts with kvtrio's magic: a kvtrio file, however damaged after
    it (False for anything else, including what cannot be read as a regular file)."""
    try:
        fd = file_ops.open(path, os.O_RDONLY | O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(file_ops.fstat(fd).st_mode):
            return False
        head = bytearray(len(MAGIC))
        return pread_full(file_ops, fd, memoryview(head), 0) == len(MAGIC) and head == MAGIC
    except OSError:
        return False
    finally:
        file_ops.close(fd)


def list_cache_files(directory: str, *, file_ops: FileOps = OS_FILE_OPS) -> list[str]:
    """Regular, non-hidden files directly in ``directory`` (cache files and manifests)."""
    return [path for path, _, _ in _listed_files(directory, file_ops)]


def _listed_files(directory: str, file_ops: FileOps) -> list[tuple[str, int, int]]:
    """:func:`list_cache_files` with each file's size and mtime (ns)."""
    try:
        names = file_ops.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        if name.startswith("."):
            continue
        path = os.path.join(directory, name)
        try:
            info = file_ops.stat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            out.append((path, info.st_size, info.st_mtime_ns))
    return out


def _remove_old_tmp(directory: str, cutoff: float, file_ops: FileOps) -> int:
    removed = 0
    try:
        names = file_ops.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            if file_ops.stat(path).st_mtime < cutoff:
                file_ops.unlink(path)
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def collect_garbage(
    manifest_dir: str,
    store: BlockStore,
    *,
    grace_s: float = 3600.0,
    now: float | None = None,
    file_ops: FileOps = OS_FILE_OPS,
    catalogue_dir: str | None = None,
    update_catalogue: bool = True,
) -> GcReport:
    """One mark-and-sweep pass over ``store`` using the manifests in ``manifest_dir``.

    ``catalogue_dir``: the tier root holding its catalogue, used as the module docstring
    says. ``update_catalogue``: the caller holds the tier's lock (docs/design.md invariant
    10), so the swept blocks are also taken out of the catalogue's table of existing
    blocks; without it (a dry run beside a possible owner) the catalogue is only read.
    """
    cutoff = (time.time() if now is None else now) - grace_s
    blocks = list(store.iter_blocks())
    catalogue, rows = _clean_catalogue(catalogue_dir, writable=update_catalogue)
    try:
        marked = _mark(manifest_dir, rows, file_ops)
        # A newer kvtrio's manifest may name any unmarked block: then none is swept.
        doomed = [
            b for b in blocks if b.name not in marked.live and b.mtime < cutoff and not marked.newer
        ]
        young = sum(1 for b in blocks if b.name not in marked.live and b.mtime >= cutoff)
        if isinstance(store, LocalBlockStore):
            # Re-checks each block's mtime after moving it aside (see delete_stale): a
            # writer that freshened a block after the listing above keeps it.
            deleted, deleted_bytes = store.delete_stale([b.name for b in doomed], cutoff)
        else:
            deleted = store.delete_many([b.name for b in doomed]) if doomed else 0
            deleted_bytes = sum(b.size for b in doomed)
        if catalogue is not None and not catalogue.read_only and doomed:
            catalogue.delete_blocks(b.name for b in doomed)
    finally:
        if catalogue is not None:
            catalogue.close(clean=catalogue.was_clean)
    tmp_removed = _remove_old_tmp(manifest_dir, cutoff, file_ops)
    if isinstance(store, LocalBlockStore) and not not_a_real_directory(file_ops, store.directory):
        # A linked block directory is never traversed: its tmp-named files are not ours.
        tmp_removed += _remove_old_tmp(store.directory, cutoff, file_ops)
    return GcReport(
        manifests=marked.manifests,
        live_blocks=len(marked.live),
        deleted_blocks=deleted,
        deleted_bytes=deleted_bytes,
        young_unreferenced=young,
        tmp_removed=tmp_removed,
        unreadable=tuple(marked.unreadable),
        foreign=tuple(marked.foreign),
        catalogued=marked.catalogued,
        newer=tuple(marked.newer),
    )


@attrs.define
class _Marked:
    live: set[str] = attrs.field(factory=set)
    manifests: int = 0
    catalogued: int = 0
    unreadable: list[str] = attrs.field(factory=list)
    foreign: list[str] = attrs.field(factory=list)
    newer: list[str] = attrs.field(factory=list)


def _clean_catalogue(
    directory: str | None, *, writable: bool
) -> tuple[Catalogue | None, dict[str, tuple[int, int, bytes]]]:
    """The catalogue of ``directory`` and its block lists by key, when it was closed
    cleanly; (None, {}) when there is none or it is unusable (the manifests are read)."""
    if directory is None:
        return None, {}
    try:
        if writable:
            if not os.path.isfile(os.path.join(directory, CATALOGUE_NAME)):
                return None, {}
            catalogue: Catalogue | None = Catalogue.open(directory)
        else:
            catalogue = Catalogue.open_read_only(directory)
    except CorruptCacheError:
        return None, {}
    if catalogue is None:
        return None, {}
    try:
        if not catalogue.was_clean:
            return catalogue, {}
        return catalogue, {
            key: (size, mtime_ns, names)
            for key, size, mtime_ns, names in catalogue.manifest_blocks()
        }
    except CorruptCacheError:
        catalogue.close(clean=False)
        return None, {}


def _mark(
    manifest_dir: str, rows: dict[str, tuple[int, int, bytes]], file_ops: FileOps
) -> _Marked:
    """Step 2: every block a manifest names, from its catalogue row (the same size and
    mtime: a manifest rewritten since, even to the same size, is read) or read."""
    marked = _Marked()
    for path, size, mtime_ns in _listed_files(manifest_dir, file_ops):
        name = os.path.basename(path)
        row = rows.get(name[: -len(_SUFFIX)]) if name.endswith(_SUFFIX) else None
        if row is not None and row[0] == size and row[1] == mtime_ns:
            marked.manifests += 1
            marked.catalogued += 1
            hexed = row[2].hex()
            marked.live.update(hexed[i : i + 64] for i in range(0, len(hexed), 64))
            continue
        try:
            header = read_header(path, file_ops=file_ops).header
        except FileNotFoundError:  # deleted since the listing: it references nothing now
            continue
        except NewerFormatError:  # a newer kvtrio's: its blocks cannot be known here
            marked.newer.append(path)
            continue
        except CorruptCacheError:
            (marked.unreadable if is_kvtrio_file(path, file_ops) else marked.foreign).append(path)
            continue
        # Any other OSError (EIO, EMFILE, ...) propagates: a manifest that could not be
        # read may still reference blocks, so this pass must delete nothing.
        if header.layout != "blocks":
            continue
        marked.manifests += 1
        for slot in header.slots():
            marked.live.update(ref.sha256 for ref in slot.blocks or ())
    return marked


def _verify_file(path: str, store: BlockStore | None, file_ops: FileOps) -> list[str]:
    """Recheck one cache file's tensor hashes, or list the blocks its manifest names that
    ``store`` lacks (raises CorruptCacheError, CacheMissError, OSError)."""
    cache_file = read_header(path, file_ops=file_ops)
    header = cache_file.header
    if header.layout == "single":
        bufs = allocate_buffers(header)
        views = [[memoryview(b) for b in pieces] for pieces in bufs]
        read_tensors(cache_file, views, verify=True, file_ops=file_ops)
        return []
    if store is None:
        return []
    refs = [r.sha256 for s in header.slots() for r in s.blocks or ()]
    present = store.has_many(refs)
    return [r for r, ok in zip(refs, present, strict=True) if not ok]


def _exists(path: str, file_ops: FileOps) -> bool:
    try:
        file_ops.stat(path)
    except FileNotFoundError:
        return False
    return True


def verify_tree(
    manifest_dir: str,
    store: BlockStore | None = None,
    *,
    file_ops: FileOps = OS_FILE_OPS,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Recheck every cache file (all tensor hashes), every manifest and every stored block.

    Files and blocks are listed first, so ``progress(done, total)``, when given, is called
    with the full ``total`` (files + blocks) from the start: once with ``done=0``, then after
    each file and each block is checked, ending at ``done == total``.
    """
    paths = list_cache_files(manifest_dir, file_ops=file_ops)
    blocks = list(store.iter_blocks()) if store is not None else []
    total = len(paths) + len(blocks)
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    files_ok = 0
    bad_files: list[tuple[str, str]] = []
    foreign: list[str] = []
    missing: list[tuple[str, str]] = []
    for path in paths:
        try:
            absent = _verify_file(path, store, file_ops)
        except FileNotFoundError:  # removed since the listing: a live owner evicted it
            step()
            continue
        except (CorruptCacheError, CacheMissError, OSError) as exc:
            if is_kvtrio_file(path, file_ops):
                bad_files.append((path, str(exc)))
            else:
                foreign.append(path)
            step()
            continue
        if absent and not _exists(path, file_ops):
            # Evicted while checked: a tier removes the manifest, then the blocks only
            # it named, so blocks missing after the manifest went are no finding.
            step()
            continue
        missing.extend((path, r) for r in absent)
        files_ok += 1
        step()
    blocks_ok = 0
    bad_blocks: list[tuple[str, str]] = []
    if store is not None:
        for info in blocks:
            buffer = bytearray(info.size)
            try:
                if read_block_verified(store, info.name, memoryview(buffer)):
                    blocks_ok += 1
            except (CorruptCacheError, OSError) as exc:
                bad_blocks.append((info.name, str(exc)))
            step()
    return VerifyReport(
        files_ok=files_ok,
        blocks_ok=blocks_ok,
        bad_files=tuple(bad_files),
        bad_blocks=tuple(bad_blocks),
        missing_blocks=tuple(missing),
        foreign_files=tuple(foreign),
    )
