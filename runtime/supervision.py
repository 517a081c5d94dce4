"""Supervision policies: what happens when an actor's handler raises.

:class:`Escalate` (the default) behaves like a trio nursery: the crash propagates as
:class:`~kvtrio.errors.ActorCrashed` and the whole system is cancelled.
:class:`Restart` restarts the actor in place, keeping its mailbox, at most
``max_restarts`` times within any ``within`` seconds (OTP's intensity and period); the
crash after that escalates. Before each restart it waits an exponential backoff with
jitter, measured on trio's clock (docs/design.md invariant 7), so MockClock tests are exact.
"""

from __future__ import annotations

import random
from collections import deque

import attrs

__all__ = ["Escalate", "Restart", "RestartTracker", "Supervision", "ESCALATE"]


@attrs.frozen
class Escalate:
    """A crash stops the actor and propagates: the system's nursery is cancelled."""


@attrs.frozen
class Restart:
    """Restart on crash: at most ``max_restarts`` within ``within`` seconds, then escalate.

    The k-th restart inside the current window (k = 0, 1, ...) waits
    ``min(backoff_max, backoff_initial * backoff_factor**k)``, scaled by a uniform factor in
    ``[1 - jitter, 1 + jitter]``.
    """

    max_restarts: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    within: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    backoff_initial: float = attrs.field(default=0.1, validator=attrs.validators.ge(0))
    backoff_factor: float = attrs.field(default=2.0, validator=attrs.validators.ge(1))
    backoff_max: float = attrs.field(default=5.0, validator=attrs.validators.ge(0))
    jitter: float = attrs.field(
        default=0.1, validator=[attrs.validators.ge(0), attrs.validators.le(1)]
    )

    def backoff(self, k: int, rng: random.Random) -> float:
        """The delay before the k-th restart of the current window."""
        base = min(self.backoff_max, self.backoff_initial * self.backoff_factor**k)
        if self.jitter == 0:
            return base
        return base * rng.uniform(1 - self.jitter, 1 + self.jitter)


Supervision = Escalate | Restart
ESCALATE = Escalate()


@attrs.define
class RestartTracker:
    """The restart history of one actor under a :class:`Restart` policy."""

    policy: Restart
    rng: random.Random
    _restarts: deque[float] = attrs.field(factory=deque)

    def on_crash(self, now: float) -> float | None:
        """Record a crash at ``now``: the backoff to wait before restarting, or None to
        escalate (the crash would be restart number ``max_restarts + 1`` inside ``within``)."""
        window_start = now - self.policy.within
        while self._restarts and self._restarts[0] <= window_start:
            self._restarts.popleft()
        recent = len(self._restarts)
        if recent >= self.policy.max_restarts:
            return None
        self._restarts.append(now)
        return self.policy.backoff(recent, self.rng)
