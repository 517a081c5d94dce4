"""kvtrio: a durable, non-blocking cold tier for MLX KV caches, on an actor runtime on trio."""

from __future__ import annotations

from kvtrio.errors import (
    ActorCrashed,
    ActorStopped,
    AskTimeout,
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    KvtrioError,
    OperationCancelled,
    ShuttingDown,
    StoreUnavailableError,
)

__version__ = "0.1.0"

__all__ = [
    "ActorCrashed",
    "ActorStopped",
    "AskTimeout",
    "CacheMismatchError",
    "CacheMissError",
    "CorruptCacheError",
    "KvtrioError",
    "OperationCancelled",
    "ShuttingDown",
    "StoreUnavailableError",
    "__version__",
]
