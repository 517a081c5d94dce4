"""`kvtrio bench serve`'s start fill: the entries each server finds on disk at a restart.

The start phase checks a restart "with 1,000 entries on disk": :func:`fill` writes them
where each kind keeps its cache, the naive baseline's as mlx-lm's ``save_prompt_cache``
files, kvtrio's through its adapter, every one admitted and every one on disk (checked).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["fill"]


def fill(kind: str, model: Path, work: Path, entries: int) -> float:
    """Write ``entries`` small entries where ``kind`` keeps its cache; seconds taken."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    llm: Any = load(str(model))[0]
    import mlx.core as mx

    def caches_for(tokens: list[int]) -> list[Any]:
        caches = make_prompt_cache(llm)
        llm(mx.array([tokens]), cache=caches)
        mx.eval([c.state for c in caches])
        return list(caches)

    started = time.perf_counter()
    if kind == "naive":
        directory = work / "naive"
        directory.mkdir(parents=True, exist_ok=True)
        for i in range(entries):
            tokens = [1 + i % 500, 1 + i // 500, *range(3, 35)]
            save_prompt_cache(str(directory / f"{i}.safetensors"), caches_for(tokens))
            (directory / f"{i}.json").write_text(json.dumps(tokens))
    elif kind == "kvtrio":
        from kvtrio.actors.policy import AdmitAll
        from kvtrio.serve.adapter import TieredLRUPromptCache
        from kvtrio.serve.bridge import TierOptions, TierThread
        from kvtrio.serve.flags import model_identity

        flags = argparse.Namespace(
            model=str(model), adapter_path=None, draft_model=None, kv_bits=None
        )
        key = model_identity(flags)  # all admitted (the default refuses a big model's short ones)
        options = TierOptions(str(work / "kv"), key, shutdown_grace=3600, admission=AdmitAll())
        tier = TierThread(options)
        tier.start()
        tier.bind()
        # Every entry stays in RAM until the close writes them all (a flush sheds nothing):
        # evicted as they were made, an H200's fill outran the disk and the pending-write cap
        # shed most of them (159-164 of 1,000 on disk; docs/bench/serve.md, gpu12).
        cache = TieredLRUPromptCache(entries, tier=tier, tier_model=(str(model), None, None))
        for i in range(entries):
            tokens = [1 + i % 500, 1 + i // 500, *range(3, 35)]
            cache.insert_cache((str(model), None, None), tokens, caches_for(tokens))
        closed = cache.close()
        report = cache.flush_report()
        if not closed or report.landed != entries:
            lost = report.lost[:3]
            raise RuntimeError(f"start fill: {report.landed} of {entries} on disk; {lost}")
    return time.perf_counter() - started
