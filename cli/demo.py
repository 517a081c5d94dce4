"""``kvtrio demo``: a trio server with a tiered prompt cache, serving chat conversations.

The server runs a tiny random-weight mlx-lm llama on the MLX owner thread and keeps its
prompt caches in a :class:`~kvtrio.actors.tiered.TieredPromptCache`: RAM first, then
files under the data directory (``--data-dir``, ``$KVTRIO_DATA_DIR``, or the user's
cache directory). Clients are trio tasks holding multi-turn conversations, one of them
about a 4k-token document. Halfway through, the server restarts (the cache is reopened
from disk); a second ``kvtrio demo`` continues the same conversations from the first
run's files.

Every cache hit is checked twice, outside the timed path:

1. bit-exact: the logits equal those of continuing from the live cache that was saved
   (kept in memory by the demo), or, for an entry saved by an earlier process, the
   logits of a probe token stored at save time;
2. close to a full recomputation of the prompt, within a tolerance derived on the device
   at start (:func:`recompute_tolerance`): prefill in other chunks is not bit-identical, only
   close, and how close depends on the device's float32 arithmetic (MLX's CUDA matmuls are
   not the CPU's).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import (
    Fetched,
    Tier,
    TieredPromptCache,
    WritePolicy,
    open_tiered_cache,
)
from kvtrio.cli.demo_state import (
    Conversation,
    arrays_equal,
    load_probe,
    load_state,
    next_prompt,
    plan_conversations,
    random_tokens,
    save_probe,
    save_state,
)
from kvtrio.cli.paths import default_data_dir
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill

__all__ = ["DemoOptions", "DemoReport", "add_arguments", "default_data_dir", "run", "run_demo"]

# max |logits(hit) - logits(full recompute)|: at least TOLERANCE (float32 logits of size ~4
# on the CPU), and TOLERANCE_MARGIN times the device's own chunking difference.
TOLERANCE = 1e-3
TOLERANCE_MARGIN = 4.0
PROBE_TOKEN = 1
BLOCK_TOKENS = 256


@attrs.frozen
class DemoOptions:
    """What the demo serves, and where its cache lives."""

    data_dir: Path
    chats: int = 3
    system_tokens: int = 256
    user_tokens: int = 96
    reply_tokens: int = 16
    doc_tokens: int = 4096  # the document conversation's first prompt, system included
    question_tokens: int = 64
    max_chat_tokens: int = 1600  # longer conversations retire and new ones start
    hot_bytes: int = 8 << 20
    cold_bytes: int = 512 << 20
    policy: WritePolicy = WritePolicy.WRITE_BACK
    seed: int = 0
    quiet: bool = False
    io: IoOptions = DEFAULT_IO_OPTIONS  # the cold tier's I/O tuning (docs/tuning.md)


@attrs.define
class _Check:
    bit_exact: bool | None  # None: no reference (a trimmed hit on an earlier run's entry)
    max_diff: float
    recompute_s: float


@attrs.define
class _Served:
    cid: str
    turn: int
    phase: str
    prompt_tokens: int
    reused: int
    tier: Tier | None
    previous_run: bool  # the entry was written by an earlier process
    ttft_s: float
    check: _Check | None


@attrs.frozen
class DemoReport:
    """Everything the demo measured (``kvtrio demo --json`` prints it)."""

    data_dir: str
    run: int
    requests: int
    hits_hot: int
    hits_cold: int
    misses: int
    hits_after_restart: int
    hits_on_previous_run: int
    checks: int
    bit_exact: int
    bit_exact_unchecked: int
    within_tolerance: int
    max_diff: float
    tolerance: float
    chunking_diff: float  # the device's difference the tolerance was derived from
    doc_prompt_tokens: int
    doc_ttft_cached_s: float | None
    doc_ttft_recomputed_s: float | None
    doc_speedup: float | None
    doc_tier: str | None
    bytes_written: int
    bytes_deduplicated: int
    bytes_read: int
    hot_evictions: int
    cold_evictions: int
    cold_bytes_on_disk: int
    ttft_hot_ms: float | None  # medians over the requests of each kind
    ttft_cold_ms: float | None
    ttft_miss_ms: float | None
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.bit_exact + self.bit_exact_unchecked == self.checks == self.within_tolerance


# -- MLX jobs (owner thread) --------------------------------------------------------------


def _continue(
    tiny: TinyModel, caches: list[Any], prompt: Sequence[int], start: int, cut: int
) -> Any:
    """Prefill ``prompt[start:]`` in the server's schedule: up to ``cut``, then the rest."""
    if start < cut:
        prefill(tiny, caches, prompt[start:cut])
        start = cut
    return prefill(tiny, caches, prompt[start:])


def _clone_trimmed(caches: list[Any], trim: int) -> list[Any]:
    from mlx_lm.models.cache import trim_prompt_cache

    out = copy.deepcopy(caches)
    if trim:
        trim_prompt_cache(out, trim)
    return out


def _reference_logits(
    tiny: TinyModel, live: list[Any], trim: int, prompt: Sequence[int], start: int, cut: int
) -> Any:
    return _continue(tiny, _clone_trimmed(live, trim), prompt, start, cut)


def _probe(tiny: TinyModel, caches: list[Any]) -> Any:
    import numpy as np

    logits = prefill(tiny, copy.deepcopy(caches), [PROBE_TOKEN])
    return np.array(logits, copy=True)


def _probe_equal(tiny: TinyModel, caches: list[Any], stored: Any) -> bool:
    import numpy as np

    return bool(np.array_equal(_probe(tiny, caches), stored))


def recompute_tolerance(tiny: TinyModel, prompt: Sequence[int]) -> tuple[float, float]:
    """(tolerance, chunking difference) for the recompute check on the current device.

    A correct cache hit computes the prompt's prefix in one pass and the rest in another,
    so it differs from a full recomputation exactly as prefill in two chunks differs from
    prefill in one: different reduction orders and matmul shapes, nothing else. That
    difference is measured here on ``prompt``, cut at a quarter, half and three quarters
    (owner thread); the tolerance is TOLERANCE_MARGIN times the largest, and never below
    TOLERANCE. A hit that reads wrong keys or positions is off by far more (order 1).
    """
    import mlx.core as mx

    whole = len(prompt)
    full = prefill(tiny, make_caches(tiny), prompt, chunk=whole)
    worst = 0.0
    for cut in (whole // 4, whole // 2, 3 * whole // 4):
        caches = make_caches(tiny)
        prefill(tiny, caches, prompt[:cut], chunk=whole)
        split = prefill(tiny, caches, prompt[cut:], chunk=whole)
        diff = mx.max(mx.abs(split - full)).item()
        assert isinstance(diff, float)
        worst = max(worst, diff)
    return max(TOLERANCE, TOLERANCE_MARGIN * worst), worst


def _recompute(tiny: TinyModel, prompt: Sequence[int], logits: Any) -> tuple[float, float]:
    import mlx.core as mx

    start = time.perf_counter()
    full = prefill(tiny, make_caches(tiny), prompt)
    _argmax(full)
    elapsed = time.perf_counter() - start
    diff = mx.max(mx.abs(full - logits)).item()
    assert isinstance(diff, float)
    return diff, elapsed


def _argmax(logits: Any) -> int:
    import mlx.core as mx

    token = mx.argmax(logits).item()
    assert isinstance(token, int)
    return token


def _decode(tiny: TinyModel, caches: list[Any], logits: Any, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        token = _argmax(logits)
        out.append(token)
        logits = prefill(tiny, caches, [token])
    return out


# -- the server --------------------------------------------------------------------------


@attrs.define(eq=False)
class _Server:
    options: DemoOptions
    owner: MlxOwner
    tiny: TinyModel
    probes_dir: Path
    system: list[int]
    live: dict[str, list[Any]] = attrs.field(factory=dict)  # the live caches saved, by key
    served: list[_Served] = attrs.field(factory=list)
    cache: TieredPromptCache | None = None
    phase: str = "serve"
    tolerance: float = TOLERANCE
    chunking_diff: float = 0.0  # the device's prefill-in-two-chunks difference (tolerance)

    def _say(self, text: str) -> None:
        if not self.options.quiet:
            from rich.console import Console

            Console(highlight=False).print(text, soft_wrap=True)

    async def _save(self, tokens: list[int], caches: list[Any], cid: str | None) -> None:
        assert self.cache is not None
        key = await self.cache.insert(tokens, caches, conversation=cid)
        reference = await self.owner.run(copy.deepcopy, caches)
        self.live[key] = reference
        probe = await self.owner.run(_probe, self.tiny, reference)
        await trio.to_thread.run_sync(save_probe, self.probes_dir / f"{key}.npy", probe)

    async def handle(self, conv: Conversation, prompt: list[int]) -> list[int]:
        """Serve one request: find the cache, prefill the rest, decode, save, check."""
        assert self.cache is not None
        opts = self.options
        cut = len(self.system)
        start = time.perf_counter()
        fetched = await self.cache.fetch_nearest(prompt, need_logits=True)
        fetch_s = time.perf_counter() - start
        reused = fetched.reused
        if fetched.caches is None:
            caches = await self.owner.run(make_caches, self.tiny)
        else:
            caches = fetched.caches
        key = fetched.match.entry.key if fetched.match is not None else None
        earlier = key is not None and key not in self.live
        before = await self.owner.run(copy.deepcopy, caches) if earlier else None
        start = time.perf_counter()
        if reused < cut:
            # The shared system prompt gets its own entry: every conversation starts there.
            await self.owner.run(prefill, self.tiny, caches, prompt[reused:cut])
            checkpoint_s = time.perf_counter() - start
            await self._save(prompt[:cut], caches, None)
            start = time.perf_counter() - checkpoint_s
            logits = await self.owner.run(prefill, self.tiny, caches, prompt[cut:])
        else:
            logits = await self.owner.run(prefill, self.tiny, caches, prompt[reused:])
        await self.owner.run(_argmax, logits)
        ttft = fetch_s + time.perf_counter() - start
        reply = await self.owner.run(_decode, self.tiny, caches, logits, opts.reply_tokens)
        await self._save(prompt + reply, caches, conv.cid)
        check = None
        if fetched.caches is not None:
            check = await self._check(fetched, prompt, logits, before)
        record = _Served(
            conv.cid,
            conv.turns,
            self.phase,
            len(prompt),
            reused,
            fetched.tier,
            earlier,
            ttft,
            check,
        )
        self.served.append(record)
        self._say(_describe(record, self.tolerance))
        return reply

    async def _check(
        self, fetched: Fetched, prompt: list[int], logits: Any, before: list[Any] | None
    ) -> _Check:
        assert fetched.match is not None
        key, trim = fetched.match.entry.key, fetched.match.trim
        cut = len(self.system)
        exact: bool | None = None
        if key in self.live:
            reference = await self.owner.run(
                _reference_logits, self.tiny, self.live[key], trim, prompt, fetched.reused, cut
            )
            exact = await self.owner.run(arrays_equal, reference, logits)
        elif before is not None and trim == 0:
            stored = await trio.to_thread.run_sync(load_probe, self.probes_dir / f"{key}.npy")
            if stored is not None:
                exact = await self.owner.run(_probe_equal, self.tiny, before, stored)
        diff, recompute_s = await self.owner.run(_recompute, self.tiny, prompt, logits)
        return _Check(exact, diff, recompute_s)


def _describe(r: _Served, tolerance: float) -> str:
    where = {Tier.HOT: "hot hit", Tier.COLD: "cold hit", None: "miss"}[r.tier]
    line = (
        f"{r.phase:>7} {r.cid:>6} turn {r.turn}: {r.prompt_tokens:>5} tokens, {where:>8}"
        f" {r.reused:>5} reused, TTFT {r.ttft_s * 1e3:7.1f} ms"
    )
    if r.check is not None:
        exact = {True: "bit-exact", False: "[red]NOT bit-exact[/]", None: "no reference"}[
            r.check.bit_exact
        ]
        ok = "" if r.check.max_diff <= tolerance else " [red]FAIL[/]"
        line += (
            f" (recomputed {r.check.recompute_s * 1e3:7.1f} ms), {exact},"
            f" |diff| {r.check.max_diff:.0e}{ok}"
        )
        if r.previous_run:
            line += ", [magenta]saved by an earlier run[/]"
    return line


# -- conversations -----------------------------------------------------------------------


# -- the event loop's lateness -----------------------------------------------------------


@attrs.define
class _LagMonitor:
    samples: list[float] = attrs.field(factory=list)

    async def run(self) -> None:
        while True:
            start = trio.current_time()
            await trio.sleep(0.001)
            self.samples.append(max(0.0, trio.current_time() - start - 0.001))

    def percentile(self, q: float) -> float:
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- running it --------------------------------------------------------------------------


async def _serve_phase(server: _Server, convs: list[Conversation], system: list[int]) -> None:
    """Every conversation sends one turn; the server answers one request at a time."""
    send, receive = trio.open_memory_channel[tuple[Conversation, list[int], trio.Event]](4)

    async def client(conv: Conversation) -> None:
        prompt = next_prompt(conv, system, server.options, 0)
        done = trio.Event()
        await send.send((conv, prompt, done))
        await done.wait()

    async def serve() -> None:
        async for conv, prompt, done in receive:
            reply = await server.handle(conv, prompt)
            conv.tokens = prompt + reply
            conv.turns += 1
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        async with send:
            async with trio.open_nursery() as clients:
                for conv in convs:
                    clients.start_soon(client, conv)


async def run_demo(opts: DemoOptions) -> DemoReport:
    """Serve, restart, serve again; return the figures."""
    began = time.perf_counter()
    root = opts.data_dir / "demo"
    root.mkdir(parents=True, exist_ok=True)
    lag = _LagMonitor()
    async with MlxOwner.dedicated() as owner, trio.open_nursery() as nursery:
        tiny = await owner.run(build_tiny_model)
        model = ModelKey(tiny.model_id, tiny.fingerprint)
        state_path = root / "conversations.json"
        previous_run, previous = load_state(state_path, tiny.fingerprint)
        run = previous_run + 1
        system = random_tokens(random.Random(f"{opts.seed}/system"), opts.system_tokens)
        convs = plan_conversations(previous, opts, run)
        server = _Server(opts, owner, tiny, root / "probes", system)
        probe = random_tokens(random.Random(f"{opts.seed}/tolerance"), 1024)
        server.tolerance, server.chunking_diff = await owner.run(
            recompute_tolerance, tiny, system + probe
        )
        nursery.start_soon(lag.run)
        totals: dict[str, int] = {}
        returning = sum(1 for c in convs if c.tokens)
        server._say(
            f"kvtrio demo run {run}, cache in {root}: {returning} returning and "
            f"{len(convs) - returning} new conversations; RAM {opts.hot_bytes >> 20} MiB, "
            f"disk {opts.cold_bytes >> 20} MiB, {opts.policy.value}"
        )
        for phase in ("serve", "restart"):
            server.phase = phase
            if phase == "restart":
                server._say("restart: cache closed (RAM entries written to disk); reopening")
            async with open_tiered_cache(
                root / "cold",
                model,
                owner=owner,
                hot_budget=opts.hot_bytes,
                cold_budget=opts.cold_bytes,
                policy=opts.policy,
                block_size=BLOCK_TOKENS,
                options=opts.io,
            ) as cache:
                server.cache = cache
                if phase == "restart":
                    server._say(f"reopened: {cache.statistics().cold_entries} entries on disk")
                await _serve_phase(server, convs, system)
            stats = cache.statistics()
            for name in (
                "bytes_written",
                "bytes_deduplicated",
                "bytes_read",
                "hot_evictions",
                "cold_evictions",
            ):
                totals[name] = totals.get(name, 0) + getattr(stats, name)
            totals["cold_bytes"] = stats.cold_bytes
        nursery.cancel_scope.cancel()
    save_state(state_path, tiny.fingerprint, run, convs)
    await trio.to_thread.run_sync(_prune_probes, root / "probes", root / "cold" / "caches")
    return _report(opts, run, server, lag, totals, time.perf_counter() - began)


def _prune_probes(probes: Path, caches: Path) -> None:
    """Drop the probes of entries the cold tier no longer holds."""
    alive = {p.stem for p in caches.glob("*.kvc")}
    for path in probes.glob("*.npy"):
        if path.stem not in alive:
            path.unlink(missing_ok=True)


def _report(
    opts: DemoOptions,
    run: int,
    server: _Server,
    lag: _LagMonitor,
    totals: dict[str, int],
    elapsed: float,
) -> DemoReport:
    served = server.served
    checks = [r.check for r in served if r.check is not None]
    doc = [r for r in served if r.cid.startswith("doc") and r.check is not None]
    doc_hit = max(doc, key=lambda r: (r.tier is Tier.COLD, r.reused)) if doc else None
    cached = doc_hit.ttft_s if doc_hit else None
    recomputed = doc_hit.check.recompute_s if doc_hit and doc_hit.check else None
    return DemoReport(
        data_dir=str(opts.data_dir),
        run=run,
        requests=len(served),
        hits_hot=sum(1 for r in served if r.tier is Tier.HOT),
        hits_cold=sum(1 for r in served if r.tier is Tier.COLD),
        misses=sum(1 for r in served if r.tier is None),
        hits_after_restart=sum(1 for r in served if r.phase == "restart" and r.tier),
        hits_on_previous_run=sum(1 for r in served if r.previous_run),
        checks=len(checks),
        bit_exact=sum(1 for c in checks if c.bit_exact is True),
        bit_exact_unchecked=sum(1 for c in checks if c.bit_exact is None),
        within_tolerance=sum(1 for c in checks if c.max_diff <= server.tolerance),
        max_diff=max((c.max_diff for c in checks), default=0.0),
        tolerance=server.tolerance,
        chunking_diff=server.chunking_diff,
        doc_prompt_tokens=doc_hit.prompt_tokens if doc_hit else 0,
        doc_ttft_cached_s=cached,
        doc_ttft_recomputed_s=recomputed,
        doc_speedup=(recomputed / cached) if cached and recomputed else None,
        doc_tier=doc_hit.tier.value if doc_hit and doc_hit.tier else None,
        bytes_written=totals.get("bytes_written", 0),
        bytes_deduplicated=totals.get("bytes_deduplicated", 0),
        bytes_read=totals.get("bytes_read", 0),
        hot_evictions=totals.get("hot_evictions", 0),
        cold_evictions=totals.get("cold_evictions", 0),
        cold_bytes_on_disk=totals.get("cold_bytes", 0),
        ttft_hot_ms=_median_ms(r.ttft_s for r in served if r.tier is Tier.HOT),
        ttft_cold_ms=_median_ms(r.ttft_s for r in served if r.tier is Tier.COLD),
        ttft_miss_ms=_median_ms(r.ttft_s for r in served if r.tier is None),
        lag_p50_ms=lag.percentile(0.5) * 1e3,
        lag_p99_ms=lag.percentile(0.99) * 1e3,
        lag_max_ms=max(lag.samples, default=0.0) * 1e3,
        elapsed_s=elapsed,
    )


def _median_ms(seconds: Iterable[float]) -> float | None:
    values = sorted(seconds)
    return values[len(values) // 2] * 1e3 if values else None


def _print_report(report: DemoReport) -> None:
    from rich.console import Console
    from rich.table import Table

    def mb(n: int) -> str:
        return f"{n / 1e6:,.1f} MB"

    table = Table(title=f"kvtrio demo, run {report.run} ({report.data_dir})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("requests served", str(report.requests)),
        ("hits from RAM (hot)", str(report.hits_hot)),
        ("hits from disk (cold)", str(report.hits_cold)),
        ("misses", str(report.misses)),
        (
            "median TTFT: hot hits / cold hits / misses",
            " / ".join(
                "-" if ms is None else f"{ms:,.0f}"
                for ms in (report.ttft_hot_ms, report.ttft_cold_ms, report.ttft_miss_ms)
            )
            + " ms",
        ),
        ("hits after the restart", str(report.hits_after_restart)),
        ("hits on an earlier run's entries", str(report.hits_on_previous_run)),
    ]
    if report.doc_ttft_cached_s and report.doc_ttft_recomputed_s and report.doc_speedup:
        rows += [
            (
                f"TTFT, {report.doc_prompt_tokens}-token prompt, cached ({report.doc_tier})",
                f"{report.doc_ttft_cached_s * 1e3:,.1f} ms",
            ),
            (
                f"TTFT, {report.doc_prompt_tokens}-token prompt, recomputed",
                f"{report.doc_ttft_recomputed_s * 1e3:,.1f} ms",
            ),
            ("TTFT speed-up (recomputed / cached)", f"{report.doc_speedup:,.1f}x"),
        ]
    rows += [
        ("bytes written to disk", mb(report.bytes_written)),
        ("bytes deduplicated (not written)", mb(report.bytes_deduplicated)),
        ("bytes read from disk", mb(report.bytes_read)),
        ("cold tier on disk now", mb(report.cold_bytes_on_disk)),
        ("evictions RAM -> disk / from disk", f"{report.hot_evictions} / {report.cold_evictions}"),
        (
            "event-loop lag p50 / p99 / max",
            f"{report.lag_p50_ms:.2f} / {report.lag_p99_ms:.2f} / {report.lag_max_ms:.2f} ms",
        ),
        (
            "hits bit-exact vs the saved live cache",
            f"{report.bit_exact}/{report.checks}"
            + (
                f" ({report.bit_exact_unchecked} without reference)"
                if report.bit_exact_unchecked
                else ""
            ),
        ),
        (
            f"hits within {report.tolerance:.1e} of full recomputation (4x this device's "
            f"two-chunk prefill difference {report.chunking_diff:.1e}, at least "
            f"{TOLERANCE:g})",
            f"{report.within_tolerance}/{report.checks} (max |diff| {report.max_diff:.1e})",
        ),
        ("elapsed", f"{report.elapsed_s:,.1f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    verdict = "[green]all checks passed[/]" if report.ok else "[red]CHECKS FAILED[/]"
    console.print(verdict)
    if report.run == 1:
        console.print("Run it again: the next run continues these conversations from disk.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the cache lives (default: $KVTRIO_DATA_DIR or the user cache dir)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete the demo's cache first")
    parser.add_argument("--chats", type=int, default=3, help="chat conversations (default 3)")
    parser.add_argument(
        "--doc-tokens", type=int, default=4096, help="the long prompt's length (default 4096)"
    )
    parser.add_argument("--hot-mb", type=float, default=8.0, help="RAM budget (default 8 MB)")
    parser.add_argument("--cold-mb", type=float, default=512.0, help="disk budget (512 MB)")
    parser.add_argument(
        "--policy",
        choices=[p.value for p in WritePolicy],
        default=WritePolicy.WRITE_BACK.value,
        help="when entries are written to disk (default write-back)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    defaults = DemoOptions(data_dir=Path())
    shortest = defaults.system_tokens + defaults.question_tokens + 1
    problem = (
        "--chats must be >= 0"
        if args.chats < 0
        else f"--doc-tokens must be >= {shortest}"
        if args.doc_tokens < shortest
        else "--hot-mb and --cold-mb must be finite and > 0"
        if not all(0 < mb < math.inf for mb in (args.hot_mb, args.cold_mb))  # NaN too
        else None
    )
    if problem:
        print(f"kvtrio demo: {problem}", file=sys.stderr)
        return 2
    data_dir: Path = args.data_dir or default_data_dir()
    if args.fresh:
        shutil.rmtree(data_dir / "demo", ignore_errors=True)
    opts = DemoOptions(
        data_dir=data_dir,
        chats=args.chats,
        doc_tokens=args.doc_tokens,
        hot_bytes=int(args.hot_mb * (1 << 20)),
        cold_bytes=int(args.cold_mb * (1 << 20)),
        policy=WritePolicy(args.policy),
        quiet=args.json,
        io=args.io_options,
    )
    report = trio.run(run_demo, opts)
    if args.json:
        print(json.dumps(attrs.asdict(report) | {"ok": report.ok}, indent=2))
    else:
        _print_report(report)
    return 0 if report.ok else 1
