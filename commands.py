"""Imports the modules that register CLI subcommands and benchmarks in :mod:`kvtrio.cli`.

Each listed module sets ``kvtrio.cli.COMMANDS[...]`` or ``kvtrio.cli.BENCHES[...]`` at import
time. Add a module's name to :data:`COMMAND_MODULES` when it adds a command.
"""

from __future__ import annotations

import importlib

__all__ = ["COMMAND_MODULES", "load_all"]

COMMAND_MODULES: tuple[str, ...] = (
    "kvtrio.showcase",  # kvtrio showcase
    "kvtrio.demo",  # kvtrio demo (the main job)
    "kvtrio.cli_tools",  # kvtrio inspect / verify / gc
    "kvtrio.drill",  # kvtrio drill ...
    "kvtrio.bench_runtime",  # kvtrio bench runtime
    "kvtrio.bench_redis",  # kvtrio bench redis
    "kvtrio.bench_storage",  # kvtrio bench storage
    "kvtrio.bench_attention",  # kvtrio bench attention
    "kvtrio.bench_tier",  # kvtrio bench tier
)


def load_all() -> None:
    """Import every command module (each registers itself on import)."""
    for name in COMMAND_MODULES:
        importlib.import_module(name)


load_all()
