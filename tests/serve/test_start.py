"""``kvtrio serve``'s start and flags: the cold tier opened in the background, a tier that
cannot open, ``--eviction`` / ``--admission`` reaching the tier, ``--no-prefetch``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from kvtrio.actors.policy import (
    DEFAULT_ADMIT_SECONDS_PER_GIB,
    AdmitAll,
    AllOf,
    GreedyDualPolicy,
    LruPolicy,
    MinimumTokens,
    RecomputePerByte,
    SecondUse,
)
from kvtrio.actors.prefix import ModelKey
from kvtrio.serve.bridge import TierThread
from kvtrio.serve.modeldir import write_tiny_model_dir
from kvtrio.serve.server import ServeOptions
from kvtrio.tests.serve.servers import COLD_READY, exit_summary, free_port, start_kvtrio

pytest.importorskip("openai")


def _args(*argv: str) -> argparse.Namespace:
    from kvtrio.cli import serve as serve_command

    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return parser.parse_args(["--model", "unused", *argv])


def _tier_of(args: argparse.Namespace) -> TierThread:
    tier = TierThread(ServeOptions.from_args(args).tier_options(ModelKey("m", "f")))
    tier.start()
    return tier


def test_eviction_and_admission_flags_reach_the_tier(tmp_path: Path) -> None:
    """docs/serve.md, "Flags": --eviction and --admission are the tier's policies."""
    spec = ("--eviction", "lru", "--admission", "min-tokens:100+second-use")
    tier = _tier_of(_args("--cache-dir", str(tmp_path / "a"), *spec))
    try:
        assert tier.cache is not None
        assert isinstance(tier.cache.cold_policy, LruPolicy)
        assert isinstance(tier.cache.hot_policy, LruPolicy)
        admission = tier.cache.admission
        assert isinstance(admission, AllOf)
        first, second = admission.policies
        assert first == MinimumTokens(100) and isinstance(second, SecondUse)
    finally:
        assert tier.close(timeout=30)
    tier = _tier_of(_args("--cache-dir", str(tmp_path / "b"), "--admission", "all"))
    try:
        assert tier.cache is not None and tier.cache.admission == AdmitAll()
        assert isinstance(tier.cache.cold_policy, GreedyDualPolicy)  # the default: cost
    finally:
        assert tier.close(timeout=30)
    default = ServeOptions.from_args(_args("--cache-dir", str(tmp_path / "c")))
    options = default.tier_options(ModelKey("m", "f"))
    assert options.admission is None  # the tier's default_admission()
    per_gib = _args("--admission", "per-gib:3.5", "--eviction", "cost-frequency")
    options = ServeOptions.from_args(per_gib).tier_options(ModelKey("m", "f"))
    assert options.admission == RecomputePerByte(3.5)
    assert options.eviction.value == "cost-frequency"
    assert DEFAULT_ADMIT_SECONDS_PER_GIB == 12.0  # what --help and docs/serve.md say


@pytest.mark.parametrize("spec", ["sometimes", "min-tokens:x", "per-gib:-1", "all:3", "all+"])
def test_a_bad_admission_spec_is_refused_by_the_parser(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _args("--admission", spec)
    assert exited.value.code == 2
    assert "bad admission" in capsys.readouterr().err


def test_a_cold_tier_that_cannot_open_stops_the_server_with_status_two(tmp_path: Path) -> None:
    """docs/serve.md, "Start": the tier opens in the background; when it cannot, the
    server says why and exits 2."""
    model = write_tiny_model_dir(tmp_path / "model")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file, not a directory")
    argv = [sys.executable, "-m", "kvtrio", "serve", "--model", str(model), "--port"]
    argv += [str(free_port()), "--cache-dir", str(not_a_dir), "--log-level", "WARNING"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "kvtrio serve: the cold tier did not open (" in done.stderr
    assert COLD_READY not in done.stdout


def test_no_prefetch_loads_turn_two_on_the_lookup(tmp_path: Path) -> None:
    """--no-prefetch (with --eviction lru --admission all): turn 2 after a restart is
    still served from disk, by the lookup itself: nothing is set aside."""
    model = write_tiny_model_dir(tmp_path / "model")
    flags = ("--no-prefetch", "--eviction", "lru", "--admission", "all")
    turn1 = [{"role": "user", "content": "What is the capital of France? " * 8}]
    first = start_kvtrio(model, tmp_path / "cache", tmp_path / "a.txt", *flags)
    one = first.client().chat.completions.create(
        model="default_model", messages=turn1, max_tokens=4, temperature=0.0
    )
    assert first.stop() == 0, first.output()
    turn2 = [
        *turn1,
        {"role": "assistant", "content": one.choices[0].message.content or ""},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = start_kvtrio(model, tmp_path / "cache", tmp_path / "b.txt", *flags)
    raw = second.client().chat.completions.with_raw_response.create(
        model="default_model", messages=turn2, max_tokens=4, temperature=0.0
    )
    assert second.stop() == 0, second.output()
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    summary = exit_summary(second)
    assert summary["hits_cold"] == 1 and summary["prefetches"] == 0
    assert summary["before_open"] == 0  # the test waited for the cold tier
