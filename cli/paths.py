"""Where kvtrio keeps its data by default (imported by ``kvtrio serve`` at start: light)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["default_data_dir"]


def default_data_dir() -> Path:
    """``$KVTRIO_DATA_DIR``, else the platform's user cache directory + ``kvtrio``."""
    env = os.environ.get("KVTRIO_DATA_DIR")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "kvtrio"
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "kvtrio" / "Cache"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtrio"
