"""Everything under a tier's root is reached through its directory descriptor: docs/design.md
invariant 18 (issue 15, item 3; ``kvtrio.storage.rootfd``'s rules, ColdTier's rule 7).

The race these guard against: a directory under the root is a real directory whenever
kvtrio checks it (``lstat``) and a link to another program's files whenever kvtrio acts
on it. Path-based operations then list, rename and delete outside the root; operations
walked from the root's descriptor with O_NOFOLLOW refuse the link (ELOOP) instead. Each
race test runs the same adversary against the plain path-based operations first, to show
that it bites.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps, FileOps, OsFileOps
from kvtrio.storage.maintenance import collect_garbage
from kvtrio.storage.rootfd import NotRegularFileError, OutsideRootError, RootedFileOps

OLD = time.time() - 10 * 86400


class SwappingOps(OsFileOps):
    """The adversary: ``<root>/<name>`` is the real directory whenever kvtrio lstats it
    (the check), and a link to ``outside`` whenever kvtrio does anything else (opens,
    lists, renames, unlinks, or lstats a name inside it)."""

    def __init__(self, root: Path, name: str, outside: Path) -> None:
        self.place = root / name
        self.real = root / f"{name}.real"
        self.outside = outside
        self.swaps = 0

    def as_real(self) -> None:
        if self.place.is_symlink():
            self.place.unlink()
            self.real.rename(self.place)

    def as_link(self) -> None:
        if not self.place.is_symlink():
            self.place.rename(self.real)
            self.place.symlink_to(self.outside)
            self.swaps += 1

    def stat(self, path: str, *, dir_fd: int | None = None) -> os.stat_result:
        checked = path == self.place.name if dir_fd is not None else path == str(self.place)
        self.as_real() if checked else self.as_link()
        return super().stat(path, dir_fd=dir_fd)

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        self.as_link()
        return super().open(path, flags, mode, dir_fd=dir_fd)

    def open_dir(self, path: str, *, dir_fd: int | None = None) -> int:
        self.as_link()
        return super().open_dir(path, dir_fd=dir_fd)

    def listdir(self, directory: str | int) -> list[str]:
        self.as_link()
        return super().listdir(directory)

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        self.as_link()
        super().rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        self.as_link()
        super().unlink(path, dir_fd=dir_fd)


def _hex(i: int) -> str:
    return f"{i:064x}"


def _sentinel_dir(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Another program's directory of 64-hex-named files (a blob cache), all older than
    any grace period: a sweep that followed a link there would delete every one."""
    outside = tmp_path / "hf-blobs"
    outside.mkdir()
    files = {_hex(1000 + i): f"weights {i}".encode() for i in range(3)}
    for name, data in files.items():
        (outside / name).write_bytes(data)
        os.utime(outside / name, (OLD, OLD))
    return outside, files


def _tier_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tier"
    (root / "caches").mkdir(parents=True)
    (root / "blocks").mkdir()
    orphan = root / "blocks" / _hex(7)
    orphan.write_bytes(b"an orphan block")
    os.utime(orphan, (OLD, OLD))
    return root


def _intact(outside: Path, files: dict[str, bytes]) -> bool:
    return {p.name: p.read_bytes() for p in outside.iterdir()} == files


def _gc(root: Path, ops: FileOps) -> None:
    store = LocalBlockStore(str(root / "blocks"), ops)
    collect_garbage(str(root / "caches"), store, grace_s=60, file_ops=ops)


def test_the_swapping_adversary_makes_path_based_removal_delete_files_outside(
    tmp_path: Path,
) -> None:
    """The control: the adversary bites plain paths. Removing stale blocks by path (the
    names a sweep listed, or a catalogue holds) passes the directory check, then renames
    and unlinks through the link: the sentinels outside are deleted."""
    outside, files = _sentinel_dir(tmp_path)
    root = _tier_tree(tmp_path)
    store = LocalBlockStore(str(root / "blocks"), SwappingOps(root, "blocks", outside))
    assert store.delete_stale(list(files), time.time())[0] == len(files)
    assert not _intact(outside, files)


def test_removal_through_the_root_descriptor_never_follows_the_swapped_in_link(
    tmp_path: Path,
) -> None:
    outside, files = _sentinel_dir(tmp_path)
    root = _tier_tree(tmp_path)
    with RootedFileOps.at(root, SwappingOps(root, "blocks", outside)) as ops:
        store = LocalBlockStore(str(root / "blocks"), ops)
        with pytest.raises(OSError) as caught:
            store.delete_stale(list(files), time.time())
    assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert _intact(outside, files)


def test_gc_through_the_root_descriptor_never_touches_a_swapped_in_link(tmp_path: Path) -> None:
    """A ``blocks/`` swapped for a link between gc's check and its listing or removal: the
    walk from the root's descriptor meets the link and stops (ELOOP); every sentinel file
    outside the root survives, byte for byte."""
    outside, files = _sentinel_dir(tmp_path)
    root = _tier_tree(tmp_path)
    adversary = SwappingOps(root, "blocks", outside)
    with RootedFileOps.at(root, adversary) as ops, pytest.raises(OSError) as caught:
        _gc(root, ops)
    # ELOOP, or ENOTDIR where the adversary turned it back before the link was told apart.
    assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert adversary.swaps >= 1
    assert _intact(outside, files)


def test_a_swap_after_the_walk_acts_on_the_tiers_own_directory(tmp_path: Path) -> None:
    """Swapped after ``blocks/`` was first walked (just before the rename): its kept
    descriptor is the tier's own directory, so the removal finishes there, wherever that
    directory was moved, and never reaches through the link; the name, now a link, is
    refused from then on (the store's own check)."""
    outside, files = _sentinel_dir(tmp_path)
    root = _tier_tree(tmp_path)
    swap = SwappingOps(root, "blocks", outside)

    def hook(op: str) -> None:
        if op == "rename":
            swap.as_link()

    with RootedFileOps.at(root, FaultyFileOps(OS_FILE_OPS, hook)) as ops:
        store = LocalBlockStore(str(root / "blocks"), ops)
        assert store.delete_stale([_hex(7)], time.time())[0] == 1
        assert store.delete_stale(list(files), time.time()) == (0, 0)  # now a link
        assert list(store.iter_blocks()) == []
    assert _intact(outside, files)
    assert os.listdir(root / "blocks.real") == []  # removed from the tier's own directory


def test_paths_outside_the_root_are_refused_before_anything_is_touched(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    calls: list[str] = []
    with RootedFileOps.at(root, FaultyFileOps(OS_FILE_OPS, calls.append)) as ops:
        for path in (str(victim), str(root / ".." / "victim"), "/etc/hostname"):
            with pytest.raises(OutsideRootError):
                ops.unlink(path)
            with pytest.raises(OutsideRootError):
                ops.open(path, os.O_RDONLY)
    assert calls == ["open_dir"]  # only the root's own open
    assert victim.exists()


def test_a_fifo_or_a_directory_under_the_root_opens_to_a_typed_refusal(tmp_path: Path) -> None:
    """O_NONBLOCK + fstat S_ISREG: a FIFO is refused at once (no writer needed, no hang)."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    with RootedFileOps.at(root, OS_FILE_OPS) as ops:
        for name in ("fifo", "dir"):
            with pytest.raises(NotRegularFileError):
                ops.open(str(root / name), os.O_RDONLY)


def test_a_link_or_file_on_the_way_is_never_traversed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"x")
    (root / "link").symlink_to(outside)
    (root / "file").write_bytes(b"")
    with RootedFileOps.at(root, OS_FILE_OPS) as ops:
        with pytest.raises(OSError) as caught:
            ops.open(str(root / "link" / "f"), os.O_RDONLY)
        assert caught.value.errno == errno.ELOOP
        with pytest.raises(OSError) as caught:
            ops.listdir(str(root / "link"))
        assert caught.value.errno == errno.ELOOP
        with pytest.raises(OSError) as caught:
            ops.mkdir(str(root / "link" / "sub"))
        assert caught.value.errno == errno.ELOOP
        with pytest.raises(NotADirectoryError):
            ops.stat(str(root / "file" / "x"))
        assert ops.stat(str(root / "link")).st_mode & 0o170000 == 0o120000  # the link's own
        ops.unlink(str(root / "link"))  # the link itself, never its target
    assert (outside / "f").exists()


def test_the_rooted_operations_publish_durably_through_descriptors(tmp_path: Path) -> None:
    """mkdir, create, rename, fsync of the directory's descriptor, listing by descriptor."""
    from kvtrio.storage.writer import publish_bytes

    root = tmp_path / "root"
    root.mkdir()
    events: list[str] = []
    with RootedFileOps.at(root, FaultyFileOps(OS_FILE_OPS, events.append)) as ops:
        ops.mkdir(str(root / "a" / "b"))
        publish_bytes(str(root / "a" / "b" / "m"), b"manifest", file_ops=ops)
        assert ops.listdir(str(root / "a" / "b")) == ["m"]
    assert (root / "a" / "b" / "m").read_bytes() == b"manifest"
    assert events.count("fsync_dir") == 1 and "rename" in events


def test_a_linked_catalogue_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    """sqlite opens by path: a link under the catalogue's names is refused before the
    open (the tier then removes the names and rebuilds), and removal unlinks the link."""
    from kvtrio.errors import CorruptCacheError
    from kvtrio.storage.catalogue import CATALOGUE_NAME, Catalogue

    root = tmp_path / "tier"
    root.mkdir()
    target = tmp_path / "someone-elses.sqlite3"
    target.write_bytes(b"not yours")
    for suffix in ("", "-wal"):
        link = root / (CATALOGUE_NAME + suffix)
        link.symlink_to(target)
        with pytest.raises(CorruptCacheError, match=r"not a regular file$"):
            Catalogue.open(str(root))
        Catalogue.remove(str(root))
        assert not link.is_symlink()
    assert target.read_bytes() == b"not yours"
    Catalogue.open(str(root)).close()
