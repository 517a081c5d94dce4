"""Imports the modules that register CLI subcommands and benchmarks in :mod:`kvtrio.cli`.

Each listed module calls ``kvtrio.cli.COMMANDS[...] = ...`` or ``kvtrio.cli.BENCHES[...] = ...``
at import time. Add a module here when it adds a command.
"""

from __future__ import annotations

__all__: list[str] = []
import kvtrio.bench_redis  # noqa: F401  (kvtrio bench redis)
import kvtrio.bench_runtime  # (kvtrio bench runtime)
import kvtrio.showcase  # (kvtrio showcase, and kvtrio demo until the full demo lands)
import kvtrio.drill  # noqa: F401  (kvtrio drill)
