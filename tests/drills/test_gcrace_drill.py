"""GC racing writers and a deleter: deterministic interleavings, 3,000 in the suite.

The drill's own CI size is 10,000 (``kvtrio drill gcrace``) and ``--full`` 100,000; the
suite runs 3,000 through the drill's size knob to stay within its time budget (each
interleaving is a few ms of thread hand-offs and file copies)."""

from __future__ import annotations

import random
from pathlib import Path

from kvtrio.drills.gcrace import Turnstile
from kvtrio.tests.drills.helpers import run_drill_cli

SUITE_INTERLEAVINGS = 3_000


def test_gc_never_deletes_a_referenced_block_in_3000_interleavings(tmp_path: Path) -> None:
    """GC's grace period (docs/design.md, GC): across seeded interleavings of a dedup writer,
    a writer that deletes a manifest, and a GC pass, no manifest names a deleted block
    and every acknowledged save loads."""
    figures = run_drill_cli(
        "gcrace", tmp_path, env={"KVTRIO_DRILL_INTERLEAVINGS": str(SUITE_INTERLEAVINGS)}
    )
    assert figures["interleavings"] == SUITE_INTERLEAVINGS
    assert figures["thread switches"] >= figures["interleavings"]
    assert figures["referenced blocks deleted"] == 0
    assert figures["losses"] == 0


def test_the_turnstile_replays_an_interleaving_from_its_seed() -> None:
    """The drill's scheduler is deterministic: one seed, one order of steps."""

    def order(seed: int) -> list[str]:
        steps: list[str] = []
        with Turnstile(3) as turnstile:

            def job(name: str) -> None:
                for i in range(20):
                    turnstile.point("write")
                    steps.append(f"{name}{i}")

            errors = turnstile.run(
                [lambda: job("a"), lambda: job("b"), lambda: job("c")], random.Random(seed)
            )
        assert errors == [None, None, None]
        return steps

    first = order(7)
    assert order(7) == first
    assert sorted(first) == sorted(f"{n}{i}" for n in "abc" for i in range(20))
    assert first != sorted(first, key=lambda s: (s[0], int(s[1:])))  # really interleaved
