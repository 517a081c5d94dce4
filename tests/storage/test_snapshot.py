"""docs/design.md invariant 1: a snapshot is an independent immutable view of the live caches."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from kvtrio.storage.cacheio import materialize, snapshot

from .conftest import BUILDERS, kv


def _bytes(host: list[Any]) -> list[bytes]:
    return [bytes(p) for h in host for p in h.pieces]


def _mutate(cache: Any, how: str) -> None:
    if how == "append":
        cache.update_and_fetch(*kv(3, seed=77))
    elif how == "trim_append":
        cache.trim(50)
        cache.update_and_fetch(*kv(40, seed=78))
    else:  # write into the live buffer in place
        cache.keys[..., :10, :] = mx.zeros_like(cache.keys[..., :10, :])


@pytest.mark.parametrize("when", ["before_materialize", "after_materialize"])
@pytest.mark.parametrize("how", ["append", "trim_append", "setitem"])
def test_live_cache_changes_never_reach_a_snapshot(how: str, when: str) -> None:
    """Invariant 1: append, trim+append or __setitem__ on the live cache after the
    snapshot cannot change what gets written."""
    reference = _bytes(materialize(snapshot([BUILDERS["kv"]()], [])))
    live = BUILDERS["kv"]()
    snap = snapshot([live], [])
    if when == "after_materialize":
        host = materialize(snap)
        _mutate(live, how)
        mx.eval(live.keys, live.values)
    else:
        _mutate(live, how)
        mx.eval(live.keys, live.values)
        host = materialize(snap)
    assert _bytes(host) == reference


def test_snapshot_plans_without_moving_bytes() -> None:
    live = BUILDERS["kv"]()
    snap = snapshot([live], list(range(302)))
    assert snap.tensor_count == 2 and snap.nbytes == live.keys[..., :302, :].nbytes * 2
    assert all(s.off is None and s.xxh3 is None for s in snap.header.slots())
