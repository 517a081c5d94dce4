"""``kvtrio bench tier``: the cold tier end to end, against the disk and against mlx-lm.

One run, one directory, the same cache (``--size-mib`` of float16 KV tensors across
``--tensors`` tensors, offsets off the 256-token allocation step like a real cache):

- save: ``tier.save`` -> ticket WRITTEN (snapshot, materialize, hash, write, fsync,
  rename, fsync dir) GB/s vs an O_DIRECT write + fsync of the tier file's own bytes from
  page-aligned RAM into the same directory, and vs mlx-lm's ``save_prompt_cache`` (+
  fsync, so both are durable);
- load: cold (the file's pages dropped with ``posix_fadvise(DONTNEED)`` first)
  ``tier.load`` GB/s (verified, arrays built) vs an O_DIRECT read of those bytes into
  fresh page-aligned memory, and vs mlx-lm's ``load_prompt_cache`` (arrays evaluated),
  also cold;
- event-loop lag: a 1 ms heartbeat task's lateness p50/p99/max while the tier saves and
  loads, next to the same heartbeat while mlx-lm's save and load run in the loop (how a
  server calling mlx-lm from its event loop behaves), and idle;
- context: the same storage core called synchronously on the owner thread
  (``kvtrio.save_cache`` / ``load_cache``), so the actors' own cost shows.

``--background-slice-ms`` is the scheduler time slice kvtrio's threads ask for (default
20 ms, :mod:`kvtrio.actors.sched`; 0 leaves them alone, the comparison); the opt-in
``--loop-slice-ms`` has the event loop's own thread ask for a short one, a server-side
setting kvtrio never makes by itself; ``--switch-interval-ms`` sets
``sys.setswitchinterval`` for the run and ``--gc-freeze`` calls ``gc.freeze()`` once the
cache is made (a process importing mlx-lm holds ~90k objects, so a full collection, which
holds the GIL, takes 10-70 ms here; frozen objects are not scanned again): two more
opt-in server settings, reported as such.
"""

from __future__ import annotations

import argparse
import functools
import gc
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.sched import set_thread_slice, thread_slice
from kvtrio.actors.tier import ColdTier
from kvtrio.bench.argtypes import whole

__all__ = ["add_arguments", "measure", "render"]

T = TypeVar("T")
HEADS, HEAD_DIM = 8, 128
TOKEN_BYTES = HEADS * HEAD_DIM * 2  # float16
_IO_CHUNK = 16 * 1024 * 1024


def _make_caches(size_bytes: int, tensors: int) -> tuple[list[Any], list[int]]:
    """KV caches of about ``size_bytes`` in ``tensors`` tensors (owner thread)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layers = max(1, tensors // 2)
    per_tensor = size_bytes // (2 * layers)
    tokens = max(1, per_tensor // TOKEN_BYTES - 37)  # a real cache's offset is rarely aligned
    allocated = -(-tokens // KVCache.step) * KVCache.step
    mx.random.seed(0)
    caches = []
    for _ in range(layers):
        cache = KVCache()  # type: ignore[no-untyped-call]
        shape = (1, HEADS, allocated, HEAD_DIM)
        cache.keys = mx.random.normal(shape).astype(mx.float16)
        cache.values = mx.random.normal(shape).astype(mx.float16)
        cache.offset = tokens
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches, list(range(tokens))


def _drop_pages(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _odirect_write(source: Path, path: str) -> float:
    """Time an O_DIRECT write + fsync of ``source``'s bytes, from page-aligned memory.

    The bytes are loaded into an anonymous mapping first (untimed): the reference sends
    the same bytes from RAM to the disk, as the tier does.
    """
    size = source.stat().st_size
    rounded = -(-size // 4096) * 4096
    buf = mmap.mmap(-1, rounded)
    with open(source, "rb") as f:
        f.readinto(memoryview(buf)[:size])
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        done = 0
        while done < rounded:
            n = min(_IO_CHUNK, rounded - done)
            done += os.pwrite(fd, memoryview(buf)[done : done + n], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(dir_fd)
    os.close(dir_fd)
    elapsed = time.perf_counter() - start
    buf.close()
    return elapsed


def _odirect_read(path: str) -> float:
    """Time an O_DIRECT read of the file into fresh page-aligned memory (as a load fills
    freshly allocated arrays)."""
    size = os.stat(path).st_size
    buf = mmap.mmap(-1, -(-size // 4096) * 4096)
    view = memoryview(buf)
    _drop_pages(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset = 0
        while offset < size:
            n = os.preadv(fd, [view[offset : offset + _IO_CHUNK]], offset)
            if n <= 0:
                break
            offset += n
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    view.release()
    buf.close()
    return elapsed


class GcPauses:
    """Records how long each garbage collection (any thread, holding the GIL) took."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)


class Heartbeat:
    """A task that sleeps 1 ms at a time and records how late each wake-up was."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lateness: list[float] = []
        self.active = False
        self.gc = GcPauses()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            due = trio.current_time() + self.period
            await trio.sleep_until(due)
            if self.active:
                self.lateness.append(max(0.0, trio.current_time() - due))

    async def measure(self, fn: Callable[[], Awaitable[T]]) -> tuple[T, float, list[float]]:
        """Run ``fn`` with the heartbeat recording; return its result, seconds, lateness."""
        self.lateness = []
        self.active = True
        await trio.sleep(0.01)
        gc.callbacks.append(self.gc)
        start = time.perf_counter()
        try:
            result = await fn()
        finally:
            elapsed = time.perf_counter() - start
            gc.callbacks.remove(self.gc)
            await trio.sleep(0.01)  # one more beat: the one an inline call delayed
            self.active = False
        return result, elapsed, self.lateness


def _lag(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "beats": 0}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": p99 * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "beats": len(ordered),
    }


async def _bench(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    size = int(args.size_mib) * 1024 * 1024
    figures: dict[str, Any] = {"directory": str(directory)}
    heartbeat = Heartbeat()
    background = args.background_slice_ms / 1e3 if args.background_slice_ms else None
    figures["settings"] = {
        "background_slice_ms": args.background_slice_ms,
        "loop_slice_ms": args.loop_slice_ms,
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "gc_freeze": bool(args.gc_freeze),
    }
    loop_before = thread_slice()
    if args.loop_slice_ms:
        set_thread_slice(args.loop_slice_ms / 1e3)
    try:
        return await _measure(args, directory, size, figures, heartbeat, background)
    finally:
        if args.loop_slice_ms and loop_before is not None:
            set_thread_slice(loop_before)


async def _measure(
    args: argparse.Namespace,
    directory: Path,
    size: int,
    figures: dict[str, Any],
    heartbeat: Heartbeat,
    background: float | None,
) -> dict[str, Any]:
    async with (
        MlxOwner.dedicated(background=background) as owner,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(heartbeat.run)
        made: tuple[list[Any], list[int]] = await owner.run(_make_caches, size, args.tensors)
        caches, tokens = made
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        _, _, idle = await heartbeat.measure(lambda: trio.sleep(0.5))

        # -- kvtrio ----------------------------------------------------------------------
        async with ColdTier.open(
            directory / "tier", owner=owner, background=background, options=args.io_options
        ) as tier:

            async def save() -> Any:
                ticket = await tier.save("bench", tokens, caches)
                result = await ticket.wait()
                if not result.written:
                    raise RuntimeError(f"bench save did not write: {result}")
                return ticket

            ticket, save_s, save_lag = await heartbeat.measure(save)
            path = tier.path_of("bench")
            file_bytes = path.stat().st_size
            await trio.to_thread.run_sync(_drop_pages, path)
            loaded, load_s, load_lag = await heartbeat.measure(lambda: tier.load("bench"))
            del loaded
            # -- O_DIRECT, the same bytes, the same directory --------------------------
            raw = str(directory / "odirect.bin")
            odirect_write_s = await trio.to_thread.run_sync(_odirect_write, path, raw)
            odirect_read_s = await trio.to_thread.run_sync(_odirect_read, raw)
            os.unlink(raw)
        nbytes = ticket.nbytes
        figures["cache"] = {
            "tensor_bytes": nbytes,
            "tensors": 2 * len(caches),
            "file_bytes": file_bytes,
            "tokens": len(tokens),
        }

        # -- the same storage core, synchronously on the owner (no actors, no offload) ----
        from kvtrio.api import load_cache, save_cache

        core = str(directory / "core.kvc")
        start = time.perf_counter()
        await owner.run(functools.partial(save_cache, core, tokens, caches))
        core_save_s = time.perf_counter() - start
        await trio.to_thread.run_sync(_drop_pages, core)
        start = time.perf_counter()
        await owner.run(load_cache, core)
        core_load_s = time.perf_counter() - start
        os.unlink(core)

        # -- mlx-lm, called in the event loop as a server would ---------------------------
        from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

        st = str(directory / "mlx-lm.safetensors")

        async def mlx_save() -> None:
            save_prompt_cache(st, caches)
            fd = os.open(st, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            await trio.lowlevel.checkpoint()

        async def mlx_load() -> None:
            import mlx.core as mx

            restored = load_prompt_cache(st)  # type: ignore[no-untyped-call]
            mx.eval([c.state for c in restored])
            await trio.lowlevel.checkpoint()

        _, mlx_save_s, mlx_save_lag = await heartbeat.measure(mlx_save)
        _drop_pages(st)
        _, mlx_load_s, mlx_load_lag = await heartbeat.measure(mlx_load)
        os.unlink(st)
        caches.clear()
        if args.gc_freeze:
            gc.unfreeze()
        nursery.cancel_scope.cancel()

    gb = nbytes / 1e9
    figures["gb_per_s"] = {
        "kvtrio_save": gb / save_s,
        "sync_core_save": gb / core_save_s,
        "odirect_write": gb / odirect_write_s,
        "mlx_lm_save": gb / mlx_save_s,
        "kvtrio_load": gb / load_s,
        "sync_core_load": gb / core_load_s,
        "odirect_read": gb / odirect_read_s,
        "mlx_lm_load": gb / mlx_load_s,
    }
    g = figures["gb_per_s"]
    figures["ratios"] = {
        "save_vs_odirect": g["kvtrio_save"] / g["odirect_write"],
        "save_vs_mlx_lm": g["kvtrio_save"] / g["mlx_lm_save"],
        "load_vs_odirect": g["kvtrio_load"] / g["odirect_read"],
        "load_vs_mlx_lm": g["kvtrio_load"] / g["mlx_lm_load"],
        "save_vs_sync_core": g["kvtrio_save"] / g["sync_core_save"],
        "load_vs_sync_core": g["kvtrio_load"] / g["sync_core_load"],
    }
    figures["heartbeat_lateness"] = {
        "idle": _lag(idle),
        "kvtrio_save_load": _lag(save_lag + load_lag),
        "kvtrio_save": _lag(save_lag),
        "kvtrio_load": _lag(load_lag),
        "mlx_lm_save_load_inline": _lag(mlx_save_lag + mlx_load_lag),
    }
    pauses = heartbeat.gc.pauses
    figures["gc_during_measurements"] = {
        "collections": len(pauses),
        "max_pause_ms": max(pauses, default=0.0) * 1e3,
    }
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring)."""
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    before = sys.getswitchinterval()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtrio-bench-tier-", dir=args.dir) as tmp:
            return trio.run(_bench, args, Path(tmp))
    finally:
        sys.setswitchinterval(before)


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c, g, r = figures["cache"], figures["gb_per_s"], figures["ratios"]
    console = Console()
    table = Table(
        title=f"kvtrio cold tier: {c['tensor_bytes'] / 2**30:.2f} GiB in {c['tensors']} "
        f"tensors, {c['tokens']} tokens (GB/s; ratio = kvtrio / reference)"
    )
    for column in ("", "kvtrio", "O_DIRECT", "ratio", "mlx-lm", "ratio", "sync core", "ratio"):
        table.add_column(column, justify="right")
    for label, op, disk in (("save (durable)", "save", "write"), ("load (cold)", "load", "read")):
        table.add_row(
            label,
            f"{g[f'kvtrio_{op}']:.2f}",
            f"{g[f'odirect_{disk}']:.2f}",
            f"{r[f'{op}_vs_odirect']:.2f}x",
            f"{g[f'mlx_lm_{op}']:.2f}",
            f"{r[f'{op}_vs_mlx_lm']:.2f}x",
            f"{g[f'sync_core_{op}']:.2f}",
            f"{r[f'{op}_vs_sync_core']:.2f}x",
        )
    console.print(table)
    lag = Table(title="1 ms heartbeat lateness during save + load (ms)")
    for column in ("", "p50", "p99", "max", "beats"):
        lag.add_column(column, justify="right")
    for name, label in (
        ("idle", "idle"),
        ("kvtrio_save_load", "kvtrio tier"),
        ("kvtrio_save", "  of which save"),
        ("kvtrio_load", "  of which load"),
        ("mlx_lm_save_load_inline", "mlx-lm in the loop"),
    ):
        row = figures["heartbeat_lateness"][name]
        lag.add_row(
            label,
            f"{row['p50_ms']:.2f}",
            f"{row['p99_ms']:.2f}",
            f"{row['max_ms']:.1f}",
            str(row["beats"]),
        )
    console.print(lag)
    st = figures["settings"]
    console.print(
        f"settings: kvtrio threads' time slice {st['background_slice_ms'] or 'default'} ms; "
        f"event loop's slice {st['loop_slice_ms'] or 'default'} ms (opt-in); "
        f"switch interval {st['switch_interval_ms']:.2f} ms; "
        f"gc.freeze() {'yes (opt-in)' if st['gc_freeze'] else 'no'}"
    )
    gcf = figures["gc_during_measurements"]
    console.print(
        f"garbage collections during the measurements: {gcf['collections']}, "
        f"longest {gcf['max_pause_ms']:.1f} ms; sync core = kvtrio.save_cache/load_cache "
        "on the owner thread (the same storage core without the actors)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=whole, default=1024, help="cache size, MiB (1024)")
    parser.add_argument("--tensors", type=whole, default=64, help="number of tensors (64)")
    parser.add_argument("--dir", help="directory on the disk to measure (default: the tmp dir)")
    parser.add_argument(
        "--background-slice-ms",
        type=float,
        default=20.0,
        help="time slice kvtrio's threads ask for, ms (20; 0: leave them alone)",
    )
    parser.add_argument(
        "--loop-slice-ms",
        type=float,
        default=0.0,
        help="opt-in server setting: the event loop thread's own time slice, ms (0: off)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="opt-in server setting: sys.setswitchinterval for the run, ms (0: Python's)",
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="opt-in server setting: gc.freeze() once the cache is made",
    )
