"""Map process signals to shutdown: the first SIGINT/SIGTERM drains, the second cancels."""

from __future__ import annotations

import signal
from collections.abc import Iterable

import trio
from kvtrio.runtime.system import ActorSystem

__all__ = ["shutdown_on_signals"]

DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def shutdown_on_signals(
    system: ActorSystem,
    *,
    grace: float | None = None,
    signals: Iterable[signal.Signals] = DEFAULT_SIGNALS,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> signal.Signals | None:
    """Serve until a signal arrives, then shut ``system`` down; return the first signal.

    The first signal starts ``system.shutdown(grace=grace)``; a second one during that
    shutdown cancels every actor at once (``system.cancel()``). Returns when the system
    has stopped, with None if it stopped for another reason. Call it from the main thread
    (trio only receives signals there); ``task_status`` reports when the handlers are set.
    """
    with trio.open_signal_receiver(*signals) as received:
        task_status.started()
        first: signal.Signals | None = None
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal first
                async for signum in received:
                    if first is None:
                        first = signal.Signals(signum)
                        nursery.start_soon(_shutdown, system, grace)
                    else:
                        system.cancel()

            nursery.start_soon(watch)
            await system.wait_stopped()
            nursery.cancel_scope.cancel()
        return first


async def _shutdown(system: ActorSystem, grace: float | None) -> None:
    await system.shutdown(grace=grace)
