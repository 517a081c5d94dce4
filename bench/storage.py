"""``kvtrio bench storage``: sync save and cold load GB/s, against O_DIRECT and mlx-lm.

One run, one directory, the same bytes (a KV cache of ``--mib`` MiB: ``--layers`` layers of
fp16 keys and values ``[1, heads, tokens, head_dim]``; ``--tokens N`` sets the cache's
offset instead, in buffers of mlx-lm's 256-token steps, so an offset that is not a multiple
of 16 tokens makes segments that cut 4 KiB pages, as real caches do):

- kvtrio save: ``kvtrio.save_cache`` end to end (snapshot, materialize, hash every tensor,
  write, fsync, rename, fsync dir); with ``--compare-direct`` also the same save through
  the O_DIRECT path (``write_single(direct=True)``), in the same rotation;
- kvtrio cold load: ``kvtrio.load_cache`` with ``verify=True`` (every tensor's xxh3
  checked) into evaluated MLX arrays;
- reference: an O_DIRECT write (+ fsync) and an O_DIRECT read of the same byte count from
  a page-aligned buffer, 8 MiB per call, in the same directory (``dd oflag=direct``);
- mlx-lm: ``save_prompt_cache`` (+ fsync of the file, for the same durability) and
  ``load_prompt_cache`` + ``mx.eval`` of every array; it verifies nothing.

"Cold" means the file's pages were dropped (fsync, then ``posix_fadvise(DONTNEED)``)
before the load. Each round removes the previous round's files and syncs before the saves,
and the order of the saves, and of the loads, rotates from round to round; medians are
reported, with ratios, and every round's figures are in ``--json`` (``rounds_gbps``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvtrio.bench.argtypes import whole
from kvtrio.storage.options import IoOptions

__all__ = ["add_arguments", "measure", "render"]

_CHUNK = 8 * 1024 * 1024


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _make_caches(
    total_bytes: int, layers: int, heads: int, head_dim: int, tokens: int | None = None
) -> tuple[list[Any], int]:
    """KV caches of ``tokens`` tokens (derived from ``total_bytes`` when None) in buffers of
    mlx-lm's 256-token steps: ``cache.offset`` may end inside the buffer, as it does live."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache_module

    mlx_cache: Any = mlx_cache_module
    per_token = 2 * heads * head_dim * 2  # keys + values, fp16
    if tokens is None:
        tokens = max(256, (total_bytes // (layers * per_token)) // 256 * 256)
    capacity = (tokens + 255) // 256 * 256
    caches = []
    for layer in range(layers):
        key = mx.random.key(layer)
        k = mx.random.normal((1, heads, capacity, head_dim), key=key).astype(mx.float16)
        v = (k * 0.5 + 1).astype(mx.float16)
        mx.eval(k, v)
        cache: Any = mlx_cache.KVCache()
        cache.keys, cache.values, cache.offset = k, v, tokens
        caches.append(cache)
    return caches, tokens


def _direct_write(path: str, source: mmap.mmap, nbytes: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        view = memoryview(source)
        offset = 0
        while offset < nbytes:
            offset += os.pwrite(fd, view[offset : offset + _CHUNK], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _direct_read(path: str, target: mmap.mmap, nbytes: int) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        view = memoryview(target)
        offset = 0
        while offset < nbytes:
            got = os.preadv(fd, [view[offset : offset + _CHUNK]], offset)
            if got == 0:
                raise OSError("short O_DIRECT read")
            offset += got
    finally:
        os.close(fd)


def _direct_read_fresh(path: str, nbytes: int) -> None:
    """The O_DIRECT read into freshly mapped memory: what any load into new arrays pays."""
    target = mmap.mmap(-1, (nbytes + _CHUNK - 1) // _CHUNK * _CHUNK)
    try:
        _direct_read(path, target, nbytes)
    finally:
        target.close()


def _memcpy(caches: list[Any], target: mmap.mmap) -> None:
    """One memmove of the cache's bytes into warm memory: this machine's copy bandwidth."""
    import ctypes

    import numpy as np

    base = int(np.frombuffer(memoryview(target), dtype=np.uint8).ctypes.data)
    offset = 0
    for cache in caches:
        for array in (cache.keys, cache.values):
            view = memoryview(array).cast("B")
            size = min(len(view), len(target) - offset)  # --tokens: the buffers are larger
            ctypes.memmove(base + offset, int(np.frombuffer(view, np.uint8).ctypes.data), size)
            offset += size


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything; return the figures (GB/s medians and ratios)."""
    import kvtrio
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache_module

    mlx_cache: Any = mlx_cache_module
    io: IoOptions = args.io_options  # the KVTRIO_* overrides, read by the CLI
    total = args.mib * 2**20
    caches, tokens = _make_caches(total, args.layers, args.heads, args.head_dim, args.tokens)
    nbytes = args.layers * 2 * args.heads * tokens * args.head_dim * 2  # the saved bytes
    parent = os.path.abspath(args.dir)
    os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix=".kvtrio-bench-storage-", dir=parent)
    aligned = mmap.mmap(-1, (nbytes + _CHUNK - 1) // _CHUNK * _CHUNK)
    aligned.write(os.urandom(1 << 20) * (len(aligned) >> 20))
    names = (
        "kvtrio_save",
        *(("kvtrio_save_direct",) if args.compare_direct else ()),
        "direct_write",
        "mlx_save",
        "kvtrio_load",
        "direct_read",
        "mlx_load",
        "direct_read_fresh",
        "memcpy",
    )
    times: dict[str, list[float]] = {k: [] for k in names}
    kv_path = os.path.join(workdir, "cache.kvt")
    kv_direct_path = os.path.join(workdir, "cache-direct.kvt")
    direct_path = os.path.join(workdir, "direct.bin")
    mlx_path = os.path.join(workdir, "cache.safetensors")
    token_ids = list(range(tokens))

    def kvtrio_save_direct() -> None:
        from kvtrio.storage.cacheio import materialize, snapshot
        from kvtrio.storage.writer import write_single

        snap = snapshot(caches, token_ids)
        host = materialize(snap, options=io)
        segments = [h.segments[0] for h in host]
        write_single(kv_direct_path, snap.header, segments, direct=True, options=io)

    def mlx_save() -> None:
        mlx_cache.save_prompt_cache(mlx_path, caches)
        _fsync_file(mlx_path)

    def kvtrio_load() -> None:
        loaded = kvtrio.load_cache(kv_path, verify=True, options=io)
        mx.eval([c.keys for c in loaded.caches] + [c.values for c in loaded.caches])

    def mlx_load() -> None:
        loaded: list[Any] = mlx_cache.load_prompt_cache(mlx_path)
        mx.eval([c.keys for c in loaded] + [c.values for c in loaded])

    saves: list[tuple[str, Callable[[], Any]]] = [
        ("kvtrio_save", lambda: kvtrio.save_cache(kv_path, token_ids, caches, options=io)),
        ("direct_write", lambda: _direct_write(direct_path, aligned, nbytes)),
        ("mlx_save", mlx_save),
    ]
    if args.compare_direct:
        saves.insert(1, ("kvtrio_save_direct", kvtrio_save_direct))
    loads: list[tuple[str, Callable[[], Any]]] = [
        ("kvtrio_load", kvtrio_load),
        ("direct_read", lambda: _direct_read(direct_path, aligned, nbytes)),
        ("mlx_load", mlx_load),
    ]
    try:
        for round_index in range(args.rounds):
            for path in (kv_path, kv_direct_path, direct_path, mlx_path):
                if os.path.exists(path):
                    os.unlink(path)
            # The unlinks' journal and discard work is not any contender's: flush it first,
            # and rotate the order so no contender always goes first after them.
            os.sync()
            turn = round_index % len(saves)
            for name, save in saves[turn:] + saves[:turn]:
                times[name].append(_timed(save))
            for path in (kv_path, direct_path, mlx_path):
                _evict(path)
            # Rotated too: a loader that runs just after another one freed its arrays
            # gets recently used (warm) memory; the first one after the saves does not.
            for name, load in loads[turn:] + loads[:turn]:
                times[name].append(_timed(load))
            _evict(direct_path)
            times["direct_read_fresh"].append(
                _timed(lambda: _direct_read_fresh(direct_path, nbytes))
            )
            times["memcpy"].append(_timed(lambda: _memcpy(caches, aligned)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {
        "bytes": nbytes,
        "layers": args.layers,
        "tokens": tokens,
        "strided": tokens % 256 != 0,
        "rounds": args.rounds,
        "directory": parent,
        "gbps": gbps,
        "rounds_gbps": {k: [nbytes / t / 1e9 for t in v] for k, v in times.items()},
        "ratios": {
            "save_vs_direct": gbps["kvtrio_save"] / gbps["direct_write"],
            "save_vs_mlx_lm": gbps["kvtrio_save"] / gbps["mlx_save"],
            **(
                {"save_vs_save_direct": gbps["kvtrio_save"] / gbps["kvtrio_save_direct"]}
                if args.compare_direct
                else {}
            ),
            "load_vs_direct": gbps["kvtrio_load"] / gbps["direct_read"],
            "load_vs_mlx_lm": gbps["kvtrio_load"] / gbps["mlx_load"],
        },
        "targets": {
            "save_vs_direct": 0.85,
            "save_vs_mlx_lm": 1.5,
            "load_vs_direct": 0.85,
            "load_vs_mlx_lm": 1.1,
        },
    }


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    g, r, t = figures["gbps"], figures["ratios"], figures["targets"]
    table = Table(
        title=(
            f"kvtrio bench storage: {figures['bytes'] / 2**30:.2f} GiB KV cache "
            f"({figures['layers']} layers x {figures['tokens']} tokens"
            f"{', strided' if figures['strided'] else ''}), "
            f"median of {figures['rounds']} rounds, in {figures['directory']}"
        )
    )
    for column in ("", "kvtrio GB/s", "O_DIRECT GB/s", "mlx-lm GB/s", "vs O_DIRECT", "vs mlx-lm"):
        table.add_column(column, justify="right")

    def mark(name: str) -> str:
        ok = "ok" if r[name] >= t[name] else "MISS"
        return f"{r[name]:.2f}x (>= {t[name]}x {ok})"

    for label, ours, direct, mlx, op in (
        ("save (durable)", "kvtrio_save", "direct_write", "mlx_save", "save"),
        ("cold load (verified)", "kvtrio_load", "direct_read", "mlx_load", "load"),
    ):
        table.add_row(
            label,
            f"{g[ours]:.2f}",
            f"{g[direct]:.2f}",
            f"{g[mlx]:.2f}",
            mark(f"{op}_vs_direct"),
            mark(f"{op}_vs_mlx_lm"),
        )
    console = Console()
    console.print(table)
    if "kvtrio_save_direct" in g:
        console.print(
            f"kvtrio save through O_DIRECT (direct=True): {g['kvtrio_save_direct']:.2f} GB/s; "
            f"the default save is {r['save_vs_save_direct']:.2f}x that"
        )
    console.print(
        "kvtrio verifies every tensor's xxh3 on load; mlx-lm verifies nothing. mlx-lm's save "
        "is followed by an fsync of its file so both saves are durable."
    )
    console.print(
        f"context: O_DIRECT read into freshly mapped memory {g['direct_read_fresh']:.2f} GB/s "
        f"(page faults included, as in any load into new arrays); memcpy of the cache into "
        f"warm memory {g['memcpy']:.2f} GB/s (a save pays one copy: O_DIRECT needs aligned "
        f"memory, MLX buffers are not)."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=whole, default=1024, help="cache size in MiB (1024)")
    parser.add_argument("--layers", type=whole, default=16, help="layers (16)")
    parser.add_argument("--heads", type=whole, default=8, help="KV heads (8)")
    parser.add_argument("--head-dim", type=whole, default=128, help="head dim (128)")
    parser.add_argument(
        "--tokens",
        type=whole,
        default=None,
        help="cache offset in tokens (default: from --mib); not a multiple of 16: strided",
    )
    parser.add_argument(
        "--compare-direct",
        action="store_true",
        help="also time kvtrio's save through O_DIRECT (write_single(direct=True))",
    )
    parser.add_argument("--rounds", type=whole, default=3, help="rounds; median reported (3)")
    parser.add_argument("--dir", default=".", help="directory to measure in (default: cwd)")
