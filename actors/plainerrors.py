"""Public openers raise plain errors, not their nurseries' ExceptionGroups (issue 15).

trio wraps every exception that leaves a nursery in an ExceptionGroup. The nurseries
inside kvtrio's context managers (the tier's actor system, the tiered cache's writer
task) are kvtrio's own, not the caller's: a caller who writes ``except
DirectoryLockedError`` around ``ColdTier.open`` should catch it. :func:`plain_errors`
decorates such an opener: an ExceptionGroup whose only leaf is an ``Exception`` reaches
the caller as that exception, with its own traceback and cause, whether it was raised
while opening or by the ``async with`` block. A group of two or more stays a group, so
nothing is hidden; a lone BaseException that is not an Exception (trio's Cancelled,
KeyboardInterrupt) is left to trio.

Used by :meth:`~kvtrio.actors.tier.ColdTier.open`,
:meth:`~kvtrio.actors.tiered.TieredPromptCache.open` and
:func:`~kvtrio.actors.factory.open_tiered_cache`.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import ParamSpec, TypeVar

__all__ = ["plain_errors", "sole_exception"]

P = ParamSpec("P")
T = TypeVar("T")


def sole_exception(group: BaseExceptionGroup[BaseException]) -> Exception | None:
    """The group's only leaf (through nested groups), when there is exactly one and it is
    an Exception; None otherwise."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending and len(leaves) < 2:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if pending or len(leaves) != 1 or not isinstance(leaves[0], Exception):
        return None
    return leaves[0]


def plain_errors(
    opener: Callable[P, AbstractAsyncContextManager[T]],
) -> Callable[P, AbstractAsyncContextManager[T]]:
    """``opener`` (an async context manager factory), raising a one-leaf ExceptionGroup
    as its leaf (the module docstring)."""

    @functools.wraps(opener)
    @asynccontextmanager
    async def plain(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        try:
            async with opener(*args, **kwargs) as value:
                yield value
        except BaseExceptionGroup as group:
            leaf = sole_exception(group)
            if leaf is None:
                raise
            raise leaf from leaf.__cause__

    return plain
