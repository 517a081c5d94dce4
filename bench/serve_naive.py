"""The naive persistence baseline of ``kvtrio bench serve``: mlx_lm.server whose
LRUPromptCache also calls mlx-lm's own ``save_prompt_cache`` on every insert (on the
generation thread, as a user would write it) and, on a RAM miss, loads the saved file
with the longest common prefix. Run as ``python -m kvtrio.bench.serve_naive`` with
mlx_lm.server's flags; the files go to ``$KVTRIO_NAIVE_DIR``. With
``$KVTRIO_NAIVE_SAVE_TRACE`` set, each save's span is appended there as ``kvtrio serve
--save-trace`` writes it (:mod:`kvtrio.serve.savetrace`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from kvtrio.serve.savetrace import SaveTrace
from mlx_lm import server as mlx_server
from mlx_lm.models import cache as mlx_cache

__all__ = ["NaivePromptCache", "main"]

_cache: Any = mlx_cache


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class NaivePromptCache(_cache.LRUPromptCache):  # type: ignore[misc]
    """LRUPromptCache + save_prompt_cache on insert + load_prompt_cache on a miss."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63) -> None:
        super().__init__(max_size, max_bytes)
        self.dir = Path(os.environ["KVTRIO_NAIVE_DIR"])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: dict[tuple[int, ...], Path] = {}
        self.trace = SaveTrace.at(os.environ.get("KVTRIO_NAIVE_SAVE_TRACE") or None)
        for sidecar in self.dir.glob("*.json"):
            tokens = tuple(json.loads(sidecar.read_text()))
            self.files[tokens] = sidecar.with_suffix(".safetensors")

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        start = time.perf_counter()
        name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
        path = self.dir / f"{name}.safetensors"
        _cache.save_prompt_cache(str(path), prompt_cache)
        (self.dir / f"{name}.json").write_text(json.dumps(tokens))
        self.files[tuple(tokens)] = path
        if self.trace is not None:  # the save is the write, on this thread
            end = time.perf_counter()
            self.trace.record(start, end, len(tokens), (start, end))

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None or not self.files:
            return cache, rest
        stored, path = max(self.files.items(), key=lambda item: _common(item[0], tokens))
        common = _common(stored, tokens)
        if common == 0:
            return None, tokens
        cache = _cache.load_prompt_cache(str(path))
        if stored == tuple(tokens):
            return cache, []
        if len(stored) > common:  # longer or diverging: trim back (LRUPromptCache's rule)
            if not _cache.can_trim_prompt_cache(cache):
                return None, tokens
            prefix = min(len(tokens) - 1, common)
            _cache.trim_prompt_cache(cache, len(stored) - prefix)
            return cache, tokens[prefix:]
        return cache, tokens[len(stored) :]


def main() -> None:
    server: Any = mlx_server
    server.LRUPromptCache = NaivePromptCache
    server.main()


if __name__ == "__main__":
    main()
