"""kvtrio.actors.misses: every miss reason is produced, and the best explanation wins."""

from __future__ import annotations

import pytest
from kvtrio.actors.misses import (
    Departures,
    Explanation,
    MissCounter,
    MissReason,
    explain,
)
from kvtrio.actors.prefix import MatchKind, ModelKey, PrefixIndex

MODEL = ModelKey("model-a", "fp-a")
OTHER = ModelKey("model-a", "fp-kv8")  # the same weights, another kv quantization
B = 4  # block size: small so short token lists span several blocks

DOC = list(range(100, 120))  # 20 tokens


def _index(*entries: tuple[ModelKey, list[int], bool, int]) -> PrefixIndex:
    index = PrefixIndex(block_size=B)
    for model, tokens, trimmable, min_offset in entries:
        index.add(
            index.make_entry(model, tokens, trimmable=trimmable, min_reusable_offset=min_offset)
        )
    return index


def _explain(
    index: PrefixIndex, tokens: list[int], departures: Departures | None = None
) -> Explanation:
    return explain(
        index,
        MODEL,
        tokens,
        index.lookup(MODEL, tokens),
        departures=departures,
        other_models=[MODEL, OTHER],
    )


def test_exact_hit_has_no_reason() -> None:
    index = _index((MODEL, DOC, True, 0))
    got = _explain(index, DOC)
    assert (got.reused, got.reason, got.possible) == (20, None, 20)


def test_no_entry() -> None:
    got = _explain(_index(), DOC)
    assert (got.prompt_tokens, got.reused, got.hit) == (20, 0, False)
    assert got.reason is MissReason.NO_ENTRY


def test_a_shorter_hit_with_nothing_better_cached_says_no_entry() -> None:
    index = _index((MODEL, DOC[:8], True, 0))
    got = _explain(index, DOC)
    assert (got.reused, got.reason, got.possible, got.hit) == (8, MissReason.NO_ENTRY, 8, True)


def test_other_model_key() -> None:
    index = _index((OTHER, DOC, True, 0))
    got = _explain(index, DOC)
    assert (got.reused, got.reason, got.possible) == (0, MissReason.OTHER_MODEL, 20)


def test_not_trimmable() -> None:
    """A rotating (sliding-window) cache cannot be trimmed back to the common prefix."""
    index = _index((MODEL, [*DOC, 1, 2, 3], False, 0))
    got = _explain(index, [*DOC, 9])
    assert (got.reused, got.reason, got.possible) == (0, MissReason.NOT_TRIMMABLE, 20)


def test_below_min_reuse() -> None:
    index = _index((MODEL, DOC, True, 16))
    got = _explain(index, [*DOC[:10], 7, 7])
    assert (got.reused, got.reason, got.possible) == (0, MissReason.BELOW_MIN_REUSE, 10)


@pytest.mark.parametrize(
    "reason",
    [
        MissReason.EVICTED,
        MissReason.DROPPED,
        MissReason.CORRUPT,
        MissReason.STORE_UNREACHABLE,
        MissReason.EXPIRED,
    ],
)
def test_departed_entries_explain_the_miss(reason: MissReason) -> None:
    index = _index((MODEL, DOC[:4], True, 0))
    departures = Departures(block_size=B)
    departures.note(index.make_entry(MODEL, DOC), reason)
    got = _explain(index, [*DOC, 5], departures)
    assert (got.reused, got.reason, got.possible) == (4, reason, 20)
    assert got.key == index.make_entry(MODEL, DOC).key


def test_the_candidate_that_would_reuse_most_names_the_reason() -> None:
    index = _index((MODEL, [*DOC[:8], 1, 2], False, 0), (OTHER, DOC[:12], True, 0))
    departures = Departures(block_size=B)
    departures.note(index.make_entry(MODEL, DOC[:16]), MissReason.EVICTED)
    assert _explain(index, DOC, departures).reason is MissReason.EVICTED
    # On a tie, the most actionable reason: a refused longer entry beats an eviction.
    departures.note(index.make_entry(MODEL, DOC[:8]), MissReason.EVICTED)
    departures.forget(index.make_entry(MODEL, DOC[:16]).key)
    tie = _explain(index, [*DOC[:8], 5, 5], departures)
    assert (tie.reason, tie.possible) == (MissReason.NOT_TRIMMABLE, 8)


def test_a_departure_that_came_back_explains_nothing() -> None:
    index = _index()
    departures = Departures(block_size=B)
    entry = index.make_entry(MODEL, DOC)
    departures.note(entry, MissReason.EVICTED)
    departures.forget(entry.key)
    assert len(departures) == 0
    assert _explain(index, [*DOC, 1], departures).reason is MissReason.NO_ENTRY


def test_departures_are_bounded_oldest_forgotten_first() -> None:
    departures = Departures(block_size=B, limit=2)
    index = PrefixIndex(block_size=B)
    for i in range(3):
        departures.note(index.make_entry(MODEL, [i, *DOC]), MissReason.EVICTED)
    assert len(departures) == 2
    assert departures.best(MODEL, [0, *DOC, 1]) is None
    found = departures.best(MODEL, [2, *DOC, 1])
    assert found is not None and found[0].kind is MatchKind.SHORTER
    by_tokens = Departures(block_size=B, token_limit=45)
    for i in range(3):
        by_tokens.note(index.make_entry(MODEL, [i, *DOC]), MissReason.EVICTED)
    assert len(by_tokens) == 2  # 21 tokens each: three would exceed 45
    by_tokens.note(index.make_entry(MODEL, [7] * 40), MissReason.EVICTED)
    assert len(by_tokens) == 1  # 40 tokens: only it fits
    by_tokens.forget(index.make_entry(MODEL, [7] * 40).key)
    by_tokens.note(index.make_entry(MODEL, [0, *DOC]), MissReason.EVICTED)
    assert len(by_tokens) == 1
    with pytest.raises(ValueError, match=r"^no-entry is not a reason an entry leaves the cache$"):
        departures.note(index.make_entry(MODEL, DOC), MissReason.NO_ENTRY)


def test_counter_counts_every_reason() -> None:
    counter = MissCounter()
    for n, reason in enumerate(MissReason, start=1):
        for _ in range(n):
            counter.add(Explanation(10, 0, reason, 5))
    counter.add(Explanation(10, 10, None, 10))
    stats = counter.statistics()
    assert stats.lookups == sum(range(1, len(MissReason) + 1)) + 1
    assert stats.best_possible == 1
    for n, reason in enumerate(MissReason, start=1):
        assert stats.count(reason) == n, reason
