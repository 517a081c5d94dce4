"""mlx-lm's ``PromptTrie.search`` in time linear in the trie walked, with the same answers.

mlx-lm's search looks for the shortest stored entry that extends the prompt's deepest
match (``longer``) by a depth-first walk that copies the path so far at every node
(``extra + [tok]``): walking one long entry of L tokens beyond the match copies
L * (L + 1) / 2 list items. A prompt that shares only a chat template's first tokens
with a RAM entry of 8,192 tokens (any new conversation, once such an entry is the only
one beyond the template) cost about 90 ms of the generation thread per search on the
H200 machine's host (docs/benchmarks.md, "H200, tenth session"), and kvtrio serve
searched up to three times per request (rule 8's arrival, rule 3's prefetch, the lookup).

:func:`search` walks the same nodes in the same order with the same pruning, and keeps
a path as (token, parent) links instead of copied lists; the path of the entry found is
built once at the end. Its result equals mlx-lm's for every trie and prompt (tests/serve/
test_triesearch.py compares them on random tries).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as _mlx_cache

__all__ = ["search"]

_VALUE = "__value__"  # mlx-lm's PromptTrie marks an entry's node with this key


def search(trie: Any, model: Any, tokens: list[int]) -> Any:
    """``trie.search(model, tokens)`` (a ``PromptTrie``), without its quadratic walk."""
    result = _mlx_cache.PromptTrieResult
    if model not in trie._trie:
        return result(model, None, None, None, 0)
    current = trie._trie[model]
    if not tokens and _VALUE in current:
        return result(model, [], None, None, 0)
    last_index = -1
    index = 0
    while index < len(tokens) and tokens[index] in current:
        current = current[tokens[index]]
        if _VALUE in current:
            last_index = index
        index += 1
    if last_index == len(tokens) - 1 >= 0:
        return result(model, tokens, None, None, 0)
    shorter = tokens[: last_index + 1] if last_index > 0 else None
    longer = None
    if index > 0:
        best: tuple[int, Any] | None = None  # (depth, path link) of the entry found
        stack: list[tuple[Any, int, Any]] = [(current, 0, None)]
        while stack:
            node, depth, link = stack.pop()
            if _VALUE in node:
                if best is None or depth < best[0]:
                    best = (depth, link)
            elif best is None or depth < best[0]:
                for tok in node:
                    stack.append((node[tok], depth + 1, (tok, link)))
        if best is None:  # a node with neither entry nor child: mlx-lm fails the same way
            raise TypeError('can only concatenate list (not "NoneType") to list')
        extra: list[int] = []
        link = best[1]
        while link is not None:
            extra.append(link[0])
            link = link[1]
        extra.reverse()
        longer = tokens[:index] + extra
    return result(model, None, shorter, longer, index)
