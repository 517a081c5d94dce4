"""One device session's work for the paged kernels, in few calls (run on the GPU host).

``python tests/metal/device_session.py tests`` runs the GPU tests (tests/metal, the parity
test) and ``kvtrio demo``; ``... bench`` runs the attention benches (single sequence, with
launch-shape variants; batched mixes) with the copy and read ceilings measured in the same
process; ``... explore`` times launch-shape variants of the tensor-core kernel against sdpa in
alternating rounds (``KVTRIO_VARIANTS``, ``KVTRIO_LENGTHS``, ``KVTRIO_MIXES``; on a machine
without a GPU it runs the numpy stand-in, as a smoke test of the script); ``... profile``
makes a few unchained 128k calls for a profiler (ncu) to read; ``... overhead`` splits
a chained call's time into building the calls and evaluating them; ``... host`` does that
split for another tree's direct call against this tree's (kept launches, compiled replay,
fused merge), with a pipelined decode loop too, ``... construct`` times building single kernel
calls (nothing evaluated), and ``... stubbed`` times their Python share alone, the kernels
stubbed (any machine).
Everything lands as JSON and logs under ``$OUT`` (the device tool's output folder), with a
short table printed last.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "/tmp/out"))
# The tests a session runs (pytest -k); KVTRIO_GPU_SELECT overrides, e.g. "" for all.
SELECT = os.environ.get("KVTRIO_GPU_SELECT", "parity or batch or self_check")


def _sh(cmd: list[str], log: str, timeout: float, env: dict[str, str] | None = None) -> int:
    began = time.time()
    with open(OUT / log, "w") as f:
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **(env or {})}, check=False)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"{log}: rc {rc} in {time.time() - began:.0f} s", flush=True)
    return rc


def tests(budget: float) -> None:
    began = time.time()
    _sh([sys.executable, "-m", "pytest", "-q", "-rs", "--timeout", "120",
         "tests/storage/test_parity.py", "tests/metal/test_direct_gpu.py",
         *(["-k", SELECT] if SELECT else [])],
        "pytest.log", budget * 0.75, env={"KVTRIO_GPU_ERRORS": str(OUT / "batch_errors.json")})
    left = budget - (time.time() - began)
    _sh([sys.executable, "-m", "kvtrio", "demo", "--json", "--data-dir", "/tmp/kvdemo"],
        "demo.json", max(30.0, left - 10))
    tail = (OUT / "pytest.log").read_text().splitlines()[-15:]
    print("\n".join(tail))
    if (OUT / "batch_errors.json").exists():
        errors = json.loads((OUT / "batch_errors.json").read_text())
        worst: dict[str, float] = {}
        for e in errors:
            key = f"{e['dtype']} bits={e['bits']}"
            worst[key] = max(worst.get(key, 0.0), e["error"])
        print("worst batched relative error:", json.dumps(worst))
    try:
        demo = json.loads((OUT / "demo.json").read_text())
        print("demo ok", demo.get("ok"), "tolerance", demo.get("tolerance"), "chunking_diff",
              demo.get("chunking_diff"), "max_diff", demo.get("max_diff"))
    except (OSError, ValueError) as exc:
        print("demo: no JSON", exc)


def bench(budget: float) -> None:
    import attrs
    import mlx.core as mx
    from kvtrio.bench import attention as b
    from kvtrio.metal.attention import DEFAULT_TUNING

    began = time.time()
    results: dict[str, Any] = {"device": str(mx.default_device())}
    shape = {"q_heads": 32, "kv_heads": 8, "dim": 128, "dtype": mx.float16, "block_size": 16}
    results["ceilings"] = b.ceilings(4 << 30, 10)
    print("ceilings", results["ceilings"], flush=True)
    variants = {
        "default": DEFAULT_TUNING,
        "wide_l2": attrs.evolve(DEFAULT_TUNING, mma_wide_l2=True),
        "blocks132": attrs.evolve(DEFAULT_TUNING, mma_blocks=132),
        "warps4_528": attrs.evolve(DEFAULT_TUNING, mma_warps=4, mma_blocks=528),
        "warps4_264": attrs.evolve(DEFAULT_TUNING, mma_warps=4, mma_blocks=264),
        "wide_l2_528": attrs.evolve(DEFAULT_TUNING, mma_wide_l2=True, mma_blocks=528),
    }
    mixes = [(32, 1024, 32768), (32, 1024, 4096), (64, 512, 8192), (8, 16384, 131072)]
    batch_tunings = {
        "batched": DEFAULT_TUNING,
        "waves8": attrs.evolve(DEFAULT_TUNING, batch_waves=8),
        "wide_l2": attrs.evolve(DEFAULT_TUNING, mma_wide_l2=True),
        "warps4": attrs.evolve(DEFAULT_TUNING, mma_warps=4),
    }
    results["batch"] = []
    import random

    for batch, lo, hi in mixes:
        if time.time() - began > budget * 0.5:
            break
        rng = random.Random(16)
        lengths = [rng.randint(lo, hi) for _ in range(batch)]
        row = b.measure_batch(lengths, iters=10, tunings=batch_tunings,
                              padded=batch * hi <= 32 * 32768, **shape)  # type: ignore[arg-type]
        row["mix"] = f"{batch}x{lo}:{hi}"
        row["batched_of_copy"] = row["batched_gbs"] / results["ceilings"]["copy_gbs"]
        row["batched_of_read"] = row["batched_gbs"] / results["ceilings"]["read_gbs"]
        results["batch"].append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
        mx.clear_cache()
    results["single"] = []
    for length in (4096, 32768, 131072):
        for name, tuning in variants.items():
            if time.time() - began > budget * 0.95:
                break
            if name != "default" and length == 4096:
                continue
            row = b.measure_length(length, bits=[4] if name == "default" else [], group_size=64,
                            iters=10, tuning=tuning, **shape)  # type: ignore[arg-type]
            row["variant"] = name
            gbs = row["direct_gbs"]
            assert isinstance(gbs, float)
            row["direct_of_copy"] = gbs / results["ceilings"]["copy_gbs"]
            row["direct_of_read"] = gbs / results["ceilings"]["read_gbs"]
            results["single"].append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    (OUT / "bench.json").write_text(json.dumps(results, indent=1))
    left = budget - (time.time() - began)
    for name in ("tier", "storage"):
        if left > 60:
            took = time.time()
            _sh([sys.executable, "-m", "kvtrio", "bench", name, "--json"], f"bench_{name}.json",
                left / 2 if name == "tier" else left - 5)
            left -= time.time() - took


def _single_views(length: int, shape: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """A shuffled one-sequence view of ``length`` random tokens, its contiguous keys and
    values, and queries (as kvtrio.bench.attention lays them out)."""
    import mlx.core as mx
    from kvtrio.bench import attention as b

    mx.random.seed(length)
    keys = mx.random.normal((1, shape["kv_heads"], length, shape["dim"])).astype(shape["dtype"])
    values = mx.random.normal((1, shape["kv_heads"], length, shape["dim"])).astype(
        shape["dtype"])
    queries = mx.random.normal((1, shape["q_heads"], 1, shape["dim"])).astype(shape["dtype"])
    mx.eval(keys, values, queries)
    view = b._paged_view(keys, values, shape["block_size"], None, 64)
    return view, keys, values, queries


def explore(budget: float) -> None:
    """Launch-shape variants of the tensor-core kernel against contiguous sdpa, alternating
    (two rounds), single sequences and batches, ceilings in the same process. Variants are
    made of ``_``-joined parts: ``b<blocks>`` (items aiming for that many thread blocks),
    ``w<waves>`` (batch_waves) and ``W<warps>`` (mma_warps); ``default`` is the default
    shape. (Chunks claimed from a counter, a per-head rotation of the steps, loads that skip
    L1, a cp.async ring of 1-3 steps per lane and items rounded to 16 tokens were measured
    with this too, and dropped: docs/benchmarks.md.)"""
    import random

    import attrs
    import mlx.core as mx
    from kvtrio.bench import attention as b
    from kvtrio.metal.attention import DEFAULT_TUNING, direct_backend

    began = time.time()
    backend = direct_backend()
    if backend is None:  # a CPU smoke run of this script: the numpy stand-in
        from emulated_backend import EmulatedBackend  # type: ignore[import-not-found]

        backend = EmulatedBackend()
        b.direct_backend = lambda: backend  # type: ignore[attr-defined]
    shape = {"q_heads": 32, "kv_heads": 8, "dim": 128, "dtype": mx.float16, "block_size": 16}
    results: dict[str, Any] = {"device": str(mx.default_device()), "single": [], "batch": []}
    results["ceilings"] = b.ceilings(int(os.environ.get("KVTRIO_CEILING_BYTES", 4 << 30)), 10)
    print("ceilings", json.dumps(results["ceilings"]), flush=True)
    names = os.environ.get("KVTRIO_VARIANTS",
                           "default,b528,b1056").split(",")

    def tuning_of(name: str) -> Any:
        t = DEFAULT_TUNING
        for part in name.split("_"):
            if part.startswith("b"):
                t = attrs.evolve(t, mma_blocks=int(part[1:]))
            elif part.startswith("w"):
                t = attrs.evolve(t, batch_waves=int(part[1:]))
            elif part.startswith("W"):
                t = attrs.evolve(t, mma_warps=int(part[1:]))

        return t

    lengths = [int(x) for x in os.environ.get("KVTRIO_LENGTHS", "131072,32768,4096").split(",")]
    for length in lengths:
        results["single"].append(_explore_length(length, shape, names, tuning_of, backend,
                                                 results["ceilings"]["copy_gbs"]))
        mx.clear_cache()
    refused = {n for r in results["single"] for n in r["failed"]}
    batch_names = [n for n in os.environ.get("KVTRIO_BATCH_VARIANTS", "default,w1,w8").split(",")
                   if n not in refused]
    mixes = os.environ.get("KVTRIO_MIXES", "32:1024:32768,32:1024:4096").split(",")
    for batch, lo, hi in ([int(x) for x in mix.split(":")] for mix in mixes if mix):
        if time.time() - began > budget * 0.8:
            break
        rng = random.Random(16)
        lengths = [rng.randint(lo, hi) for _ in range(batch)]
        row = b.measure_batch(lengths, iters=10, padded=False,
                              tunings={n: tuning_of(n) for n in batch_names},
                              **shape)  # type: ignore[arg-type]
        row["mix"] = f"{batch}x{lo}:{hi}"
        copy = results["ceilings"]["copy_gbs"]
        print(f"batch {row['mix']}: sdpa loop {row['sdpa_loop_us']:.1f} us, direct loop "
              f"{row['direct_loop_us']:.1f} us", flush=True)
        for name in batch_names:
            print(f"        {name:<12} {row[name + '_us']:7.1f} us  "
                  f"{row[name + '_vs_sdpa_loop']:5.3f}x loop  "
                  f"{row[name + '_gbs'] / copy:.0%} of copy", flush=True)
        results["batch"].append(row)
        mx.clear_cache()
    results["ceilings_end"] = b.ceilings(int(os.environ.get("KVTRIO_CEILING_BYTES", 4 << 30)), 10)
    print("ceilings at the end", json.dumps(results["ceilings_end"]), flush=True)
    (OUT / "explore.json").write_text(json.dumps(results, indent=1))


def _explore_length(length: int, shape: dict[str, Any], names: list[str],
                    tuning_of: Any, backend: Any, copy: float) -> dict[str, Any]:
    import mlx.core as mx
    from kvtrio.bench import attention as b

    view, keys, values, queries = _single_views(length, shape)
    scale = shape["dim"] ** -0.5
    kv_bytes = keys.nbytes + values.nbytes
    row: dict[str, Any] = {"tokens": length, "kv_bytes": kv_bytes}
    failed: dict[str, str] = {}
    for _ in range(2):
        row.setdefault("sdpa_us", []).append(b._median_us(
            lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
            queries, 10))
        for name in names:
            if name in failed:
                continue
            tuning = tuning_of(name)
            try:
                us = b._median_us(
                    functools.partial(view.attend_direct, scale=scale, mask=None,
                                      backend=backend, tuning=tuning), queries, 10)
            except RuntimeError as exc:  # a launch shape the device refuses: say so, go on
                failed[name] = str(exc)
                print(f"{length:>7} {name}: {type(exc).__name__}: {exc}", flush=True)
                continue
            row.setdefault(name, []).append(us)
    names = [n for n in names if n not in failed]
    row["failed"] = failed
    # The same pool read in other block orders (every block full, one query: the same
    # attention): each work item's blocks in physical order, and the whole table in order.
    if os.environ.get("KVTRIO_ORDERS") and length % shape["block_size"] == 0:
        orders = _reordered_views(view, tuning_of("default"), backend, queries)
        for _ in range(2):
            for order, other in orders.items():
                row.setdefault(order, []).append(b._median_us(
                    functools.partial(other.attend_direct, scale=scale, mask=None,
                                      backend=backend, tuning=tuning_of("default")),
                    queries, 10))
        names = [*names, *orders]
    # The same tokens in a pool of a few more blocks than they need (so its key and value
    # arrays are not a power of two bytes long).
    spare = int(os.environ.get("KVTRIO_SPARE_BLOCKS", "61"))
    if spare and length >= 131072:
        padded = _padded_view(keys, values, shape["block_size"], spare)
        for _ in range(2):
            for name in ("default",):
                tuning = tuning_of(name)
                row.setdefault(f"spare_{name}", []).append(b._median_us(
                    functools.partial(padded.attend_direct, scale=scale, mask=None,
                                      backend=backend, tuning=tuning), queries, 10))
        del padded
    # The partition kernel alone (the merge replaced by a slice), default and most items.
    for name in ("default", "b1056"):
        row[f"partial_{name}_us"] = _partial_only_us(view.as_batch(), queries, scale,
                                                     backend, tuning_of(name))
    sdpa = min(row["sdpa_us"])
    print(f"{length:>7} sdpa {row['sdpa_us'][0]:7.1f} {row['sdpa_us'][1]:7.1f} us "
          f"({kv_bytes / sdpa / 1e3 / copy:.0%} of copy)", flush=True)
    for name in names:
        best = min(row[name])
        print(f"        {name:<12} {row[name][0]:7.1f} {row[name][1]:7.1f} us  "
              f"{best / sdpa:5.3f}x sdpa  {kv_bytes / best / 1e3 / copy:.0%} of copy",
              flush=True)
    for name in ("spare_default",):
        if name in row:
            best = min(row[name])
            print(f"        {name:<12} {row[name][0]:7.1f} {row[name][1]:7.1f} us  "
                  f"{best / sdpa:5.3f}x sdpa  {kv_bytes / best / 1e3 / copy:.0%} of copy "
                  f"(pool of {spare} more blocks)", flush=True)
    print(f"        without the merge: default {row['partial_default_us']:.1f} us, "
          f"b1056 {row['partial_b1056_us']:.1f} us", flush=True)
    return row


def _reordered_views(view: Any, tuning: Any, backend: Any, queries: Any) -> dict[str, Any]:
    """``view`` with each work item's blocks sorted by physical block, and with the whole
    table sorted (the pool read front to back)."""
    from kvtrio.metal.attention import PagedAttentionView

    batch = view.as_batch()
    _, q_heads, n, _ = queries.shape
    steps = tuning.mma_warps * 16 * tuning.mma_tiles
    part = batch.part_tokens(batch.kv_heads * -(-(q_heads // batch.kv_heads * n) // 8), steps,
                             tuning.mma_blocks, tuning)
    per_item = part // view.block_size
    table = list(view.block_table)
    by_item = [b for i in range(0, len(table), per_item) for b in sorted(table[i:i + per_item])]

    def reading(order: list[int]) -> PagedAttentionView:
        return PagedAttentionView(
            arrays=view.arrays, blocks=view.blocks, block_table=tuple(order), length=view.length,
            block_size=view.block_size, bits=view.bits, group_size=view.group_size,
            direct=view.direct)

    return {f"item_sorted_{per_item}": reading(by_item), "table_sorted": reading(sorted(table))}


def _padded_view(keys: Any, values: Any, block_size: int, spare: int) -> Any:
    """Like kvtrio.bench.attention._paged_view, in a pool of ``spare`` more blocks."""
    import random

    import mlx.core as mx
    from kvtrio.metal.attention import PagedAttentionView
    from kvtrio.metal.pool import BlockPool

    _, kv_heads, length, dim = keys.shape
    blocks = -(-length // block_size)
    pool = BlockPool(blocks + spare, kv_heads, block_size, dim, dtype=keys.dtype)
    order = [pool.allocate() for _ in range(blocks + spare)]
    random.Random(length).shuffle(order)
    table = order[:blocks]
    for begin in range(0, length, 8192):
        end = min(length, begin + 8192)
        positions = range(begin, end)
        pool.write([table[p // block_size] for p in positions],
                   [p % block_size for p in positions],
                   keys[:, :, begin:end], values[:, :, begin:end])
        mx.eval(pool.arrays())
    return PagedAttentionView.capture(pool, table, length)


def _partial_only_us(view: Any, queries: Any, scale: float, backend: Any,
                     tuning: Any) -> float:
    """A chained call with the merge kernel replaced by a slice of the partials (one small
    copy): the partition kernel's share of the call."""
    from kvtrio.bench import attention as b

    real = backend.merge

    def stub() -> Any:
        def run(*, inputs: Any, output_shapes: Any, output_dtypes: Any, **_: Any) -> Any:
            partials = inputs[0]
            return [partials[:, 0, :].reshape(output_shapes[0]).astype(output_dtypes[0])]
        return run

    backend.merge = stub
    try:
        return b._median_us(
            lambda q: view.attend_direct(q, scale, None, backend, tuning), queries, 10)
    finally:
        backend.merge = real


def profile(budget: float) -> None:
    """A few unchained calls of contiguous sdpa and of the direct kernel at 128k (the default
    launch), for a profiler to read: ``ncu -k regex:"kvtrio|sdpa" python3
    tests/metal/device_session.py profile``."""
    import mlx.core as mx
    from kvtrio.metal.attention import direct_backend

    dim = 128
    shape: dict[str, Any] = {"q_heads": 32, "kv_heads": 8, "dim": dim, "dtype": mx.float16,
                             "block_size": 16}
    view, keys, values, queries = _single_views(131072, shape)
    scale = dim**-0.5
    backend = direct_backend()
    for _ in range(3):
        mx.eval(mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale))
        if backend is not None:
            mx.eval(view.attend_direct(queries, scale, None, backend))
    print("profiled", budget, flush=True)


def overhead(budget: float) -> None:
    """Where a chained call's time goes: the bench's figure (building 20 chained calls and
    evaluating them, per call), the building alone, and the evaluation alone (the calls
    built before the clock starts); for contiguous sdpa and the direct kernel."""
    import mlx.core as mx

    results: dict[str, Any] = {}
    for length in (int(x) for x in os.environ.get("KVTRIO_LENGTHS", "131072,4096").split(",")):
        results.update(_overhead_length(length))
        mx.clear_cache()
    (OUT / "overhead.json").write_text(json.dumps(results, indent=1))
    print("overhead", budget, flush=True)


def _split_times(fn: Any, queries: Any, reps: int = 10) -> dict[str, float]:
    """Per call, medians of ``reps`` rounds of 20 chained calls: the bench's figure (building
    and evaluating), the building alone and the evaluation of calls already built (us)."""
    import statistics

    import mlx.core as mx

    def chain() -> Any:
        q = queries
        for _ in range(20):
            q = fn(q)
        return q

    mx.eval(chain())
    bench, build, run = [], [], []
    for _ in range(reps):
        began = time.perf_counter()
        mx.eval(chain())
        bench.append((time.perf_counter() - began) / 20)
        began = time.perf_counter()
        out = chain()
        built = time.perf_counter()
        mx.eval(out)
        build.append((built - began) / 20)
        run.append((time.perf_counter() - built) / 20)
    return {k: statistics.median(v) * 1e6 for k, v in
            (("bench_us", bench), ("build_us", build), ("eval_us", run))}


def _pipelined_us(fn: Any, queries: Any, steps: int = 60, reps: int = 5) -> float:
    """Per step of a decode loop that builds step k+1 while step k runs (``mx.async_eval``
    of each step's output, the next step's input): median of ``reps`` loops, in us."""
    import statistics

    import mlx.core as mx

    def loop() -> float:
        q = fn(queries)
        mx.async_eval(q)
        began = time.perf_counter()
        for _ in range(steps):
            q = fn(q)
            mx.async_eval(q)
        mx.eval(q)
        return (time.perf_counter() - began) / steps * 1e6

    loop()
    return statistics.median(loop() for _ in range(reps))


def construct(budget: float) -> None:
    """What building one call costs on the host, nothing evaluated (1,000 calls each, median
    of 5 rounds, us per call; the graphs are dropped unevaluated): contiguous sdpa; the
    tensor-core partition kernel's ``mx.fast.cuda_kernel`` call as kept, the same with its
    template constants in the source instead (no template argument), and with a 100-byte
    body instead of the real header and body; the merge kernel's call;
    ``mx.fast.precompiled_cuda_kernel`` with stand-in bytes of 1k, 32k and 128k; and a
    kept launch (two calls) replayed through mx.compile. At 128k (KVTRIO_LENGTHS)."""
    import statistics

    import attrs
    import mlx.core as mx
    from kvtrio.metal import kernels_cuda
    from kvtrio.metal.attention import DEFAULT_TUNING, direct_backend

    backend = direct_backend()
    length = int(os.environ.get("KVTRIO_LENGTHS", "131072").split(",")[0])
    view, keys, values, queries = _single_views(
        length, {"q_heads": 32, "kv_heads": 8, "dim": 128, "dtype": mx.float16,
                 "block_size": 16})
    batch = view.as_batch()
    plain = attrs.evolve(DEFAULT_TUNING, compiled_launch=False)
    batch.attend_direct(queries, 128**-0.5, None, backend, plain)
    (launch,) = batch._launches.values()
    kw, mkw = launch.partial_kw, launch.merge_kw
    inputs = [queries, *launch.tail]
    baked = "".join(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = "
                    f"{str(v).lower() if isinstance(v, bool) else v};\n"
                    for k, v in kw["template"])
    flat: Any = mx.fast.cuda_kernel(
        name="kvtrio_construct_baked", input_names=["q", "keys", "values", "table"],
        output_names=["out", "normal"], source=baked + kernels_cuda.PARTIAL_MMA_SOURCE,
        header=kernels_cuda.HEADER_MMA)
    tiny: Any = mx.fast.cuda_kernel(
        name="kvtrio_construct_tiny", input_names=["q", "keys", "values", "table"],
        output_names=["out", "normal"], source="out[0] = 0.f; normal[0] = 0.f;" + " " * 60)
    no_template = {k: v for k, v in kw.items() if k != "template"}
    merge_inputs = launch.partial(inputs=inputs, **kw)

    def precompiled(size: int) -> Any:
        blob = b"\0" * size
        return lambda: mx.fast.precompiled_cuda_kernel(
            name="kvtrio_stand_in", compiled_source=blob, inputs=inputs,
            output_shapes=kw["output_shapes"], output_dtypes=kw["output_dtypes"], scalars=[],
            grid=kw["grid"], threadgroup=kw["threadgroup"])

    replay = mx.compile(launch._plain)
    replay(*inputs)
    cases: dict[str, Any] = {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(queries, keys, values,
                                                             scale=128**-0.5),
        "partial_kept": lambda: launch.partial(inputs=inputs, **kw),
        "partial_baked": lambda: flat(inputs=inputs, **no_template),
        "partial_tiny": lambda: tiny(inputs=inputs, **kw),
        "merge_kept": lambda: launch.merge(
            inputs=[merge_inputs[0], merge_inputs[1], launch.table], **mkw),
        "precompiled_1k": precompiled(1 << 10),
        "precompiled_32k": precompiled(32 << 10),
        "precompiled_128k": precompiled(128 << 10),
        "launch_plain": lambda: launch._plain(*inputs),
        "launch_compiled": lambda: replay(*inputs),
    }
    results: dict[str, list[float]] = {}
    for _ in range(5):
        for name, fn in cases.items():
            fn()
            began = time.perf_counter()
            for _ in range(1000):
                fn()
            results.setdefault(name, []).append((time.perf_counter() - began) * 1e3)
    for name, rounds in results.items():
        print(f"  build {name:<18} {statistics.median(rounds):6.2f} us per call "
              f"(rounds {min(rounds):.2f}-{max(rounds):.2f})", flush=True)
    (OUT / "construct.json").write_text(json.dumps(results, indent=1))
    print("construct", budget, flush=True)


def _old_attention() -> Any:
    """The module at ``$KVTRIO_OLD_ATTENTION`` (another tree's metal/attention.py, timed
    beside this one), or None."""
    import importlib.util

    path = os.environ.get("KVTRIO_OLD_ATTENTION")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("old_attention", path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    return old


def host(budget: float) -> None:
    """The direct call before and after the host-side work, in one process: ``old`` is the
    attention module of another tree (its path in KVTRIO_OLD_ATTENTION: it builds every call
    from scratch, two kernel calls), ``kept`` this tree's default (the launch kept per view and
    call shape, plain kernel calls), ``compiled`` the kept launch replayed through mx.compile
    (the default now), ``fused`` that with the fused merge (one kernel call); contiguous sdpa
    as the reference. Three
    alternating rounds of :func:`_split_times` and :func:`_pipelined_us` per length
    (KVTRIO_LENGTHS), the relative error of each direct output against float32 sdpa on the
    CPU, and the copy ceiling measured in the same process."""

    import attrs
    import mlx.core as mx
    from kvtrio.bench import attention as b
    from kvtrio.metal.attention import DEFAULT_TUNING, direct_backend

    began = time.time()
    backend: Any = direct_backend()
    if backend is None:  # a CPU smoke run of this script: the numpy stand-in
        from emulated_backend import EmulatedBackend

        backend = EmulatedBackend()
    old = _old_attention()
    shape: dict[str, Any] = {"q_heads": 32, "kv_heads": 8, "dim": 128, "dtype": mx.float16,
                             "block_size": 16}
    results: dict[str, Any] = {"device": str(mx.default_device())}
    results["ceilings"] = b.ceilings(int(os.environ.get("KVTRIO_CEILING_BYTES", 1 << 30)), 10)
    copy = results["ceilings"]["copy_gbs"]
    print("ceilings", json.dumps(results["ceilings"]), flush=True)
    scale = shape["dim"] ** -0.5
    for length in (int(x) for x in os.environ.get("KVTRIO_LENGTHS", "131072,4096").split(",")):
        if time.time() - began > budget * 0.8:
            break
        view, keys, values, queries = _single_views(length, shape)
        kv_bytes = keys.nbytes + values.nbytes
        calls: dict[str, Any] = {"sdpa": functools.partial(
            mx.fast.scaled_dot_product_attention, k=keys, v=values, scale=scale)}
        if old is not None:
            old_view = old.PagedAttentionView(
                arrays=view.arrays, blocks=view.blocks, block_table=view.block_table,
                length=view.length, block_size=view.block_size, bits=view.bits,
                group_size=view.group_size, direct=view.direct)
            calls["old"] = functools.partial(old_view.attend_direct, scale=scale, mask=None,
                                             backend=backend, tuning=old.DEFAULT_TUNING)
        for name, fused, compiled in (("kept", False, False), ("compiled", False, True),
                                      ("fused", True, True)):
            calls[name] = functools.partial(
                view.attend_direct, scale=scale, mask=None, backend=backend,
                tuning=attrs.evolve(DEFAULT_TUNING, fused_merge=fused,
                                    compiled_launch=compiled))
        with mx.stream(mx.cpu):
            want = mx.fast.scaled_dot_product_attention(
                queries.astype(mx.float32), keys.astype(mx.float32),
                values.astype(mx.float32), scale=scale)
            mx.eval(want)
        row: dict[str, Any] = {"tokens": length, "kv_bytes": kv_bytes, "errors": {}}
        for name, fn in calls.items():
            got = fn(queries).astype(mx.float32)
            mx.eval(got)
            with mx.stream(mx.cpu):
                row["errors"][name] = float(mx.linalg.norm((got - want).reshape(-1))
                                            / mx.linalg.norm(want.reshape(-1)))
        for _ in range(3):
            for name, fn in calls.items():
                for key, us in _split_times(fn, queries).items():
                    row.setdefault(name, {}).setdefault(key, []).append(us)
                row[name].setdefault("pipelined_us", []).append(_pipelined_us(fn, queries))
        results[str(length)] = row
        print(f"{length:>7} tokens, copy {copy:.0f} GB/s; per call: bench (3 rounds), "
              "build, eval; best bench / best sdpa; of copy; error vs float32", flush=True)
        sdpa = min(row["sdpa"]["bench_us"])
        for name in calls:
            r = row[name]
            best = min(r["bench_us"])
            print(f"  {name:<6} " + " ".join(f"{x:7.1f}" for x in r["bench_us"])
                  + f" | build {min(r['build_us']):5.1f} | eval {min(r['eval_us']):7.1f}"
                  f" | {best / sdpa:5.3f}x | {kv_bytes / best / 1e3 / copy:4.0%}"
                  f" | {row['errors'][name]:.1e}", flush=True)
        piped = min(row["sdpa"]["pipelined_us"])
        for name in calls:
            r = row[name]["pipelined_us"]
            print(f"  pipelined {name:<8} " + " ".join(f"{x:7.1f}" for x in r)
                  + f" | {min(r) / piped:5.3f}x sdpa pipelined", flush=True)
        del view, keys, values, calls
        mx.clear_cache()
    (OUT / "host.json").write_text(json.dumps(results, indent=1))


class _Stub:
    """Kernels that return preallocated outputs at once: what is left of a direct call is its
    Python share (``stubbed``)."""

    NAME = "cuda"
    TENSOR_CORES = True
    FUSED_MERGE = True

    def __init__(self) -> None:
        import mlx.core as mx

        self.outputs = [mx.zeros((4,)), mx.zeros((4,))]

    def _kernel(self, **_: Any) -> Any:
        return self.outputs

    def partial_mma(self) -> Any:
        return self._kernel

    def partial_mma_fused(self) -> Any:
        return self._kernel

    def partial(self, quantized: bool) -> Any:
        return self._kernel

    def merge(self) -> Any:
        return lambda **_: self.outputs[:1]


def stubbed(budget: float) -> None:
    """Python's share of one direct call at 128k (KVTRIO_LENGTHS), kernels stubbed (runs on
    any machine): another tree's call (KVTRIO_OLD_ATTENTION, built every call), this tree's
    kept launch with two kernel calls and fused, and a fresh capture per call (as a decode
    step captures a view per layer) plus its first call, for both trees; three alternating
    rounds, each a median of 20 x 1,000 calls (50 for captures), in us per call."""

    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    old = _old_attention()
    results: dict[str, Any] = {}
    for length in (int(x) for x in os.environ.get("KVTRIO_LENGTHS", "131072").split(",")):
        results[str(length)] = row = _stubbed_length(length, old, _Stub())
        for name, rounds in row.items():
            print(f"{length:>7} {name:<10} " + " ".join(f"{x:8.2f}" for x in rounds)
                  + " us per call", flush=True)
    (OUT / "stubbed.json").write_text(json.dumps(results, indent=1))
    print("stubbed", budget, flush=True)


def _stubbed_length(length: int, old: Any, stub: _Stub) -> dict[str, list[float]]:
    import statistics

    import attrs
    import mlx.core as mx
    from kvtrio.metal.attention import DEFAULT_TUNING, PagedAttentionView

    view, _, _, queries = _single_views(length, {"q_heads": 32, "kv_heads": 8, "dim": 128,
                                                 "dtype": mx.float16, "block_size": 16})

    class _Pool:
        block_size, bits, group_size = view.block_size, view.bits, view.group_size

        def arrays(self) -> Any:
            return view.arrays

    pool, table, scale = _Pool(), list(view.block_table), 128**-0.5

    def fresh(cls: Any, tuning: Any) -> Any:
        return cls.capture(pool, table, length).attend_direct(queries, scale, None, stub, tuning)

    calls: dict[str, tuple[Any, int]] = {}
    if old is not None:
        old_view = old.PagedAttentionView(
            arrays=view.arrays, blocks=view.blocks, block_table=view.block_table,
            length=view.length, block_size=view.block_size, bits=view.bits,
            group_size=view.group_size, direct=True)
        calls["old"] = (functools.partial(old_view.attend_direct, queries, scale, None, stub,
                                          old.DEFAULT_TUNING), 1000)
        calls["old_fresh"] = (functools.partial(fresh, old.PagedAttentionView,
                                                old.DEFAULT_TUNING), 50)
    fused = attrs.evolve(DEFAULT_TUNING, fused_merge=True)
    calls["kept"] = (functools.partial(view.attend_direct, queries, scale, None, stub), 1000)
    calls["fused"] = (functools.partial(view.attend_direct, queries, scale, None, stub,
                                        fused), 1000)
    calls["fresh"] = (functools.partial(fresh, PagedAttentionView, DEFAULT_TUNING), 50)
    row: dict[str, list[float]] = {}
    for _ in range(3):
        for name, (fn, n) in calls.items():
            fn()
            times = []
            for _ in range(20):
                began = time.perf_counter()
                for _ in range(n):
                    fn()
                times.append((time.perf_counter() - began) / n * 1e6)
            row.setdefault(name, []).append(statistics.median(times))
    return row


def _overhead_length(length: int) -> dict[str, Any]:

    import mlx.core as mx
    from kvtrio.metal.attention import direct_backend

    dim = 128
    shape: dict[str, Any] = {"q_heads": 32, "kv_heads": 8, "dim": dim, "dtype": mx.float16,
                             "block_size": 16}
    view, keys, values, queries = _single_views(length, shape)
    backend = direct_backend()
    calls: dict[str, Any] = {"sdpa": functools.partial(
        mx.fast.scaled_dot_product_attention, k=keys, v=values, scale=dim**-0.5)}
    if backend is not None:
        calls["direct"] = functools.partial(view.attend_direct, scale=dim**-0.5, mask=None,
                                            backend=backend)
    rows: dict[str, Any] = {}
    for name, fn in calls.items():
        row = _split_times(fn, queries)
        rows[f"{name}_{length}"] = row
        print(f"{length:>7} {name:<7} bench {row['bench_us']:7.1f} us = build "
              f"{row['build_us']:5.1f} + eval {row['eval_us']:7.1f} (per call)", flush=True)
    return rows


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    what, budget = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 500.0
    modes = {"tests": tests, "bench": bench, "explore": explore, "profile": profile,
             "overhead": overhead, "host": host, "stubbed": stubbed, "construct": construct}
    modes[what](budget)
