"""kvtrio.serve.triesearch: mlx-lm's PromptTrie.search answers, without its quadratic walk."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtrio.serve import triesearch
from kvtrio.serve.adapter import _RecordingTrie
from mlx_lm.models.cache import PromptTrie

MODEL = ("m", None, None)
# A small alphabet: shared prefixes, branches and equal-length ties between entries.
TOKENS = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=400, deadline=None)
@given(entries=st.lists(TOKENS, max_size=8), prompts=st.lists(TOKENS, min_size=1, max_size=6))
def test_search_gives_mlx_lms_answer_on_any_trie_and_prompt(
    entries: list[list[int]], prompts: list[list[int]]
) -> None:
    trie = PromptTrie()
    for n, tokens in enumerate(entries):
        trie.add(MODEL, tokens, n)
    for prompt in [*prompts, *entries]:
        for model in (MODEL, ("other", None, None)):
            assert triesearch.search(trie, model, prompt) == trie.search(model, prompt)


def test_kvtrios_trie_searches_with_it() -> None:
    trie = _RecordingTrie()
    trie.add(MODEL, [1, 2, 3, 4], "a")
    trie.add(MODEL, [1, 2, 5], "b")
    found = trie.search(MODEL, [1, 2, 9])
    assert found == PromptTrie.search(trie, MODEL, [1, 2, 9])
    assert found.longer == [1, 2, 5] and found.common_prefix == 2


def test_a_long_entry_beyond_a_short_match_is_walked_without_copying_its_path() -> None:
    # A new conversation shares a chat template's first tokens with long RAM entries:
    # mlx-lm's walk copies the path so far at every node (a 20,000-token entry: 200
    # million list items copied). Measured by memory, not time: where the long path forks
    # into 64 entries, mlx-lm holds 64 copies of it at once (about 10 MB); this search
    # holds one link per node walked (about 1.4 MB).
    trie = PromptTrie()
    long = [1, 2, 3, *range(10, 20_010)]
    for k in range(64):
        trie.add(MODEL, [*long, 100_000 + k], k)
    prompt = [1, 2, 3, 7, 7]
    tracemalloc.start()
    try:
        found = triesearch.search(trie, MODEL, prompt)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        expected = trie.search(MODEL, prompt)
        mlx_lms_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == expected
    assert found.longer[:-1] == long and found.common_prefix == 3 and found.shorter is None
    assert mlx_lms_peak > 5_000_000, mlx_lms_peak  # the shape does show the copies
    assert peak < 4_000_000, peak
