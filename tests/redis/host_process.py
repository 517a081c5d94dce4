"""One simulated host of a shared tier: a separate process with its own local directory.

Run as ``python host_process.py ACTION URL LOCAL_DIR NAME TOKENS [BASE]``; prints one JSON
line. ``save`` writes a synthetic KV cache of ``TOKENS`` tokens (the bytes of token t
depend only on t, so every host computes the same bytes for a shared prefix, as real
hosts do for a shared system prompt) through the block layout: blocks to Redis, the
manifest to Redis. ``load`` reads manifest ``NAME`` and its blocks back, verifying every
hash, and reports a sha256 of the loaded tensors.

The tests import :func:`synthetic_cache` and :func:`digest` from here too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np
from kvtrio.storage.format import CacheEntry, Header, TensorSlot, piece_ranges
from kvtrio.storage.openstore import open_store
from kvtrio.storage.reader import allocate_buffers, read_manifest, read_tensors
from kvtrio.storage.writer import write_blocks

LAYERS, HEADS, DIM, BLOCK_TOKENS = 2, 2, 32, 16


def synthetic_cache(tokens: int) -> tuple[Header, list[np.ndarray]]:
    """A plan header and K/V arrays whose token t holds bytes determined by t alone."""
    arrays = []
    for tensor in range(2 * LAYERS):
        per_token = [
            np.random.default_rng([tensor, t]).standard_normal((HEADS, DIM)).astype(np.float16)
            for t in range(tokens)
        ]
        arrays.append(np.stack(per_token, axis=1)[None])  # (1, heads, tokens, dim)
    slot = TensorSlot(
        shape=(1, HEADS, tokens, DIM), dtype="float16", nbytes=HEADS * tokens * DIM * 2,
        token_axis=2,
    )  # fmt: skip
    entry = CacheEntry(
        kind="KVCache", offset=tokens, min_reusable_offset=0, trimmable=True, fields={},
        tensors=(slot, slot),
    )  # fmt: skip
    header = Header(
        layout="blocks", tokens=tuple(range(tokens)), caches=(entry,) * LAYERS,
        created_at=time.time(), model_id="synthetic", config_fingerprint="f" * 16,
    )  # fmt: skip
    return header, arrays


def pieces_of(header: Header, arrays: list[np.ndarray]) -> list[list[memoryview]]:
    slots = list(header.slots())
    return [
        [
            np.ascontiguousarray(a[:, :, start:stop, :]).data.cast("B")
            for start, stop in piece_ranges(slot, BLOCK_TOKENS)
        ]
        for slot, a in zip(slots, arrays, strict=True)
    ]


def digest(buffers: list[list[bytearray]] | list[list[memoryview]]) -> str:
    h = hashlib.sha256()
    for pieces in buffers:
        for piece in pieces:
            h.update(piece)
    return h.hexdigest()


def main(action: str, url: str, local_dir: str, name: str, tokens: int) -> dict[str, object]:
    # ``local_dir`` is the host's own directory: a Redis host needs nothing there.
    blocks, manifests = open_store(url)
    try:
        if action == "save":
            header, arrays = synthetic_cache(tokens)
            pieces = pieces_of(header, arrays)
            result = write_blocks(
                name, header, pieces, blocks, block_tokens=BLOCK_TOKENS, manifests=manifests
            )
            return {"new_block_bytes": result.new_block_bytes, "digest": digest(pieces)}
        cache_file = read_manifest(manifests, name)
        buffers = allocate_buffers(cache_file.header)
        views = [[memoryview(b) for b in pieces] for pieces in buffers]
        read_tensors(cache_file, views, store=blocks, verify=True)
        return {"tokens": len(cache_file.header.tokens), "digest": digest(buffers)}
    finally:
        manifests.close()
        blocks.close()


if __name__ == "__main__":
    action, url, local_dir, name, tokens = sys.argv[1:6]
    print(json.dumps(main(action, url, local_dir, name, int(tokens))))
