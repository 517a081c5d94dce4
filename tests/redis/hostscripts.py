"""The host scripts of the two-host tests (``tier_host.py``, ``host_process.py``): imported
in-process for their helpers, or run as one process per host."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_HERE = Path(__file__).parent


@functools.cache
def load(script: str) -> ModuleType:
    """The script ``script`` (a file next to this one) imported as a module, once."""
    path = _HERE / script
    spec = importlib.util.spec_from_file_location(f"kvtrio_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: str, *args: object, timeout: float = 120) -> dict[str, Any]:
    """Run ``script`` in a process of its own; its last output line is a JSON result."""
    out = subprocess.run(
        [sys.executable, str(_HERE / script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result
