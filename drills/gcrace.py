"""GC races: deterministic randomized interleavings of writers, a deleter and GC.

Theory of operation
-------------------
Each interleaving starts from the same directory: a live manifest ``keep``, and the
blocks of a deleted entry left as orphans whose mtime is far past the grace period
(exactly what GC is for). Then real threads run the storage layer's own code:

- writer A saves an entry whose blocks are exactly those orphans (the dedup path: the
  blocks exist, so ``put_many`` only freshens them);
- writer B saves an entry sharing a prefix with ``keep``, and then deletes ``keep``;
- a GC pass (:func:`kvtrio.storage.maintenance.collect_garbage`, a grace period of an
  hour); in every other interleaving a second GC pass runs too, as a tier's own GC and
  ``kvtrio gc`` from cron might.

A :class:`Turnstile` lets exactly one of them run at a time: every file operation is a
yield point (through :class:`~kvtrio.storage.fileops.FaultyFileOps`), where a seeded
random choice picks who runs next, so each seed is one exact, replayable interleaving.
fsync is skipped (ordering, not durability, is under test), which makes an interleaving
cost about a millisecond.

After each interleaving: every manifest present names only blocks that exist (zero
referenced blocks deleted), every save that returned has its manifest, and no thread
raised. A violation names its seed; ``--seed`` replays it.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
from kvtrio.drills.crash import delete_entry
from kvtrio.drills.fileops import NoSyncFileOps, drill_dir
from kvtrio.drills.report import DrillResult, Tally
from kvtrio.drills.workload import CacheDir, EntrySpec, write_entry
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps, FileOps
from kvtrio.storage.reader import read_header

__all__ = ["Turnstile", "run_gcrace_drill"]

_GRACE = 3600.0
_OLD = 10 * _GRACE  # how far back the orphans' mtimes are set


@attrs.define(eq=False)
class Turnstile:
    """Runs jobs on its threads one at a time; at each ``point`` a seeded choice says who
    runs next (the caller itself included), so an interleaving is a function of the seed.

    Hand-offs are direct: each thread waits on its own gate (a lock used as a binary
    semaphore), and whoever yields opens exactly the next thread's gate. The threads live
    across rounds (``run`` calls), since starting threads costs more than a round.
    Use as a context manager; ``close`` ends the threads.
    """

    threads: int
    switch_p: float = 0.5
    rng: random.Random = attrs.field(factory=random.Random)
    switches: int = 0
    points: int = 0
    _gates: list[threading.Lock] = attrs.field(factory=list)
    _index: dict[int, int] = attrs.field(factory=dict)
    _alive: list[int] = attrs.field(factory=list)
    _jobs: list[Callable[[], None]] | None = None
    _errors: list[BaseException | None] = attrs.field(factory=list)
    _finished: threading.Lock = attrs.field(factory=threading.Lock)
    _workers: list[threading.Thread] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self._gates = [threading.Lock() for _ in range(self.threads)]
        for gate in self._gates:
            gate.acquire()
        self._finished.acquire()
        self._workers = [
            threading.Thread(target=self._worker, args=(i,), daemon=True)
            for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    def __enter__(self) -> Turnstile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._jobs = None
        for gate in self._gates:
            gate.release()
        for worker in self._workers:
            worker.join()

    def run(self, jobs: list[Callable[[], None]], rng: random.Random) -> list[BaseException | None]:
        """Run ``jobs`` (one per thread) interleaved by ``rng``; return each one's exception."""
        if len(jobs) != self.threads:
            raise ValueError(f"{len(jobs)} jobs for {self.threads} threads")
        self.rng = rng
        self._jobs = jobs
        self._errors = [None] * len(jobs)
        self._alive = list(range(len(jobs)))
        self._gates[self.rng.choice(self._alive)].release()
        self._finished.acquire()
        return self._errors

    def _worker(self, i: int) -> None:
        self._index[threading.get_ident()] = i
        while True:
            self._gates[i].acquire()
            jobs = self._jobs
            if jobs is None:
                return
            try:
                jobs[i]()
            except BaseException as exc:
                self._errors[i] = exc
            self._alive.remove(i)
            if self._alive:
                self._gates[self.rng.choice(self._alive)].release()
            else:
                self._finished.release()

    def point(self, op: str) -> None:
        """A yield point (the FileOps hook); threads the turnstile does not run pass through."""
        me = self._index.get(threading.get_ident())
        if me is None:
            return
        self.points += 1
        if self.rng.random() >= self.switch_p:
            return
        nxt = self.rng.choice(self._alive)
        if nxt == me:
            return
        self.switches += 1
        self._gates[nxt].release()
        self._gates[me].acquire()


KEEP = EntrySpec("keep", 0, 8)
ORPHAN = EntrySpec("orphan", 1, 8)
WRITER_A = EntrySpec("a", 1, 8)  # exactly the orphans' blocks
WRITER_B = EntrySpec("b", 0, 16)  # keep's blocks plus one more token block each


def _template(root: Path, ops: FileOps) -> None:
    cache_dir = CacheDir(str(root), ops).make()
    write_entry(cache_dir, KEEP, "blocks")
    write_entry(cache_dir, ORPHAN, "blocks")
    orphan_blocks = {
        ref.sha256
        for slot in read_header(cache_dir.path_of("orphan", "blocks")).header.slots()
        for ref in slot.blocks or ()
    }
    delete_entry(cache_dir, "orphan", "blocks")
    old = time.time() - _OLD
    for name in orphan_blocks:
        os.utime(os.path.join(cache_dir.blocks, name), (old, old))


def _interleaving(
    turnstile: Turnstile, template: Path, root: Path, seed: int, tally: Tally
) -> None:
    from kvtrio.storage.maintenance import collect_garbage

    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)  # copy2: the orphans keep their old mtimes
    ops = FaultyFileOps(NoSyncFileOps(), turnstile.point)
    cache_dir = CacheDir(str(root), ops)
    acked: list[EntrySpec] = []

    def writer_a() -> None:
        write_entry(cache_dir, WRITER_A, "blocks")
        acked.append(WRITER_A)

    def writer_b() -> None:
        write_entry(cache_dir, WRITER_B, "blocks")
        acked.append(WRITER_B)
        delete_entry(cache_dir, KEEP.name, "blocks")

    def gc() -> None:
        collect_garbage(cache_dir.manifests, cache_dir.block_store(), grace_s=_GRACE, file_ops=ops)

    def idle() -> None:
        return None

    two_gcs = seed % 2 == 1
    jobs = [writer_a, writer_b, gc, gc if two_gcs else idle]
    errors = turnstile.run(jobs, random.Random(seed))
    tally.add("interleavings")
    tally.add("interleavings with two GCs", int(two_gcs))
    for name, error in zip(("writer A", "writer B", "GC 1", "GC 2"), errors, strict=True):
        if error is not None:
            tally.violation(f"seed {seed}: {name} raised {type(error).__name__}: {error}")
    _check(CacheDir(str(root), OS_FILE_OPS), acked, seed, tally)


def _check(cache_dir: CacheDir, acked: list[EntrySpec], seed: int, tally: Tally) -> None:
    store = cache_dir.block_store()
    for name in sorted(os.listdir(cache_dir.manifests)):
        if name.startswith("."):
            continue
        header = read_header(cache_dir.path_of(name, "blocks")).header
        refs = [ref.sha256 for slot in header.slots() for ref in slot.blocks or ()]
        missing = [r for r, ok in zip(refs, store.has_many(refs), strict=True) if not ok]
        tally.add("references checked", len(refs))
        if missing:
            tally.add("referenced blocks deleted", len(missing))
            tally.violation(f"seed {seed}: manifest {name} names {len(missing)} deleted block(s)")
    for spec in acked:  # its blocks were checked above, if its manifest is there
        if not os.path.exists(cache_dir.path_of(spec.name, "blocks")):
            tally.violation(f"seed {seed}: acknowledged save {spec.name} has no manifest")


def run_gcrace_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """10,000 interleavings (100,000 with ``full``), seeds ``seed*10**6`` onwards."""
    tally = Tally("gcrace")
    tally.set("referenced blocks deleted", 0)
    started = time.perf_counter()
    count = int(os.environ.get("KVTRIO_DRILL_INTERLEAVINGS", 0)) or (100_000 if full else 10_000)
    # tmpfs when there is one: an interleaving makes and removes ~20 files.
    with drill_dir(workdir, full=full) as tmp:
        template = Path(tmp) / "template"
        _template(template, NoSyncFileOps())
        with Turnstile(4) as turnstile:
            for i in range(count):
                _interleaving(turnstile, template, Path(tmp) / "run", seed * 10**6 + i, tally)
            tally.set("yield points", turnstile.points)
            tally.set("thread switches", turnstile.switches)
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)
