"""``kvtrio bench policy``: eviction and write-admission policies replayed on a synthetic
trace of chats and long documents, RAM and disk simulated with the library's own policy
objects (:mod:`kvtrio.actors.policy`).

The trace (seeded): ``--chats`` conversations sharing one system prompt, each going on
for another turn with probability ``--continue``, the next turn mostly a minute or two
later and sometimes hours later (a user coming back); ``--docs`` long documents (8k to
100k tokens, log-uniform) each asked a few questions over hours. Prefill time is
``a * n + b * n**2`` seconds for ``n`` tokens (``--prefill-a``, ``--prefill-b``: about 1000
tokens/s for a short prompt, half that at 32k); each request's prefill is measured (with
10 % noise) and fed to the cost model, as a server would.

The simulation keeps what the tiered cache does (docs/tiered.md): one prefix index over
both tiers with mlx-lm's lookup rules (exact, a longer entry trimmed back, a shorter
prefix); RAM holds full copies, LRU or cost-aware by bytes, soft by one entry; write-back
of an entry leaving RAM (if the admission policy admits it); the disk stores shared
prefixes once (the blocks layout), evicting by its own policy while over budget; a disk
hit is promoted to RAM; a conversation's new turn supersedes its older entry (out of RAM
at once, off the disk once the new one is written). The cost-aware RAM tier values an
entry the disk holds, or will admit, by its reload time (bytes at 2 GB/s) when that is
less than its recompute time: losing it from RAM costs only the reload. Tokens are
simulated as segments (system prompt, message, document), so a shared prefix is a shared
segment.

Figures per budget, eviction policy and admission policy: the hit ratio (reused prompt
tokens over prompt tokens), the share of prefill time saved (seconds saved over the
seconds a cache-less server would spend, same run), bytes written to disk and the
reuse ratio (written bytes read back at least once). The headline ratios compare the
cost-aware default with LRU at equal budgets, and the admission default with writing
everything.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from typing import Any

import attrs
from kvtrio.actors.policy import (
    AdmissionCandidate,
    AdmissionPolicy,
    AdmitAll,
    EntryCost,
    EvictionPolicy,
    MinimumTokens,
    PolicyKind,
    PrefillCost,
    SecondUse,
    default_admission,
    make_eviction_policy,
)
from kvtrio.actors.wear import WearAccount

__all__ = ["Trace", "add_arguments", "make_trace", "measure", "render", "replay"]

GIB = 1 << 30
MODEL = "bench-model"
# A cold load's speed (the NVMe figure of docs/design.md), for the RAM tier's reload cost.
DISK_READ_BYTES_PER_SECOND = 2e9
# Llama-3-8B's KV cache in fp16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2

Path = tuple[int, ...]


@attrs.frozen
class Request:
    time: float
    conversation: str
    prompt: Path  # segment ids
    answer: int  # the segment the reply appends


@attrs.frozen
class Trace:
    requests: tuple[Request, ...]
    lengths: tuple[int, ...]  # tokens of each segment


def make_trace(
    *,
    seed: int,
    chats: int,
    docs: int,
    hours: float,
    system_tokens: int = 1500,
    p_continue: float = 0.6,
    p_return: float = 0.15,
) -> Trace:
    rng = random.Random(seed)
    lengths: list[int] = []

    def segment(tokens: int) -> int:
        lengths.append(tokens)
        return len(lengths) - 1

    horizon = hours * 3600.0
    system = segment(system_tokens)
    requests: list[Request] = []

    def gap(short_mean: float, long_mean: float, p_long: float) -> float:
        return rng.expovariate(1 / (long_mean if rng.random() < p_long else short_mean))

    for c in range(chats):
        path: Path = (system,)
        t = rng.uniform(0, horizon)
        while t < horizon:
            prompt = (*path, segment(rng.randint(30, 400)))
            answer = segment(rng.randint(50, 600))
            requests.append(Request(t, f"chat{c}", prompt, answer))
            path = (*prompt, answer)
            if rng.random() >= p_continue:
                break
            t += gap(90.0, 4 * 3600.0, p_return)
    for d in range(docs):
        doc = segment(int(math.exp(rng.uniform(math.log(8_000), math.log(100_000)))))
        t = rng.uniform(0, horizon * 0.75)
        for q in range(1 + min(8, int(rng.expovariate(1 / 4)))):
            if t >= horizon:
                break
            prompt = (system, doc, segment(rng.randint(20, 150)))
            requests.append(Request(t, f"doc{d}.{q}", prompt, segment(rng.randint(100, 500))))
            t += gap(20 * 60.0, 3 * 3600.0, 0.3)
    requests.sort(key=lambda r: r.time)
    return Trace(tuple(requests), tuple(lengths))


@attrs.define(eq=False)
class _Entry:
    path: Path
    tokens: int
    conversation: str
    in_ram: bool = False
    on_disk: bool = False
    ram_uses: int = 0
    retired: bool = False
    supersedes: list[_Entry] = attrs.field(factory=list)

    @property
    def nbytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN


@attrs.define
class _Node:
    passing: dict[Path, None] = attrs.field(factory=dict)
    ending: dict[Path, None] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Sim:
    """RAM and disk over one prefix index (see the module's docstring)."""

    lengths: tuple[int, ...]
    ram_budget: int
    disk_budget: int
    hot: EvictionPolicy
    cold: EvictionPolicy
    admission: AdmissionPolicy
    prefill: PrefillCost
    true_seconds: Callable[[int], float]
    now: float = 0.0
    ram_bytes: int = 0
    disk_bytes: int = 0
    entries: dict[Path, _Entry] = attrs.field(factory=dict)
    nodes: dict[Path, _Node] = attrs.field(factory=dict)
    node_refs: dict[Path, int] = attrs.field(factory=dict)  # disk: shared prefixes once
    conversations: dict[str, _Entry] = attrs.field(factory=dict)
    wear: WearAccount = attrs.field(factory=WearAccount)
    counts: dict[str, float] = attrs.field(factory=dict)

    def count(self, name: str, n: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    # -- the index ---------------------------------------------------------------------

    def _findable(self, e: _Entry) -> bool:
        return e.in_ram or e.on_disk

    def _index(self, e: _Entry) -> None:
        for i in range(len(e.path) + 1):
            self.nodes.setdefault(e.path[:i], _Node()).passing[e.path] = None
        self.nodes[e.path].ending[e.path] = None

    def _unindex(self, e: _Entry) -> None:
        for i in range(len(e.path) + 1):
            node = self.nodes[e.path[:i]]
            node.passing.pop(e.path, None)
            node.ending.pop(e.path, None)
            if not node.passing:
                del self.nodes[e.path[:i]]

    def _pick(self, keys: dict[Path, None], longer_than: int = -1) -> _Entry:
        """Any of ``keys`` longer than ``longer_than`` segments (they reuse alike), one in
        RAM if one of the first few is."""
        first = None
        n = 0
        for key in keys:
            if len(key) <= longer_than:
                continue
            n += 1
            e = self.entries[key]
            if e.in_ram:
                return e
            first = first or e
            if n >= 8:
                break
        assert first is not None
        return first

    def lookup(self, prompt: Path) -> tuple[_Entry, int] | None:
        """mlx-lm's rules: exact; else a longer entry trimmed back if it keeps more than the
        longest shorter prefix; else that prefix."""
        depth, tokens, prefix_tokens = 0, 0, [0]
        while depth < len(prompt) and prompt[: depth + 1] in self.nodes:
            tokens += self.lengths[prompt[depth]]
            prefix_tokens.append(tokens)
            depth += 1
        if depth == 0:
            return None
        query = sum(self.lengths[s] for s in prompt)
        deepest = self.nodes[prompt[:depth]]
        if depth == len(prompt) and deepest.ending:
            return self._pick(deepest.ending), query
        shorter = None
        for i in range(min(depth, len(prompt) - 1), 0, -1):
            ending = self.nodes[prompt[:i]].ending
            if ending:
                shorter = (self._pick(ending), prefix_tokens[i])
                break
        if len(deepest.passing) > len(deepest.ending):  # some entry goes on past ``deepest``
            reuse = query - 1 if depth == len(prompt) else prefix_tokens[depth]
            if shorter is None or reuse > shorter[1]:
                return self._pick(deepest.passing, longer_than=depth), reuse
        return shorter

    # -- the two tiers -----------------------------------------------------------------

    def _cost(self, e: _Entry) -> EntryCost:
        return EntryCost(e.nbytes, e.tokens, MODEL)

    def _hot_cost(self, e: _Entry) -> EntryCost:
        """In RAM, an entry the disk holds or will admit costs only its reload if lost."""
        reload = None
        if e.on_disk or self.admission.would_admit(self._candidate(e)):
            reload = e.nbytes / DISK_READ_BYTES_PER_SECOND
        return EntryCost(e.nbytes, e.tokens, MODEL, reload)

    def _candidate(self, e: _Entry) -> AdmissionCandidate:
        return AdmissionCandidate(
            _key(e.path), e.tokens, e.nbytes, e.ram_uses, self.prefill.seconds(MODEL, e.tokens)
        )

    def ram_add(self, e: _Entry) -> None:
        was = self._findable(e)
        e.in_ram = True
        self.ram_bytes += e.nbytes
        self.hot.on_insert(_key(e.path), self._hot_cost(e))
        if not was:
            self._index(e)

    def ram_drop(self, e: _Entry) -> None:
        if e.in_ram:
            e.in_ram = False
            self.ram_bytes -= e.nbytes
            self.hot.on_remove(_key(e.path))
            self._maybe_forget(e)

    def enforce_ram(self) -> None:
        while self.ram_bytes > self.ram_budget and len(self.hot) > 1:
            key = self.hot.victim()
            assert key is not None
            e = self.entries[_path_of(key)]
            e.in_ram = False
            self.ram_bytes -= e.nbytes
            self.count("ram_evictions")
            if not e.on_disk and not e.retired:
                self._write_back(e)
            self._maybe_forget(e)

    def _write_back(self, e: _Entry) -> None:
        candidate = self._candidate(e)
        admitted = self.admission.admit(candidate)
        self.wear.on_admission(candidate, admitted)
        if not admitted:
            return
        new = 0
        for i in range(1, len(e.path) + 1):
            node = e.path[:i]
            refs = self.node_refs.get(node, 0)
            if not refs:
                new += self.lengths[e.path[i - 1]] * BYTES_PER_TOKEN
            self.node_refs[node] = refs + 1
        self.disk_bytes += new
        self.wear.on_written(_key(e.path), new)
        e.on_disk = True
        self.cold.on_insert(_key(e.path), self._cost(e))
        for old in e.supersedes:
            if old.on_disk and self.entries.get(old.path) is old:
                self.disk_drop(old)
                self.cold.on_remove(_key(old.path))
        e.supersedes.clear()
        while self.disk_bytes > self.disk_budget and len(self.cold) > 1:
            key = self.cold.victim()
            assert key is not None
            victim = self.entries[_path_of(key)]
            self.count("disk_evictions")
            self.disk_drop(victim)

    def disk_drop(self, e: _Entry) -> None:
        e.on_disk = False
        self.wear.on_removed(_key(e.path))
        for i in range(1, len(e.path) + 1):
            node = e.path[:i]
            self.node_refs[node] -= 1
            if not self.node_refs[node]:
                del self.node_refs[node]
                self.disk_bytes -= self.lengths[e.path[i - 1]] * BYTES_PER_TOKEN
        self._maybe_forget(e)

    def _maybe_forget(self, e: _Entry) -> None:
        if not self._findable(e) and self.entries.get(e.path) is e:
            self._unindex(e)
            del self.entries[e.path]

    # -- one request -------------------------------------------------------------------

    def serve(self, request: Request, noise: float) -> None:
        self.now = request.time
        query = sum(self.lengths[s] for s in request.prompt)
        self.count("requests")
        self.count("prompt_tokens", query)
        self.count("seconds_without_cache", self.true_seconds(query))
        found = self.lookup(request.prompt)
        reuse = 0
        if found is not None:
            e, reuse = found
            key = _key(e.path)
            self.count("reused_tokens", reuse)
            self.count("seconds_saved", self.true_seconds(reuse))
            if e.in_ram:
                self.count("ram_hits")
                self.hot.on_hit(key)
                e.ram_uses += 1
                self.cold.on_hit(key)
            else:
                self.count("disk_hits")
                self.count("bytes_read", e.nbytes)
                self.cold.on_hit(key)
                self.wear.on_read(key, e.nbytes)
                if not e.retired:
                    self.ram_add(e)
                    self.enforce_ram()
        if reuse < query:
            spent = self.true_seconds(query) - self.true_seconds(reuse)
            self.prefill.observe(MODEL, reuse, query, spent * noise)
        self.insert(request)

    def insert(self, request: Request) -> None:
        path = (*request.prompt, request.answer)
        tokens = sum(self.lengths[s] for s in path)
        e = self.entries.get(path)
        if e is None:
            e = self.entries[path] = _Entry(path, tokens, request.conversation)
        if not e.in_ram:
            self.ram_add(e)
        old = self.conversations.get(request.conversation)
        self.conversations[request.conversation] = e
        if old is not None and old is not e and self.entries.get(old.path) is old:
            old.retired = True
            self.ram_drop(old)
            if old.on_disk:
                e.supersedes.append(old)
        self.enforce_ram()


def _key(path: Path) -> str:
    return ",".join(map(str, path))


def _path_of(key: str) -> Path:
    return tuple(int(x) for x in key.split(","))


def replay(
    trace: Trace,
    *,
    policy: PolicyKind,
    disk_policy: PolicyKind | None = None,
    admission: Callable[[], AdmissionPolicy],
    ram_budget: int,
    disk_budget: int,
    prefill_a: float,
    prefill_b: float,
    seed: int = 0,
) -> dict[str, float]:
    """One replay of ``trace``; the figures of the module's docstring."""

    def true_seconds(n: int) -> float:
        return prefill_a * n + prefill_b * n * n

    prefill = PrefillCost()
    sim = _Sim(
        trace.lengths,
        ram_budget,
        disk_budget,
        make_eviction_policy(policy, prefill=prefill, clock=lambda: sim.now),
        make_eviction_policy(disk_policy or policy, prefill=prefill, clock=lambda: sim.now),
        admission(),
        prefill,
        true_seconds,
    )
    rng = random.Random(seed)
    for request in trace.requests:
        sim.serve(request, rng.uniform(0.9, 1.1))
    c = sim.counts.get
    wear = sim.wear.statistics()
    return {
        "requests": c("requests", 0),
        "hit_ratio": c("reused_tokens", 0) / c("prompt_tokens", 1),
        "saved_share": c("seconds_saved", 0) / c("seconds_without_cache", 1),
        "hours_saved": c("seconds_saved", 0) / 3600,
        "hours_without_cache": c("seconds_without_cache", 0) / 3600,
        "ram_hits": c("ram_hits", 0),
        "disk_hits": c("disk_hits", 0),
        "gib_written": wear.bytes_written / GIB,
        "gib_read": wear.bytes_read / GIB,
        "reuse_ratio": wear.reuse_ratio,
        "refused": wear.refused,
    }


# name -> a fresh admission policy (stateful ones must not leak between replays)
ADMISSIONS: dict[str, Callable[[], AdmissionPolicy]] = {
    "all": AdmitAll,
    "default": default_admission,
    "second-use": SecondUse,
    "min-16k-tokens": lambda: MinimumTokens(16_384),
}
POLICIES = (PolicyKind.LRU, PolicyKind.COST, PolicyKind.COST_FREQUENCY)
DEFAULT_POLICY = PolicyKind.COST
UNBOUNDED = 1 << 62


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chats", type=int, default=3000, help="conversations")
    parser.add_argument("--docs", type=int, default=40, help="long documents")
    parser.add_argument("--hours", type=float, default=24.0, help="the trace's span")
    parser.add_argument("--prefill-a", type=float, default=1e-3, help="seconds per token")
    parser.add_argument("--prefill-b", type=float, default=3.1e-8, help="seconds per token squared")
    parser.add_argument(
        "--budgets",
        default="16:64,32:128",
        help="RAM:disk budgets in GiB, comma-separated (default: 16:64,32:128)",
    )


def _budgets(text: str) -> list[tuple[float, float]]:
    out = []
    for part in text.split(","):
        ram, disk = part.split(":")
        out.append((float(ram), float(disk)))
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trace = make_trace(seed=args.seed, chats=args.chats, docs=args.docs, hours=args.hours)

    def run(policy: PolicyKind, admission: str, ram: int, disk: int) -> dict[str, float]:
        return replay(
            trace,
            policy=policy,
            admission=ADMISSIONS[admission],
            ram_budget=ram,
            disk_budget=disk,
            prefill_a=args.prefill_a,
            prefill_b=args.prefill_b,
            seed=args.seed,
        )

    # The reference: no budget at all, so every reuse the trace allows is made.
    unbounded = run(PolicyKind.LRU, "all", UNBOUNDED, UNBOUNDED)
    runs, headline = [], []
    for ram, disk in _budgets(args.budgets):
        table = {
            (policy.value, name): run(policy, name, int(ram * GIB), int(disk * GIB))
            for policy in POLICIES
            for name in ADMISSIONS
        }
        for (policy_name, name), figures in table.items():
            runs.append(
                {
                    "ram_gib": ram,
                    "disk_gib": disk,
                    "policy": policy_name,
                    "admission": name,
                    **figures,
                }
            )
        lru, cost = table["lru", "all"], table[DEFAULT_POLICY.value, "all"]
        admitted = table[DEFAULT_POLICY.value, "default"]
        lru_admitted = table["lru", "default"]
        headline.append(
            {
                "ram_gib": ram,
                "disk_gib": disk,
                # the defaults against LRU writing everything (kvtrio before issue 18)
                "default_vs_lru": admitted["hours_saved"] / lru["hours_saved"],
                # eviction alone: both write everything; then both with the default admission
                "saved_vs_lru": cost["hours_saved"] / lru["hours_saved"],
                "saved_vs_lru_admitted": admitted["hours_saved"] / lru_admitted["hours_saved"],
                "written_cut": cost["gib_written"] / max(admitted["gib_written"], 1e-9),
                "saved_loss": 1 - admitted["hours_saved"] / cost["hours_saved"],
                "of_attainable": admitted["hours_saved"] / unbounded["hours_saved"],
            }
        )
    return {
        "seed": args.seed,
        "chats": args.chats,
        "docs": args.docs,
        "hours": args.hours,
        "requests": len(trace.requests),
        "prefill_a": args.prefill_a,
        "prefill_b": args.prefill_b,
        "bytes_per_token": BYTES_PER_TOKEN,
        "unbounded": unbounded,
        "runs": runs,
        "headline": headline,
    }


def render(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    unbounded = figures["unbounded"]
    table = Table(
        title=f"policy replay: {figures['requests']:,} requests ({figures['chats']} chats, "
        f"{figures['docs']} documents, {figures['hours']:g} h, seed {figures['seed']}), "
        f"{figures['bytes_per_token'] // 1024} KiB/token; without a cache "
        f"{unbounded['hours_without_cache']:.2f} h of prefill, unbounded cache saves "
        f"{unbounded['hours_saved']:.2f} h"
    )
    for column in (
        "RAM:disk GiB",
        "eviction",
        "admission",
        "hit ratio",
        "prefill saved",
        "h saved",
        "RAM hits",
        "disk hits",
        "GiB written",
        "read back",
    ):
        table.add_column(column, justify="right")
    for r in figures["runs"]:
        table.add_row(
            f"{r['ram_gib']:g}:{r['disk_gib']:g}",
            r["policy"],
            r["admission"],
            f"{r['hit_ratio']:.1%}",
            f"{r['saved_share']:.1%}",
            f"{r['hours_saved']:.2f}",
            f"{r['ram_hits']:,.0f}",
            f"{r['disk_hits']:,.0f}",
            f"{r['gib_written']:,.0f}",
            f"{r['reuse_ratio']:.1%}",
        )
    console.print(table)

    def verdict(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]missed[/]"

    for h in figures["headline"]:
        console.print(
            f"{h['ram_gib']:g}:{h['disk_gib']:g} GiB: the defaults ({DEFAULT_POLICY.value} "
            f"eviction, default admission) save {h['default_vs_lru']:.3f}x the prefill time of "
            f"LRU writing everything ({verdict(h['default_vs_lru'] > 1)} > 1); eviction alone "
            f"{h['saved_vs_lru']:.3f}x (both writing everything), "
            f"{h['saved_vs_lru_admitted']:.3f}x (both admitting by default); "
            f"default admission writes {h['written_cut']:.2f}x fewer bytes "
            f"({verdict(h['written_cut'] >= 2)} >= 2) and changes the time saved by "
            f"{-h['saved_loss']:+.1%} ({verdict(h['saved_loss'] <= 0.05)} >= -5%); "
            f"{h['of_attainable']:.1%} of the unbounded cache's saving"
        )
