"""The keys of the shared prefix index (kvtrio.actors.sharedkeys.index_keys / probe_keys):
a query finds every stored sequence sharing a full block with it (or equal to it) under
one of its probe keys, and each probe key's bound is never below what the sequence found
under it has in common with the query (rule 8 of kvtrio.actors.tiered stops at bounds)."""

from __future__ import annotations

import random

import pytest
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.sharedkeys import index_keys, probe_keys

MODEL = ModelKey("m", "fp")
BLOCK = 4


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(5))
def test_probe_keys_find_every_shared_prefix_with_a_sound_bound(seed: int) -> None:
    rng = random.Random(seed)
    base = [rng.randrange(3) for _ in range(24)]
    for _ in range(200):
        stored = base[: rng.randrange(1, 25)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        query = base[: rng.randrange(1, 25)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        registered = set(index_keys(MODEL, stored, BLOCK))
        probes = probe_keys(MODEL, query, BLOCK)
        bounds = [bound for _, bound in probes]
        assert bounds == sorted(bounds, reverse=True)  # deepest first
        hits = [bound for key, bound in probes if key in registered]
        common = _common(stored, query)
        if stored == query or common >= BLOCK:
            assert hits, (stored, query)
            assert hits[0] >= min(common, len(query))
        else:
            assert not hits


def test_other_models_never_share_keys() -> None:
    tokens = list(range(12))
    other = ModelKey("m", "other-fp")
    assert not set(index_keys(MODEL, tokens, BLOCK)) & set(index_keys(other, tokens, BLOCK))
