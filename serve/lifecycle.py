"""The server's life outside any one request: the requests in flight, and the model's load.

:class:`InFlight` counts the requests being handled, so that a shutdown waits for them
(docs/serve.md, "Shutdown"). :class:`ModelLoad` says how the generation thread's load of
the model ended: a model that does not load stops the server at start with exit status 2,
as plain ``mlx_lm.server`` does, rather than listening and answering every request with
an error (tests/serve/test_start.py,
``test_a_model_that_does_not_load_stops_the_server_with_status_two``).
"""

from __future__ import annotations

import threading

import attrs

__all__ = ["InFlight", "ModelLoad"]


@attrs.define(eq=False)
class InFlight:
    """Requests being handled (shutdown waits for them)."""

    count: int = 0
    lock: threading.Condition = attrs.field(factory=threading.Condition)

    def __enter__(self) -> None:
        with self.lock:
            self.count += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.count -= 1
            self.lock.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: self.count == 0, timeout)


@attrs.define(eq=False)
class ModelLoad:
    """Set by the generation thread once its load of the model has ended; ``failure`` is
    what the load raised, if it did."""

    done: threading.Event = attrs.field(factory=threading.Event)
    failure: BaseException | None = None

    def ended(self, failure: BaseException | None = None) -> None:
        self.failure = failure
        self.done.set()
