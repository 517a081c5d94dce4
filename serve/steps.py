"""How kvtrio serve's generation thread shares its decode steps with the cold tier
(kvtrio.serve.server's rules 1 and 8): when mlx-lm's decode time slice ends early, and
how many of the tier's owner jobs run between two steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtrio.serve.adapter import TieredLRUPromptCache

__all__ = ["between_steps", "pumping_budget"]


def between_steps(timeout: float | None) -> tuple[bool, float | None]:
    """Rule 8, for mlx-lm's ``_next_request(timeout)``: whether a batch is decoding (mlx-lm
    asks without a timeout while one is in flight) and the budget of the pump then (0:
    one owner job between two decode steps; None: the adapter's own)."""
    decoding = timeout is None
    return decoding, (0.0 if decoding else None)


def pumping_budget(adapter: TieredLRUPromptCache, released: Callable[[], bool]) -> Any:
    """mlx-lm's TimeBudget for the generation thread of ``adapter``'s server (rule 1);
    ``released``: whether a request set aside is ready to be taken again (rule 3)."""
    from mlx_lm import server

    base = server.TimeBudget

    class PumpingBudget(base):  # type: ignore[misc,valid-type]
        """mlx-lm's decode time slice, ended early (after one step at least) when the tier
        has MLX jobs queued (rule 1) or a request set aside is ready (rule 3)."""

        def __iter__(self) -> Any:
            self._kvtrio_steps = 0
            return super().__iter__()

        def __next__(self) -> Any:
            self._kvtrio_steps += 1
            if self._kvtrio_steps > 1 and (
                released() or (adapter.tier is not None and adapter.tier.pending())
            ):
                raise StopIteration
            return super().__next__()

    return PumpingBudget()
