"""``kvtrio bench scale``'s timed opens: how many per N, in which order, and their summary
(every sample kept, the median of each figure the figure itself). Split from
:mod:`kvtrio.bench.scale`, which runs each open in a fresh process."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_REPEAT",
    "OPEN_KEYS",
    "interleaved_opens",
    "repeats",
    "round_ratios",
    "summarise_opens",
]

DEFAULT_REPEAT = 5  # opens per N up to 100,000 entries (one at 1,000,000: half a minute each)


def repeats(n: int, repeat: int | None) -> int:
    """Opens measured at N: ``--repeat`` where given, else :data:`DEFAULT_REPEAT` up to
    100,000 entries (an open of 100,000 is two seconds; single samples of it swung by
    1.6x on a shared 2-core VM, enough to swing the ratios) and 1 above."""
    if repeat is not None:
        if repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {repeat}")
        return repeat
    return DEFAULT_REPEAT if n <= 100_000 else 1


def interleaved_opens(
    directories: dict[int, Path], counts: dict[int, int], open_one: Callable[[Path], dict[str, Any]]
) -> dict[int, list[dict[str, Any]]]:
    """``counts[n]`` samples of ``open_one(directories[n])`` per N, the N's taking turns:
    round r opens each N that still needs a sample once, starting from the r-th N (so no N
    always runs right after another), and each sample records its ``round``. A drift of
    the machine's load over the run then reaches every N's samples alike, rather than
    the N measured during the busy minute (before: all of one N's opens, then the next
    N's)."""
    sizes = list(directories)
    opens: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for r in range(max(counts.values(), default=0)):
        for step in range(len(sizes)):
            n = sizes[(r + step) % len(sizes)]
            if len(opens[n]) < counts[n]:
                opens[n].append({**open_one(directories[n]), "round": r})
    return opens


OPEN_KEYS = (
    "open_s", "open_cpu_s", "open_stall_s", "open_minor_faults", "rss_per_entry",
    "full_gc_s", "full_gc_base_s", "load_1m",
)  # fmt: skip


def summarise_opens(opens: list[dict[str, float]]) -> dict[str, Any]:
    """Every open's figures ("opens"), the median of each as the figure itself (what the
    ratios divide), and the spread beside it: ``<key>_min``/``<key>_max``."""
    out: dict[str, Any] = {"opens": opens, "repeat": len(opens)}
    for key in OPEN_KEYS:
        values = [sample[key] for sample in opens]
        out[key] = statistics.median(values)
        out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def round_ratios(small: list[dict[str, Any]], big: list[dict[str, Any]]) -> list[float]:
    """open_s of ``big`` over ``small`` in each round both were opened in."""
    by_round = {sample["round"]: sample["open_s"] for sample in small if "round" in sample}
    return [
        sample["open_s"] / by_round[sample["round"]]
        for sample in big
        if sample.get("round") in by_round
    ]
