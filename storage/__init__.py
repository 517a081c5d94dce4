"""kvtrio.storage."""

from __future__ import annotations
