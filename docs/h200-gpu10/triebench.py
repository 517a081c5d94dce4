# mypy: ignore-errors
"""Time mlx-lm's PromptTrie.search against kvtrio.serve.triesearch.search (same answer)
for a prompt that shares 3 tokens (a chat template's start) with the one RAM entry of
L tokens: the lookup of the spill phase's request E. Median of 7 per length."""

import statistics
import time

from kvtrio.serve import triesearch
from mlx_lm.models.cache import PromptTrie

M = ("m", None, None)
for L in (1024, 4120, 8216, 16408):
    trie = PromptTrie()
    trie.add(M, [1, 2, 3, *range(10, 10 + L - 3)], "entry")
    prompt = [1, 2, 3, 7, 7]
    old, new = [], []
    for _ in range(7):
        a = time.perf_counter()
        r1 = trie.search(M, prompt)
        b = time.perf_counter()
        r2 = triesearch.search(trie, M, prompt)
        c = time.perf_counter()
        assert r1 == r2
        old.append(b - a)
        new.append(c - b)
    print(
        f"{L:6d} tokens: mlx-lm {1e3 * statistics.median(old):7.1f} ms, "
        f"kvtrio {1e3 * statistics.median(new):6.2f} ms"
    )
