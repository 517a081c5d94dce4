"""``kvtrio serve``'s flags: mlx_lm.server's own, read from the installed mlx_lm.server, and
kvtrio's (docs/serve.md, "Flags"); the options they make, and the tier's model key."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import types
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attrs
from kvtrio.actors.callerchecks import DEFAULT_MIN_REUSE_TOKENS, check_seconds
from kvtrio.serve.savetrace import SaveTrace

if TYPE_CHECKING:  # imported where used: ``kvtrio serve`` starts without the tier's modules
    from kvtrio.actors.policy import AdmissionPolicy
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.serve.bridge import TierOptions

__all__ = [
    "EVICTIONS",
    "REDIS_SCHEMES",
    "SIZE_UNITS",
    "ServeOptions",
    "add_kvtrio_arguments",
    "add_mlx_server_arguments",
    "admission_policy",
    "byte_size",
    "mlx_server_parser",
    "model_identity",
]


def _mlx_server() -> Any:
    from mlx_lm import server

    return server


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


class _CapturingParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["add_help"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)


def mlx_server_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's own argument parser (without -h), taken from its ``main`` as
    installed: its ``parse_args`` call hands the parser back instead of parsing."""
    mlx_server = _mlx_server()
    shim = types.SimpleNamespace(**vars(argparse))
    shim.ArgumentParser = _CapturingParser
    saved = mlx_server.argparse
    mlx_server.argparse = shim
    try:
        mlx_server.main()
    except _Captured as captured:
        return captured.parser
    finally:
        mlx_server.argparse = saved
    raise RuntimeError("mlx_lm.server.main() built no argument parser")


def add_mlx_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every flag of mlx_lm.server to ``parser``, unchanged but for how a bad value
    fails (:func:`_usage_error_on_failure`)."""
    mlx_parser = mlx_server_parser()
    for action in mlx_parser._actions:
        if callable(action.type):
            action.type = _usage_error_on_failure(action.type)
    parser._add_container_actions(mlx_parser)


def _usage_error_on_failure(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An mlx-lm flag's type whose failures are usage errors: argparse makes one of a
    ValueError or TypeError only, and mlx-lm's size parser (``--prompt-cache-bytes``)
    raises KeyError for an unknown unit and decimal.InvalidOperation for ``-5``."""

    def checked(text: str) -> Any:
        try:
            return convert(text)
        except (ArithmeticError, LookupError):
            raise argparse.ArgumentTypeError(f"bad value {text!r}") from None

    checked.__name__ = getattr(convert, "__name__", "value")  # argparse's message names it
    return checked


#: Units of ``--hot-bytes`` / ``--cold-bytes`` (case-insensitive): mlx-lm's M, G, MB, GB
#: (powers of ten, as its ``--prompt-cache-bytes`` reads them), K, KB, T, TB, and the
#: binary KiB, MiB, GiB, TiB.
SIZE_UNITS = {
    **{"": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6},
    **{"g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12},
    **{"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40},
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)

#: The schemes of a Redis URL (``kvtrio.storage.redisstore.is_redis_url``'s, written out:
#: parsing the flags imports nothing of the tier; tests/serve/test_flags.py keeps them equal).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def byte_size(text: str) -> int:
    """A flag's byte count: a number (a decimal point allowed) and a unit of
    :data:`SIZE_UNITS`; anything else (a sign, an unknown unit) is a usage error."""
    match = _SIZE.fullmatch(text.strip())
    unit = SIZE_UNITS.get(match[2].lower()) if match else None
    if match is None or unit is None:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: bytes, or a size like 512MB, 4GB or 8GiB"
        )
    return int(Decimal(match[1]) * unit)


def _seconds(text: str) -> float:
    """A flag's finite time in seconds, >= 0, as the tier checks its own
    (:func:`~kvtrio.actors.callerchecks.check_seconds`)."""
    try:
        value = float(text)
        check_seconds("seconds", value, finite=True)
    except ValueError:  # InvalidInputError is one
        raise argparse.ArgumentTypeError(f"expected finite seconds >= 0, got {text!r}") from None
    return value


def _count(text: str) -> int:
    if not text.strip().isdigit():  # no sign, no decimal point
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _streams(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _redis_url(text: str) -> str:
    """``--redis``: a URL the tier reads as Redis (it takes any other text for a local
    directory's path: ``localhost:6379`` would be one)."""
    if text.startswith(REDIS_SCHEMES):
        try:
            urlsplit(text).port  # noqa: B018  (ValueError for a port that is no number)
        except ValueError:
            pass
        else:
            return text
    raise argparse.ArgumentTypeError(
        f"not a Redis URL: {text!r} (redis://HOST:PORT/DB, rediss://... or unix://PATH)"
    )


def _prompt_file(text: str) -> Path:
    """``--warm-prompts``: a UTF-8 text file, read now (the generation thread reads it
    again once the model is loaded: a file it cannot read would stop it)."""
    path = Path(text).expanduser()
    try:
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{text}: not a file")
        path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{text}: {type(exc).__name__}: {exc}") from None
    return path


def _trace_file(text: str) -> Path:
    """``--save-trace``: a file opened for appending now (a path it cannot append to
    stops the start, not the first save)."""
    try:
        trace = SaveTrace.at(Path(text).expanduser())
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {type(exc).__name__}: {exc}") from None
    assert trace is not None
    return trace.path


def _directory(text: str) -> Path:
    if not text.strip():  # an unset variable in a unit file: not the working directory
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text).expanduser()


def add_kvtrio_arguments(parser: argparse.ArgumentParser, *, default_cache_dir: Path) -> None:
    """kvtrio's own flags (see docs/serve.md)."""
    group = parser.add_argument_group("kvtrio")
    group.add_argument(
        "--cache-dir",
        type=_directory,
        default=default_cache_dir,
        metavar="DIR",
        help="the cold tier's directory (default: %(default)s)",
    )
    group.add_argument(
        "--redis",
        type=_redis_url,
        metavar="URL",
        default=None,
        help="a redis://, rediss:// or unix:// URL: keep the cold tier in Redis, shared by "
        "several hosts",
    )
    group.add_argument(
        "--hot-bytes",
        type=byte_size,
        default=None,
        metavar="N",
        help="RAM budget of the prompt cache: bytes, or a size like 512MB, 4GB or 8GiB "
        "(default: mlx-lm's, --prompt-cache-size entries only)",
    )
    group.add_argument(
        "--cold-bytes",
        type=byte_size,
        default=8 << 30,
        metavar="N",
        help="disk budget, as --hot-bytes (default: 8GiB; exceeded by at most one entry)",
    )
    group.add_argument(
        "--grace",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="seconds requests in flight get at shutdown, and again once they are cut (default 10)",
    )
    group.add_argument(
        "--flush-timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds the shutdown's disk writes of the RAM entries get at most (default: "
        "2 x --grace + 5, plus 1 s per 50 MB of RAM entries); past it the server exits 1 "
        "and names each entry not written",
    )
    group.add_argument(
        "--cold-load-timeout",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="a disk load taking longer is a miss for its request (seconds, default 30)",
    )
    group.add_argument(
        "--min-reuse-tokens",
        type=_count,
        metavar="N",
        default=DEFAULT_MIN_REUSE_TOKENS,
        help="a disk entry reusing fewer tokens is not loaded: recomputing them is faster "
        f"(default {DEFAULT_MIN_REUSE_TOKENS}, measured: docs/tiered.md)",
    )
    group.add_argument(
        "--write-defer",
        type=_seconds,
        default=WRITE_DEFER,
        metavar="S",
        help="seconds an evicted entry's disk write waits while requests decode "
        f"(default {WRITE_DEFER:g}; 0: at once)",
    )
    group.add_argument(
        "--warm-prompts",
        type=_prompt_file,
        default=None,
        metavar="FILE",
        help="prefill each line of FILE (a text prompt) at start and store it on disk, "
        "skipping prompts already there",
    )
    group.add_argument(
        "--eviction",
        choices=EVICTIONS,
        default="cost",
        help="the disk's eviction order: cost (recompute time per byte, aged: the default), "
        "cost-frequency, or lru",
    )
    group.add_argument(
        "--admission",
        type=_admission_spec,
        default="default",
        metavar="SPEC",
        help="which entries RAM evicts are written to disk: default (at least "
        "12 s of prefill saved per GiB), all, second-use, min-tokens:N, per-gib:SECONDS, "
        "or several joined by + (all of them must admit)",
    )
    group.add_argument(
        "--restore-bytes",
        type=byte_size,
        default=None,
        metavar="N",
        help="after a start, load the most recently used disk entries back into RAM while "
        "idle, up to N bytes (as --hot-bytes; default 1GiB, and never past --hot-bytes or "
        "--prompt-cache-size; 0: off)",
    )
    group.add_argument(
        "--save-trace",
        type=_trace_file,
        default=None,
        metavar="FILE",
        help="append one JSON line per entry handed to disk: when RAM handed it over and "
        "when the writes had settled (time.perf_counter's clock), for measuring what a "
        "save costs other streams (docs/serve.md)",
    )
    group.add_argument(
        "--load-streams",
        type=_streams,
        default=None,
        metavar="N",
        help="reads (each with its blocks' hash checks) one disk load runs at once "
        "(default: one below 8 CPUs, else one per 4 CPUs up to 4; docs/serve.md, Tuning)",
    )
    group.add_argument(
        "--import-torch",
        action="store_true",
        help="leave PyTorch importable (by default kvtrio serve keeps it out of its process: "
        "mlx-lm does not use it, and transformers imports it at start wherever it is "
        "installed; kept with --trust-remote-code too; docs/serve.md, Start)",
    )
    group.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="do not start a request's disk load when it arrives (only when the generation "
        "thread takes it)",
    )


#: ``--eviction``'s choices: kvtrio.actors.policy.PolicyKind's values.
EVICTIONS = ("cost", "cost-frequency", "lru")

#: --write-defer's default: kvtrio.actors.writegate.DEFAULT_WRITE_DEFER, written out so
#: that parsing the flags imports nothing of the tier (docs/serve.md, "Start").
WRITE_DEFER = 2.0


def admission_parts(spec: str) -> list[tuple[str, float | None]]:
    """``--admission``'s parts as (name, value), checked; ValueError for a bad spec. It
    imports nothing of the tier: the parser checks the flag at start with it, and the
    policies are built with the tier, on the thread that opens it."""
    parts: list[tuple[str, float | None]] = []
    for part in spec.split("+"):
        name, _, value = part.strip().partition(":")
        try:
            if name in ("default", "all", "second-use") and not value:
                parts.append((name, None))
            elif name == "min-tokens" and int(value) >= 0:
                parts.append((name, int(value)))
            elif name == "per-gib" and float(value) >= 0:
                parts.append((name, float(value)))
            else:
                raise ValueError(part)
        except ValueError:
            raise ValueError(f"bad admission {part.strip()!r}") from None
    return parts


def admission_policy(spec: str) -> AdmissionPolicy | None:
    """``--admission``'s policy (None: the tier's default); ValueError for a bad spec."""
    from kvtrio.actors import policy

    parts: list[policy.AdmissionPolicy] = []
    for name, value in admission_parts(spec):
        if name == "default":
            parts.append(policy.default_admission())
        elif name == "all":
            parts.append(policy.AdmitAll())
        elif name == "second-use":
            parts.append(policy.SecondUse())
        elif name == "min-tokens":
            parts.append(policy.MinimumTokens(int(value or 0)))
        else:
            parts.append(policy.RecomputePerByte(float(value or 0.0)))
    if spec.strip() == "default":
        return None
    return parts[0] if len(parts) == 1 else policy.AllOf(tuple(parts))


def _admission_spec(text: str) -> str:
    try:
        admission_parts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}: use default, all, second-use, min-tokens:N, per-gib:SECONDS, or A+B"
        ) from None
    return text


@attrs.frozen
class ServeOptions:
    """kvtrio's part of ``kvtrio serve``'s options."""

    cache_dir: str
    hot_bytes: int | None = None
    cold_bytes: int = 8 << 30
    grace: float = 10.0
    cold_load_timeout: float = 30.0
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS
    eviction: str = "cost"
    admission: str = "default"
    prefetch: bool = True
    write_defer: float = WRITE_DEFER
    load_streams: int | None = None
    save_trace: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(
            cache_dir=args.redis or os.fspath(args.cache_dir),
            hot_bytes=args.hot_bytes,
            cold_bytes=args.cold_bytes,
            grace=args.grace,
            cold_load_timeout=args.cold_load_timeout,
            min_reuse_tokens=args.min_reuse_tokens,
            eviction=getattr(args, "eviction", "cost"),
            admission=getattr(args, "admission", "default"),
            prefetch=getattr(args, "prefetch", True),
            write_defer=getattr(args, "write_defer", WRITE_DEFER),
            load_streams=getattr(args, "load_streams", None),
            save_trace=getattr(args, "save_trace", None),
        )

    def saves(self) -> SaveTrace | None:
        """``--save-trace``'s record (:mod:`kvtrio.serve.savetrace`), or None."""
        return SaveTrace.at(self.save_trace)

    def tier_options(self, model: ModelKey) -> TierOptions:
        """The cold tier's options (TierThread's) for ``model``."""
        from kvtrio.actors.policy import PolicyKind
        from kvtrio.serve.bridge import TierOptions

        return TierOptions(
            self.cache_dir,
            model,
            cold_budget=self.cold_bytes,
            shutdown_grace=self.grace,
            min_reuse_tokens=self.min_reuse_tokens,
            eviction=PolicyKind(self.eviction),
            admission=admission_policy(self.admission),
            write_defer=self.write_defer,
            load_streams=self.load_streams,
        )


def _one_spelling(model: str) -> str:
    """A local model path as one string however it is spelled (relative, ``./``, a
    trailing ``/``, through a link); a Hugging Face repo id as given."""
    path = Path(model)
    return str(path.resolve()) if path.exists() else model


def model_identity(args: argparse.Namespace) -> ModelKey:
    """The tier's model key: the model (its resolved path, or its repo id), and a
    fingerprint of its config, its weight files (names, sizes, modification times),
    adapter and draft model (their paths, and for a local directory the same of its
    weight and config files) and KV quantization. The path tells apart two fine-tunes of one
    base, whose configs and file sizes are the same."""
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.storage.fingerprint import config_fingerprint
    from mlx_lm.utils import _download

    path = Path(args.model)
    if not path.exists():
        path = Path(_download(args.model))
    config = json.loads((path / "config.json").read_text())
    weights = hashlib.sha256()
    for item in sorted(path.glob("*.safetensors")):
        # Not hashed (seconds per GB at start): the size and the modification time tell
        # weights rewritten in place (a re-fuse, a re-quantization: same shapes, same sizes)
        # from the ones the entries were computed with.
        info = item.stat()
        weights.update(f"{item.name}:{info.st_size}:{info.st_mtime_ns};".encode())
    adapter = args.adapter_path and _one_spelling(args.adapter_path)
    draft = args.draft_model and _one_spelling(args.draft_model)
    weights.update(f"adapter={adapter};draft={draft}".encode())
    # An adapter retrained in place, or a draft model re-fused (its caches are part of
    # each entry), changes the key as the model's own weights do.
    for given in (adapter, draft):
        if given and Path(given).is_dir():
            for item in sorted(Path(given).glob("*.safetensors")) + sorted(
                Path(given).glob("*config.json")
            ):
                info = item.stat()
                weights.update(f"{item}:{info.st_size}:{info.st_mtime_ns};".encode())
    fingerprint = config_fingerprint(
        config,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size if args.kv_bits else None,
        quantized_kv_start=args.quantized_kv_start if args.kv_bits else None,
        weights_id=weights.hexdigest(),
    )
    return ModelKey(_one_spelling(str(args.model)), fingerprint)
