"""``kvtrio serve``'s start and flags: the cold tier opened in the background, a tier that
cannot open, ``--eviction`` / ``--admission`` reaching the tier, ``--no-prefetch``."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.coldstore import ColdTierStore
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


def test_load_streams_reach_the_tier(tmp_path: Path) -> None:
    """docs/serve.md, "Flags": --load-streams is the tier's reads per load; without it the
    tier's default (by the CPU count: storage.options.default_tier_load_streams)."""
    tier = _tier_of(_args("--cache-dir", str(tmp_path / "a"), "--load-streams", "3"))
    try:
        assert tier.cache is not None
        cold = tier.cache.cold
        assert isinstance(cold, ColdTierStore)
        assert cold.tier.load_streams == 3
    finally:
        assert tier.close(timeout=30)
    default = ServeOptions.from_args(_args("--cache-dir", str(tmp_path / "b")))
    assert default.tier_options(ModelKey("m", "f")).load_streams is None


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


def test_a_model_that_does_not_load_stops_the_server_with_status_two(tmp_path: Path) -> None:
    """docs/serve.md, "Start": a --model that does not load (here a directory holding no
    model) stops the server with exit 2, as plain mlx_lm.server fails at start, rather
    than listening and answering every request with an error."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    argv = [sys.executable, "-m", "kvtrio", "serve", "--model", str(empty), "--port"]
    argv += [str(free_port()), "--cache-dir", str(tmp_path / "cache"), "--log-level", "WARNING"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert COLD_READY not in done.stdout
    # One line says why, once: before, the error's traceback was printed twice (the
    # generation thread went on into mlx-lm's loop, which loaded the model again and died
    # of it), some 200 lines for a mistyped Hugging Face repo.
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("the model did not load (FileNotFoundError: ") == 1, done.stderr


def test_a_port_in_use_ends_the_server_instead_of_hanging(tmp_path: Path) -> None:
    """A listener that cannot bind ends the process (its generation thread too): before,
    the error was printed and the process hung on the thread forever."""
    model = write_tiny_model_dir(tmp_path / "model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "kvtrio", "serve", "--model", str(model), "--port"]
        argv += [str(port), "--cache-dir", str(tmp_path / "cache"), "--log-level", "WARNING"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "listening on" not in done.stdout


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
    # No warm restart: turn 2's own lookup loads it.
    second = start_kvtrio(
        model, tmp_path / "cache", tmp_path / "b.txt", *flags, "--restore-bytes", "0"
    )
    raw = second.client().chat.completions.with_raw_response.create(
        model="default_model", messages=turn2, max_tokens=4, temperature=0.0
    )
    assert second.stop() == 0, second.output()
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    summary = exit_summary(second)
    assert summary["hits_cold"] == 1 and summary["prefetches"] == 0
    assert summary["before_open"] == 0  # the test waited for the cold tier


def test_the_cold_tier_opens_only_once_no_request_is_in_flight() -> None:
    """docs/serve.md, "Start": the open waits while a request is in flight (arrived and
    not answered: it would share the GIL with the open's imports and index), and starts
    once none is, or OPEN_DEFER after the first answer whatever is in flight."""
    from kvtrio.serve.coldopen import OPEN_DEFER, open_now

    assert not open_now(request_taken=False, in_flight=1, now=1.0, first_answer=None)
    assert not open_now(request_taken=True, in_flight=0, now=1.0, first_answer=None)
    assert open_now(request_taken=False, in_flight=0, now=1.0, first_answer=None)
    later = 1.1 + OPEN_DEFER
    assert not open_now(request_taken=True, in_flight=3, now=later, first_answer=1.2)
    assert open_now(request_taken=True, in_flight=3, now=later, first_answer=1.0)


def test_the_cold_tier_never_opens_while_the_first_request_is_in_flight() -> None:
    """docs/serve.md, "Start": however long the first request takes, the open does not
    start before its answer. The deadline that opens the tier whatever is in flight counts
    from the first answer; counted from the model's load (as it was), it fell inside a
    first prefill longer than OPEN_DEFER (the SmolLM2-135M-shaped model on a 2-core CPU:
    4-7 s), whose answer then shared the GIL and the CPU with the open."""
    import threading

    from kvtrio.serve.coldopen import open_now
    from kvtrio.serve.server import _generator_class

    assert not open_now(request_taken=True, in_flight=1, now=1e9, first_answer=None)
    assert not open_now(request_taken=False, in_flight=1, now=1e9, first_answer=None)
    cls: Any = _generator_class()
    generator: Any = cls.__new__(cls)  # mlx-lm's __init__ would start its thread
    generator._active_lock, generator.in_flight, generator._first_answer = threading.Lock(), 2, None
    generator._answered()  # the first answer: the deadline starts here
    first = generator._first_answer
    assert first is not None and generator.in_flight == 1
    generator._answered()
    assert generator._first_answer == first and generator.in_flight == 0


def test_the_start_path_imports_none_of_the_tiers_modules() -> None:
    """docs/serve.md, "Start": parsing kvtrio serve's flags (an --admission spec
    included) and building its options import none of the tier's modules; they load on
    the thread that opens the tier."""
    code = (
        "import argparse, sys\n"
        "from kvtrio.cli import serve as command\n"
        "from kvtrio.serve.server import ServeOptions\n"
        "parser = argparse.ArgumentParser()\n"
        "command.add_arguments(parser)\n"
        "args = parser.parse_args(['--model', 'm', '--admission', 'second-use+min-tokens:8'])\n"
        "ServeOptions.from_args(args)\n"
        "tier = ('kvtrio.actors.policy', 'kvtrio.actors.tiered', 'kvtrio.actors.owner',\n"
        "        'kvtrio.serve.bridge', 'kvtrio.storage.writer', 'kvtrio.runtime.system')\n"
        "print(sorted(m for m in tier if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_a_bad_admission_part_is_refused_without_the_tier() -> None:
    """--admission is checked at start by its syntax alone (the policies come with the
    tier); the same specs build the same policies there."""
    from kvtrio.serve.flags import admission_parts, admission_policy

    assert admission_parts("second-use+min-tokens:8") == [("second-use", None), ("min-tokens", 8)]
    for bad in ("sometimes", "min-tokens:-1", "per-gib:x", "all:3"):
        with pytest.raises(ValueError):
            admission_parts(bad)
    assert admission_policy("min-tokens:8") == MinimumTokens(8)
    assert admission_policy("all+per-gib:2.5") == AllOf((AdmitAll(), RecomputePerByte(2.5)))


#: Every kvtrio module ``kvtrio serve`` imports before it listens: its command line, the
#: adapter and the server (docs/serve.md, "Start"). Not the tier's modules (they load on
#: the thread that opens it), nor :mod:`kvtrio.storage` (serve reads no ``KVTRIO_*`` I/O
#: tuning at start).
START_PATH_MODULES = [
    "kvtrio",
    "kvtrio._lazy",
    "kvtrio.actors",
    "kvtrio.actors.callerchecks",
    "kvtrio.actors.collector",  # the collector paused while the flags import mlx-lm
    "kvtrio.cli",
    "kvtrio.cli.paths",
    "kvtrio.cli.serve",
    "kvtrio.errors",
    "kvtrio.serve",
    "kvtrio.serve.adapter",
    "kvtrio.serve.cachekinds",  # which caches go to disk, in what shape (mlx-lm cache only)
    "kvtrio.serve.coldopen",
    "kvtrio.serve.flags",
    "kvtrio.serve.flushreport",  # the shutdown's deadline and report (nothing of the tier)
    "kvtrio.serve.lifecycle",  # requests in flight, the model's load (nothing of the tier)
    "kvtrio.serve.restore",  # the warm restart (nothing of the tier until it is open)
    "kvtrio.serve.savetrace",  # --save-trace's record (json, os, attrs)
    "kvtrio.serve.server",
    "kvtrio.serve.steps",
    "kvtrio.serve.tagging",  # which tier served a request; its response queue
    "kvtrio.serve.triesearch",  # the RAM trie's search (mlx-lm's cache module, nothing more)
]


def test_kvtrio_serve_listens_having_imported_only_its_start_path_modules(
    tmp_path: Path,
) -> None:
    """docs/serve.md, "Start": up to its listener, ``kvtrio serve`` imports of kvtrio only
    ``START_PATH_MODULES`` (what mlx_lm.server does not do is kept to those). The real
    command runs, through ``kvtrio.cli.main``, on the tiny model; the tier's open is kept
    from starting, so that a fast model load cannot race the snapshot taken as it listens."""
    printed = _run_to_listener(
        tmp_path,
        "",
        "sorted(m for m in sys.modules if m == 'kvtrio' or m.startswith('kvtrio.'))",
    )
    assert printed == str(START_PATH_MODULES)


def test_the_system_fingerprint_is_taken_after_the_listener_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/serve.md, "Start": before it listens kvtrio serve makes no MLX call that
    mlx_lm.server does not. mlx-lm takes its system fingerprint (MLX's ``device_info``: on
    CUDA the GPU's properties and NVML) in each connection's handler, after listening;
    kvtrio serve took it before opening its listener (10-20 ms of its start on this VM,
    with the model's load running beside it). Now the first connection takes it, once."""
    import mlx_lm.server as mlx_server
    from kvtrio.serve import server

    calls: list[int] = []

    def fingerprint() -> str:
        calls.append(1)
        return "fp"

    monkeypatch.setattr(mlx_server, "get_system_fingerprint", fingerprint)
    made: list[str] = []
    monkeypatch.setattr(
        server, "_handler_class", lambda: lambda *a, **k: made.append(k["system_fingerprint"])
    )
    httpd = server._http_server("127.0.0.1", 0, object())
    try:
        assert calls == []  # listening, and no fingerprint taken
        httpd.RequestHandlerClass(None, None, httpd)
        httpd.RequestHandlerClass(None, None, httpd)
        assert calls == [1] and made == ["fp", "fp"]
    finally:
        httpd.server_close()


def test_kvtrio_serve_makes_mlx_lm_servers_start_calls_before_any_thread(
    tmp_path: Path,
) -> None:
    """docs/serve.md, "Start": once its flags are parsed mlx_lm.server's ``main`` sets the
    recommended wired limit (Metal; it reads MLX's ``device_info``, on CUDA the driver's
    and NVML's first use) on the main thread, before the model provider and the generation
    thread exist. kvtrio serve, which takes mlx-lm's parser but not its ``main``, skipped
    it: no wired limit on a Mac, and its first ``device_info`` came later, beside the
    model's load. The real command runs to its listener, recording the order."""
    printed = _run_to_listener(
        tmp_path,
        "import mlx_lm.server as ms\n"
        "events = []\n"
        "wired = ms.maybe_set_recommended_wired_limit\n"
        "def wired_limit():\n"
        "    events.append(('wired_limit', threading.active_count()))\n"
        "    return wired()\n"
        "ms.maybe_set_recommended_wired_limit = wired_limit\n"
        "init = ms.ModelProvider.__init__\n"
        "def provider(self, *a, **k):\n"
        "    events.append(('provider', threading.active_count()))\n"
        "    init(self, *a, **k)\n"
        "ms.ModelProvider.__init__ = provider\n",
        "[name for name, _ in events], events[0][1]",
    )
    # Once, first, with the main thread alone (as in mlx-lm's main).
    assert printed == "['wired_limit', 'provider'] 1"


def _run_to_listener(
    tmp_path: Path, prelude: str, expression: str, *, hold_open: bool = True
) -> str:
    """Run the real ``kvtrio serve`` (through ``kvtrio.cli.main``) on the tiny model after
    ``prelude``, print ``expression`` as its listener opens and exit there. With
    ``hold_open`` the tier's open is kept from starting, so that a fast model load cannot
    race what is printed; that imports the adapter, and with it mlx-lm, before the
    command runs."""
    model = write_tiny_model_dir(tmp_path / "model")
    code = (
        "import os, socketserver, sys, threading\n"
        + prelude
        + "activate = socketserver.TCPServer.server_activate\n"
        "def listening(self):\n"
        "    activate(self)\n"
        f"    print({expression}, flush=True)\n"
        "    os._exit(0)\n"
        "socketserver.TCPServer.server_activate = listening\n"
        + (
            "import kvtrio.serve.coldopen as coldopen\n"  # on the start path already
            "coldopen.ColdOpening.start = lambda self: None\n"
            if hold_open
            else ""
        )
        + "from kvtrio.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    argv = [sys.executable, "-c", code, "serve", "--model", str(model), "--port"]
    argv += [str(free_port()), "--cache-dir", str(tmp_path / "cache"), "--log-level", "WARNING"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_kvtrio_serve_imports_with_the_collector_paused_and_freezes_what_they_made(
    tmp_path: Path,
) -> None:
    """docs/serve.md, "Start": no automatic collection traverses the objects of the start's
    imports (mlx-lm, transformers: some 130,000; 60-90 ms of collections on this VM), and
    mlx-lm's load, which begins with a full ``gc.collect()``, finds them frozen (25-40 ms
    more). The real command runs to its listener, counting the collections that ran while
    transformers was being imported, then looking for mlx-lm's classes among the objects a
    collection would traverse."""
    printed = _run_to_listener(
        tmp_path,
        "import gc\n"
        "during = []\n"
        "def counted(phase, info):\n"
        "    if phase == 'start' and 'transformers' in sys.modules:\n"
        "        during.append('mlx_lm.server' in sys.modules)\n"
        "gc.callbacks.append(counted)\n",
        "during.count(False), "
        "any(o is sys.modules['mlx_lm.server'].ModelProvider for o in gc.get_objects()), "
        "gc.get_freeze_count() > 10000",
        hold_open=False,  # mlx-lm imported by the command alone, as in a real start
    )
    # Without the pause: dozens of collections while mlx-lm and transformers import, and
    # mlx-lm's ModelProvider class among the objects every full collection traverses.
    assert printed == "0 False True"
