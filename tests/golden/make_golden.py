"""Make the golden files of the kvtrio cache format: ``python tests/golden/make_golden.py``.

Every format version ever written keeps its golden files here, committed, and
tests/storage/test_golden.py requires them to keep loading bit-exact. Run this script only
when adding a NEW format version (it writes ``v<FORMAT_VERSION>/`` and refuses to
overwrite an existing version's files).

Contents are deterministic (no RNG, fixed created_at): every cache kind, empty caches,
an attachment, a minimum reusable offset, in the single layout and the block layout.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache_module

mlx_cache: Any = _mlx_cache_module

GOLDEN_DIR = os.path.dirname(os.path.abspath(__file__))
TOKENS = list(range(100, 141))


def tokens_for(version: int) -> list[int]:
    """The tokens version ``version``'s files record: :data:`TOKENS` in version 1's,
    written before writers required a token list to agree with every layer's offset;
    none from version 2 on (the layers here hold different counts, so no list agrees)."""
    return TOKENS if version == 1 else []
META = {"model_id": "golden-model", "config_fingerprint": "sha256:" + "ab" * 32, "note": "gold"}


def pattern(shape: tuple[int, ...], dtype: Any, salt: int) -> Any:
    """A deterministic array: small integers scaled, exact in every float dtype."""
    n = 1
    for d in shape:
        n *= d
    values = ((mx.arange(n, dtype=mx.int32) * 7 + salt) % 61 - 30).astype(mx.float32) / 8
    return values.reshape(shape).astype(dtype)


def kv_pair(n: int, dtype: Any, salt: int) -> tuple[Any, Any]:
    return pattern((1, 2, n, 32), dtype, salt), pattern((1, 2, n, 32), dtype, salt + 1)


def build_caches() -> list[Any]:
    """The caches every golden file holds (tests rebuild them to compare)."""
    kv = mlx_cache.KVCache()
    kv.update_and_fetch(*kv_pair(41, mx.float16, 1))
    kv.min_reusable_offset = 9
    kv_bf16 = mlx_cache.KVCache()
    kv_bf16.update_and_fetch(*kv_pair(5, mx.bfloat16, 3))
    rotating = mlx_cache.RotatingKVCache(max_size=16, keep=2)
    rotating.update_and_fetch(*kv_pair(20, mx.float16, 5))
    for i in range(3):
        rotating.update_and_fetch(*kv_pair(1, mx.float16, 7 + i))
    quantized = mlx_cache.QuantizedKVCache(group_size=32, bits=8)
    quantized.update_and_fetch(*kv_pair(12, mx.float16, 11))
    chunked = mlx_cache.ChunkedKVCache(chunk_size=8)
    chunked.update_and_fetch(*kv_pair(10, mx.float32, 13))
    chunked.maybe_trim_front()
    arrays = mlx_cache.ArraysCache(3)
    arrays[0] = pattern((1, 3, 4), mx.float32, 17)
    arrays[2] = pattern((1, 2, 2), mx.bfloat16, 19)
    nested = mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.ArraysCache(1))
    nested.caches[0].update_and_fetch(*kv_pair(3, mx.float16, 23))
    empty = mlx_cache.KVCache()
    return [kv, kv_bf16, rotating, quantized, chunked, arrays, nested, empty]


def build_attachments() -> list[Any]:
    from kvtrio.storage.cacheio import AttachmentData

    arrays = (mx.arange(6, dtype=mx.int32).reshape(2, 3), pattern((4,), mx.float16, 29))
    return [AttachmentData("golden/v1", {"k": "v"}, arrays)]


def main() -> int:
    from kvtrio.storage.blockstore import LocalBlockStore
    from kvtrio.storage.cacheio import materialize, snapshot
    from kvtrio.storage.format import FORMAT_VERSION
    from kvtrio.storage.writer import write_blocks, write_single

    out = os.path.join(GOLDEN_DIR, f"v{FORMAT_VERSION}")
    if os.path.exists(out):
        print(f"{out} exists: golden files of a written version are never regenerated")
        return 1
    os.makedirs(out)
    snap = snapshot(
        build_caches(),
        tokens_for(FORMAT_VERSION),
        model_id=META["model_id"],
        config_fingerprint=META["config_fingerprint"],
        meta={"note": META["note"]},
        attachments=build_attachments(),
    )
    snap = attrs.evolve(snap, header=attrs.evolve(snap.header, created_at=0.0))
    host = materialize(snap)
    write_single(os.path.join(out, "single.kvt"), snap.header, [h.pieces[0] for h in host])
    pieces = materialize(snap, block_tokens=16)
    store = LocalBlockStore(os.path.join(out, "blocks"))
    write_blocks(
        os.path.join(out, "manifest.kvt"),
        snap.header,
        [h.pieces for h in pieces],
        store,
        block_tokens=16,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
