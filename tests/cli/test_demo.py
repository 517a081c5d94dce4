"""`kvtrio demo`: every hit checked, and a second run served from the first run's disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvtrio.cli.demo import DemoOptions, default_data_dir, run_demo


def _small(data_dir: Path) -> DemoOptions:
    return DemoOptions(
        data_dir=data_dir,
        chats=2,
        system_tokens=64,
        user_tokens=24,
        reply_tokens=4,
        doc_tokens=400,
        question_tokens=16,
        max_chat_tokens=400,
        hot_bytes=1 << 20,
        quiet=True,
    )


async def test_two_runs_check_every_hit_and_the_second_reuses_the_disk(tmp_path: Path) -> None:
    first = await run_demo(_small(tmp_path))
    assert first.ok and first.checks > 0
    assert first.hits_after_restart > 0
    assert first.doc_speedup is not None
    assert first.bytes_written > 0 and first.bytes_deduplicated > 0
    second = await run_demo(_small(tmp_path))
    assert second.ok and second.run == 2
    assert second.hits_on_previous_run > 0
    assert second.bit_exact == second.checks  # probes stored by run 1 cover its entries


def test_data_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRIO_DATA_DIR", "/somewhere/kv")
    assert default_data_dir() == Path("/somewhere/kv")
    monkeypatch.delenv("KVTRIO_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    if sys.platform.startswith("linux"):
        assert default_data_dir() == Path("/xdg/kvtrio")


def test_the_command_prints_json_and_exits_zero(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtrio",
            "demo",
            "--data-dir",
            str(tmp_path),
            "--json",
            "--doc-tokens",
            "512",
            "--chats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["hits_after_restart"] > 0
    assert (tmp_path / "demo" / "cold" / "caches").is_dir()


def test_the_command_refuses_impossible_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtrio.cli import main

    assert main(["demo", "--doc-tokens", "10"]) == 2
    assert capsys.readouterr().err == "kvtrio demo: --doc-tokens must be >= 321\n"


@pytest.mark.parametrize("budget", ["--hot-mb=nan", "--cold-mb=inf", "--hot-mb=-1", "--cold-mb=0"])
def test_the_command_refuses_budgets_it_cannot_use(budget: str) -> None:
    """``--hot-mb nan`` passed the check (NaN compares false) and ended in a ValueError
    traceback converting it to bytes; ``inf`` in an OverflowError."""
    from kvtrio.cli import main

    assert main(["demo", budget]) == 2


def test_recompute_tolerance_is_derived_and_still_catches_a_wrong_hit() -> None:
    """The tolerance is TOLERANCE_MARGIN x the device's two-chunk prefill difference (at
    least TOLERANCE), and a "hit" whose prefix is another prompt's lands far outside it."""
    import random

    import mlx.core as mx
    from kvtrio.cli.demo import TOLERANCE, TOLERANCE_MARGIN, recompute_tolerance
    from kvtrio.tinymodel import build_tiny_model, make_caches, prefill

    tiny = build_tiny_model()
    rng = random.Random(3)
    prompt = [rng.randrange(1, 200) for _ in range(300)]
    tolerance, diff = recompute_tolerance(tiny, prompt)
    assert tolerance == max(TOLERANCE, TOLERANCE_MARGIN * diff)
    full = prefill(tiny, make_caches(tiny), prompt)
    wrong = make_caches(tiny)
    prefill(tiny, wrong, [t + 1 for t in prompt[:150]])
    off = mx.max(mx.abs(prefill(tiny, wrong, prompt[150:]) - full)).item()
    assert isinstance(off, float)
    assert off > 10 * tolerance
