"""``kvtrio bench attention``: decode attention over a paged cache vs contiguous sdpa.

For each context length, one decode step (one query per head) is timed three ways on the
same keys and values, in the same run:

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` on contiguous ``[1, kv_heads, L, D]``
  keys and values (the reference, what a ``KVCache`` gives);
- ``gather+sdpa``: the paged reference path (gather by block table, then sdpa);
- ``direct``: the split-K kernel reading the pool blocks in place (GPU only; on tensor
  cores for float16/bfloat16 pools), plus its affine-quantized variants when ``--bits`` is
  given (reading fewer bytes); ``scalar``: the same kernel without tensor cores (the
  direct kernel before they were used), for comparison in the same run.

With ``--batch B --lengths-mix LO:HI``, one decode step of B sequences (lengths drawn
uniformly from LO..HI, seeded) in one shuffled pool is timed four ways on the same KV bytes:
``batched`` (the direct kernel, one launch for the batch), ``direct loop`` (the direct
kernel per sequence), ``sdpa loop`` (contiguous sdpa per sequence) and ``padded sdpa`` (one
sdpa over the batch left-padded to the longest, with a mask).

Ceilings, measured in the same process: ``copy`` (a device-to-device elementwise pass over
a buffer at least as large as the KV, counting bytes read plus written) and ``read`` (a
float16 sum over the same buffer, counting bytes read). Each direct figure is also given as
a fraction of both.

A time is the median over ``--iters`` evaluations of 20 queued calls, divided by 20, after
warm-up; each call's output is the next call's queries (as layers follow each other in a
decode step), so calls cannot overlap on the GPU (``--independent`` lets them). Effective
bandwidth is the bytes of keys and values the step must read over that time. The physical
blocks are shuffled, as a pool shared by many sequences leaves them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
from kvtrio.bench.argtypes import whole, wholes
from kvtrio.metal.attention import (
    DEFAULT_TUNING,
    BatchPagedAttentionView,
    KernelTuning,
    PagedAttentionView,
    direct_backend,
)
from kvtrio.metal.pool import BlockPool

__all__ = ["add_arguments", "ceilings", "measure", "measure_batch", "measure_length", "render"]

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _median_us(
    fn: Callable[[mx.array], mx.array],
    queries: mx.array,
    iters: int,
    batch: int = 20,
    *,
    chain: bool = True,
) -> float:
    """Median time of one call, over ``iters`` evaluations of ``batch`` calls queued together
    (one evaluation per call would time the host round trip, not the GPU work). Each call's
    output is the next call's queries, as in a model's decode step, where a layer waits for
    the one before; independent calls could overlap on the GPU and share its cache (with
    ``--independent`` they may)."""

    def queue() -> list[mx.array]:
        outs = []
        q = queries
        for _ in range(batch):
            out = fn(q)
            outs.append(out)
            if chain:
                q = out
        return outs

    mx.eval(queue())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(queue())
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times) * 1e6


def ceilings(nbytes: int, iters: int) -> dict[str, float]:
    """Copy and read bandwidth (GB/s) over a float16 buffer of at least ``nbytes`` (on a GPU
    at least 1 GiB, several times its cache)."""
    floor = 1 << 30 if mx.default_device() == mx.gpu else 1 << 24
    elements = -(-max(nbytes, floor) // 8192) * 4096
    x = mx.random.normal((elements // 4096, 4096)).astype(mx.float16)
    mx.eval(x)
    copy_us = _median_us(mx.negative, x, iters)
    read_us = _median_us(
        lambda a: mx.sum(a, axis=1, keepdims=True) + a[:, :1], x, iters, chain=False
    )
    del x
    return {"copy_gbs": 2 * elements * 2 / copy_us / 1e3, "read_gbs": elements * 2 / read_us / 1e3}


def _paged_view(
    keys: mx.array, values: mx.array, block_size: int, bits: int | None, group_size: int
) -> PagedAttentionView:
    """A pool holding ``keys``/``values`` in shuffled physical blocks, and its view."""
    _, kv_heads, length, dim = keys.shape
    blocks = -(-length // block_size)
    pool = BlockPool(
        blocks, kv_heads, block_size, dim, dtype=keys.dtype, bits=bits, group_size=group_size
    )
    table = list(range(blocks))
    random.Random(length).shuffle(table)
    for _ in table:
        pool.allocate()
    step = 8192  # write in slices so the index arrays stay small
    for begin in range(0, length, step):
        end = min(length, begin + step)
        positions = range(begin, end)
        pool.write(
            [table[p // block_size] for p in positions],
            [p % block_size for p in positions],
            keys[:, :, begin:end],
            values[:, :, begin:end],
        )
        mx.eval(pool.arrays())
    return PagedAttentionView.capture(pool, table, length)


def measure_length(
    length: int,
    *,
    q_heads: int,
    kv_heads: int,
    dim: int,
    dtype: mx.Dtype,
    block_size: int,
    bits: list[int],
    group_size: int,
    iters: int,
    tuning: KernelTuning = DEFAULT_TUNING,
    chain: bool = True,
) -> dict[str, float | int | str | None]:
    """One context length's figures (times in microseconds, bandwidth in GB/s)."""
    mx.random.seed(length)
    keys = mx.random.normal((1, kv_heads, length, dim)).astype(dtype)
    values = mx.random.normal((1, kv_heads, length, dim)).astype(dtype)
    queries = mx.random.normal((1, q_heads, 1, dim)).astype(dtype)
    mx.eval(keys, values, queries)
    scale = dim**-0.5
    kv_bytes = keys.nbytes + values.nbytes
    view = _paged_view(keys, values, block_size, None, group_size)
    sdpa_us = _median_us(
        lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
        queries,
        iters,
        chain=chain,
    )
    gather_us = _median_us(lambda q: view.attend_reference(q, scale), queries, iters, chain=chain)
    row: dict[str, float | int | str | None] = {
        "tokens": length,
        "kv_bytes": kv_bytes,
        "sdpa_us": sdpa_us,
        "sdpa_gbs": kv_bytes / sdpa_us / 1e3,
        "gather_us": gather_us,
        "gather_vs_sdpa": gather_us / sdpa_us,
        "direct_us": None,
        "direct_gbs": None,
        "direct_vs_sdpa": None,
    }
    backend = direct_backend()
    if backend is not None:
        direct_us = _median_us(
            lambda q: view.attend_direct(q, scale, None, backend, tuning),
            queries,
            iters,
            chain=chain,
        )
        row.update(
            direct_us=direct_us,
            direct_gbs=kv_bytes / direct_us / 1e3,
            direct_vs_sdpa=direct_us / sdpa_us,
        )
        if view.uses_mma(tuning, backend):
            scalar = attrs.evolve(tuning, mma=False)
            scalar_us = _median_us(
                lambda q: view.attend_direct(q, scale, None, backend, scalar),
                queries,
                iters,
                chain=chain,
            )
            row.update(scalar_us=scalar_us, scalar_vs_sdpa=scalar_us / sdpa_us)
        for b in bits:
            qview = _paged_view(keys, values, block_size, b, group_size)
            q_bytes = (
                sum(a.nbytes for a in qview.arrays)
                * length
                // (qview.arrays[0].shape[0] * block_size)
            )
            q_us = _median_us(
                partial(
                    qview.attend_direct, scale=scale, mask=None, backend=backend, tuning=tuning
                ),
                queries,
                iters,
                chain=chain,
            )
            row[f"direct_q{b}_us"] = q_us
            row[f"direct_q{b}_gbs"] = q_bytes / q_us / 1e3
            row[f"direct_q{b}_vs_sdpa"] = q_us / sdpa_us
    return row


def _batch_pool(
    lengths: list[int], kv_heads: int, dim: int, dtype: mx.Dtype, block_size: int, seed: int
) -> tuple[BatchPagedAttentionView, list[tuple[mx.array, mx.array]]]:
    """One pool holding every sequence in blocks shuffled across the whole batch, its batch
    view, and each sequence's contiguous keys and values (the same values)."""
    counts = [-(-x // block_size) for x in lengths]
    pool = BlockPool(sum(counts), kv_heads, block_size, dim, dtype=dtype)
    order = [pool.allocate() for _ in range(sum(counts))]
    random.Random(seed).shuffle(order)
    tables, contiguous, at = [], [], 0
    for b, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        mx.random.seed(seed * 1000 + b)
        keys = mx.random.normal((1, kv_heads, length, dim)).astype(dtype)
        values = mx.random.normal((1, kv_heads, length, dim)).astype(dtype)
        table = order[at : at + count]
        at += count
        for begin in range(0, length, 8192):
            end = min(length, begin + 8192)
            positions = range(begin, end)
            pool.write(
                [table[p // block_size] for p in positions],
                [p % block_size for p in positions],
                keys[:, :, begin:end],
                values[:, :, begin:end],
            )
            mx.eval(pool.arrays())
        tables.append(table)
        contiguous.append((keys, values))
    return BatchPagedAttentionView.capture(pool, tables, lengths), contiguous


def measure_batch(
    lengths: list[int],
    *,
    q_heads: int,
    kv_heads: int,
    dim: int,
    dtype: mx.Dtype,
    block_size: int,
    iters: int,
    tunings: dict[str, KernelTuning] | None = None,
    padded: bool = True,
    seed: int = 16,
) -> dict[str, Any]:
    """One batched decode step's figures (times in microseconds, bandwidth in GB/s)."""
    view, contiguous = _batch_pool(lengths, kv_heads, dim, dtype, block_size, seed)
    batch = len(lengths)
    queries = mx.random.normal((batch, q_heads, 1, dim)).astype(dtype)
    mx.eval(queries)
    scale = dim**-0.5
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in contiguous)

    def sdpa_loop(q: mx.array) -> mx.array:
        return mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(q[b : b + 1], k, v, scale=scale)
                for b, (k, v) in enumerate(contiguous)
            ]
        )

    row: dict[str, Any] = {
        "batch": batch,
        "tokens": sum(lengths),
        "min_length": min(lengths),
        "max_length": max(lengths),
        "kv_bytes": kv_bytes,
    }
    row["sdpa_loop_us"] = _median_us(sdpa_loop, queries, iters)
    if padded:
        longest = max(lengths)
        keys = mx.concatenate(
            [mx.pad(k, [(0, 0), (0, 0), (longest - k.shape[2], 0), (0, 0)]) for k, _ in contiguous]
        )
        values = mx.concatenate(
            [mx.pad(v, [(0, 0), (0, 0), (longest - v.shape[2], 0), (0, 0)]) for _, v in contiguous]
        )
        mask = (mx.arange(longest)[None, :] >= mx.array([longest - x for x in lengths])[:, None])[
            :, None, None, :
        ]
        mx.eval(keys, values, mask)
        row["padded_sdpa_us"] = _median_us(
            lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask),
            queries,
            iters,
        )
        del keys, values, mask
    backend = direct_backend()
    if backend is not None:
        sequences = [view.sequence(b) for b in range(batch)]
        row["direct_loop_us"] = _median_us(
            lambda q: mx.concatenate(
                [
                    s.attend_direct(q[b : b + 1], scale, None, backend)
                    for b, s in enumerate(sequences)
                ]
            ),
            queries,
            iters,
        )
        for name, tuning in (tunings or {"batched": DEFAULT_TUNING}).items():
            us = _median_us(
                partial(view.attend_direct, scale=scale, mask=None, backend=backend, tuning=tuning),
                queries,
                iters,
            )
            row[f"{name}_us"] = us
            row[f"{name}_gbs"] = kv_bytes / us / 1e3
            row[f"{name}_vs_sdpa_loop"] = us / row["sdpa_loop_us"]
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", type=wholes, default="4096,32768,131072", help="context lengths"
    )
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bits", default="", help="quantized direct variants, e.g. 4,8")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--iters", type=whole, default=15)
    parser.add_argument(
        "--tuning",
        default="",
        help="kernel shape: warps,rows,unroll,pipeline(0|1),blocks[,mma(0|1)[,mma_warps,"
        "mma_blocks[,mma_tiles,mma_wide_l2(0|1)[,batch_waves]]]] (the first five shape the "
        "scalar kernel)",
    )
    parser.add_argument(
        "--independent",
        action="store_true",
        help="queue independent calls (they may overlap on the GPU) instead of chaining each "
        "call's output into the next call's queries",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="time a batched decode step of this many sequences instead",
    )
    parser.add_argument(
        "--lengths-mix",
        default="1024:32768",
        help="with --batch: sequence lengths drawn uniformly from LO:HI",
    )
    parser.add_argument("--seed", type=int, default=16, help="with --batch: the lengths' seed")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time the direct kernel's launch shapes instead; print the fastest as --tuning",
    )


def _parse_tuning(text: str) -> KernelTuning:
    return KernelTuning.parse(text) if text else DEFAULT_TUNING


def _sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Direct-kernel time per launch shape, summed over the lengths; the fastest is printed."""
    backend = direct_backend()
    if backend is None:
        return {"sweep": [], "best": None, "error": "no GPU backend: nothing to sweep"}
    dtype = _DTYPES[args.dtype]
    lengths = [int(x) for x in args.lengths.split(",")]
    # The scalar kernel's default shape, then the tensor-core kernel's warps and grid sizes.
    shapes = [attrs.evolve(DEFAULT_TUNING, mma=False)] + [
        attrs.evolve(DEFAULT_TUNING, mma_warps=warps, mma_blocks=blocks)
        for warps in (2, 4, 8)
        for blocks in (132, 264, 528, 1056, 2112)
    ]
    totals: dict[KernelTuning, float] = {}
    timings: list[dict[str, Any]] = []
    for length in lengths:
        mx.random.seed(length)
        keys = mx.random.normal((1, args.kv_heads, length, args.head_dim)).astype(dtype)
        values = mx.random.normal((1, args.kv_heads, length, args.head_dim)).astype(dtype)
        queries = mx.random.normal((1, args.q_heads, 1, args.head_dim)).astype(dtype)
        view = _paged_view(keys, values, args.block_size, None, args.group_size)
        scale = args.head_dim**-0.5
        sdpa = _median_us(
            partial(mx.fast.scaled_dot_product_attention, k=keys, v=values, scale=scale),
            queries,
            args.iters,
            chain=not args.independent,
        )
        for tuning in shapes:
            us = _median_us(
                partial(view.attend_direct, scale=scale, mask=None, backend=backend, tuning=tuning),
                queries,
                args.iters,
                chain=not args.independent,
            )
            totals[tuning] = totals.get(tuning, 0.0) + us
            timings.append({"tokens": length, "tuning": tuning.text(), "us": us, "sdpa_us": sdpa})
            print(
                f"{length:>7} --tuning {tuning.text():<24} "
                f"{us:8.1f} us  {us / sdpa:5.2f}x sdpa ({sdpa:.1f} us)",
                file=sys.stderr,
            )
    best = min(totals, key=lambda k: totals[k])
    return {"sweep": timings, "best": best.text()}


def _run_batch(args: argparse.Namespace) -> dict[str, Any]:
    lo, hi = (int(x) for x in args.lengths_mix.split(":"))
    rng = random.Random(args.seed)
    lengths = [rng.randint(lo, hi) for _ in range(args.batch)]
    row = measure_batch(
        lengths,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        dim=args.head_dim,
        dtype=_DTYPES[args.dtype],
        block_size=args.block_size,
        iters=args.iters,
        tunings={"batched": _parse_tuning(args.tuning)},
        seed=args.seed,
    )
    row.update(ceilings(row["kv_bytes"], args.iters))
    if "batched_gbs" in row:
        row["batched_of_copy"] = row["batched_gbs"] / row["copy_gbs"]
        row["batched_of_read"] = row["batched_gbs"] / row["read_gbs"]
    return {
        "device": str(mx.default_device()),
        "lengths": lengths,
        "batch_row": row,
        "shape": {**_shape(args), "mix": args.lengths_mix},
    }


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    """The attention shape a run measured, as its JSON reports it."""
    return {
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "block_size": args.block_size,
    }


def _render_batch(figures: dict[str, Any]) -> None:
    row, shape = figures["batch_row"], figures["shape"]
    print(
        f"batched decode, {row['batch']} sequences of {shape['mix']} tokens "
        f"({row['kv_bytes'] / 1e9:.2f} GB of KV), {shape['q_heads']} q / {shape['kv_heads']} "
        f"kv heads, head dim {shape['head_dim']}, {shape['dtype']}, block "
        f"{shape['block_size']}, {figures['device']}"
    )
    for key in ("batched", "direct_loop", "sdpa_loop", "padded_sdpa"):
        if f"{key}_us" in row:
            us = row[f"{key}_us"]
            print(
                f"  {key:<12} {us:9.1f} us  {row['kv_bytes'] / us / 1e3:7.0f} GB/s  "
                f"{us / row['sdpa_loop_us']:5.2f}x sdpa loop"
            )
    print(
        f"  ceilings: copy {row['copy_gbs']:.0f} GB/s, read {row['read_gbs']:.0f} GB/s"
        + (
            f"; batched = {row['batched_of_copy']:.0%} of copy, "
            f"{row['batched_of_read']:.0%} of read"
            if "batched_of_copy" in row
            else ""
        )
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.sweep:
        return _sweep(args)
    if args.batch:
        return _run_batch(args)
    tuning = _parse_tuning(args.tuning)
    rows = [
        measure_length(
            int(length),
            q_heads=args.q_heads,
            kv_heads=args.kv_heads,
            dim=args.head_dim,
            dtype=_DTYPES[args.dtype],
            block_size=args.block_size,
            bits=[int(b) for b in args.bits.split(",") if b],
            group_size=args.group_size,
            iters=args.iters,
            tuning=tuning,
            chain=not args.independent,
        )
        for length in args.lengths.split(",")
    ]
    limits = ceilings(max(int(r["kv_bytes"] or 0) for r in rows), args.iters)
    for r in rows:
        for key in ("sdpa", "direct"):
            gbs = r.get(f"{key}_gbs")
            if isinstance(gbs, float):
                r[f"{key}_of_copy"] = gbs / limits["copy_gbs"]
                r[f"{key}_of_read"] = gbs / limits["read_gbs"]
    return {
        "device": str(mx.default_device()),
        "chained": not args.independent,
        "ceilings": limits,
        "rows": rows,
        "shape": _shape(args),
    }


def render(figures: dict[str, Any]) -> None:
    if "sweep" in figures:
        print(figures.get("error") or "best --tuning " + str(figures["best"]))
        return
    if "batch_row" in figures:
        _render_batch(figures)
        return
    rows: list[dict[str, Any]] = figures["rows"]
    shape = figures["shape"]
    device = figures["device"]
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"decode attention, {shape['q_heads']} q heads / {shape['kv_heads']} kv heads, "
        f"head dim {shape['head_dim']}, {shape['dtype']}, block {shape['block_size']}, {device}"
    )
    columns = [
        "tokens",
        "sdpa us",
        "sdpa GB/s",
        "gather+sdpa us",
        "gather/sdpa",
        "direct us",
        "direct GB/s",
        "direct/sdpa",
        "scalar/sdpa",
    ]
    for name in columns:
        table.add_column(name, justify="right")
    extra = sorted({k for r in rows for k in r if k.startswith("direct_q") and k.endswith("_us")})
    for key in extra:
        table.add_column(key.removesuffix("_us").replace("direct_", "") + " us", justify="right")
        table.add_column(key.removesuffix("_us").replace("direct_", "") + "/sdpa", justify="right")

    def fmt(value: object, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        cells = [
            str(r["tokens"]),
            fmt(r["sdpa_us"], ".1f"),
            fmt(r["sdpa_gbs"], ".0f"),
            fmt(r["gather_us"], ".1f"),
            fmt(r["gather_vs_sdpa"], ".2f") + "x",
            fmt(r["direct_us"], ".1f"),
            fmt(r["direct_gbs"], ".0f"),
            fmt(r["direct_vs_sdpa"], ".2f") + "x",
            fmt(r.get("scalar_vs_sdpa"), ".2f") + "x",
        ]
        for key in extra:
            cells += [fmt(r.get(key), ".1f"), fmt(r.get(key.replace("_us", "_vs_sdpa")), ".2f")]
        table.add_row(*cells)
    Console().print(table)
    limits = figures["ceilings"]
    print(
        f"ceilings (same process): copy {limits['copy_gbs']:.0f} GB/s, "
        f"read {limits['read_gbs']:.0f} GB/s"
    )
    for r in rows:
        if r.get("direct_of_copy") is not None:
            print(
                f"  {r['tokens']:>7} tokens: direct {r['direct_of_copy']:.0%} of copy, "
                f"{r['direct_of_read']:.0%} of read; sdpa {r['sdpa_of_copy']:.0%} of copy"
            )
