"""kvtrio's errors: one base class and a small flat set a caller can act on.

Every error kvtrio raises on purpose is a :class:`KvtrioError`. Each subclass
has one meaning, stated in its docstring; callers branch on the type, never
on the message text.
"""

from __future__ import annotations

__all__ = [
    "ActorCrashed",
    "ActorStopped",
    "AskTimeout",
    "CacheMismatchError",
    "CacheMissError",
    "CorruptCacheError",
    "DirectoryLockedError",
    "InvalidInputError",
    "KvtrioError",
    "LifecycleError",
    "NewerFormatError",
    "OperationCancelled",
    "PinLimitError",
    "ShuttingDown",
    "StoreUnavailableError",
    "UnknownCacheKindError",
    "UnsupportedCacheError",
    "UnsupportedModelError",
]


class KvtrioError(Exception):
    """Base class of every error kvtrio raises on purpose."""


class ShuttingDown(KvtrioError):
    """The system is shutting down: it accepts no new work."""


class ActorStopped(KvtrioError):
    """The actor addressed has stopped (or never started): the message was not accepted."""


class ActorCrashed(KvtrioError):
    """An actor's handler raised; the original exception is ``__cause__``."""

    def __init__(self, actor: str, message: str | None = None) -> None:
        self.actor = actor
        super().__init__(message or f"actor {actor!r} crashed")


class AskTimeout(KvtrioError):
    """An ``ask`` got no reply within its timeout; the late reply, if any, is discarded."""


class OperationCancelled(KvtrioError):
    """A blocking job saw its cancel token set and stopped at a step boundary, cleaning up."""


class CorruptCacheError(KvtrioError):
    """A cache file, block or manifest failed validation: it is never returned as data."""


class NewerFormatError(CorruptCacheError):
    """A cache file or manifest of a format version newer than this library reads: written
    by a newer kvtrio, not damaged. Never returned as data (a :class:`CorruptCacheError`),
    but kept: a load counts it a miss and leaves it, and neither open nor ``kvtrio gc``
    removes it or the blocks it may name (docs/format.md, "Compatibility promise")."""


class CacheMismatchError(KvtrioError):
    """A valid cache does not fit what the caller expects (model, fingerprint or structure)."""


class InvalidInputError(KvtrioError, ValueError):
    """What a caller handed kvtrio (tokens, meta, ids, options) cannot be stored or used as
    given; nothing was written. The message starts with the argument or field at fault."""


class UnknownCacheKindError(KvtrioError):
    """A well-formed cache file names a cache kind no codec is registered for (a newer
    writer, or a plugin's codec not imported): it cannot be restored here, but it is not
    corruption, and the tier never deletes it."""


class CacheMissError(KvtrioError):
    """The requested cache (or a block it needs) is not in the store: a clean miss."""


class StoreUnavailableError(KvtrioError):
    """A shared block store (e.g. Redis) could not be reached; the operation did not happen."""


class PinLimitError(KvtrioError):
    """Pinning the entry would pin more bytes than the tier's pin limit allows."""


class UnsupportedCacheError(KvtrioError):
    """A cache object's class has no kvtrio codec (or cannot be saved per sequence): it stays
    in RAM only. ``cache_class`` names the class."""

    def __init__(self, cache_class: str, message: str | None = None) -> None:
        self.cache_class = cache_class
        super().__init__(message or f"cache class {cache_class} cannot be saved by kvtrio")


class UnsupportedModelError(KvtrioError):
    """A model file kvtrio cannot convert for mlx-lm (an architecture, tokenizer or tensor
    it does not map)."""


class DirectoryLockedError(KvtrioError):
    """Another process holds the cold-tier directory's lock (one owner per directory).

    ``directory`` and ``holder_pid`` (None when the lock file names none) say whose it is.
    """

    def __init__(self, directory: str, holder_pid: int | None, waited: float) -> None:
        self.directory = directory
        self.holder_pid = holder_pid
        self.waited = waited
        holder = f"process {holder_pid}" if holder_pid is not None else "another process"
        super().__init__(f"cold tier {directory} is held by {holder} (waited {waited:g} s)")


class LifecycleError(KvtrioError):
    """A cold entry was asked to make a transition its state table forbids (a bug)."""
