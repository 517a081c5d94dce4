"""Property tests: mailbox order and accounting hold for any message mix and mailbox size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtrio.runtime.supervision import Restart
from kvtrio.runtime.testing import Scenario, run_scenario
from kvtrio.tests.runtime.helpers import Add, Counter, Crash, Get, Msg

messages = st.lists(
    st.one_of(st.integers(0, 9).map(Add), st.just(Crash())), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(sent=messages, mailbox_size=st.integers(1, 8))
def test_every_accepted_message_is_handled_once_in_order(
    sent: list[Msg], mailbox_size: int
) -> None:
    """One sender, crashes restarting in place: every message is handled exactly once, in
    the order sent; failures and restarts match the crashes; the state seen afterwards is
    the fresh instance's (the sum of the Adds after the last crash)."""
    crashes = sum(isinstance(m, Crash) for m in sent)

    async def scenario(kit: Scenario) -> tuple[list[str], int, tuple[int, int, int]]:
        policy = Restart(max_restarts=len(sent), within=1.0, backoff_initial=0.0, jitter=0.0)
        async with kit.system() as system:
            ref = await system.spawn(
                Counter, name="c", mailbox_size=mailbox_size, supervision=policy
            )
            for msg in sent:
                await ref.tell(msg)
            total = await ref.ask(Get)
            stats = ref.statistics()
        handled = [e.message_type for e in kit.trace.handled("c")]
        return handled, total, (stats.processed, stats.failures, stats.restarts)

    handled, total, (processed, failures, restarts) = run_scenario(scenario)
    assert handled == [type(m).__name__ for m in sent] + ["Get"]
    last_crash = max((i for i, m in enumerate(sent) if isinstance(m, Crash)), default=-1)
    assert total == sum(m.n for m in sent[last_crash + 1 :] if isinstance(m, Add))
    assert (processed, failures, restarts) == (len(sent) + 1 - crashes, crashes, crashes)
