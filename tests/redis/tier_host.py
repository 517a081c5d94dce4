"""One server host of a shared tier: a process with its own local directory and a ColdTier
opened on the Redis URL, caching a tiny random-weight model's real mlx-lm KV caches.

``python tier_host.py URL LOCAL_DIR save KEY N``: prefill tokens 1..N, save as KEY.
``python tier_host.py URL LOCAL_DIR extend BASE KEY N``: load BASE (another host's cache),
prefill the tokens after it up to N on top of it, save as KEY.
``python tier_host.py URL LOCAL_DIR load KEY``: load KEY.
``python tier_host.py URL LOCAL_DIR insert N [N ...]``: through a TieredPromptCache
(``open_tiered_cache``), insert the caches of tokens 1..N for each N and flush them to the
shared tier; prints the digest of each and the cache's statistics.
Prints one JSON line: the sha256 of the caches' live keys and values, and what was
written. The model is rebuilt from a fixed seed, so every process has the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import trio
from kvtrio.actors.tier import ColdTier
from kvtrio.tinymodel import TINY_CONFIG, TinyModel, build_tiny_model, make_caches, prefill

BLOCK_TOKENS = 16
CONFIG = {**TINY_CONFIG, "num_hidden_layers": 2, "hidden_size": 64}


def kv_digest(caches: Sequence[Any]) -> str:
    """sha256 over every layer's live keys and values (call on the MLX owner)."""
    import mlx.core as mx

    h = hashlib.sha256()
    for cache in caches:
        for array in (cache.keys, cache.values):
            live = mx.contiguous(array[..., : cache.offset, :])
            mx.eval(live)
            h.update(bytes(memoryview(live)))  # type: ignore[arg-type]
    return h.hexdigest()


def _build() -> TinyModel:
    return build_tiny_model(CONFIG, seed=7)


def _fresh(tiny: TinyModel, tokens: Sequence[int]) -> list[Any]:
    caches = make_caches(tiny)
    prefill(tiny, caches, tokens)
    return caches


def _extend(tiny: TinyModel, caches: list[Any], tokens: Sequence[int]) -> list[Any]:
    prefill(tiny, caches, tokens)
    return caches


async def insert(url: str, lengths: Sequence[int]) -> dict[str, Any]:
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import open_tiered_cache

    async with MlxOwner.dedicated() as owner:
        tiny = await owner.run(_build)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        digests = {}
        async with open_tiered_cache(
            url, model, owner=owner, hot_budget=1 << 30, cold_budget=1 << 40,
            block_size=BLOCK_TOKENS,
        ) as cache:  # fmt: skip
            for n in lengths:
                tokens = list(range(1, n + 1))
                caches = await owner.run(_fresh, tiny, tokens)
                digests[str(n)] = await owner.run(kv_digest, caches)
                await cache.insert(tokens, caches)
            await cache.flush()
            stats = cache.statistics()
        return {"digests": digests, "cold_entries": stats.cold_entries}


async def main(argv: list[str]) -> dict[str, Any]:
    url, local_dir, action, *args = argv
    os.makedirs(local_dir, exist_ok=True)  # this host's own disk: the shared tier needs none
    if action == "insert":
        return await insert(url, [int(n) for n in args])
    async with ColdTier.open(url, layout="blocks", block_tokens=BLOCK_TOKENS) as tier:
        tiny = await tier.owner.run(_build)
        meta = {"model_id": tiny.model_id, "config_fingerprint": tiny.fingerprint}
        if action == "load":
            restored = await tier.load(args[0])
            return {"digest": await tier.owner.run(kv_digest, restored.caches)}
        if action == "save":
            key, n = args[0], int(args[1])
            tokens = list(range(1, n + 1))
            caches = await tier.owner.run(_fresh, tiny, tokens)
        else:
            base, key, n = args[0], args[1], int(args[2])
            restored = await tier.load(base)
            done = len(restored.tokens)
            tokens = [*restored.tokens, *range(done + 1, n + 1)]
            caches = await tier.owner.run(_extend, tiny, list(restored.caches), tokens[done:])
        result = await (await tier.save(key, tokens, caches, meta=meta)).wait()
        assert result.written and result.write is not None, result
        return {
            "digest": await tier.owner.run(kv_digest, caches),
            "new_block_bytes": result.write.new_block_bytes,
        }


if __name__ == "__main__":
    print(json.dumps(trio.run(main, sys.argv[1:])))
