"""What a scatter read would save: a tier's blocks read straight into each tensor's final
array (``os.preadv`` of a block into its runs, one per kv head, each block's sha256
over those runs) against the reads of this branch (a block into a piece array, its
sha256, then the pieces joined), on one thread, no pipelining, alternated.

    python docs/load10/scatter.py ROUNDS [TOKENS]

A probe for the recommendation, not kvtrio's code: the reader and the block store are
left as they are.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from kvtrio.actors import owner as owner_module
from kvtrio.bench import loadcost
from kvtrio.storage import hostbuffers
from kvtrio.storage.format import DTYPE_SIZES, piece_ranges
from kvtrio.storage.reader import read_header


def _pieces_then_join(header: Any, blocks: Path, spans: dict[str, float]) -> list[Any]:
    out = []
    for index, slot in enumerate(header.slots()):
        t0 = time.perf_counter()
        arrays, views = hostbuffers.allocate_slot(header, index)
        t1 = time.perf_counter()
        spans["allocate"] += t1 - t0
        for ref, view in zip(slot.blocks, views, strict=True):
            t2 = time.perf_counter()
            fd = os.open(blocks / ref.sha256, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                assert os.fstat(fd).st_size == len(view)
                assert os.preadv(fd, [view], 0) == len(view)
            finally:
                os.close(fd)
            t3 = time.perf_counter()
            assert hashlib.sha256(view).hexdigest() == ref.sha256
            t4 = time.perf_counter()
            spans["read"] += t3 - t2
            spans["sha256"] += t4 - t3
        t5 = time.perf_counter()
        out.append(owner_module._join(arrays, slot.token_axis))
        spans["join"] += time.perf_counter() - t5
    return out


def _scatter(header: Any, blocks: Path, spans: dict[str, float]) -> list[Any]:
    out = []
    for slot in header.slots():
        t0 = time.perf_counter()
        backing = hostbuffers._untouched_uint8(slot.nbytes, True)
        raw = memoryview(backing).cast("B")
        array = backing.view(hostbuffers.MX_DTYPES[slot.dtype]).reshape(list(slot.shape))
        t1 = time.perf_counter()
        spans["allocate"] += t1 - t0
        axis = slot.token_axis
        lead = math.prod(slot.shape[:axis])
        tokens = slot.shape[axis]
        per_token = DTYPE_SIZES[slot.dtype] * math.prod(slot.shape[axis + 1 :])
        for ref, (start, stop) in zip(
            slot.blocks, piece_ranges(slot, header.block_tokens), strict=True
        ):
            runs = [
                raw[(h * tokens + start) * per_token : (h * tokens + stop) * per_token]
                for h in range(lead)
            ]
            t2 = time.perf_counter()
            fd = os.open(blocks / ref.sha256, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                assert os.fstat(fd).st_size == ref.nbytes
                assert os.preadv(fd, runs, 0) == ref.nbytes
            finally:
                os.close(fd)
            t3 = time.perf_counter()
            digest = hashlib.sha256()
            for run in runs:
                digest.update(run)
            assert digest.hexdigest() == ref.sha256
            spans["read"] += t3 - t2
            spans["sha256"] += time.perf_counter() - t3
        t5 = time.perf_counter()
        mx.eval(array)
        spans["join"] += time.perf_counter() - t5
        out.append(array)
    return out


def main() -> None:
    rounds = int(sys.argv[1])
    tokens_n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    caches = loadcost.make_caches(tokens_n)
    want = [np.array(a) for c in caches for a in (c.keys, c.values)]
    with tempfile.TemporaryDirectory(prefix="kvtrio-scatter-") as root:
        tier = loadcost._Kvtrio(str(Path(root) / "tier"), list(range(2, 2 + tokens_n)), caches)
        tier.cache.close()
        manifest = next(p for p in Path(root, "tier").rglob("*.kvc"))
        blocks = next(p for p in Path(root, "tier").rglob("blocks") if p.is_dir())
        header = read_header(str(manifest)).header
        totals: dict[str, list[float]] = defaultdict(list)
        parts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for round_ in range(rounds):
            order = [("pieces+join", _pieces_then_join), ("scatter", _scatter)]
            if round_ % 2:
                order.reverse()
            for name, load in order:
                gc.collect()
                mx.clear_cache()
                spans: dict[str, float] = defaultdict(float)
                start = time.perf_counter()
                got = load(header, blocks, spans)
                totals[name].append(time.perf_counter() - start)
                for part, seconds in spans.items():
                    parts[name][part].append(seconds)
                assert all(np.array_equal(np.array(g), w) for g, w in zip(got, want, strict=True))
                del got
    for name, values in totals.items():
        print(
            f"{name:12s} median {statistics.median(values) * 1e3:7.1f} ms  "
            f"({', '.join(f'{v * 1e3:.0f}' for v in values)})"
        )
        for part, per_round in parts[name].items():
            print(f"  {part:10s} {statistics.median(per_round) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
