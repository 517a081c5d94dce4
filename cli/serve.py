"""``kvtrio serve``: mlx_lm.server's flags and kvtrio's, then :func:`kvtrio.serve.server.serve`."""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtrio.cli.paths import default_data_dir
    from kvtrio.serve.server import add_kvtrio_arguments, add_mlx_server_arguments

    add_mlx_server_arguments(parser)
    add_kvtrio_arguments(parser, default_cache_dir=default_data_dir() / "serve")


def run(args: argparse.Namespace) -> int:
    from kvtrio.cli import UsageError
    from kvtrio.serve.server import serve

    if not (args.model or "").strip():  # missing, or an unset variable: not the working dir
        raise UsageError("--model is required (a model directory or a Hugging Face repo)")
    if not 0 <= args.port <= 65535:  # getaddrinfo takes 99999 as 99999 % 65536: 34463
        raise UsageError(f"--port {args.port}: expected 0 to 65535")

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    return serve(args)
