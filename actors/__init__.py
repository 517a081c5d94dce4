"""kvtrio.actors."""

from __future__ import annotations
