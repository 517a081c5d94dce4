"""kvtrio: a durable, non-blocking cold tier for MLX KV caches, on an actor runtime on trio.

The public API is here, in one namespace (names load on first use, so ``import kvtrio``
imports neither MLX nor trio):

- serving: :class:`TieredPromptCache` and :func:`open_tiered_cache` (RAM, then disk, then
  an optional shared store), :class:`WritePolicy`, :class:`Tier`, :class:`ModelKey`,
  :class:`ColdTier` (the cold tier alone), :class:`MlxOwner` (the one thread that touches
  MLX);
- scripts: :func:`save_cache`, :func:`load_cache`, :class:`Expect`, :func:`import_mlx_lm`,
  :func:`export_mlx_lm`, :func:`config_fingerprint`;
- :class:`IoOptions`, the I/O paths' tuning, passed as ``options=`` (docs/tuning.md);
- the errors, all subclasses of :class:`KvtrioError`.

The runtime (actors, supervision, shutdown) is :mod:`kvtrio.runtime`; the storage layer
:mod:`kvtrio.storage`; paged caches and attention :mod:`kvtrio.metal`. docs/api.md lists
every name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrio._lazy import lazy_exports
from kvtrio.errors import (
    ActorCrashed,
    ActorStopped,
    AskTimeout,
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    DirectoryLockedError,
    KvtrioError,
    LifecycleError,
    NewerFormatError,
    OperationCancelled,
    PinLimitError,
    ShuttingDown,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tier import ColdTier
    from kvtrio.actors.tiered import Tier, TieredPromptCache, WritePolicy, open_tiered_cache
    from kvtrio.api import Expect, LoadedCache, export_mlx_lm, import_mlx_lm, load_cache, save_cache
    from kvtrio.storage.fingerprint import config_fingerprint
    from kvtrio.storage.options import IoOptions

__version__ = "0.1.0"

_EXPORTS = {
    "ColdTier": "kvtrio.actors.tier",
    "Expect": "kvtrio.api",
    "IoOptions": "kvtrio.storage.options",
    "LoadedCache": "kvtrio.api",
    "MlxOwner": "kvtrio.actors.owner",
    "ModelKey": "kvtrio.actors.prefix",
    "Tier": "kvtrio.actors.tiered",
    "TieredPromptCache": "kvtrio.actors.tiered",
    "WritePolicy": "kvtrio.actors.tiered",
    "config_fingerprint": "kvtrio.storage.fingerprint",
    "export_mlx_lm": "kvtrio.api",
    "import_mlx_lm": "kvtrio.api",
    "load_cache": "kvtrio.api",
    "open_tiered_cache": "kvtrio.actors.tiered",
    "save_cache": "kvtrio.api",
}

__all__ = [
    "ActorCrashed",
    "ActorStopped",
    "AskTimeout",
    "CacheMismatchError",
    "CacheMissError",
    "ColdTier",
    "CorruptCacheError",
    "NewerFormatError",
    "DirectoryLockedError",
    "Expect",
    "IoOptions",
    "KvtrioError",
    "LifecycleError",
    "LoadedCache",
    "MlxOwner",
    "ModelKey",
    "OperationCancelled",
    "PinLimitError",
    "ShuttingDown",
    "StoreUnavailableError",
    "Tier",
    "TieredPromptCache",
    "WritePolicy",
    "__version__",
    "config_fingerprint",
    "export_mlx_lm",
    "import_mlx_lm",
    "load_cache",
    "open_tiered_cache",
    "save_cache",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
