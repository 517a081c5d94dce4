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

PyTorch is kept out of the process (docs/serve.md, "Start"): mlx-lm never uses it, but
transformers imports it while mlx-lm's server is imported wherever it is installed (the
rotary-embedding helpers; 0.7 s of a 1.6 s import on a 2-core VM, 3-4 s with torch's
CUDA build, sympy and the rest on the H200 host). Before anything imports transformers,
``sys.modules["torch"]`` is set to None, so ``importlib.util.find_spec("torch")`` (how
transformers asks) finds nothing and the process runs as on a machine without PyTorch,
the configuration mlx-lm supports on every Mac without it and this suite tests.
``--import-torch`` leaves it importable, and so does ``--trust-remote-code`` (a model's
own code may need it). A transformers that imports PyTorch unconditionally then fails
its import with ``ImportError.name == "torch"``: the command then stops with a usage
error (exit status 2) naming ``--import-torch``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence

__all__ = ["TORCH_FLAGS", "add_arguments", "before_imports", "run"]

#: The flags that leave PyTorch importable (either names one: argparse's abbreviations too).
TORCH_FLAGS = ("--import-torch", "--trust-remote-code")

#: Whether :func:`before_imports` kept PyTorch out of this process.
_torch_kept_out = False


def _names(word: str, flag: str) -> bool:
    """Whether ``word`` is ``flag``, ``flag=VALUE`` or an abbreviation argparse takes."""
    name = word.split("=", 1)[0]
    return len(name) > 2 and name.startswith("--") and flag.startswith(name)


def before_imports(argv: Sequence[str]) -> None:
    """Keep PyTorch out of this process unless a word of ``argv`` names one of
    :data:`TORCH_FLAGS` (the module docstring). Called before :func:`add_arguments`."""
    global _torch_kept_out
    if "torch" in sys.modules or any(_names(w, f) for w in argv for f in TORCH_FLAGS):
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch: ImportError
    _torch_kept_out = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtrio.actors.collector import collector_paused
    from kvtrio.cli.paths import default_data_dir

    with collector_paused():  # the imports (module docstring)
        from kvtrio.serve.server import add_kvtrio_arguments, add_mlx_server_arguments

        try:
            add_mlx_server_arguments(parser)  # imports mlx_lm.server
        except ImportError as exc:
            if not (_torch_kept_out and exc.name == "torch"):
                raise
            parser.error(  # exit status 2 with the usage line, as for a bad flag
                "this transformers imports PyTorch, which kvtrio serve keeps out of its "
                "process by default: run it with --import-torch"
            )
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
