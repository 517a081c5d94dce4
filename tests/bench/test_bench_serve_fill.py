"""`kvtrio bench serve`'s fill: the start phase's entries are on kvtrio's disk, all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors import policy, tiered
from kvtrio.serve import adapter
from kvtrio.serve.modeldir import write_tiny_model_dir


class _RefuseAll(policy.AdmissionPolicy):
    def admit(self, candidate: policy.AdmissionCandidate) -> bool:
        return False


def test_the_fill_writes_every_entry_whatever_the_default_admission_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start phase checks a restart "with 1,000 entries on disk". The fill went through
    a 64-entry RAM cache whose evictions the tier's default admission judged: with the
    SmolLM2-135M-shaped model it refused every one (too little prefill saved per byte), so
    only the 64 entries still in RAM at the end reached kvtrio's disk, against the naive
    baseline's 1,000. Here the default refuses everything: the fill's entries are written
    anyway."""
    from kvtrio.bench.serve_fill import fill

    monkeypatch.setattr(tiered, "default_admission", _RefuseAll)
    counted: list[int] = []
    close = adapter.TieredLRUPromptCache.close

    def closing(self: adapter.TieredLRUPromptCache, **kwargs: Any) -> bool:
        done = close(self, **kwargs)
        stats = self.cold_statistics()
        assert stats is not None
        counted.append(stats.cold_entries)
        return done

    monkeypatch.setattr(adapter.TieredLRUPromptCache, "close", closing)
    model = write_tiny_model_dir(tmp_path / "model")
    fill("kvtrio", model, tmp_path / "kvtrio-entries", 70)
    assert counted == [70]


def test_the_fill_fails_when_an_entry_did_not_reach_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the H200 the fill's writes outran the disk and the pending-write cap shed most of
    them (159-164 of 1,000 on disk): the fill now keeps every entry in RAM until the close
    writes them all, and a fill that still leaves one off the disk is an error, not a
    start figure measured on fewer entries."""
    from kvtrio.bench.serve_fill import fill

    monkeypatch.setattr(adapter.TieredLRUPromptCache, "close", lambda self, **kw: False)
    model = write_tiny_model_dir(tmp_path / "model")
    with pytest.raises(RuntimeError):
        fill("kvtrio", model, tmp_path / "kvtrio-entries", 3)

