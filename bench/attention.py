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
from kvtrio.metal.attention import (
    DEFAULT_TUNING,
    KernelTuning,
    PagedAttentionView,
    direct_backend,
)
from kvtrio.metal.pool import BlockPool

__all__ = ["add_arguments", "measure", "measure_length", "render"]

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
    gather_us = _median_us(
        lambda q: view.attend_reference(q, scale), queries, iters, chain=chain
    )
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
            q_bytes = sum(a.nbytes for a in qview.arrays) * length // (
                qview.arrays[0].shape[0] * block_size
            )
            q_us = _median_us(
                partial(qview.attend_direct, scale=scale, mask=None, backend=backend,
                        tuning=tuning),
                queries,
                iters,
                chain=chain,
            )
            row[f"direct_q{b}_us"] = q_us
            row[f"direct_q{b}_gbs"] = q_bytes / q_us / 1e3
            row[f"direct_q{b}_vs_sdpa"] = q_us / sdpa_us
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="4096,32768,131072", help="context lengths")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bits", default="", help="quantized direct variants, e.g. 4,8")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument(
        "--tuning", default="",
        help="kernel shape: warps,rows,unroll,pipeline(0|1),blocks[,mma(0|1)[,mma_warps,"
        "mma_blocks]] (the first five shape the scalar kernel)",
    )
    parser.add_argument(
        "--independent", action="store_true",
        help="queue independent calls (they may overlap on the GPU) instead of chaining each "
        "call's output into the next call's queries",
    )
    parser.add_argument(
        "--sweep", action="store_true",
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
                partial(view.attend_direct, scale=scale, mask=None, backend=backend,
                        tuning=tuning),
                queries,
                args.iters,
                chain=not args.independent,
            )
            totals[tuning] = totals.get(tuning, 0.0) + us
            timings.append(
                {"tokens": length, "tuning": tuning.text(), "us": us, "sdpa_us": sdpa}
            )
            print(f"{length:>7} --tuning {tuning.text():<24} "
                  f"{us:8.1f} us  {us / sdpa:5.2f}x sdpa ({sdpa:.1f} us)", file=sys.stderr)
    best = min(totals, key=lambda k: totals[k])
    return {"sweep": timings, "best": best.text()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.sweep:
        return _sweep(args)
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
    return {
        "device": str(mx.default_device()),
        "chained": not args.independent,
        "rows": rows,
        "shape": {
            "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "dtype": args.dtype, "block_size": args.block_size,
        },
    }


def render(figures: dict[str, Any]) -> None:
    if "sweep" in figures:
        print(figures.get("error") or "best --tuning " + str(figures["best"]))
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
    columns = ["tokens", "sdpa us", "sdpa GB/s", "gather+sdpa us", "gather/sdpa",
               "direct us", "direct GB/s", "direct/sdpa", "scalar/sdpa"]
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
            str(r["tokens"]), fmt(r["sdpa_us"], ".1f"), fmt(r["sdpa_gbs"], ".0f"),
            fmt(r["gather_us"], ".1f"), fmt(r["gather_vs_sdpa"], ".2f") + "x",
            fmt(r["direct_us"], ".1f"), fmt(r["direct_gbs"], ".0f"),
            fmt(r["direct_vs_sdpa"], ".2f") + "x",
            fmt(r.get("scalar_vs_sdpa"), ".2f") + "x",
        ]
        for key in extra:
            cells += [fmt(r.get(key), ".1f"), fmt(r.get(key.replace("_us", "_vs_sdpa")), ".2f")]
        table.add_row(*cells)
    Console().print(table)
