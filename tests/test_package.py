"""The package's public surface: errors form one hierarchy, the CLI parses."""

from __future__ import annotations

import subprocess
import sys

import kvtrio
from kvtrio import errors


def test_every_public_error_is_a_kvtrio_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), kvtrio.KvtrioError), name


def test_python_dash_m_prints_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "--help"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("usage: kvtrio")
