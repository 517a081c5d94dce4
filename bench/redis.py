"""``kvtrio bench redis``: the shared tier's block throughput against raw Redis, and dedup.

Every headline figure is a ratio against a reference measured in the same run, on the
same bytes, over the same client connection:

- put: :meth:`RedisBlockStore.put_many` (SET NX + the put-time index, pipelined) vs raw
  pipelined ``SET`` of the same blocks, in the same batch sizes;
- verified get (the headline): :meth:`RedisBlockStore.read_many_verified_into`
  (pipelined GET into preallocated buffers, sizes checked, every block re-hashed against
  its sha256 name on helper threads while the next blocks arrive; the block reader's
  path) vs raw pipelined ``GET`` (no hashing: raw Redis does not check anything);
- context: the same read followed by the re-hash on the calling thread (what the block
  reader did before the overlap), and the read alone (``read_many_into``, no hashing:
  the transport); the per-block ``read_into`` (one round trip per block) vs raw ``GET``s;
- dedup: N hosts (N clients, each its own connection) save caches that share a system
  prompt through the real block layout (``storage.writer.write_blocks``); bytes the hosts
  asked to save vs bytes Redis stores (key count and value bytes, read back by SCAN);
- lookup: a host finding another host's entry for a prompt among M manifests that share
  a system prompt: through the prefix index (one pipelined ``SMEMBERS`` per chain hash,
  then the deepest entry's manifest) vs re-reading the catalogue (``SCAN``, then every
  manifest), the tiered cache's fallback; time per lookup (manifest parsing not counted,
  which favours the catalogue).

The rounds alternate kvtrio and raw and report the median. Without ``--url`` the program
starts a private redis-server (no persistence) on a free loopback port and stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtrio.bench.redis_server import server_binary
from kvtrio.storage.options import IoOptions

__all__ = ["add_arguments", "measure", "render"]

Blocks = list[tuple[str, memoryview]]


@contextlib.contextmanager
def _private_redis() -> Iterator[str]:
    binary = server_binary()
    if binary is None:
        raise SystemExit("no redis-server binary: install one (or kvtrio[test]), or pass --url")
    with tempfile.TemporaryDirectory(prefix="kvtrio-bench-redis-") as directory:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        log = os.path.join(directory, "log")
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
                "--save", "", "--appendonly", "no", "--logfile", log]  # fmt: skip
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise SystemExit("redis-server did not start") from None
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.kill()
            process.wait()


def _blocks(count: int, size: int, salt: bytes) -> list[tuple[str, memoryview]]:
    out = []
    for i in range(count):
        data = bytearray(os.urandom(size))
        data[:16] = hashlib.sha256(salt + i.to_bytes(8, "little")).digest()[:16]
        out.append((hashlib.sha256(data).hexdigest(), memoryview(bytes(data))))
    return out


def _batched(items: Sequence[Any], batch: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), batch):
        yield items[start : start + batch]


def _timed(fn: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _throughput(
    url: str, block_size: int, total: int, batch: int, rounds: int, io: IoOptions
) -> dict[str, Any]:
    from kvtrio.storage.redisstore import RedisBlockStore

    store = RedisBlockStore.open(url, options=io)
    client = store.client
    count = max(1, total // block_size)
    nbytes = count * block_size
    names = ["put", "raw_set", "get_verified", "get_then_hash", "get", "raw_get"]
    names += ["get1", "raw_get1", "raw_get_copy", "raw_get1_copy"]
    times: dict[str, list[float]] = {name: [] for name in names}
    # Filled once so page faults of fresh memory are not charged to whichever op runs first.
    buffers = [memoryview(bytearray(b"\x01" * block_size)) for _ in range(count)]

    def put(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(blocks, batch):
            store.put_many(chunk)

    def raw_set(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(range(count), batch):
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                pipe.set(raw_keys[i], blocks[i][1])
            pipe.execute()

    def get(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(range(count), batch):
            found = store.read_many_into([(blocks[i][0], buffers[i]) for i in chunk])
            assert all(found)

    def get_verified(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(range(count), batch):
            items = [(blocks[i][0], buffers[i]) for i in chunk]
            assert all(store.read_many_verified_into(items))

    def get_then_hash(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(range(count), batch):
            items = [(blocks[i][0], buffers[i]) for i in chunk]
            assert all(store.read_many_into(items))
            for name, view in items:
                if hashlib.sha256(view).hexdigest() != name:
                    raise AssertionError(f"block {name} does not hash to its name")

    def raw_get(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(range(count), batch):
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                pipe.get(raw_keys[i])
            assert all(value is not None for value in pipe.execute())

    def get1(blocks: Blocks, raw_keys: list[str]) -> None:
        for i in range(count):
            assert store.read_into(blocks[i][0], buffers[i])

    def raw_get1(blocks: Blocks, raw_keys: list[str]) -> None:
        for key in raw_keys:
            assert client.get(key) is not None

    # Context: raw GET followed by the copy into the same buffers that read_into makes
    # (redis-py hands back bytes; any caller wanting the bytes in a tensor copies them).
    def raw_get_copy(blocks: Blocks, raw_keys: list[str]) -> None:
        for chunk in _batched(range(count), batch):
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                pipe.get(raw_keys[i])
            for i, value in zip(chunk, pipe.execute(), strict=True):
                buffers[i][:] = value

    def raw_get1_copy(blocks: Blocks, raw_keys: list[str]) -> None:
        for i, key in enumerate(raw_keys):
            value = client.get(key)
            assert isinstance(value, bytes)
            buffers[i][:] = value

    pairs = [(put, raw_set), (get_verified, get_then_hash), (get, raw_get), (get1, raw_get1)]
    pairs += [(raw_get_copy, raw_get1_copy)]
    for r in range(rounds):
        blocks = _blocks(count, block_size, salt=f"{block_size}:{r}".encode())
        raw_keys = [f"bench:raw:{name}" for name, _ in blocks]
        client.flushdb()
        for ours, raw in pairs:
            # Alternate the order each round so neither side always runs on a warmer server.
            for fn in (ours, raw) if r % 2 == 0 else (raw, ours):
                times[fn.__name__].append(_timed(fn, blocks, raw_keys))
        assert bytes(buffers[-1]) == bytes(blocks[-1][1])
    client.flushdb()
    store.close()
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    return {
        "block_bytes": block_size,
        "blocks": count,
        "bytes": nbytes,
        "batch": batch,
        "rounds": rounds,
        "gb_per_s": gbps,
        "ratio_put": gbps["put"] / gbps["raw_set"],
        "ratio_get_verified": gbps["get_verified"] / gbps["raw_get"],
        "ratio_get_then_hash": gbps["get_then_hash"] / gbps["raw_get"],
        "ratio_get": gbps["get"] / gbps["raw_get"],
        "ratio_get_per_block": gbps["get1"] / gbps["raw_get1"],
        "ratio_get_vs_raw_copy": gbps["get"] / gbps["raw_get_copy"],
        "ratio_get_per_block_vs_raw_copy": gbps["get1"] / gbps["raw_get1_copy"],
    }


def _dedup(url: str, hosts: int, layers: int, system_tokens: int, user_tokens: int,
           block_tokens: int) -> dict[str, Any]:  # fmt: skip
    import numpy as np
    from kvtrio.storage.format import CacheEntry, Header, TensorSlot, piece_ranges
    from kvtrio.storage.redisstore import RedisBlockStore
    from kvtrio.storage.writer import write_blocks

    heads, dim = 8, 128
    rng = np.random.default_rng(0)
    system = [rng.standard_normal((1, heads, system_tokens, dim)).astype(np.float16)
              for _ in range(2 * layers)]  # fmt: skip
    stores = [RedisBlockStore.open(url) for _ in range(hosts)]
    stores[0].client.flushdb()
    logical = 0
    new_bytes = 0
    with tempfile.TemporaryDirectory(prefix="kvtrio-bench-dedup-") as directory:
        for host, store in enumerate(stores):
            tokens = system_tokens + user_tokens
            arrays = [np.concatenate([s, rng.standard_normal((1, heads, user_tokens, dim))
                                      .astype(np.float16)], axis=2) for s in system]  # fmt: skip
            slot = TensorSlot(shape=(1, heads, tokens, dim), dtype="float16",
                              nbytes=heads * tokens * dim * 2, token_axis=2)  # fmt: skip
            entries = tuple(CacheEntry(kind="KVCache", offset=tokens, min_reusable_offset=0,
                                       trimmable=True, fields={}, tensors=(slot, slot))
                            for _ in range(layers))  # fmt: skip
            header = Header(layout="blocks", tokens=tuple(range(tokens)), caches=entries,
                            created_at=time.time())  # fmt: skip
            pieces = [[np.ascontiguousarray(a[:, :, s:e, :]).data.cast("B")
                       for s, e in piece_ranges(slot, block_tokens)] for a in arrays]  # fmt: skip
            result = write_blocks(os.path.join(directory, f"host{host}"), header, pieces,
                                  store, block_tokens=block_tokens)  # fmt: skip
            logical += header.nbytes
            new_bytes += result.new_block_bytes
        keys, stored = stores[0].count_blocks()
    for store in stores:
        store.close()
    return {
        "hosts": hosts,
        "layers": layers,
        "system_tokens": system_tokens,
        "user_tokens": user_tokens,
        "block_tokens": block_tokens,
        "logical_bytes": logical,
        "stored_bytes": stored,
        "new_bytes_reported": new_bytes,
        "redis_block_keys": keys,
        "dedup_ratio": logical / stored,
    }


def _lookup(url: str, manifests: int, manifest_kib: int, rounds: int) -> dict[str, Any]:
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.sharedkeys import index_keys, probe_keys
    from kvtrio.actors.tiered import SHARED_CANDIDATES
    from kvtrio.storage.manifeststore import RedisManifestStore

    store = RedisManifestStore.open(url)
    store.client.flushdb()
    model = ModelKey("bench/model", "bench-fingerprint")
    block = 256
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(2048)]
    payload = os.urandom(manifest_kib * 1024)
    saved: list[list[int]] = []
    for m in range(manifests):
        tokens = system + [rng.randrange(32000) for _ in range(256 + m % 512)]
        store.put(f"entry{m}.kvc", payload, index_keys=index_keys(model, tokens, block))
        saved.append(tokens)
    query = [*saved[manifests // 2], 7]
    want = f"entry{manifests // 2}.kvc"
    probes = [key for key, _ in probe_keys(model, query, block)]

    def index() -> None:  # as the tiered cache asks: a few names per key at most
        for names in store.lookup_each(probes, limit=SHARED_CANDIDATES):
            if names:
                assert names == [want] and store.get(names[0]) is not None
                return
        raise AssertionError("the index did not find the entry")

    def catalogue() -> None:
        assert sum(store.get(name) is not None for name in store.list()) == manifests

    times: dict[str, list[float]] = {"index": [], "catalogue": []}
    for r in range(rounds):
        for fn in (index, catalogue) if r % 2 == 0 else (catalogue, index):
            times[fn.__name__].append(_timed(fn))
    store.client.flushdb()
    store.close()
    index_s = statistics.median(times["index"])
    catalogue_s = statistics.median(times["catalogue"])
    return {
        "manifests": manifests,
        "manifest_bytes": len(payload),
        "index_s": index_s,
        "catalogue_s": catalogue_s,
        "speedup": catalogue_s / index_s,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(_private_redis())
        sep = "&" if "?" in url else "?"
        url = f"{url}{sep}prefix=kvtrio-bench"
        sizes = [int(kib) * 1024 for kib in args.block_kib.split(",")]
        total = int(args.mib) * 1024 * 1024
        io: IoOptions = args.io_options  # the KVTRIO_* overrides, read by the CLI
        rows = [_throughput(url, size, total, args.batch, args.rounds, io) for size in sizes]
        dedup = _dedup(url, args.hosts, args.layers, args.system_tokens, args.user_tokens,
                       args.block_tokens)  # fmt: skip
        lookup = _lookup(url, args.manifests, args.manifest_kib, args.rounds)
    from kvtrio.storage.options import usable_cpus
    from redis.utils import HIREDIS_AVAILABLE

    return {
        "server": "given URL" if args.url else "private redis-server (no persistence)",
        "reply_parser": "hiredis" if HIREDIS_AVAILABLE else "python",
        "hash_threads": io.redis_hash_threads,
        "cpus": usable_cpus(),
        "throughput": rows,
        "dedup": dedup,
        "lookup": lookup,
    }


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="kvtrio shared tier (Redis): GB/s, median of rounds",
        caption=(
            f"{figures['server']}; redis-py reply parser: {figures['reply_parser']}; "
            f"sha256 helper threads: {figures['hash_threads']} ({figures['cpus']} usable CPUs)"
        ),
    )
    for column in ("block", "operation", "kvtrio", "raw Redis", "kvtrio / raw"):
        table.add_column(column, justify="right")
    operations = (
        ("put", "raw_set", "ratio_put", "put_many vs pipelined SET"),
        ("get_verified", "raw_get", "ratio_get_verified", "verified get vs pipelined GET"),
        ("get_then_hash", "raw_get", "ratio_get_then_hash", "context: get, then hash"),
        ("get", "raw_get", "ratio_get", "context: get, no hash"),
        ("get1", "raw_get1", "ratio_get_per_block", "read_into vs GET, per block"),
        ("get", "raw_get_copy", "ratio_get_vs_raw_copy", "context: vs pipelined GET + copy"),
        ("get1", "raw_get1_copy", "ratio_get_per_block_vs_raw_copy", "context: vs GET + copy"),
    )
    for row in figures["throughput"]:
        g = row["gb_per_s"]
        for ours, raw, ratio, label in operations:
            table.add_row(
                f"{row['block_bytes'] // 1024} KiB", label, f"{g[ours]:.2f}", f"{g[raw]:.2f}",
                f"{row[ratio]:.2f}x",
            )  # fmt: skip
    console = Console()
    console.print(table)
    d = figures["dedup"]
    console.print(
        f"dedup: {d['hosts']} hosts x ({d['system_tokens']} shared system-prompt tokens + "
        f"{d['user_tokens']} own), {d['layers']} layers, {d['block_tokens']}-token blocks: "
        f"asked to save {d['logical_bytes'] / 2**20:.1f} MiB, Redis holds "
        f"{d['stored_bytes'] / 2**20:.1f} MiB in {d['redis_block_keys']} block keys: "
        f"dedup ratio {d['dedup_ratio']:.2f}x"
    )
    lk = figures["lookup"]
    console.print(
        f"lookup of another host's entry among {lk['manifests']} manifests of "
        f"{lk['manifest_bytes'] // 1024} KiB: prefix index {lk['index_s'] * 1e3:.2f} ms vs "
        f"catalogue re-read {lk['catalogue_s'] * 1e3:.1f} ms: {lk['speedup']:.0f}x faster"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="Redis URL (default: start a private redis-server)")
    parser.add_argument("--block-kib", default="64,512", help="block sizes, KiB (default 64,512)")
    parser.add_argument("--mib", type=int, default=128, help="MiB per round and size (128)")
    parser.add_argument("--batch", type=int, default=64, help="blocks per pipeline (64)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; median reported (5)")
    parser.add_argument("--hosts", type=int, default=4, help="dedup: hosts (4)")
    parser.add_argument("--layers", type=int, default=4, help="dedup: layers (4)")
    parser.add_argument("--system-tokens", type=int, default=2048, help="dedup: shared (2048)")
    parser.add_argument("--user-tokens", type=int, default=256, help="dedup: per host (256)")
    parser.add_argument("--block-tokens", type=int, default=256, help="dedup: block tokens")
    parser.add_argument("--manifests", type=int, default=1000, help="lookup: manifests (1000)")
    parser.add_argument("--manifest-kib", type=int, default=64, help="lookup: KiB each (64)")
