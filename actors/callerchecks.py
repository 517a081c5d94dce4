"""What the tiered cache checks of its callers, once, at the API (issue 15).

The tier can only write what it can read back, so caller input is refused before
anything is kept: token ids and ``meta`` by the reader's own rules
(:func:`kvtrio.storage.writable.check_token_ids`, :func:`~kvtrio.storage.writable.check_meta`),
a conversation id that is not a ``str``, caches whose layers do not hold ``len(tokens)``
tokens (:func:`check_held_tokens`), and budgets, sizes, counts and times an opener
cannot use (:func:`check_open_arguments`, :func:`check_tier_arguments`): each is refused
once, at the API, with InvalidInputError naming the argument. A bool is never a number
here, NaN never a time, and zero is refused where it means nothing (a block of zero
tokens, no I/O threads).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kvtrio.errors import CacheMismatchError, InvalidInputError

__all__ = [
    "DEFAULT_MIN_REUSE_TOKENS",
    "check_held_tokens",
    "check_open_arguments",
    "check_seconds",
    "check_tier_arguments",
    "held_token_counts",
]

#: Cold matches reusing fewer tokens are not loaded: recomputing them is faster. Measured
#: on the demo's model (``kvtrio bench reuse``, two runs, 2-core VM): reusing 16 tokens, a
#: cold load took 1.1-1.4x (1,024-token entry) and 3.7-4.3x (4,096-token entry) the time
#: of recomputing them; from 64 tokens it won in 3 of 4 (0.34x, 0.34x; 1.12x, 0.81x).
DEFAULT_MIN_REUSE_TOKENS = 64


def _held_tokens(cache: Any, path: str) -> Iterable[tuple[str, int]]:
    """The token count of every layer of ``cache`` that states one: a KV-like cache's
    ``offset`` (rotating, chunked, quantized and paged caches count every token seen, not
    what the window keeps); a CacheList's children; an SSM state (ArraysCache) states
    none and holds any count."""
    children = getattr(cache, "caches", None)
    if isinstance(children, list | tuple):
        for j, child in enumerate(children):
            yield from _held_tokens(child, f"{path}.children[{j}]")
        return
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int) and not isinstance(offset, bool):
        yield path, offset


def held_token_counts(cache: Any) -> list[int]:
    """The token count every layer of ``cache`` states (none for a state that holds any
    count, such as an SSM's ArraysCache)."""
    return [held for _, held in _held_tokens(cache, "")]


def check_held_tokens(caches: list[Any], n_tokens: int) -> None:
    """Owner thread: every layer of ``caches`` holds ``n_tokens`` tokens, else
    CacheMismatchError naming the layer."""
    for i, cache in enumerate(caches):
        for path, held in _held_tokens(cache, f"caches[{i}]"):
            if held != n_tokens:
                raise CacheMismatchError(
                    f"{path}.offset: the cache holds {held} tokens, {n_tokens} tokens were given"
                )


def _non_negative_int(name: str, value: object, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInputError(f"{name}: expected an int >= {low}, got {value!r}")


def check_seconds(
    name: str, value: object, *, positive: bool = False, finite: bool = False
) -> None:
    """A time in seconds: an int or float (not bool), not NaN, >= 0 (> 0 with
    ``positive``; not infinite with ``finite``); else InvalidInputError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name}: expected a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise InvalidInputError(f"{name}: expected seconds {bound}, got {value!r}")
    if finite and math.isinf(value):
        raise InvalidInputError(f"{name}: expected a finite number of seconds, got {value!r}")


def _byte_cap(name: str, value: object) -> None:
    """A byte cap: an int >= 0, or a float >= 0 (``math.inf``: no cap); not NaN or bool."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name}: expected a number of bytes, got {value!r}")
    if math.isnan(value) or value < 0:
        raise InvalidInputError(f"{name}: expected bytes >= 0, got {value!r}")


def check_tier_arguments(
    *,
    block_tokens: object,
    cap_bytes: object,
    io_threads: object,
    shutdown_grace: object,
    lock_timeout: object,
    background: object,
) -> None:
    """:meth:`~kvtrio.actors.tier.ColdTier.open`'s sizes, caps and times (InvalidInputError)."""
    _non_negative_int("block_tokens", block_tokens, low=1)
    _byte_cap("cap_bytes", cap_bytes)
    _non_negative_int("io_threads", io_threads, low=1)
    check_seconds("shutdown_grace", shutdown_grace)
    check_seconds("lock_timeout", lock_timeout)
    if background is not None:
        check_seconds("background", background, positive=True, finite=True)


def check_open_arguments(
    *,
    hot_budget: object,
    cold_budget: object,
    min_free_bytes: object,
    block_size: object,
    min_reuse_tokens: object,
    pending_budget: object = 0,
    pin_limit: object = 0,
    shared_refresh: object = None,
) -> None:
    """The tiered cache's budgets and sizes, checked at open (InvalidInputError)."""
    _non_negative_int("pending_budget", pending_budget)
    _non_negative_int("pin_limit", pin_limit)
    if shared_refresh is not None:
        check_seconds("shared_refresh", shared_refresh)
    _non_negative_int("hot_budget", hot_budget)
    _non_negative_int("cold_budget", cold_budget)
    if min_free_bytes is not None:
        if isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int):
            raise InvalidInputError(f"min_free_bytes: expected an int, got {min_free_bytes!r}")
        if min_free_bytes < 0:
            raise InvalidInputError(f"min_free_bytes: expected >= 0, got {min_free_bytes}")
    _non_negative_int("block_size", block_size, low=1)
    _non_negative_int("min_reuse_tokens", min_reuse_tokens)
