"""``kvtrio serve``: mlx_lm.server's flags and kvtrio's, then :func:`kvtrio.serve.server.serve`.

The start's garbage collection (docs/serve.md, "Start"): building the flags imports
mlx-lm, transformers and huggingface_hub, some 130,000 tracked objects that live as long
as the process, and Python's collector traverses them again and again while they are
made (60-90 ms of a 0.9 s start on a 2-core VM); mlx-lm's model load then begins with a
full ``gc.collect()`` (meant to free a model loaded before: there is none at start) that
traverses them once more (25-40 ms), before the first answer. So the imports run with
automatic collections paused, and the objects they made are frozen (``gc.freeze``: kept
where no collection looks) before collections resume; later collections traverse only
what was made since. mlx-lm's behaviour is unchanged: its load still collects (a second
model's load frees the first, made after the freeze), and nothing a request makes is
frozen.
"""

from __future__ import annotations

import argparse
import gc
import logging

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtrio.actors.collector import collector_paused
    from kvtrio.cli.paths import default_data_dir

    with collector_paused():  # the imports (module docstring)
        from kvtrio.serve.server import add_kvtrio_arguments, add_mlx_server_arguments

        add_mlx_server_arguments(parser)  # imports mlx_lm.server
        # Frozen before collections resume: the next one would traverse all of them.
        gc.freeze()
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
