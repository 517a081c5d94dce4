"""kvtrio.metal."""

from __future__ import annotations
