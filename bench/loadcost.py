"""One cold load of a SmolLM2-135M-shaped entry, part by part, against mlx-lm's own.

Not wired into ``kvtrio bench``; run it as a module::

    python -m kvtrio.bench.loadcost --rounds 7 [--tokens 4096] [--shape S] [--drop-cache] [--json F]

The entry (``--shape smollm2-135m``, the default): 30 layers of mlx-lm ``KVCache``, keys
and values ``(1, 3, T, 64)`` float16, random (T = 4,096: 94,371,840 bytes);
``--shape tiny``: the served bench's tiny llama, 2 layers of ``(1, 1, T, 64)`` float32
(T = 4,127, its turn 2: 4,226,048 bytes, where the fixed costs of a load show). Three
loads of it, alternated round by round:

- ``naive``: ``bench/serve_naive.py``'s load, mlx-lm's ``load_prompt_cache`` of the
  file ``save_prompt_cache`` wrote, then ``mx.eval`` of every array (``mx.load`` is lazy:
  the eval is the read);
- ``kvtrio``: ``kvtrio serve``'s cold hit, the adapter's ``fetch_nearest_cache`` of the
  entry's tokens plus one on a restarted tier (a cold load on the calling thread, its
  owner jobs run there, as on the generation thread), then ``mx.eval`` of its arrays;
- ``kvtrio_parts``: the same call with the load's parts timed where they run (wrappers
  around the functions the tier calls; a few microseconds per block).

MLX's buffer cache is cleared before each load, so every load faults in fresh pages, as
a restarted server's first. ``--drop-cache`` also evicts the files from the page cache
before each load (``POSIX_FADV_DONTNEED``, file by file; no root needed).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

__all__ = ["SHAPES", "main", "make_caches", "mlx_cache"]

#: (layers, kv heads, head dim, dtype) of each ``--shape``.
SHAPES: dict[str, tuple[int, int, int, str]] = {
    "smollm2-135m": (30, 3, 64, "float16"),
    "tiny": (2, 1, 64, "float32"),
}
_MODEL = ("loadcost", None, None)
mlx_cache: Any = _mlx_cache  # mlx-lm's (model path, adapter, draft model)


def make_caches(tokens: int, *, seed: int = 0, shape: str = "smollm2-135m") -> list[Any]:
    """``shape``'s layers of KVCache holding ``tokens`` tokens of random keys and values."""
    layers, heads, dim, dtype = SHAPES[shape]
    mx.random.seed(seed)
    caches = []
    for _ in range(layers):
        cache = mlx_cache.KVCache()
        size = (1, heads, tokens, dim)
        cache.keys = mx.random.normal(size).astype(getattr(mx, dtype))
        cache.values = mx.random.normal(size).astype(getattr(mx, dtype))
        cache.offset = tokens
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def _arrays(caches: list[Any]) -> list[Any]:
    return [a for c in caches for a in (c.keys, c.values)]


def _drop_cached(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Spans:
    """Seconds and calls per part, summed over threads (each part runs on one thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                with self.lock:
                    self.seconds[part] += took
                    self.calls[part] += 1

        return timed


class _TimedHashlib:
    """``hashlib`` for the block reader: its ``sha256(piece)`` (the hash is computed
    there) timed as a part."""

    def __init__(self, spans: _Spans) -> None:
        self.sha256 = spans.wrap("sha256 per block", hashlib.sha256)


@contextmanager
def _instrumented(spans: _Spans) -> Iterator[None]:
    """The load's parts timed where they run (restored on exit). The same names exist in
    main's code since its tenth session, so older code can be timed by this file too
    (run as a script with that code first on ``PYTHONPATH``)."""
    from kvtrio.actors import owner, reader
    from kvtrio.storage import blockstore
    from kvtrio.storage import reader as storage_reader

    parts: list[tuple[Any, str, str]] = [
        (reader, "read_header", "manifest read + parse"),
        (reader, "check_blocks", "blocks present (stat each)"),
        (owner, "_allocate_group", "allocate destinations (owner)"),
        (reader, "read_tensors", "worker read_tensors (all)"),
        (owner, "_join", "join token blocks (owner, mx.concatenate)"),
        (owner, "_assemble", "assemble caches (owner)"),
    ]
    store = blockstore.LocalBlockStore
    if hasattr(store, "_open_block"):  # the blocks of a group opened, then read
        parts.append((store, "_open_block", "block opens (open, fstat, size)"))
        parts.append((store, "_fill", "block reads (preadv)"))
    else:
        parts.append((store, "_read_block", "block reads (open, fstat, preadv, close)"))
    hashing = getattr(storage_reader, "_sha256_hex", None)  # a block's hash, any destination
    if hashing is not None:
        parts.append((storage_reader, "_sha256_hex", "sha256 per block"))
    if hasattr(storage_reader, "_xxh3_hex"):  # a local block's check, format version 2 on
        parts.append((storage_reader, "_xxh3_hex", "xxh3 per block"))
    patches: list[tuple[Any, str, Any]] = [
        (target, name, spans.wrap(part, getattr(target, name))) for target, name, part in parts
    ]
    if hashing is None:
        patches.append((storage_reader, "hashlib", _TimedHashlib(spans)))
    saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
    for target, name, value in patches:
        setattr(target, name, value)
    try:
        yield
    finally:
        for target, name, value in saved:
            setattr(target, name, value)


class _Kvtrio:
    """A restarted ``kvtrio serve`` prompt cache over a tier holding the entry."""

    def __init__(self, directory: str, tokens: list[int], caches: list[Any]) -> None:
        from kvtrio.actors.prefix import ModelKey
        from kvtrio.serve.adapter import TieredLRUPromptCache
        from kvtrio.serve.bridge import TierOptions, TierThread

        options = TierOptions(directory, ModelKey("loadcost", "0" * 64))
        for first in (True, False):  # the first life writes the entry; the second loads it
            tier = TierThread(options)
            tier.start()
            tier.bind()
            self.cache = TieredLRUPromptCache(max_size=10, tier=tier, tier_model=_MODEL)
            if first:
                self.cache.insert_cache(_MODEL, tokens, caches)
                self.cache.close()
        self.prompt = [*tokens, 1]
        self.files = list(Path(directory).rglob("*"))

    def load(self) -> list[Any]:
        caches, rest = self.cache.fetch_nearest_cache(_MODEL, self.prompt)
        fetched = self.cache.last_fetch
        if caches is None or rest != [1] or fetched is None or fetched.tier.value != "cold":
            raise AssertionError(f"not a cold hit: {fetched}")
        mx.eval(_arrays(caches))
        return list(caches)


def _load_naive(path: str) -> list[Any]:
    caches = mlx_cache.load_prompt_cache(path)
    mx.eval(_arrays(caches))
    return list(caches)


def _same(a: list[Any], b: list[Any]) -> bool:
    pairs = zip(_arrays(a), _arrays(b), strict=True)
    return all(bool(mx.array_equal(x, y)) and x.dtype == y.dtype for x, y in pairs)


def _timed(load: Callable[[], list[Any]], files: list[Path], drop: bool) -> tuple[float, Any]:
    gc.collect()
    mx.clear_cache()
    if drop:
        _drop_cached(files)
    start = time.perf_counter()
    got = load()
    return time.perf_counter() - start, got


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtrio.bench.loadcost")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--drop-cache", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    caches = make_caches(args.tokens, shape=args.shape)
    tokens = list(range(2, 2 + args.tokens))
    nbytes = sum(a.nbytes for a in _arrays(caches))
    with tempfile.TemporaryDirectory(prefix="kvtrio-loadcost-") as root:
        naive_path = os.path.join(root, "naive.safetensors")
        mlx_cache.save_prompt_cache(naive_path, caches)
        kvtrio = _Kvtrio(os.path.join(root, "tier"), tokens, caches)
        naive_files = [Path(naive_path)]
        times: dict[str, list[float]] = defaultdict(list)
        parts: dict[str, list[float]] = defaultdict(list)
        for round_ in range(args.rounds):
            order = ["naive", "kvtrio", "kvtrio_parts"]
            if round_ % 2:
                order.reverse()
            for name in order:
                if name == "naive":
                    took, got = _timed(
                        lambda: _load_naive(naive_path), naive_files, args.drop_cache
                    )
                elif name == "kvtrio":
                    took, got = _timed(kvtrio.load, kvtrio.files, args.drop_cache)
                else:
                    spans = _Spans()
                    with _instrumented(spans):
                        took, got = _timed(kvtrio.load, kvtrio.files, args.drop_cache)
                    for part, seconds in spans.seconds.items():
                        parts[part].append(seconds)
                if not _same(got, caches):
                    raise AssertionError(f"{name}: the load is not bit-exact")
                del got
                times[name].append(took)
        kvtrio.cache.close()
    report = {
        "bytes": nbytes,
        "tokens": args.tokens,
        "shape": args.shape,
        "rounds": args.rounds,
        "drop_cache": args.drop_cache,
        "load_s": dict(times),
        "parts_s": dict(parts),
    }
    print(f"entry {nbytes:,} bytes, {args.tokens} tokens, {args.rounds} rounds alternated")
    for name, values in times.items():
        print(
            f"  {name:13s} median {statistics.median(values) * 1e3:7.1f} ms  "
            f"({', '.join(f'{v * 1e3:.0f}' for v in values)})"
        )
    total = statistics.median(times["kvtrio_parts"])
    print("  kvtrio's parts (median ms, share of kvtrio_parts' median):")
    for part, values in parts.items():
        med = statistics.median(values)
        print(f"    {part:45s} {med * 1e3:7.1f}  {med / total:6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
