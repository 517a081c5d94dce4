"""Operator commands over cache files: ``kvtrio inspect``, ``kvtrio verify``, ``kvtrio gc``.

They work on what kvtrio writes: a single cache file or manifest (``inspect``), and a
directory that is either a cold tier's root (``caches/`` and ``blocks/`` inside) or a
directory of cache files with an optional ``blocks/`` beside them (``verify``, ``gc``).
The checking and collecting are the storage layer's routines
(:func:`~kvtrio.storage.maintenance.verify_tree`,
:func:`~kvtrio.storage.maintenance.collect_garbage`); these commands find the
directories, show progress and print the results as tables (or ``--json``).

``gc`` deletes, so it takes the directory's lock (:mod:`kvtrio.storage.dirlock`), the one
a running tier holds: beside a live owner it waits ``--wait`` seconds, then exits 3
naming the owner's pid; its grace period applies in every case. ``--dry-run`` deletes
nothing and takes no lock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
from kvtrio.errors import CacheMissError, CorruptCacheError, DirectoryLockedError
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.catalogue import CATALOGUE_NAME
from kvtrio.storage.dirlock import LOCK_NAME, DirectoryLock, holder_pid, try_lock
from kvtrio.storage.fileops import OS_FILE_OPS
from kvtrio.storage.format import CacheEntry, Header, TensorSlot
from kvtrio.storage.maintenance import (
    collect_garbage,
    is_kvtrio_file,
    list_cache_files,
    verify_tree,
)
from kvtrio.storage.reader import read_header
from kvtrio.storage.rootfd import RootedFileOps

__all__ = [
    "TreeLayout",
    "add_gc_arguments",
    "add_inspect_arguments",
    "add_tree_arguments",
    "find_tree",
    "header_json",
    "run_gc",
    "run_inspect",
    "run_verify",
]

T = TypeVar("T")


@attrs.frozen
class TreeLayout:
    """Where a directory keeps its cache files (or manifests) and its blocks."""

    manifest_dir: Path
    block_dir: Path | None


def find_tree(directory: Path) -> TreeLayout:
    """A cold tier root (``caches/`` inside) or a directory of cache files."""
    caches = directory / "caches"
    root = caches if caches.is_dir() else directory
    for blocks in (directory / "blocks", root / "blocks"):
        if blocks.is_dir():
            return TreeLayout(root, blocks)
    return TreeLayout(root, None)


@contextmanager
def _status(text: str, quiet: bool) -> Iterator[None]:
    if quiet:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
    ) as progress:
        progress.add_task(text, total=None)
        yield


@contextmanager
def _progress_bar(text: str, quiet: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich bar of ``done / total`` items; yields the ``progress(done, total)`` callback."""
    if quiet:
        yield lambda done, total: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(text, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# -- inspect -----------------------------------------------------------------------------


def _slot_json(slot: TensorSlot) -> dict[str, Any]:
    out: dict[str, Any] = {
        "shape": list(slot.shape),
        "dtype": slot.dtype,
        "bytes": slot.nbytes,
    }
    if slot.off is not None:
        out["offset"] = slot.off
    if slot.xxh3 is not None:
        out["xxh3"] = slot.xxh3
    if slot.blocks is not None:
        out["blocks"] = [{"sha256": b.sha256, "bytes": b.nbytes} for b in slot.blocks]
    return out


def _entry_json(entry: CacheEntry) -> dict[str, Any]:
    return {
        "kind": entry.kind,
        "offset": entry.offset,
        "min_reusable_offset": entry.min_reusable_offset,
        "trimmable": entry.trimmable,
        "fields": {k: v for k, v in entry.fields.items()},
        "tensors": [_slot_json(s) for s in entry.tensors],
        "children": [_entry_json(c) for c in entry.children],
    }


def header_json(header: Header) -> dict[str, Any]:
    """A header as plain JSON values (what ``kvtrio inspect --json`` prints)."""
    return {
        "format_version": header.format_version,
        "codec": header.codec,
        "layout": header.layout,
        "model_id": header.model_id,
        "config_fingerprint": header.config_fingerprint,
        "created_at": header.created_at,
        "tokens": len(header.tokens),
        "block_tokens": header.block_tokens,
        "trimmable": header.trimmable,
        "min_reusable_offset": header.min_reusable_offset,
        "tensor_bytes": header.nbytes,
        "meta": dict(header.meta),
        "caches": [_entry_json(e) for e in header.caches],
        "attachments": [
            {
                "schema": a.schema,
                "metadata": dict(a.metadata),
                "tensors": [_slot_json(s) for s in a.tensors],
            }
            for a in header.attachments
        ],
    }


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def _print_header(path: str, header: Header, file_size: int, tokens: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    summary = Table(title=path, show_header=False)
    summary.add_column("field")
    summary.add_column("value")
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(header.created_at))
    for name, value in (
        ("format version", str(header.format_version)),
        ("codec", header.codec),
        (
            "layout",
            header.layout
            + (f" ({header.block_tokens} tokens a block)" if header.block_tokens else ""),
        ),
        ("model id", header.model_id or "-"),
        ("config fingerprint", header.config_fingerprint or "-"),
        ("created", created),
        ("tokens", f"{len(header.tokens):,}"),
        ("trimmable", "yes" if header.trimmable else "no"),
        ("minimum reusable offset", str(header.min_reusable_offset)),
        ("tensor bytes", _fmt_bytes(header.nbytes)),
        ("file bytes", _fmt_bytes(file_size)),
        *((f"meta {k}", v) for k, v in sorted(header.meta.items())),
    ):
        summary.add_row(name, value)
    console.print(summary)
    if tokens:
        console.print(f"tokens: {list(header.tokens)}")

    layers = Table(title="layers")
    for column in ("#", "kind", "offset", "min reusable", "trimmable", "fields", "tensors"):
        layers.add_column(column)

    def add(entry: CacheEntry, label: str) -> None:
        fields = ", ".join(f"{k}={v}" for k, v in entry.fields.items())
        layers.add_row(
            label,
            entry.kind,
            str(entry.offset),
            str(entry.min_reusable_offset),
            "yes" if entry.trimmable else "no",
            fields,
            str(len(entry.tensors)),
        )
        for k, child in enumerate(entry.children):
            add(child, f"{label}.{k}")

    for i, entry in enumerate(header.caches):
        add(entry, str(i))
    console.print(layers)

    tensors = Table(title="tensors")
    for column in ("slot", "shape", "dtype", "bytes", "where", "hash"):
        tensors.add_column(column)
    for index, slot in enumerate(header.slots()):
        if slot.blocks is not None:
            where = f"{len(slot.blocks)} blocks"
            digest = slot.blocks[0].sha256[:16] + "..." if slot.blocks else "-"
        else:
            where = f"@{slot.off}"
            digest = slot.xxh3 or "-"
        tensors.add_row(
            str(index), str(tuple(slot.shape)), slot.dtype, _fmt_bytes(slot.nbytes), where, digest
        )
    console.print(tensors)

    if header.attachments:
        attached = Table(title="attachments")
        for column in ("schema", "metadata", "tensors"):
            attached.add_column(column)
        for a in header.attachments:
            meta = ", ".join(f"{k}={v}" for k, v in sorted(a.metadata.items()))
            attached.add_row(a.schema, meta, str(len(a.tensors)))
        console.print(attached)


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="a cache file or manifest (.kvc)")
    parser.add_argument("--json", action="store_true", help="print the header as JSON")
    parser.add_argument("--tokens", action="store_true", help="also print the token ids")


def run_inspect(args: argparse.Namespace) -> int:
    try:
        cache_file = read_header(str(args.file))
    except CorruptCacheError as exc:  # a finding, as verify's: exit 1
        print(f"kvtrio inspect: {args.file}: {exc}", file=sys.stderr)
        return 1
    except CacheMissError as exc:  # nothing to inspect: a usage error; it names the path
        print(f"kvtrio inspect: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtrio inspect: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    header = cache_file.header
    if args.json:
        body = header_json(header) | {"path": str(args.file), "file_bytes": cache_file.file_size}
        if args.tokens:
            body["token_ids"] = list(header.tokens)
        print(json.dumps(body, indent=2))
    else:
        _print_header(str(args.file), header, cache_file.file_size, args.tokens)
    return 0


# -- verify ------------------------------------------------------------------------------


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        type=Path,
        help="a cold tier's root (caches/ and blocks/ inside) or a directory of cache files",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _holds_kvtrio(tree: TreeLayout, directory: Path) -> bool:
    """Whether ``directory`` is a tier (``caches/`` or ``blocks/`` in it) or holds at least
    one kvtrio file (its magic: damaged ones count, foreign files do not)."""
    if tree.manifest_dir != directory or tree.block_dir is not None:
        return True
    return any(is_kvtrio_file(p) for p in list_cache_files(str(tree.manifest_dir)))


def _no_tier_here(directory: Path) -> str:
    """One line: ``directory`` holds no kvtrio file, and where one may be instead."""
    try:
        subdirs = sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        subdirs = []
    tiers = [p for p in subdirs if (p / "caches").is_dir()]
    hint = f" (a cold tier is at {tiers[0]}: try that)" if tiers else ""
    return f"{directory}: holds no kvtrio tier or cache files{hint}"


def run_verify(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        print(f"kvtrio verify: {args.directory}: not a directory", file=sys.stderr)
        return 2
    tree = find_tree(args.directory)
    if not _holds_kvtrio(tree, args.directory):  # refused before a progress bar is drawn
        print(f"kvtrio verify: {_no_tier_here(args.directory)}", file=sys.stderr)
        return 2
    with RootedFileOps.at(_tree_root(tree), OS_FILE_OPS) as ops:
        store = LocalBlockStore(str(tree.block_dir), ops) if tree.block_dir else None
        with _progress_bar(f"verifying {tree.manifest_dir}", args.json) as progress:
            report, elapsed = _timed(
                lambda: verify_tree(str(tree.manifest_dir), store, progress=progress, file_ops=ops)
            )
    if args.json:
        print(json.dumps(attrs.asdict(report) | {"ok": report.ok, "seconds": elapsed}, indent=2))
        return 0 if report.ok else 1
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"kvtrio verify {args.directory}", show_header=False)
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("cache files and manifests ok", str(report.files_ok))
    table.add_row("blocks ok", str(report.blocks_ok))
    table.add_row("bad files", str(len(report.bad_files)))
    table.add_row("bad blocks", str(len(report.bad_blocks)))
    table.add_row("missing blocks", str(len(report.missing_blocks)))
    table.add_row("not kvtrio's (not checked)", str(len(report.foreign_files)))
    table.add_row("seconds", f"{elapsed:.2f}")
    console.print(table)
    for path, error in report.bad_files:
        console.print(f"[red]BAD FILE[/] {path}: {error}", soft_wrap=True)
    for name, error in report.bad_blocks:
        where = tree.block_dir / name if tree.block_dir else name
        console.print(f"[red]BAD BLOCK[/] {where}: {error}", soft_wrap=True)
    for path, name in report.missing_blocks:
        console.print(f"[red]MISSING BLOCK[/] {name} named by {path}", soft_wrap=True)
    for path in report.foreign_files:
        console.print(f"[dim]not kvtrio's[/] {path}", soft_wrap=True)
    console.print("[green]all good[/]" if report.ok else "[red]corruption found[/]")
    return 0 if report.ok else 1


# -- gc ----------------------------------------------------------------------------------


def _tree_root(tree: Any) -> str:
    """The directory whose descriptor gc and verify reach the tree's files through
    (:mod:`kvtrio.storage.rootfd`): the one holding its manifests and blocks."""
    dirs = [str(tree.manifest_dir)] + ([str(tree.block_dir)] if tree.block_dir else [])
    return os.path.commonpath([os.path.abspath(d) for d in dirs])


@attrs.define(eq=False)
class _DryRunFileOps(RootedFileOps):
    """Reads as usual; simulates renames and unlinks, recording what would be deleted.

    GC may move a block aside before deleting it (to re-check its mtime there); here the
    move is only remembered, so later calls on the new name reach the real file.
    """

    would_delete: list[str] = attrs.field(factory=list)
    _moved: dict[str, str] = attrs.field(factory=dict)  # simulated name -> the real path

    def _real(self, path: str) -> str:
        real = self._moved.get(path, path)
        if real in self.would_delete:
            raise FileNotFoundError(path)
        super().stat(real)  # FileNotFoundError when absent
        return real

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        real = self._real(src)
        self._moved.pop(src, None)
        if dst != real:
            self._moved[dst] = real

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        if dir_fd is not None:  # a listing's own stat: nothing simulated there yet
            return super().stat(path, dir_fd=dir_fd)
        return super().stat(self._real(path))

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        real = self._real(path)
        self._moved.pop(path, None)
        self.would_delete.append(real)

    def fsync_dir(self, directory: str | int) -> None:
        return None


def add_gc_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_arguments(parser)
    parser.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="keep unreferenced blocks and tmp files younger than this (default 3600)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="report what would be deleted; delete nothing"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the process that owns the directory to close (default 0)",
    )


def _lock_root(directory: Path) -> Path:
    """The directory whose lock a tier at ``directory`` takes (its root, not caches/)."""
    if directory.name == "caches" and (directory.parent / LOCK_NAME).exists():
        return directory.parent
    return directory


def _take_lock(directory: Path, wait: float) -> DirectoryLock:
    """The tier's own lock (one owner per directory): GC deletes, so it runs alone."""
    deadline = time.monotonic() + wait
    while True:
        lock = try_lock(str(directory))
        if lock is not None:
            return lock
        if time.monotonic() >= deadline:
            raise DirectoryLockedError(str(directory), holder_pid(str(directory)), wait)
        time.sleep(0.05)


def run_gc(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        print(f"kvtrio gc: {args.directory}: not a directory", file=sys.stderr)
        return 2
    for flag, seconds in (("--grace", args.grace), ("--wait", args.wait)):
        if not seconds >= 0:  # NaN too
            print(f"kvtrio gc: {flag} must be >= 0", file=sys.stderr)
            return 2
    tree = find_tree(args.directory)
    if not _holds_kvtrio(tree, args.directory):  # before the lock: it leaves a lock file
        print(f"kvtrio gc: {_no_tier_here(args.directory)}", file=sys.stderr)
        return 2
    root = _tree_root(tree)
    ops = (_DryRunFileOps if args.dry_run else RootedFileOps).at(root, OS_FILE_OPS)
    block_dir = tree.block_dir or (tree.manifest_dir / "blocks")
    store = LocalBlockStore(str(block_dir), ops)
    try:
        lock = None if args.dry_run else _take_lock(_lock_root(args.directory), args.wait)
    except DirectoryLockedError as exc:
        print(f"kvtrio gc: {exc}", file=sys.stderr)
        return 3
    try:
        tier_root = _lock_root(args.directory)
        catalogue_dir = str(tier_root) if (tier_root / CATALOGUE_NAME).is_file() else None
        with _status(f"collecting garbage in {args.directory}", args.json):
            report, elapsed = _timed(
                lambda: collect_garbage(
                    str(tree.manifest_dir),
                    store,
                    grace_s=args.grace,
                    file_ops=ops,
                    catalogue_dir=catalogue_dir,
                    update_catalogue=lock is not None,
                )
            )
    finally:
        ops.close_root()
        if lock is not None:
            lock.release()
    if args.json:
        body = attrs.asdict(report) | {"dry_run": args.dry_run, "seconds": elapsed}
        if isinstance(ops, _DryRunFileOps):
            body["would_delete"] = ops.would_delete
        print(json.dumps(body, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    verb = "to delete (dry run)" if args.dry_run else "deleted"
    table = Table(title=f"kvtrio gc {args.directory} (grace {args.grace:g} s)", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("manifests", str(report.manifests))
    table.add_row("  of which the catalogue gave", str(report.catalogued))
    table.add_row("live blocks", str(report.live_blocks))
    table.add_row(f"blocks {verb}", str(report.deleted_blocks))
    table.add_row(f"bytes {verb}", _fmt_bytes(report.deleted_bytes))
    table.add_row("unreferenced, kept (younger than grace)", str(report.young_unreferenced))
    table.add_row(f"tmp files {verb}", str(report.tmp_removed))
    table.add_row("unreadable files", str(len(report.unreadable)))
    table.add_row("not kvtrio's (left alone)", str(len(report.foreign)))
    table.add_row("a newer kvtrio's (kept; no block swept)", str(len(report.newer)))
    table.add_row("seconds", f"{elapsed:.2f}")
    console.print(table)
    for path in report.unreadable:
        console.print(f"[yellow]unreadable[/] {path}", soft_wrap=True)
    for path in report.foreign:
        console.print(f"[dim]not kvtrio's[/] {path}", soft_wrap=True)
    for path in report.newer:
        console.print(f"[yellow]a newer kvtrio's format[/] {path}", soft_wrap=True)
    if isinstance(ops, _DryRunFileOps):
        for path in ops.would_delete:
            console.print(f"would delete {path}", soft_wrap=True)
    return 0
