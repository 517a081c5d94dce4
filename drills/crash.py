"""The crash matrix: kill -9 at random points of save, publish, block writes and GC.

Theory of operation
-------------------
The drill process forks one child per crash point (fork is ~1 ms and the child needs no
MLX: it writes synthetic caches through the storage writer cores, see
:mod:`kvtrio.drills.workload`). The child loops: save an entry, delete an old one, run GC.
Before each step it tells the parent on a pipe what it is about to do ("s spec",
"d name") and, after the step returned (the durable acknowledgement), that it is done
("S spec", "D name"). The child dies by SIGKILL in one of three ways:

- ``op``: a hook on the injectable file operations kills it just before the Nth
  operation (N random), so every open, write, fsync, rename, fsync_dir, unlink and
  listdir site of every path gets hit; the child names the site on the pipe first;
- ``timed``: the parent kills it after a random delay (anywhere, mid-syscall included);
- ``lossy``: like ``op``, but first :class:`~kvtrio.drills.fileops.LossyFileOps` undoes,
  on disk, everything not yet fsynced (simulated power loss).

After each crash the parent reopens the directory and checks:

1. zero torn files under final names (every cache file verifies, every manifest parses,
   every block hashes to its name);
2. every acknowledged save (not acknowledged-deleted since) loads, verifies, and holds
   exactly its bytes; an unacknowledged one is either a clean miss or exactly its bytes;
3. dangling references are clean misses (the parent deletes a block a manifest names
   and requires CacheMissError, not a crash or a corrupt read);
4. debris is collected: after GC no tmp file remains (the loads of 2. run after GC, so
   GC deleting a block an acknowledged entry needs shows up as a loss).

The parent also evicts old entries so each check stays cheap (the directory holds at
most ``_MAX_LIVE`` entries).
"""

from __future__ import annotations

import importlib
import os
import random
import select
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import attrs
from kvtrio.drills.fileops import LossyFileOps, drill_dir, drill_file_ops
from kvtrio.drills.report import DrillResult, Tally
from kvtrio.drills.workload import (
    CacheDir,
    EntrySpec,
    expected_pieces,
    load_entry,
    scan_final_names,
    tmp_debris,
    write_entry,
)
from kvtrio.storage.fileops import FaultyFileOps, FileOps
from kvtrio.storage.format import Layout
from kvtrio.storage.manifeststore import LocalManifestStore

__all__ = ["collect_garbage", "run_crash_drill"]

LAYOUTS: tuple[Layout, ...] = ("single", "blocks")
MODES = ("op", "timed", "lossy")
_MAX_LIVE = 6
_CHILD_STEPS = 400


def collect_garbage(cache_dir: CacheDir, layout: Layout, *, grace: float) -> bool:
    """Run the storage layer's GC over ``cache_dir``; False when storage has no GC yet."""
    try:
        maintenance = importlib.import_module("kvtrio.storage.maintenance")
    except ImportError:
        return False
    directory = cache_dir.caches if layout == "single" else cache_dir.manifests
    # ``now`` a second ahead: with no writer running, debris made this very second counts.
    maintenance.collect_garbage(
        directory,
        cache_dir.block_store(),
        grace_s=grace,
        now=time.time() + 1.0,
        file_ops=cache_dir.file_ops,
    )
    return True


def delete_entry(cache_dir: CacheDir, name: str, layout: Layout) -> None:
    """Evict one entry durably (the manifest or cache file; GC takes orphaned blocks)."""
    if layout == "blocks":
        LocalManifestStore(cache_dir.manifests, file_ops=cache_dir.file_ops).delete(name)
        return
    try:
        cache_dir.file_ops.unlink(cache_dir.path_of(name, layout))
    except FileNotFoundError:
        return
    cache_dir.file_ops.fsync_dir(cache_dir.caches)


# --------------------------------------------------------------------------- the child


def _say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _child(
    cache_dir: CacheDir,
    layout: Layout,
    live: list[str],
    point: int,
    rng: random.Random,
    ops: FileOps,
    ack_fd: int,
) -> None:
    """The crash child's workload: runs until killed (or ``_CHILD_STEPS`` steps)."""
    cd = cache_dir.with_ops(ops)
    live = list(live)
    for step in range(_CHILD_STEPS):
        roll = rng.random()
        if roll < 0.6 or not live:
            spec = EntrySpec.random(f"p{point}s{step}", rng)
            _say(ack_fd, f"s {spec.encode()}")
            write_entry(cd, spec, layout)
            _say(ack_fd, f"S {spec.encode()}")
            live.append(spec.name)
        elif roll < 0.85:
            name = live.pop(rng.randrange(len(live)))
            _say(ack_fd, f"d {name}")
            delete_entry(cd, name, layout)
            _say(ack_fd, f"D {name}")
        else:
            _say(ack_fd, "g")
            collect_garbage(cd, layout, grace=0.0)
            _say(ack_fd, "G")


def _kill_hook(
    kill_at: int, ack_fd: int, before_kill: Callable[[], object]
) -> Callable[[str], None]:
    count = 0

    def hook(op: str) -> None:
        nonlocal count
        count += 1
        if count == kill_at:
            before_kill()
            _say(ack_fd, f"K {op}")
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


# --------------------------------------------------------------------------- the parent


@attrs.define
class _Book:
    """What the parent knows: acknowledged entries, and ones whose fate is open."""

    acked: dict[str, EntrySpec] = attrs.field(factory=dict)
    maybe: dict[str, EntrySpec] = attrs.field(factory=dict)  # save begun, or delete begun

    def apply(self, line: str, tally: Tally) -> None:
        kind, _, rest = line.partition(" ")
        if kind == "s":
            spec = EntrySpec.decode(rest)
            self.maybe[spec.name] = spec
        elif kind == "S":
            spec = EntrySpec.decode(rest)
            self.maybe.pop(spec.name, None)
            self.acked[spec.name] = spec
            tally.add("acknowledged saves")
        elif kind == "d":
            if rest in self.acked:
                self.maybe[rest] = self.acked.pop(rest)
        elif kind == "D":
            self.maybe.pop(rest, None)
            tally.add("acknowledged deletes")
        elif kind == "K":
            tally.add(f"crash site: {rest}")
        elif kind == "G":
            tally.add("acknowledged GC runs")


def _run_child(
    cache_dir: CacheDir,
    layout: Layout,
    book: _Book,
    point: int,
    mode: str,
    rng: random.Random,
    kill_after: float,
    ops_per_run: int,
) -> tuple[list[str], bool]:
    """Fork a crash child and collect its pipe; return its lines and whether it was killed."""
    child_seed = rng.getrandbits(64)
    kill_at = rng.randint(1, ops_per_run)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            os.close(read_fd)
            child_rng = random.Random(child_seed)
            ops: FileOps = cache_dir.file_ops
            before_kill: Callable[[], object] = lambda: None  # noqa: E731
            if mode == "lossy":
                lossy = LossyFileOps(
                    cache_dir.file_ops, os.path.join(cache_dir.root, "backup"), child_rng
                )
                ops, before_kill = lossy, lossy.lose_unsynced
            if mode in ("op", "lossy"):
                ops = FaultyFileOps(ops, _kill_hook(kill_at, write_fd, before_kill))
            _child(cache_dir, layout, sorted(book.acked), point, child_rng, ops, write_fd)
        except BaseException as exc:
            os.write(write_fd, f"E {type(exc).__name__}: {exc}\n".encode())
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + kill_after if mode == "timed" else None
    killed = False
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            deadline = None
            continue
        data = os.read(read_fd, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return b"".join(chunks).decode().splitlines(), killed


def _check_after_crash(
    cache_dir: CacheDir, layout: Layout, book: _Book, tally: Tally, rng: random.Random, where: str
) -> None:
    known = set(book.acked) | set(book.maybe)  # these get a full load below
    for path, why in list(scan_final_names(cache_dir, layout, skip=known)):
        tally.violation(f"{where}: torn file under a final name: {path}: {why}")
        os.unlink(path)  # reported once; later points start from a sound directory
    tally.add("final names checked", len(os.listdir(cache_dir.path_of("", layout))))
    _collect_debris(cache_dir, layout, tally, where)
    for name, spec in list(book.acked.items()):
        outcome = load_entry(cache_dir, name, layout)
        tally.add("acknowledged entries verified")
        if outcome.kind != "ok" or outcome.pieces != expected_pieces(spec, layout):
            tally.violation(f"{where}: acknowledged {name} lost: {outcome.kind} {outcome.error}")
            book.acked.pop(name)
    for name, spec in list(book.maybe.items()):
        outcome = load_entry(cache_dir, name, layout)
        if outcome.kind == "ok":
            if outcome.pieces != expected_pieces(spec, layout):
                tally.violation(f"{where}: unacknowledged {name} has wrong bytes")
            book.acked[name] = spec  # it is there and whole: keep checking it
        elif outcome.kind == "corrupt":
            tally.violation(f"{where}: unacknowledged {name} is torn: {outcome.error}")
            os.unlink(cache_dir.path_of(name, layout))
        tally.add("unacknowledged entries resolved")
    book.maybe.clear()
    if layout == "blocks" and book.acked and rng.random() < 0.25:
        _check_dangling(cache_dir, book, tally, rng, where)


def _check_dangling(
    cache_dir: CacheDir, book: _Book, tally: Tally, rng: random.Random, where: str
) -> None:
    """Delete one block an entry needs: its load must be a clean miss."""
    from kvtrio.storage.reader import read_header

    name = rng.choice(sorted(book.acked))
    header = read_header(cache_dir.path_of(name, "blocks")).header
    refs = [ref for slot in header.slots() for ref in slot.blocks or ()]
    victim = rng.choice(refs).sha256
    os.unlink(os.path.join(cache_dir.blocks, victim))
    tally.add("dangling references checked")
    for other in list(book.acked):
        outcome = load_entry(cache_dir, other, "blocks")
        if outcome.kind == "ok":
            continue
        if outcome.kind != "miss":
            tally.violation(f"{where}: dangling reference of {other} is not a clean miss")
        delete_entry(cache_dir, other, "blocks")
        book.acked.pop(other)


def _evict(cache_dir: CacheDir, layout: Layout, book: _Book, rng: random.Random) -> None:
    while len(book.acked) > _MAX_LIVE:
        name = rng.choice(sorted(book.acked))
        delete_entry(cache_dir, name, layout)
        book.acked.pop(name)


def _collect_debris(cache_dir: CacheDir, layout: Layout, tally: Tally, where: str) -> None:
    """GC after the crash (no writer running): no tmp debris may survive it."""
    debris = tmp_debris(cache_dir)
    tally.add("tmp debris files found", len(debris))
    if not collect_garbage(cache_dir, layout, grace=0.0):
        tally.set("gc", "storage has no GC yet: debris not collected")
        for path in debris:
            os.unlink(path)
        return
    tally.add("tmp debris files collected", len(debris))
    left = tmp_debris(cache_dir)
    if left:
        tally.violation(f"{where}: GC left tmp debris: {left[:3]}")


def _calibrate(cache_dir: CacheDir, layout: Layout) -> tuple[int, float]:
    """File operations and seconds of a few child steps, for choosing crash points."""
    counter = FaultyFileOps(cache_dir.file_ops, lambda op: None)
    rng = random.Random(0)
    start = time.perf_counter()
    cd = cache_dir.with_ops(counter)
    names: list[str] = []
    for step in range(4):
        spec = EntrySpec.random(f"cal{step}", rng)
        write_entry(cd, spec, layout)
        names.append(spec.name)
    delete_entry(cd, names[0], layout)
    collect_garbage(cd, layout, grace=0.0)
    for name in names[1:]:
        delete_entry(cd, name, layout)
    collect_garbage(cd, layout, grace=0.0)
    return sum(counter.calls.values()), time.perf_counter() - start


def run_crash_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """Run the crash matrix; ``full`` runs 2,000 crash points per layout instead of 210."""
    tally = Tally("crash")
    started = time.perf_counter()
    points = int(os.environ.get("KVTRIO_DRILL_POINTS", 0)) or (2000 if full else 210)
    with drill_dir(workdir, full=full) as where:
        for layout in LAYOUTS:
            _crash_layout(where, layout, points, full=full, seed=seed, tally=tally)
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)


def _crash_layout(
    workdir: Path, layout: Layout, points: int, *, full: bool, seed: int, tally: Tally
) -> None:
    root = workdir / layout
    shutil.rmtree(root, ignore_errors=True)
    cache_dir = CacheDir(str(root), drill_file_ops(full=full)).make()
    os.makedirs(root / "backup", exist_ok=True)
    ops_per_run, seconds_per_run = _calibrate(cache_dir, layout)
    book = _Book()
    rng = random.Random(f"{seed}/{layout}")
    for point in range(points):
        mode = MODES[point % len(MODES)]
        where = f"{layout} point {point} ({mode})"
        lines, killed = _run_child(
            cache_dir,
            layout,
            book,
            point,
            mode,
            rng,
            rng.uniform(0, seconds_per_run),
            ops_per_run,
        )
        for line in lines:
            if line.startswith("E "):
                tally.violation(f"{where}: the child failed: {line[2:]}")
            book.apply(line, tally)
        if not killed:
            tally.violation(f"{where}: the child was not killed")
            continue
        tally.add(f"crash points ({layout})")
        tally.add(f"crash points ({mode})")
        _check_after_crash(cache_dir, layout, book, tally, rng, where)
        _evict(cache_dir, layout, book, rng)
        shutil.rmtree(root / "backup")
        os.makedirs(root / "backup")
