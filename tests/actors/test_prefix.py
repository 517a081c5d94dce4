"""The hash-chain prefix index: mlx-lm's fetch_nearest semantics, namespaced by model."""

from __future__ import annotations

from typing import Any

import pytest
from kvtrio.actors.prefix import (
    MatchKind,
    ModelKey,
    PrefixIndex,
    chain_hashes,
    entry_key,
)

MODEL = ModelKey("tiny-llama", "fp-a")


def _index(*seqs: list[int], block_size: int = 4, trimmable: bool = True) -> PrefixIndex:
    index = PrefixIndex(block_size=block_size)
    for seq in seqs:
        index.add(index.make_entry(MODEL, seq, trimmable=trimmable))
    return index


def test_chain_hash_depends_on_every_earlier_block() -> None:
    a = chain_hashes(MODEL, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes(MODEL, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2
    assert a[0] != b[0] and a[1] != b[1]


def test_exact_hit_returns_nothing_left_to_compute() -> None:
    index = _index(list(range(10)))
    match = index.lookup(MODEL, list(range(10)))
    assert match is not None
    assert match.kind is MatchKind.EXACT
    assert (match.reuse, match.trim) == (10, 0)


def test_shorter_prefix_returns_the_tokens_still_to_process() -> None:
    index = _index(list(range(6)), list(range(9)))
    match = index.lookup(MODEL, list(range(15)))
    assert match is not None
    assert match.kind is MatchKind.SHORTER
    assert match.entry.tokens == tuple(range(9))
    assert match.reuse == 9


def test_longer_entry_is_trimmed_back_to_the_common_prefix() -> None:
    index = _index([*range(10), 100, 101, 102])
    match = index.lookup(MODEL, [*range(10), 7, 7])
    assert match is not None
    assert match.kind is MatchKind.LONGER
    assert (match.reuse, match.trim) == (10, 3)


def test_longer_entry_covering_the_whole_query_leaves_one_token() -> None:
    """Logits need at least one token to run: the trim stops one short of the query."""
    index = _index(list(range(20)))
    match = index.lookup(MODEL, list(range(12)))
    assert match is not None
    assert match.kind is MatchKind.LONGER
    assert (match.reuse, match.trim) == (11, 9)


def test_longer_is_preferred_only_when_it_keeps_more_than_the_shorter() -> None:
    index = _index(list(range(8)), [*range(9), 50, 51])
    match = index.lookup(MODEL, [*range(9), 60, 61, 62])
    assert match is not None
    assert (match.kind, match.reuse) == (MatchKind.LONGER, 9)
    index2 = _index(list(range(9)), [*range(9), 50, 51])
    match2 = index2.lookup(MODEL, [*range(9), 60, 61, 62])
    assert match2 is not None
    assert (match2.kind, match2.reuse) == (MatchKind.SHORTER, 9)


def test_minimum_reusable_offset_is_respected() -> None:
    """A longer entry is never trimmed below its minimum reusable offset."""
    index = _index(list(range(4)))
    index.add(index.make_entry(MODEL, [*range(12), 99], min_reusable_offset=11))
    match = index.lookup(MODEL, [*range(10), 5])
    assert match is not None
    assert (match.kind, match.entry.tokens) == (MatchKind.SHORTER, tuple(range(4)))
    ok = index.lookup(MODEL, [*range(12), 5])
    assert ok is not None
    assert (ok.kind, ok.reuse) == (MatchKind.LONGER, 12)


def test_non_trimmable_entries_are_used_only_exact_or_as_prefixes() -> None:
    index = _index(list(range(10)), trimmable=False)
    assert index.lookup(MODEL, [*range(8), 3]) is None
    shorter = index.lookup(MODEL, [*range(10), 3])
    assert shorter is not None and shorter.kind is MatchKind.SHORTER
    exact = index.lookup(MODEL, list(range(10)))
    assert exact is not None and exact.kind is MatchKind.EXACT


def test_a_different_model_id_or_fingerprint_never_hits() -> None:
    index = _index(list(range(10)))
    for other in (ModelKey("other", "fp-a"), ModelKey("tiny-llama", "fp-b")):
        assert index.lookup(other, list(range(10))) is None
        assert index.lookup(other, list(range(20))) is None
        assert index.lookup(other, list(range(5))) is None
    assert entry_key(MODEL, [1, 2], 4) != entry_key(ModelKey("tiny-llama", "fp-b"), [1, 2], 4)


def test_remove_forgets_the_entry_and_its_nodes() -> None:
    index = _index(list(range(10)))
    key = entry_key(MODEL, list(range(10)), 4)
    removed = index.remove(key)
    assert removed is not None and removed.key == key
    assert len(index) == 0
    assert index.lookup(MODEL, list(range(10))) is None
    assert index._nodes == {}


def _common(s: tuple[int, ...], query: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(s), len(query)) and s[n] == query[n]:
        n += 1
    return n


@pytest.mark.parametrize(
    "alphabet",
    [(0, 1, 2, 3, 4), (0, 1, 255, 256, 65_536, 2**32 - 1)],
    ids=["small ids", "ids across byte boundaries"],
)
def test_lookup_agrees_with_a_brute_force_scan(alphabet: tuple[int, ...]) -> None:
    """Against every-entry comparison on random prefix-sharing sequences. The index keeps
    tokens packed (u32 big-endian) and compares their bytes: ids whose bytes order
    differs from a little-endian or one-byte reading must sort and match as numbers."""
    import random

    rng = random.Random(7)

    def some(n: int) -> list[int]:
        return [rng.choice(alphabet) for _ in range(n)]

    base = some(40)
    seqs = {tuple(base[: rng.randrange(1, 40)] + some(3)) for _ in range(30)}
    index = _index(*[list(s) for s in seqs], block_size=3)
    for entry in index:
        assert entry.tokens in seqs and entry.length == len(entry.tokens)
    for node in index._nodes.values():  # numeric order: the catalogue's (sqlite's) ranks
        start = node.depth * 3
        windows = [entry.tokens[start : start + 3] for entry in node.runs]
        assert windows == sorted(windows)
    for _ in range(200):
        query = tuple(base[: rng.randrange(1, 40)] + some(2))
        match = index.lookup(MODEL, query)
        prefixes = [s for s in seqs if len(s) < len(query) and query[: len(s)] == s]
        best_short = max((len(s) for s in prefixes), default=0)

        best_long = max(
            (min(len(query) - 1, _common(s, query)) for s in seqs if _common(s, query) < len(s)),
            default=0,
        )
        if query in seqs:
            assert match is not None and match.kind is MatchKind.EXACT
        elif best_long > best_short:
            assert match is not None and (match.kind, match.reuse) == (MatchKind.LONGER, best_long)
        elif best_short:
            assert match is not None and (match.kind, match.reuse) == (
                MatchKind.SHORTER,
                best_short,
            )
        else:
            assert match is None


def test_tokens_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, 2\*\*32\)$"):
        entry_key(MODEL, [-1], 4)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import kvtrio.actors.prefix as prefix

    calls = [0]
    real = prefix._common_prefix

    def counted(a: Any, b: Any, start: int) -> int:
        calls[0] += 1
        return real(a, b, start)

    monkeypatch.setattr(prefix, "_common_prefix", counted)
    return calls


def test_a_miss_examines_candidates_not_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 entries under one root: a miss, and a longer match, compare a few entries
    next to the query's place in the sorted runs, never all of them."""
    import random

    rng = random.Random(3)
    index = PrefixIndex(block_size=16)
    for _ in range(10_000):
        index.add(index.make_entry(MODEL, [rng.randrange(1000) for _ in range(12)]))
    calls = _counting(monkeypatch)
    assert index.lookup(MODEL, [1001, 1002, 1003]) is None
    assert calls[0] <= 4
    entry = next(iter(index))
    calls[0] = 0
    match = index.lookup(MODEL, [*entry.tokens[:6], 1005])
    assert match is not None and match.kind is MatchKind.LONGER and match.reuse == 6
    assert calls[0] <= 8


def test_a_prompt_shared_by_thousands_costs_a_bounded_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5,000 entries sharing a two-block system prompt, each with its own tail: a new
    tail's lookup weighs at most MAX_TIES of the entries that tie."""
    from kvtrio.actors.prefix import MAX_TIES

    system = list(range(40))
    index = PrefixIndex(block_size=16)
    for i in range(5_000):
        index.add(index.make_entry(MODEL, [*system, 5000 + i, 7, 7]))
    calls = _counting(monkeypatch)
    match = index.lookup(MODEL, [*system, 99, 99])
    assert match is not None and match.kind is MatchKind.LONGER and match.reuse == 40
    assert calls[0] <= MAX_TIES + 2


def test_the_common_prefix_of_packed_tokens_agrees_with_a_token_by_token_count() -> None:
    """The index counts shared tokens on packed bytes (a binary search over slice
    comparisons); against the plain loop, from any start known to agree."""
    import random

    import kvtrio.actors.prefix as prefix

    rng = random.Random(11)
    for _ in range(3000):
        a = [rng.choice((0, 1, 256, 2**32 - 1)) for _ in range(rng.randrange(20))]
        b = [rng.choice((0, 1, 256, 2**32 - 1)) for _ in range(rng.randrange(20))]
        shared = _common(tuple(a), tuple(b))
        start = rng.randrange(shared + 1)
        packed_a, packed_b = prefix.pack_tokens(a), prefix.pack_tokens(b)
        assert prefix._common_prefix(packed_a, packed_b, start) == shared


def test_keys_then_runs_build_the_index_add_builds() -> None:
    """Open's two-step add (``add_keys`` in the order the entries were made, then
    ``add_runs`` in token order, each in batches) leaves the same entries, nodes, runs and
    tail counts as one ``add`` each in token order, and every entry is then found by a
    lookup."""
    import random

    rng = random.Random(12)
    other = ModelKey("other", "fp-b")
    seqs = {tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12))) for _ in range(80)}
    one_by_one, in_steps = PrefixIndex(block_size=3), PrefixIndex(block_size=3)
    entries = [
        one_by_one.make_entry(MODEL if i % 3 else other, seq) for i, seq in enumerate(seqs)
    ]
    by_tokens = sorted(entries, key=lambda e: (e.packed, e.key))
    for entry in by_tokens:
        one_by_one.add(entry)
    in_steps.add_keys(entries[:30])
    in_steps.add_keys(entries[30:])
    in_steps.add_runs(by_tokens[:40])
    in_steps.add_runs(iter(by_tokens[40:]))
    assert in_steps._entries == one_by_one._entries
    assert in_steps._nodes.keys() == one_by_one._nodes.keys()
    for node_hash, node in one_by_one._nodes.items():
        placed = in_steps._nodes[node_hash]
        assert [e.key for e in placed.runs] == [e.key for e in node.runs]
        assert placed.tails == node.tails
    for entry in entries:
        match = in_steps.lookup(entry.model, entry.tokens)
        assert match is not None and match.kind is MatchKind.EXACT, entry.tokens


def test_add_keys_refuses_a_key_indexed_or_given_twice_and_registers_nothing() -> None:
    index = _index([1, 2, 3])
    (known,) = list(index)
    fresh = index.make_entry(MODEL, [4, 5])
    with pytest.raises(ValueError, match=r"^add_keys: a key is given twice or is indexed already$"):
        index.add_keys([fresh, known])
    with pytest.raises(ValueError, match=r"^add_keys: a key is given twice or is indexed already$"):
        index.add_keys([fresh, fresh])
    assert fresh.key not in index and len(index) == 1


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the index's chain walks (one per lookup that is not answered from the
    last one)."""
    calls = [0]
    real = PrefixIndex._walk

    def counted(index: PrefixIndex, model: ModelKey, little: Any) -> Any:
        calls[0] += 1
        return real(index, model, little)

    monkeypatch.setattr(PrefixIndex, "_walk", counted)
    return calls


def test_a_lookup_hashes_each_block_of_the_query_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4k-token lookup walks its 16 blocks once: the exact probe extends the walk's
    last hash by the tail instead of hashing the whole chain again."""
    import hashlib

    entry = list(range(1, 4104))  # 16 full blocks of 256 and a tail of 7
    index = _index(entry, block_size=256)
    hashes = [0]
    real = hashlib.sha256

    def counted(*args: Any) -> Any:
        hashes[0] += 1
        return real(*args)

    monkeypatch.setattr(hashlib, "sha256", counted)
    match = index.lookup(MODEL, [*entry, *range(9000, 9040)])
    assert match is not None and (match.kind, match.reuse) == (MatchKind.SHORTER, len(entry))
    # 16 blocks walked, the query's own key (its tail), the one tail length ending there
    assert hashes[0] == 16 + 1 + 1


def test_a_repeated_lookup_is_answered_from_the_last_until_the_index_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs rule 5 of kvtrio.actors.prefix: the same query at the same epoch is not walked
    again; every add (one or many) and remove bumps the epoch, and the next lookup sees
    the change."""
    index = _index(list(range(10)))
    walks = _walks(monkeypatch)
    query = [*range(12), 50]
    first = index.lookup(MODEL, query)
    assert first is not None and first.reuse == 10
    assert index.lookup(MODEL, tuple(query)) == first and walks[0] == 1  # no second walk
    assert index.lookup(MODEL, query[:-1]) is not None and walks[0] == 2  # another query
    other = ModelKey("tiny-llama", "fp-b")
    assert index.lookup(other, query) is None and walks[0] == 3  # another model
    epoch = index.epoch
    index.add(index.make_entry(MODEL, list(range(12))))
    assert index.epoch > epoch
    match = index.lookup(MODEL, query)
    assert match is not None and match.reuse == 12 and walks[0] == 4
    exact = index.make_entry(MODEL, query)
    index.add_keys([exact])  # open's two steps: each changes what a lookup may see
    index.add_runs([exact])
    match = index.lookup(MODEL, query)
    assert match is not None and match.kind is MatchKind.EXACT and walks[0] == 5
    index.remove(match.entry.key)
    match = index.lookup(MODEL, query)
    assert match is not None and match.reuse == 12 and walks[0] == 6
