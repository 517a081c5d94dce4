# mypy: ignore-errors
"""One cold load in process, read with N streams, against mlx-lm's own load (load13).

    python docs/load13/ab.py SHAPE TOKENS ROUNDS naive,1,2,4

SHAPE as ``kvtrio.bench.loadcost``'s (smollm2-135m, tiny). One entry is saved in a
blocks-layout ColdTier (256-token blocks, as kvtrio serve's) and with mlx-lm's
``save_prompt_cache``; each round loads it once per kind, the order reversed every other
round: ``naive`` (``load_prompt_cache``, then ``mx.eval``), or N (``ColdTier.load`` with
``load_streams`` N, every block's sha256 checked, then ``mx.eval``). Prints per-kind
medians and quartiles in ms and each against naive's median.
"""

import gc
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import trio
from kvtrio.actors.tier import ColdTier
from kvtrio.bench.loadcost import make_caches
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache


async def main(shape: str, tokens: int, rounds: int, kinds: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        async with ColdTier.open(
            d + "/t", layout="blocks", block_tokens=256, io_threads=8
        ) as tier:
            caches = make_caches(tokens, shape=shape)
            await (await tier.save("e", list(range(tokens)), caches)).wait()
            save_prompt_cache(d + "/n.safetensors", caches)
            del caches
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for r in range(rounds):
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    gc.collect()
                    mx.clear_cache()
                    start = time.perf_counter()
                    if kind == "naive":
                        got = load_prompt_cache(d + "/n.safetensors")
                        mx.eval([c.state for c in got])
                    else:
                        tier.load_streams = int(kind)
                        got = (await tier.load("e")).caches
                        mx.eval([c.state for c in got])
                    times[kind].append(time.perf_counter() - start)
                    del got
    naive = statistics.median(times["naive"]) if "naive" in times else None
    for kind in kinds:
        q = statistics.quantiles(times[kind], n=4)
        m = statistics.median(times[kind])
        versus = f" {m / naive:.2f}x naive" if naive else ""
        print(
            f"{shape} {tokens} {kind}: median {m * 1e3:.2f} ms "
            f"(q {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}){versus}"
        )


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","))
