"""kvtrio.runtime: generic actors on trio (knows nothing of MLX or storage).

It imports nothing of kvtrio but its errors (docs/design.md invariant 9).

Mailboxes with backpressure, ask/tell, supervision, phased shutdown, signal handling,
thread offload and executors, and a test kit (:mod:`kvtrio.runtime.testing`).
See docs/runtime.md.
"""

from __future__ import annotations

from kvtrio.runtime.actor import Actor, ActorRef, ActorState, ActorStatistics, Reply
from kvtrio.runtime.executor import (
    DedicatedThreadExecutor,
    Executor,
    ExecutorCloseTimeout,
    InlineExecutor,
)
from kvtrio.runtime.offload import CancelToken, InlineOffload, Offload, ThreadOffload
from kvtrio.runtime.signals import shutdown_on_signals
from kvtrio.runtime.supervision import ESCALATE, Escalate, Restart, Supervision
from kvtrio.runtime.system import ActorSystem, SystemStatistics

__all__ = [
    "ESCALATE",
    "Actor",
    "ActorRef",
    "ActorState",
    "ActorStatistics",
    "ActorSystem",
    "CancelToken",
    "DedicatedThreadExecutor",
    "Escalate",
    "Executor",
    "ExecutorCloseTimeout",
    "InlineExecutor",
    "InlineOffload",
    "Offload",
    "Reply",
    "Restart",
    "Supervision",
    "SystemStatistics",
    "ThreadOffload",
    "shutdown_on_signals",
]
