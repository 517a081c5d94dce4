"""kvtrio: a durable, non-blocking cold tier for MLX KV caches, on an actor runtime on trio."""

from __future__ import annotations

from typing import Any

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
    "Expect",
    "KvtrioError",
    "OperationCancelled",
    "ShuttingDown",
    "StoreUnavailableError",
    "__version__",
    "load_cache",
    "save_cache",
]

# The sync cache API imports MLX; load it on first use so `import kvtrio` stays light.
_API_NAMES = frozenset({"Expect", "load_cache", "save_cache"})


def __getattr__(name: str) -> Any:
    if name in _API_NAMES:
        from kvtrio import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvtrio' has no attribute {name!r}")
