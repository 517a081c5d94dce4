"""kvtrio.actors.policy: eviction order on crafted traces, pins, TTLs, admission, wear."""

from __future__ import annotations

import random

import pytest
import trio
from kvtrio.actors.policy import (
    AdmissionCandidate,
    AdmitAll,
    AllOf,
    EntryCost,
    EvictionPolicy,
    GreedyDualPolicy,
    LruPolicy,
    MinimumTokens,
    PolicyKind,
    PrefillCost,
    RecomputePerByte,
    SecondUse,
    default_admission,
    make_eviction_policy,
)
from kvtrio.actors.wear import WearAccount
from kvtrio.errors import PinLimitError

BPT = 1000  # bytes per token in these traces


def _cost(tokens: int, model: str = "m") -> EntryCost:
    return EntryCost(nbytes=tokens * BPT, tokens=tokens, model=model)


def _drain(policy: EvictionPolicy) -> list[str]:
    out = []
    while (key := policy.victim()) is not None:
        out.append(key)
    return out


def _quadratic() -> PrefillCost:
    """1 ms per token plus attention: a 10k-token document costs 6x a 1k-token chat per byte."""
    prefill = PrefillCost()
    for n in (1000, 4000, 10000, 20000):
        prefill.observe("m", 0, n, 1e-3 * n + 5e-7 * n * n)
    return prefill


def test_lru_evicts_least_recently_used_first() -> None:
    policy = LruPolicy(clock=lambda: 0.0)
    for key in "abcd":
        policy.on_insert(key, _cost(10))
    policy.on_hit("a")
    policy.on_remove("c")
    assert _drain(policy) == ["b", "d", "a"]
    assert policy.nbytes == 0 and len(policy) == 0


def test_cost_aware_keeps_a_long_document_that_lru_evicts() -> None:
    """The issue's case: a long document, then ten short chats under a budget that holds
    either the document or the chats. LRU gives up the document; GreedyDual-Size gives up
    chats (cheaper to recompute per byte), oldest first."""
    trace = [("doc", 10_000), *((f"chat{i}", 1_000) for i in range(10))]
    lru = LruPolicy(clock=lambda: 0.0)
    gds = GreedyDualPolicy(clock=lambda: 0.0, prefill=_quadratic())
    for policy in (lru, gds):
        for key, tokens in trace:
            policy.on_insert(key, _cost(tokens))
    assert lru.victim() == "doc"
    assert [gds.victim() for _ in range(3)] == ["chat0", "chat1", "chat2"]
    assert "doc" in gds


def test_cost_aware_ages_an_unused_document_out() -> None:
    """L rises with every victim: a document never used again is evicted once enough newer
    chats arrive (recency still counts), and a hit on it postpones that."""

    def run(hit_doc: bool) -> int:
        gds = GreedyDualPolicy(clock=lambda: 0.0, prefill=_quadratic())
        gds.on_insert("doc", _cost(10_000))
        for i in range(200):
            gds.on_insert(f"chat{i}", _cost(1_000))
            if hit_doc and i == 10:
                gds.on_hit("doc")
            if len(gds) > 5:
                if gds.victim() == "doc":
                    return i
        return -1

    evicted_at = run(hit_doc=False)
    assert evicted_at > 0
    assert run(hit_doc=True) > evicted_at


def test_greedy_dual_frequency_counts_hits() -> None:
    gdsf = make_eviction_policy(PolicyKind.COST_FREQUENCY, clock=lambda: 0.0)
    assert isinstance(gdsf, GreedyDualPolicy) and gdsf.frequency
    gdsf.on_insert("popular", _cost(100))
    gdsf.on_insert("once", _cost(100))
    for _ in range(3):
        gdsf.on_hit("popular")
    gdsf.on_insert("new", _cost(100))
    assert gdsf.victim() == "once"
    assert gdsf.victim() == "new"


def test_greedy_dual_matches_a_brute_force_reference() -> None:
    """Against a dict-and-min() implementation of the same rule, on a random trace with
    hits, removals and re-inserts (the lazy heap must agree item by item)."""
    rng = random.Random(7)
    prefill = _quadratic()
    gds = GreedyDualPolicy(clock=lambda: 0.0, prefill=prefill)
    ref: dict[str, tuple[float, int]] = {}
    costs: dict[str, EntryCost] = {}
    inflation, seq = 0.0, 0

    def value(c: EntryCost) -> float:
        return prefill.seconds("m", c.tokens) / c.nbytes

    for step in range(3000):
        op = rng.random()
        key = f"k{rng.randrange(60)}"
        if op < 0.5:
            c = EntryCost(rng.randrange(1, 50) * 997, rng.randrange(1, 20_000), "m")
            gds.on_insert(key, c)
            seq += 1
            ref[key], costs[key] = (inflation + value(c), seq), c
        elif op < 0.7 and key in ref:
            gds.on_hit(key)
            seq += 1
            ref[key] = (inflation + value(costs[key]), seq)
        elif op < 0.8:
            gds.on_remove(key)
            ref.pop(key, None)
        elif ref:
            expected = min(ref, key=lambda k: ref[k])
            inflation = max(inflation, ref.pop(expected)[0])
            assert gds.victim() == expected, step
        assert len(gds) == len(ref)
        assert gds.nbytes == sum(costs[k].nbytes for k in ref)


def test_greedy_dual_with_pins_matches_a_brute_force_reference() -> None:
    """The same reference with pins: a pinned entry leaves the order (never a victim), a
    rewrite keeps it pinned, an unpinned one re-enters as if just used. Guards the order
    kept in the slots (a live heap item is the one whose number its slot holds)."""
    rng = random.Random(11)
    prefill = _quadratic()
    gds = GreedyDualPolicy(clock=lambda: 0.0, prefill=prefill, pin_limit=1 << 62)
    ref: dict[str, tuple[float, int]] = {}
    pinned: set[str] = set()
    costs: dict[str, EntryCost] = {}
    inflation, seq = 0.0, 0

    def value(c: EntryCost) -> float:
        return prefill.seconds("m", c.tokens) / c.nbytes

    for step in range(4000):
        op, key = rng.random(), f"k{rng.randrange(40)}"
        if op < 0.4:
            costs[key] = EntryCost(rng.randrange(1, 50) * 997, rng.randrange(1, 20_000), "m")
            gds.on_insert(key, costs[key])
            if key not in pinned:
                seq += 1
                ref[key] = (inflation + value(costs[key]), seq)
        elif op < 0.55 and key in ref:
            gds.on_hit(key)
            seq += 1
            ref[key] = (inflation + value(costs[key]), seq)
        elif op < 0.65 and key in ref:
            gds.pin(key)
            del ref[key]
            pinned.add(key)
            assert gds.priority(key) is None
        elif op < 0.75 and key in pinned:
            gds.unpin(key)
            pinned.remove(key)
            seq += 1
            ref[key] = (inflation + value(costs[key]), seq)
        elif op < 0.82:
            gds.on_remove(key)
            ref.pop(key, None)
            pinned.discard(key)
        elif ref:
            expected = min(ref, key=lambda k: ref[k])
            inflation = max(inflation, ref.pop(expected)[0])
            assert gds.victim() == expected, step
        assert len(gds) == len(ref) + len(pinned)
        assert all(gds.priority(k) == h for k, (h, _) in ref.items())


def test_victim_costs_stay_logarithmic_in_heap_size() -> None:
    """Stale heap items (hits, removals) never outnumber live entries by more than 2x + 64."""
    gds = GreedyDualPolicy(clock=lambda: 0.0)
    for i in range(100):
        gds.on_insert(f"k{i}", _cost(10))
    for _ in range(50):
        for i in range(100):
            gds.on_hit(f"k{i}")
    assert len(gds._heap) <= 2 * len(gds) + 64 + 1
    ttl = LruPolicy(default_ttl=10.0, clock=lambda: 0.0)  # deadlines too, without expire()
    for i in range(100):
        ttl.on_insert(f"k{i}", _cost(10))
    for _ in range(50):
        for i in range(100):
            ttl.on_hit(f"k{i}")
    assert len(ttl._deadlines) <= 2 * len(ttl) + 64 + 1


def test_a_pinned_entry_is_never_a_victim_but_counts_against_the_budget() -> None:
    policy = make_eviction_policy(PolicyKind.COST, pin_limit=20 * BPT, clock=lambda: 0.0)
    for key in ("system", "a", "b"):
        policy.on_insert(key, _cost(10))
    policy.pin("system")
    assert policy.nbytes == 30 * BPT and policy.pinned_bytes == 10 * BPT
    assert sorted(_drain(policy)) == ["a", "b"]
    assert policy.victim() is None
    assert "system" in policy and policy.nbytes == 10 * BPT
    policy.on_insert("system", _cost(12))  # a rewrite keeps the pin
    assert policy.is_pinned("system") and policy.pinned_bytes == 12 * BPT
    policy.unpin("system")
    assert policy.victim() == "system"
    stats = policy.statistics()
    assert (stats.pinned_entries, stats.pinned_bytes, stats.victims) == (0, 0, 3)


def test_pins_are_limited_by_bytes() -> None:
    policy = LruPolicy(pin_limit=15 * BPT, clock=lambda: 0.0)
    policy.on_insert("a", _cost(10))
    policy.on_insert("b", _cost(10))
    policy.pin("a")
    with pytest.raises(PinLimitError, match=r"^pinning 10000 bytes would exceed the pin limit"):
        policy.pin("b")
    assert not policy.is_pinned("b")
    assert policy.victim() == "b"
    with pytest.raises(KeyError):
        policy.pin("absent")


async def test_ttl_expires_after_last_use_on_trios_clock(autojump_clock: trio.abc.Clock) -> None:
    policy = LruPolicy(pin_limit=10 * BPT, default_ttl=60.0)
    policy.on_insert("a", _cost(1))
    policy.on_insert("b", _cost(1))
    policy.on_insert("default", _cost(1), ttl=None)  # the default applies
    policy.on_insert("short", _cost(1), ttl=5.0)
    policy.on_insert("pinned", _cost(1), ttl=5.0)
    policy.pin("pinned")
    await trio.sleep(5.0)
    assert policy.expire() == ["short"]
    await trio.sleep(40.0)
    policy.on_hit("a")  # used at t=45: lives until t=105
    await trio.sleep(15.0)  # t=60
    assert sorted(policy.expire()) == ["b", "default"]
    assert policy.expire() == []
    await trio.sleep(45.0)
    assert policy.expire() == ["a"]
    assert list(policy.expire()) == [] and "pinned" in policy  # pins never expire
    policy.unpin("pinned")  # as if just used: expires 5 s later
    await trio.sleep(5.0)
    assert policy.expire() == ["pinned"]
    assert policy.statistics().expired == 5


def test_prefill_cost_fits_what_is_measured() -> None:
    prefill = PrefillCost(default_tokens_per_second=500.0)
    assert prefill.seconds("m", 1000) == pytest.approx(2.0)  # unmeasured: the default
    for start, end in ((0, 1000), (1000, 3000), (0, 8000), (2000, 30000)):
        prefill.observe("m", start, end, 2e-3 * (end - start) + 1e-7 * (end**2 - start**2))
    a, b = prefill.coefficients("m")
    assert a == pytest.approx(2e-3) and b == pytest.approx(1e-7)
    assert prefill.seconds("m", 100_000) == pytest.approx(200.0 + 1000.0)
    assert prefill.seconds("other", 1000) == pytest.approx(2.0)  # per model
    one_length = PrefillCost()
    one_length.observe("m", 0, 100, 0.5)
    one_length.observe("m", 0, 100, 0.7)
    a, b = one_length.coefficients("m")
    assert (a, b) == pytest.approx((0.006, 0.0))  # one length: the linear term alone
    with pytest.raises(ValueError, match=r"^a prefill observation needs"):
        prefill.observe("m", 10, 10, 1.0)


def _candidate(key: str, tokens: int, uses: int = 0) -> AdmissionCandidate:
    return AdmissionCandidate(key, tokens, tokens * BPT, uses, 1e-3 * tokens)


def test_the_default_admission_is_12_seconds_of_prefill_per_gib() -> None:
    """docs/metrics.md and docs/benchmarks.md state this threshold."""
    assert default_admission() == RecomputePerByte(12.0)


def test_admission_decisions() -> None:
    assert AdmitAll().admit(_candidate("a", 1))
    assert MinimumTokens(1024).admit(_candidate("a", 1024))
    assert not MinimumTokens(1024).admit(_candidate("a", 1023))
    # 1 ms per token over 1000 bytes per token: 1e-6 s per byte, 1073.7 s per GiB.
    assert RecomputePerByte(1000.0).admit(_candidate("a", 10))
    assert not RecomputePerByte(1100.0).admit(_candidate("a", 10))
    both = AllOf((MinimumTokens(100), SecondUse()))
    assert not both.admit(_candidate("short", 10, uses=3))
    assert both.admit(_candidate("long", 1000, uses=1))


def test_second_use_admits_a_used_entry_or_one_refused_before() -> None:
    policy = SecondUse(remember=2)
    assert policy.admit(_candidate("hit", 10, uses=1))
    assert not policy.admit(_candidate("a", 10))
    assert policy.admit(_candidate("a", 10))  # it came back: second use
    assert not policy.admit(_candidate("a", 10))  # and that chance was spent
    assert not policy.admit(_candidate("b", 10))
    assert not policy.admit(_candidate("c", 10))  # memory of 2: "a" is forgotten
    assert not policy.admit(_candidate("a", 10))
    assert policy.admit(_candidate("c", 10))


def test_wear_counts_bytes_read_back_once_per_write() -> None:
    wear = WearAccount()
    wear.on_admission(_candidate("a", 10), True)
    wear.on_admission(_candidate("b", 10), False)
    wear.on_written("a", 100)
    wear.on_written("c", 300)
    wear.on_read("a", 100)
    wear.on_read("a", 100)
    wear.on_removed("c")
    wear.on_read("c", 300)  # a read of a removed entry's key counts as read, not reuse
    stats = wear.statistics()
    assert (stats.bytes_written, stats.bytes_read, stats.bytes_reused) == (400, 500, 100)
    assert (stats.entries_written, stats.entries_read_back) == (2, 1)
    assert (stats.admitted, stats.refused, stats.bytes_refused) == (1, 1, 10 * BPT)
    assert stats.reuse_ratio == pytest.approx(0.25)


def test_an_entry_the_disk_holds_is_valued_by_its_reload_in_ram() -> None:
    """In RAM, losing an entry the disk holds costs its reload, not its recompute: a long
    document already on disk goes before a chat only RAM has."""
    gds = GreedyDualPolicy(clock=lambda: 0.0, prefill=_quadratic())
    gds.on_insert("doc", EntryCost(10_000 * BPT, 10_000, "m", reload_seconds=0.005))
    gds.on_insert("chat", _cost(1_000))
    assert gds.victim() == "doc"
    gds.on_insert("doc", EntryCost(10_000 * BPT, 10_000, "m", reload_seconds=1e9))
    assert gds.victim() == "chat"  # a reload slower than recomputing changes nothing


def test_would_admit_remembers_nothing() -> None:
    second = SecondUse()
    assert not second.would_admit(_candidate("a", 10))
    assert not second.would_admit(_candidate("a", 10))
    assert not second.admit(_candidate("a", 10))
    assert second.would_admit(_candidate("a", 10))
    assert second.admit(_candidate("a", 10))
    assert not second.would_admit(_candidate("a", 10))
    both = AllOf((MinimumTokens(5), SecondUse()))
    assert both.would_admit(_candidate("b", 10, uses=1))
    assert not both.would_admit(_candidate("b", 4, uses=1))


@pytest.mark.parametrize("kind", list(PolicyKind))
@pytest.mark.parametrize("ttl", [None, 5.0])
def test_insert_found_is_on_insert_of_each(kind: PolicyKind, ttl: float | None) -> None:
    """``insert_found`` (open's, each distinct cost valued once) leaves the policy as one
    ``on_insert`` each would: the same bytes, entries and victims in the same order, a key
    already present replaced; with a default TTL, each is an ``on_insert`` (its deadline)."""
    rng = random.Random(3)
    shared = {n: _cost(n) for n in (10, 500, 4000)}  # entries of one length share a cost
    arrivals = [(f"k{i}", shared[rng.choice(list(shared))]) for i in range(300)]
    arrivals.append(("k7", _cost(99)))  # again: replaced
    one = make_eviction_policy(kind, prefill=_quadratic(), default_ttl=ttl, clock=lambda: 0.0)
    bulk = make_eviction_policy(kind, prefill=_quadratic(), default_ttl=ttl, clock=lambda: 0.0)
    for key, cost in arrivals[:40]:
        one.on_insert(key, cost)
        bulk.on_insert(key, cost)
    assert one.victim() == bulk.victim()  # L moves: later values start above it
    for key, cost in arrivals[40:]:
        one.on_insert(key, cost)
    bulk.insert_found(arrivals[40:])
    assert bulk.statistics() == one.statistics()
    assert _drain(bulk) == _drain(one)
