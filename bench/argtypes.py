"""Argument types the benchmarks share: a count or a length is a whole number >= 1.

Parsed by argparse, a value no bench can measure is a usage error (exit 2, one line
naming the flag). Before, ``--rounds 0`` ended in ``StatisticsError: no median for empty
data``, ``--sizes abc`` in a ValueError traceback, ``--lengths -5`` was measured as a
conversation, and ``kvtrio bench runtime --messages -1`` never ended.
"""

from __future__ import annotations

import argparse

__all__ = ["whole", "wholes"]


def whole(text: str) -> int:
    """A whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def wholes(text: str) -> str:
    """Whole numbers >= 1, comma-separated; the text itself is kept (each bench splits it)."""
    parts = [part for part in text.split(",") if part]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected numbers like 1024,4096, got {text!r}")
    for part in parts:
        whole(part)
    return text
