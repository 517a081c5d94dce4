"""Reading kvtrio's numeric ``KVTRIO_*`` switches from the environment (docs/tuning.md)."""

from __future__ import annotations

import os

__all__ = ["env_int"]


def env_int(name: str, default: int, minimum: int) -> int:
    """The integer in environment variable ``name``, or ``default`` when it is unset or
    blank. Raises ValueError naming the variable when it is not an integer >= ``minimum``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value
