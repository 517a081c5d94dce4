"""``kvtrio bench scale`` times a restart's open: every timed open (the figure and every
``--repeat`` sample) is the first open of the cold tier in a fresh process, after the
imports, over a directory whose catalogue the first child (the rebuild) has built; RSS
per entry is that process's growth over that open.

Regression: the timed open was the process's second (after the rebuild, or after an
untimed open) and reused the memory the first had freed: 237-321 bytes per entry where
a restart's first open grows by about 1.6 KB, and CPU figures that favoured a rebuild
that used more memory.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors import tiered
from kvtrio.bench import scale
from kvtrio.storage.catalogue import CATALOGUE_NAME

N = 64


@pytest.fixture(scope="module")
def catalogued(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N entries and their catalogue (built by the bench's own first child, the rebuild)."""
    directory = tmp_path_factory.mktemp("scale")
    scale._populate(directory, N)
    figures = scale.child_main(directory, N, lookups=4, maintenance=False)
    assert figures["rebuild_s"] > 0
    assert list(directory.glob(CATALOGUE_NAME + "*"))
    return directory


def test_the_timed_open_is_the_process_first_open_of_the_cold_tier(
    catalogued: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """child_open_main (what each fresh ``--child-open`` process runs) opens the cache
    once: the timed open, with the RSS and the collection inside it, is its first."""
    real = tiered.open_tiered_cache
    opens: list[Any] = []

    @contextlib.asynccontextmanager
    async def counting(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        opens.append(args[0])
        async with real(*args, **kwargs) as cache:
            yield cache

    monkeypatch.setattr(tiered, "open_tiered_cache", counting, raising=False)
    monkeypatch.setattr(scale, "_opens_in_process", 0, raising=False)
    sample = scale.child_open_main(catalogued)
    assert opens == [catalogued]  # one open: the timed one (before: an untimed one first)
    assert sample["prior_opens"] == 0
    assert sample["entries"] == N
    assert sample["open_s"] > 0 and sample["open_cpu_s"] > 0
    assert sample["rss_per_entry"] == pytest.approx(sample["rss_per_entry"])  # a number
    assert sample["open_minor_faults"] >= 0
    # The imports are done before the timing: the open imported nothing.
    assert sample["open_new_modules"] == 0, sample["open_new_module_names"]


def test_every_timed_sample_comes_from_a_fresh_open_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per N: one rebuild child; then K --child-open processes per N (K = the repeat),
    the N's taking turns round by round, every sample of the figure from those; none from
    the rebuild's process.

    Regression: all of one N's opens ran before the next N's, so a busy minute of a shared
    machine fell on one N's samples alone and bent the ratio of their medians."""
    calls: list[tuple[str, int]] = []

    def child(directory: Path, n: int, *_: Any) -> dict[str, Any]:
        calls.append(("rebuild", n))
        return {"n": n, "rebuild_s": 1.0, "miss_p50_s": 1e-4, "miss_p99_s": 1e-3}

    def child_open(directory: Path) -> dict[str, Any]:
        n = int(directory.name[1:])
        calls.append(("open", n))
        k = sum(1 for call in calls if call == ("open", n))
        return {
            "open_s": n * k * 1e-4, "open_cpu_s": n * 1e-4, "open_stall_s": 1e-3,
            "open_minor_faults": 10 * n, "rss_per_entry": 1600.0 + k,
            "full_gc_s": 0.01, "full_gc_base_s": 0.005, "load_1m": 1.0, "prior_opens": 0,
        }  # fmt: skip

    def misses(directories: list[Path], *_: Any) -> dict[str, Any]:
        return {
            d.name[1:]: {"p50_s": 1e-4, "p99_s": 1e-3, "samples": 1, "round_p50s": [1e-4]}
            for d in directories
        }

    monkeypatch.setattr(scale, "_populate", lambda *_: 0.0)
    monkeypatch.setattr(scale, "_child", child)
    monkeypatch.setattr(scale, "_child_open", child_open)
    monkeypatch.setattr(scale, "_child_misses", misses)
    monkeypatch.setattr(
        scale, "_burst", lambda *_: {"max_disk_bytes": 1, "budget": 1, "kept": 1, "fit": 1}
    )
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    args = parser.parse_args(["--sizes", "10,20", "--repeat", "3", "--dir", str(tmp_path)])
    figures = scale.measure(args)
    assert calls == [
        ("rebuild", 10), ("rebuild", 20),
        ("open", 10), ("open", 20),  # round 0
        ("open", 20), ("open", 10),  # round 1: the other N first
        ("open", 10), ("open", 20),  # round 2
    ]  # fmt: skip
    for n in ("10", "20"):
        run = figures["runs"][n]
        assert run["repeat"] == 3 and len(run["opens"]) == 3
        assert all(sample["prior_opens"] == 0 for sample in run["opens"])
        assert run["open_s"] == int(n) * 2e-4  # the median of the three fresh processes
        assert run["rss_per_entry"] == 1602.0
        assert (run["rss_per_entry_min"], run["rss_per_entry_max"]) == (1601.0, 1603.0)
        assert run["rebuild_s"] == 1.0
        assert [sample["round"] for sample in run["opens"]] == [0, 1, 2]
    # Beside the ratio of medians (the target's figure), the same ratio within each round.
    assert figures["open_20_over_10"] == 2.0
    assert (figures["open_20_over_10_rounds_min"], figures["open_20_over_10_rounds_max"]) == (
        2.0,
        2.0,
    )


def test_the_rebuild_is_timed_after_the_imports_it_uses(tmp_path: Path) -> None:
    """The rebuild child (a fresh process) imports the modules the open uses before it
    times the rebuild, as the timed opens' processes do: the rebuild's loop stall is the
    rebuild's. Regression: the open imported the tiered cache's modules inside the timing,
    a stall of 78-89 ms at 1,000 entries on a loaded VM where the rebuild's own is 4-6 ms."""
    import json
    import subprocess
    import sys

    scale._populate(tmp_path, N)
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "scale", "--json", "--child", str(tmp_path),
         str(N), "--lookups", "4", "--no-maintenance"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    assert figures["rebuild_s"] > 0
    assert figures["rebuild_new_modules"] == []
