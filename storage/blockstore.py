"""Where content-addressed blocks live: the interface, and the local-directory store.

A block is named by the sha256 of its bytes (64 lowercase hex digits). Stores are
untrusted: every read is re-hashed against the name by the caller-facing helpers
(:func:`read_block_verified`), and a block that is missing is a clean miss (``None``
/ ``False``), never an exception. All methods are blocking and CPU/IO only: callers
run them on worker threads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import attrs

__all__ = [
    "BLOCK_NAME_RE",
    "BlockInfo",
    "BlockStore",
    "check_block_name",
]

BLOCK_NAME_RE = re.compile(r"[0-9a-f]{64}")


def check_block_name(name: str) -> str:
    """Return ``name`` if it is a valid block name; raise CorruptCacheError otherwise."""
    from kvtrio.errors import CorruptCacheError

    if not isinstance(name, str) or BLOCK_NAME_RE.fullmatch(name) is None:
        raise CorruptCacheError(f"block name: not 64 lowercase hex digits: {name!r:.80}")
    return name


@attrs.frozen
class BlockInfo:
    """What a store knows of one stored block (for GC's grace period and accounting)."""

    name: str
    size: int
    mtime: float  # seconds since the epoch; stores without mtimes report the time first seen


@runtime_checkable
class BlockStore(Protocol):
    """A store of immutable blocks named by their sha256.

    Implementations: the local directory store (the default) and Redis (shared by
    hosts). Writes are idempotent: putting a block that exists stores nothing.
    """

    def put_many(self, blocks: Sequence[tuple[str, memoryview]]) -> int:
        """Store the blocks that are absent; return the number of bytes newly stored.

        Durable on return (local store: file fsynced, renamed, directory fsynced).
        """
        ...

    def has_many(self, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` are present."""
        ...

    def read_into(self, name: str, buffer: memoryview) -> bool:
        """Fill ``buffer`` (exactly the block's size) with the block; False if it is missing.

        Raises CorruptCacheError when the stored size differs from ``len(buffer)``.
        Does not hash: the caller verifies against the name.
        """
        ...

    def delete_many(self, names: Sequence[str]) -> int:
        """Delete the named blocks that exist; return how many were deleted."""
        ...

    def iter_blocks(self) -> Iterator[BlockInfo]:
        """Every stored block (for GC and verify)."""
        ...

    def close(self) -> None:
        """Release connections or handles."""
        ...
