"""Fault injection at every file-operation site of every save, load, delete and GC path.

Theory of operation
-------------------
For each path (save and load in both layouts, delete + GC) the drill first runs it once
through a counting :class:`~kvtrio.storage.fileops.FaultyFileOps` to learn how many times
each operation occurs, then runs it once per occurrence with a
:class:`~kvtrio.runtime.testing.FaultPlan` that fails exactly that call with ``EIO``.
After each run it checks:

1. the error is typed: the injected OSError or a KvtrioError, nothing else; a fault the
   path absorbed (a cleanup unlink) must leave a complete, verifying result;
2. a failed save leaves no final name (no cache file, no manifest) and no tmp file, and
   every block under a final name hashes to its name;
3. the directory keeps serving: an entry saved before still loads bit-exact, and a
   fresh save and load right after succeed.

The same is then done through the actors' :class:`~kvtrio.actors.tier.ColdTier` (real
mlx-lm caches, inline owner and I/O so it is deterministic): the ticket settles FAILED,
no final name, no tmp file, zero live snapshots (each was released), and the next save
is WRITTEN and loads bit-exact.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from kvtrio.drills.crash import collect_garbage, delete_entry
from kvtrio.drills.fileops import drill_dir, drill_file_ops
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
from kvtrio.errors import KvtrioError
from kvtrio.runtime.testing import FaultPlan
from kvtrio.storage.fileops import TMP_SUFFIX, FaultyFileOps, FileOps
from kvtrio.storage.format import Layout

__all__ = ["SITES", "run_faults_drill"]

#: The operations a fault is injected at (every hooked one the paths use).
SITES = ("open", "write", "fsync", "rename", "fsync_dir", "read", "unlink", "listdir", "mkdir")


@attrs.define
class _Switch:
    """A FileOps hook whose plan the drill swaps between runs."""

    plan: Callable[[str], None] = lambda op: None

    def __call__(self, op: str) -> None:
        self.plan(op)


def _typed(exc: BaseException) -> bool:
    return isinstance(exc, KvtrioError | OSError)


# --------------------------------------------------------------------------- storage level


@attrs.frozen
class _Path:
    name: str
    layout: Layout
    kind: str  # "save", "load", "gc"


PATHS = (
    _Path("save single", "single", "save"),
    _Path("save blocks", "blocks", "save"),
    _Path("load single", "single", "load"),
    _Path("load blocks", "blocks", "load"),
    _Path("delete+gc single", "single", "gc"),
    _Path("delete+gc blocks", "blocks", "gc"),
)


def _run_path(path: _Path, cache_dir: CacheDir, spec: EntrySpec) -> object:
    if path.kind == "save":
        return write_entry(cache_dir, spec, path.layout)
    if path.kind == "load":
        return load_entry(cache_dir, spec.name, path.layout)
    delete_entry(cache_dir, spec.name, path.layout)
    collect_garbage(cache_dir, path.layout, grace=0.0)
    return None


def _count(path: _Path, cache_dir: CacheDir, spec: EntrySpec) -> dict[str, int]:
    counter = FaultyFileOps(cache_dir.file_ops, lambda op: None)
    _run_path(path, cache_dir.with_ops(counter), spec)
    return dict(counter.calls)


def _storage_trial(
    path: _Path,
    cache_dir: CacheDir,
    base: EntrySpec,
    spec: EntrySpec,
    op: str,
    call: int,
    tally: Tally,
) -> None:
    where = f"{path.name}: {op} #{call}"
    plan = FaultPlan().fail(op, on_call=call, error=OSError(5, f"injected EIO at {op}"))
    faulty = cache_dir.with_ops(FaultyFileOps(cache_dir.file_ops, plan))
    tally.add(f"faults injected: {op}")
    tally.add("faults injected")
    final = cache_dir.path_of(spec.name, path.layout)
    try:
        outcome = _run_path(path, faulty, spec)
    except BaseException as exc:
        if not _typed(exc):
            tally.violation(f"{where}: untyped error {type(exc).__name__}: {exc}")
        tally.add("typed errors")
        if path.kind == "save" and os.path.lexists(final):
            tally.violation(f"{where}: a failed save left its final name {final}")
    else:
        tally.add("faults absorbed (result complete)")
        tally.add(f"absorbed: {path.name} {op}")
        if path.kind == "save" or path.kind == "load":
            got = load_entry(cache_dir, spec.name, path.layout) if path.kind == "save" else outcome
            assert got is None or hasattr(got, "kind")
            if getattr(got, "pieces", None) != expected_pieces(spec, path.layout):
                tally.violation(f"{where}: no error, but the result is not complete")
    debris = tmp_debris(cache_dir)
    if debris and path.kind != "gc":
        tally.violation(f"{where}: tmp file left behind: {debris[:2]}")
    for bad, why in scan_final_names(cache_dir, path.layout):
        tally.violation(f"{where}: torn file under a final name: {bad}: {why}")
    _keeps_serving(cache_dir, path.layout, base, where, tally)
    _reset(path, cache_dir, spec)


def _keeps_serving(
    cache_dir: CacheDir, layout: Layout, base: EntrySpec, where: str, tally: Tally
) -> None:
    outcome = load_entry(cache_dir, base.name, layout)
    if outcome.pieces != expected_pieces(base, layout):
        tally.violation(f"{where}: an earlier entry no longer loads: {outcome.error}")
    probe = EntrySpec("probe", 3, 20)
    write_entry(cache_dir, probe, layout)
    if load_entry(cache_dir, probe.name, layout).pieces != expected_pieces(probe, layout):
        tally.violation(f"{where}: the next save did not load back")
    delete_entry(cache_dir, probe.name, layout)


def _reset(path: _Path, cache_dir: CacheDir, spec: EntrySpec) -> None:
    """Put the directory back to its state before the trial (base entry, and the trial's
    own entry when the path needs one to exist)."""
    delete_entry(cache_dir, spec.name, path.layout)
    collect_garbage(cache_dir, path.layout, grace=0.0)
    if path.kind != "save":
        write_entry(cache_dir, spec, path.layout)


def _storage_level(workdir: Path, base_ops: FileOps, tally: Tally) -> None:
    for path in PATHS:
        root = workdir / path.name.replace(" ", "-").replace("+", "-")
        shutil.rmtree(root, ignore_errors=True)
        cache_dir = CacheDir(str(root), base_ops).make()
        base = EntrySpec("base", 1, 40)  # shares a prefix with ``spec``: dedup paths run
        spec = EntrySpec("victim", 1, 60)
        write_entry(cache_dir, base, path.layout)
        _reset(path, cache_dir, spec)
        counts = _count(path, cache_dir, spec)
        _reset(path, cache_dir, spec)
        for op in SITES:
            for call in range(1, counts.get(op, 0) + 1):
                _storage_trial(path, cache_dir, base, spec, op, call, tally)
        tally.add("paths covered")


# --------------------------------------------------------------------------- actors level


def _mlx_caches(n_tokens: int, seed: int) -> list[Any]:
    mx: Any = importlib.import_module("mlx.core")
    KVCache: Any = importlib.import_module("mlx_lm.models.cache").KVCache

    caches = []
    for layer in range(2):
        key = mx.random.key(seed * 10 + layer)
        k1, k2 = mx.random.split(key)
        cache = KVCache()
        cache.update_and_fetch(
            mx.random.normal((1, 2, n_tokens, 16), key=k1).astype(mx.float16),
            mx.random.normal((1, 2, n_tokens, 16), key=k2).astype(mx.float16),
        )
        caches.append(cache)
    return caches


def _kv_bytes(caches: list[Any]) -> list[bytes]:
    mx: Any = importlib.import_module("mlx.core")

    out = []
    for cache in caches:
        for array in (cache.keys, cache.values):
            live = mx.contiguous(array[..., : cache.offset, :])
            mx.eval(live)
            out.append(bytes(memoryview(live)))
    return out


def _tier_gc(cache_dir: Path, block_dir: Path) -> None:
    """Drop the blocks no manifest names, so the next save writes every block again."""
    from kvtrio.storage.blockstore import LocalBlockStore
    from kvtrio.storage.maintenance import collect_garbage as storage_gc

    storage_gc(str(cache_dir), LocalBlockStore(str(block_dir)), grace_s=0.0, now=time.time() + 1)


async def _tier_level_async(workdir: Path, base_ops: FileOps, tally: Tally) -> None:
    from kvtrio.actors.spill import SpillOutcome
    from kvtrio.actors.tier import ColdTier

    tokens = list(range(1, 41))
    caches = _mlx_caches(len(tokens), 1)
    want = _kv_bytes(caches)
    layouts: tuple[Layout, ...] = ("single", "blocks")
    for layout in layouts:
        root = workdir / f"tier-{layout}"
        shutil.rmtree(root, ignore_errors=True)
        switch = _Switch()
        ops: FileOps = FaultyFileOps(base_ops, switch)
        async with ColdTier.open(
            root, layout=layout, block_tokens=16, inline=True, file_ops=ops
        ) as tier:
            counter = FaultPlan()
            switch.plan = counter
            ticket = await tier.save("count", tokens, caches)
            if not (await ticket.wait()).written:
                tally.violation(f"tier {layout}: the counting save failed")
            switch.plan = lambda op: None
            await tier.delete("count")
            _tier_gc(tier.cache_dir, tier.block_dir)
            # mkdir runs once per store lifetime: the storage level covers it.
            counts = {op: counter.calls(op) for op in SITES if op != "mkdir"}
            for op, n in counts.items():
                for call in range(1, n + 1):
                    where = f"tier {layout} save: {op} #{call}"
                    key = f"k-{op}-{call}"
                    plan = FaultPlan().fail(op, on_call=call, error=OSError(5, "injected EIO"))
                    switch.plan = plan
                    tally.add("tier faults injected")
                    result = await (await tier.save(key, tokens, caches)).wait()
                    switch.plan = lambda op: None
                    if plan.calls(op) < call:
                        tally.violation(f"{where}: the fault was never reached")
                    if result.outcome is SpillOutcome.FAILED:
                        tally.add("tier tickets FAILED")
                        if result.error is None or not _typed(result.error):
                            tally.violation(f"{where}: untyped error {result.error!r}")
                        if tier.path_of(key).exists():
                            tally.violation(f"{where}: a FAILED save left its final name")
                    elif result.outcome is SpillOutcome.WRITTEN:
                        tally.add("tier faults absorbed (WRITTEN)")
                        loaded = await tier.load(key)
                        if _kv_bytes(loaded.caches) != want:
                            tally.violation(f"{where}: WRITTEN but not bit-exact")
                    else:
                        tally.violation(f"{where}: settled {result.outcome}")
                    left = [p.name for p in root.rglob(f"*{TMP_SUFFIX}")]
                    if left:
                        tally.violation(f"{where}: tmp file left behind: {left[:2]}")
                    live = tier.statistics().snapshots.live
                    if live:
                        tally.violation(f"{where}: {live} snapshot(s) not released")
                    probe = await (await tier.save("probe", tokens, caches)).wait()
                    if not probe.written:
                        tally.violation(f"{where}: the queue stopped serving: {probe.error!r}")
                    elif _kv_bytes((await tier.load("probe")).caches) != want:
                        tally.violation(f"{where}: the next save is not bit-exact")
                    await tier.delete(key)
                    await tier.delete("probe")
                    _tier_gc(tier.cache_dir, tier.block_dir)
        if tier.statistics().snapshots.live:
            tally.violation(f"tier {layout}: snapshots live after close")


def _tier_level(workdir: Path, base_ops: FileOps, tally: Tally) -> None:
    import trio

    trio.run(_tier_level_async, workdir, base_ops, tally)


def run_faults_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """Inject an EIO at every file-operation site (exhaustive; ``full`` adds real fsyncs)."""
    del seed  # exhaustive and deterministic: every site of every path, once
    tally = Tally("faults")
    started = time.perf_counter()
    base_ops = drill_file_ops(full=full)
    with drill_dir(workdir, full=full) as where:
        _storage_level(where, base_ops, tally)
        _tier_level(where, base_ops, tally)
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)
