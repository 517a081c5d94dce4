"""kvtrio.runtime."""

from __future__ import annotations
