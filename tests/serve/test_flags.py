"""``kvtrio serve``'s own flag values, checked by the parser (docs/serve.md, "Flags"): a
value the server cannot use is a usage error (exit 2) before the model loads, never a
traceback, a server that starts and fails later, or a silent other meaning.

Before these checks: ``--hot-bytes -5`` or ``8GiB`` raised decimal.InvalidOperation or
KeyError out of mlx-lm's size parser (a traceback); ``--redis localhost:6379`` made a
local cold tier in a directory named ``localhost:6379``; ``--grace -1`` and
``--min-reuse-tokens -1`` stopped the server only once the model had loaded and the tier
failed to open; ``--flush-timeout -1`` made every shutdown exit 1; ``--cold-load-timeout
-1`` and ``--write-defer -1`` were taken; a missing ``--warm-prompts`` file killed the
generation thread, leaving a server that answered every request with an error."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvtrio.serve.flags import REDIS_SCHEMES
from kvtrio.storage.redisstore import is_redis_url


def _args(*argv: str) -> argparse.Namespace:
    from kvtrio.cli import serve as serve_command

    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return parser.parse_args(["--model", "unused", *argv])


def _refused(*argv: str) -> None:
    with pytest.raises(SystemExit) as exited:
        _args(*argv)
    assert exited.value.code == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("4GB", 4 * 10**9),  # mlx-lm's units are powers of ten
        ("1.5G", 1_500_000_000),
        ("512mb", 512 * 10**6),
        ("8GiB", 8 << 30),  # what --help shows as the default
        ("2 TiB", 2 << 40),
    ],
)
def test_a_size_is_bytes_or_a_number_with_a_unit(text: str, expected: int) -> None:
    args = _args("--hot-bytes", text, "--cold-bytes", text)
    assert args.hot_bytes == expected and args.cold_bytes == expected


@pytest.mark.parametrize("flag", ["--hot-bytes", "--cold-bytes"])
@pytest.mark.parametrize("text", ["-5", "abc", "", "1e9", "4 GB GB", "1PB", "nan", "GB"])
def test_a_size_that_is_no_size_is_a_usage_error(flag: str, text: str) -> None:
    _refused(f"{flag}={text}")


@pytest.mark.parametrize(
    "argv",
    [
        ["--grace=-1"],
        ["--grace", "nan"],
        ["--grace", "inf"],
        ["--flush-timeout=-1"],
        ["--cold-load-timeout=-1"],
        ["--write-defer=-0.5"],
        ["--write-defer", "soon"],
        ["--min-reuse-tokens=-1"],
        ["--min-reuse-tokens", "1.5"],
        ["--load-streams", "0"],
        ["--load-streams=-1"],
        ["--load-streams", "two"],
    ],
)
def test_a_time_or_count_the_server_cannot_use_is_a_usage_error(argv: list[str]) -> None:
    _refused(*argv)


def test_an_infinite_time_is_refused_as_not_finite(capsys: pytest.CaptureFixture[str]) -> None:
    """``--flush-timeout inf`` was refused with "expected seconds >= 0", which inf is."""
    _refused("--flush-timeout", "inf")
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "argument --flush-timeout: expected finite seconds >= 0, got 'inf'"
    )


def test_zero_times_and_counts_are_taken() -> None:
    args = _args("--grace", "0", "--cold-load-timeout", "0", "--write-defer", "0")
    assert (args.grace, args.cold_load_timeout, args.write_defer) == (0.0, 0.0, 0.0)
    assert _args("--min-reuse-tokens", "0").min_reuse_tokens == 0


@pytest.mark.parametrize(
    "url", ["localhost:6379", "not a url", "http://h:6379/0", "redis://h:port/0", "redis:/h"]
)
def test_a_redis_flag_that_is_no_redis_url_is_a_usage_error(url: str) -> None:
    _refused("--redis", url)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0?prefix=kvtrio", "rediss://u:p@h:6380/1", "unix:///r.sock"]
)
def test_a_redis_url_is_taken_as_the_tier_reads_it(url: str) -> None:
    assert _args("--redis", url).redis == url and is_redis_url(url)


def test_the_parsers_redis_schemes_are_the_tiers() -> None:
    assert all(is_redis_url(scheme + "host") for scheme in REDIS_SCHEMES)
    for other in ("http://", "file://", "redis:", "valkey://"):
        assert not is_redis_url(other + "host")


def test_warm_prompts_must_be_a_readable_text_file(tmp_path: Path) -> None:
    _refused("--warm-prompts", str(tmp_path / "missing.txt"))
    _refused("--warm-prompts", str(tmp_path))
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00not utf-8\x80")
    _refused("--warm-prompts", str(binary))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n")
    assert _args("--warm-prompts", str(prompts)).warm_prompts == prompts


def test_an_empty_cache_dir_is_a_usage_error_not_the_working_directory() -> None:
    """``--cache-dir "$UNSET"`` made the working directory the cold tier (Path("") is
    ".")."""
    _refused("--cache-dir", "")
    _refused("--cache-dir", " ")


def test_a_home_relative_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quoted ``~`` (a unit file, a config) is the home directory, not a directory named
    ``~`` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "prompts.txt").write_text("a prompt\n")
    args = _args("--cache-dir", "~/tier", "--warm-prompts", "~/prompts.txt")
    assert args.cache_dir == tmp_path / "tier"
    assert args.warm_prompts == tmp_path / "prompts.txt"


def _started(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """The arguments ``kvtrio serve`` starts a server with (none is started)."""
    from kvtrio.serve import server

    started: list[argparse.Namespace] = []

    def serve(args: argparse.Namespace) -> int:
        started.append(args)
        return 0

    monkeypatch.setattr(server, "serve", serve)
    return started


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_a_usage_error_before_the_server_starts(
    port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's --port is any int; the listener's getaddrinfo took 99999 as 34463 (99999
    mod 65536), and the server listened there."""
    from kvtrio.cli import main

    started = _started(monkeypatch)
    assert main(["serve", "--model", "unused", f"--port={port}"]) == 2
    assert started == []
    assert main(["serve", "--model", "unused", "--port", "0"]) == 0
    assert [args.port for args in started] == [0]


def test_an_empty_model_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model "$UNSET"`` started a server on the working directory as the model: its
    load failed on the generation thread, and the server listened on, answering errors."""
    from kvtrio.cli import main

    started = _started(monkeypatch)
    assert main(["serve", "--model", ""]) == 2
    assert main(["serve"]) == 2
    assert started == []


@pytest.mark.parametrize("text", ["-5", "8GiB", "1T", "GB"])
def test_a_bad_value_of_an_mlx_lm_flag_is_a_usage_error(text: str) -> None:
    """mlx-lm's own flags keep their meaning; a value its size parser cannot read raised
    KeyError or decimal.InvalidOperation out of argparse (a traceback)."""
    _refused("--prompt-cache-bytes", text)


def test_mlx_lm_flags_keep_their_meaning() -> None:
    args = _args("--prompt-cache-bytes", "1.5GB", "--port", "8081", "--temp", "0.5")
    assert (args.prompt_cache_bytes, args.port, args.temp) == (1_500_000_000, 8081, 0.5)
    _refused("--port", "eighty")
    _refused("--chat-template-args", "{not json")


def _identity(model: str, **flags: Any) -> Any:
    from kvtrio.serve.flags import model_identity

    defaults = {"adapter_path": None, "draft_model": None, "kv_bits": None}
    return model_identity(argparse.Namespace(model=model, **(defaults | flags)))


def test_one_model_directory_has_one_key_however_its_path_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtrio serve --model tiny-llama`` after ``--model /abs/tiny-llama`` on one
    cache directory served turn 2 as a miss: the tier's model id was the flag's text."""
    from kvtrio.serve.modeldir import MODEL_CONFIG

    model = tmp_path / "models" / "tiny-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path / "models")
    key = _identity(str(model))
    for spelling in ("tiny-llama", "./tiny-llama/", str(tmp_path / "link")):
        assert _identity(spelling) == key
    assert _identity("tiny-llama", adapter_path="tiny-llama") == _identity(
        str(model), adapter_path=str(model)
    )
    fine_tune = tmp_path / "models" / "fine-tune"  # same config, same file sizes
    shutil.copytree(model, fine_tune)
    assert _identity(str(fine_tune)) != key


def test_weights_rewritten_in_place_change_the_key(tmp_path: Path) -> None:
    """Another model of the same shape copied over a model directory's weights (a re-fuse,
    a re-quantization) kept the key, and its first request after the restart continued
    from the old weights' cached keys and values, reported ``cold``."""
    from kvtrio.serve.modeldir import MODEL_CONFIG

    weights = tmp_path / "model.safetensors"
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    weights.write_bytes(b"\0" * 64)
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))
    before = _identity(str(tmp_path))
    assert _identity(str(tmp_path)) == before
    weights.write_bytes(b"\1" * 64)  # same size
    os.utime(weights, ns=(2_000_000_000, 2_000_000_000))
    assert _identity(str(tmp_path)) != before


def _mlx_lm_help_flags() -> set[str]:
    """The long flags the installed ``mlx_lm.server --help`` prints: read from its own
    output, not from the parser kvtrio captures, so a capture that missed a flag fails."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return set(re.findall(r"(?m)^\s+(--[a-z][a-z0-9-]*)", out)) - {"--help"}


def _sample(action: argparse.Action) -> list[str]:
    """A value of ``action``'s flag that mlx-lm's parser takes (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    return ["3"]  # a number, a size in bytes, a path, a host, JSON: each reads "3"


def test_every_flag_of_the_installed_mlx_lm_server_is_taken_as_mlx_lm_reads_it() -> None:
    """Issue 17: ``kvtrio serve`` accepts mlx_lm.server's flags unchanged. Each flag the
    installed ``mlx_lm.server --help`` lists is one of ``kvtrio serve``'s, with mlx-lm's
    default, and a command line giving every one of them parses to the same values."""
    from kvtrio.serve.flags import mlx_server_parser

    mlx_parser = mlx_server_parser()

    def mlx_reads(*argv: str) -> dict[str, Any]:  # the captured parser's own parse_args
        return vars(argparse.ArgumentParser.parse_args(mlx_parser, list(argv)))

    mlx_actions = [a for a in mlx_parser._actions if a.option_strings]
    assert {s for a in mlx_actions for s in a.option_strings if s.startswith("--")} == (
        _mlx_lm_help_flags()
    )
    ours, theirs = vars(_args()), mlx_reads("--model", "unused")
    assert {dest: ours[dest] for dest in theirs} == theirs  # mlx-lm's defaults
    argv = ["--model", "unused"]
    for action in mlx_actions:
        if action.dest != "model":
            argv += [action.option_strings[0], *_sample(action)]
    theirs, ours = mlx_reads(*argv), vars(_args(*argv[2:]))
    assert {dest: ours[dest] for dest in theirs} == theirs
    assert theirs != mlx_reads("--model", "unused")  # the values were read


def test_every_flag_kvtrio_adds_is_in_the_docs_flag_table() -> None:
    """docs/serve.md's table of kvtrio's own flags lists each one ``kvtrio serve`` adds
    (a flag added without its row left users with ``--help`` alone)."""
    from kvtrio.serve.flags import add_kvtrio_arguments

    parser = argparse.ArgumentParser()
    add_kvtrio_arguments(parser, default_cache_dir=Path("unused"))
    added = {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    rows = set(re.findall(r"(?m)^\| `(--[a-z-]+)", doc))
    assert added <= rows, sorted(added - rows)


def test_an_adapter_or_draft_model_rewritten_in_place_changes_the_key(tmp_path: Path) -> None:
    """An adapter retrained into the same directory (or a draft model re-fused) kept the
    key: entries computed with the old adapter would be served for the new one."""
    from kvtrio.serve.modeldir import MODEL_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    for flag, files in (
        ("adapter_path", ("adapters.safetensors", "adapter_config.json")),
        ("draft_model", ("model.safetensors", "config.json")),
    ):
        side = tmp_path / flag
        side.mkdir()
        for name in files:
            (side / name).write_bytes(b"\0" * 64)
            os.utime(side / name, ns=(1_000_000_000, 1_000_000_000))
        before = _identity(str(tmp_path), **{flag: str(side)})
        assert _identity(str(tmp_path), **{flag: str(side)}) == before
        assert _identity(str(tmp_path)) != before
        for name in files:
            (side / name).write_bytes(b"\1" * 64)  # same size, a later time
            os.utime(side / name, ns=(2_000_000_000, 2_000_000_000))
            assert _identity(str(tmp_path), **{flag: str(side)}) != before, name
            before = _identity(str(tmp_path), **{flag: str(side)})


def test_a_save_trace_must_be_a_file_it_can_append_to(tmp_path: Path) -> None:
    _refused("--save-trace", str(tmp_path))  # a directory
    _refused("--save-trace", str(tmp_path / "missing" / "saves.jsonl"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused("--save-trace", str(fifo))  # no wait for a reader
    path = tmp_path / "saves.jsonl"
    assert _args("--save-trace", str(path)).save_trace == path and path.read_text() == ""
    assert _args().save_trace is None
