"""A server stand-in for the shutdown drill: saves caches in a loop until signalled.

Usage: ``python shutdown_child.py DIRECTORY``. Prints ``READY`` once serving, then
``ACK <key> <sha256>`` for every save the tier acknowledged as WRITTEN (durable), where
the digest covers the saved tensor bytes, and ``STOPPING`` once it has seen the first
signal (send the second one after that: two signals that arrive before trio reads the
first are delivered as one). The first SIGTERM/SIGINT stops new saves and
lets the tier drain (graceful, exit 0); a second one cancels everything (exit 1).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from typing import Any

import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.tier import ColdTier

LAYERS, HEADS, TOKENS, HEAD_DIM = 4, 8, 1500, 128


def make_tensor(seed: int, layer: int, which: int) -> Any:
    """One deterministic float16 tensor of a layer's cache, evaluated (owner thread).

    One tensor per owner job, like a server's model steps: a started job always finishes,
    and the second signal's exit waits for the job in flight (MLX work cannot be
    interrupted). ``uniform`` keeps a job at about 40 ms here; ``normal`` took 150 ms per
    tensor, 300 ms per layer, and up to 0.9 s under load, most of the forced exit's time.
    """
    import mlx.core as mx

    key = mx.random.key((seed * 1000 + layer) * 2 + which)
    array: Any = mx.random.uniform(shape=(1, HEADS, TOKENS, HEAD_DIM), dtype=mx.float16, key=key)
    mx.eval(array)
    return array


def make_layer(keys: Any, values: Any, digest: Any) -> Any:
    """A layer's KV cache from its two tensors; its live bytes go into ``digest`` (owner)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache: Any = KVCache()
    cache.update_and_fetch(keys, values)
    for array in (cache.keys, cache.values):
        live: Any = mx.contiguous(array[..., : cache.offset, :])
        mx.eval(live)
        digest.update(memoryview(live))
    return cache


async def make_caches(owner: MlxOwner, seed: int) -> tuple[list[Any], str]:
    """Deterministic KV caches and the sha256 of their live bytes."""
    digest = hashlib.sha256()
    caches: list[Any] = []
    for layer in range(LAYERS):
        keys = await owner.run(make_tensor, seed, layer, 0)
        values = await owner.run(make_tensor, seed, layer, 1)
        caches.append(await owner.run(make_layer, keys, values, digest))
    return caches, digest.hexdigest()


def say(line: str) -> None:
    print(line, flush=True)


async def main(directory: str) -> int:
    forced = False
    async with MlxOwner.dedicated() as owner:
        with (
            trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
            trio.CancelScope() as everything,
        ):
            stop_saving = trio.Event()
            async with trio.open_nursery() as outer:

                async def watch() -> None:
                    nonlocal forced
                    async for _ in signals:
                        if not stop_saving.is_set():
                            stop_saving.set()  # first signal: graceful
                            say("STOPPING")  # a second signal now cannot coalesce with it
                        else:
                            forced = True  # second signal: cancel everything now
                            everything.cancel()

                outer.start_soon(watch)
                async with ColdTier.open(directory, owner=owner, shutdown_grace=20) as tier:

                    async def acknowledge(ticket: Any, digest: str) -> None:
                        if (await ticket.wait()).written:
                            say(f"ACK {ticket.key} {digest}")

                    async with trio.open_nursery() as acks:
                        say("READY")
                        pending: list[Any] = []
                        n = 0
                        while not stop_saving.is_set():
                            caches, digest = await make_caches(owner, n)
                            ticket = await tier.save(f"k{n}", list(range(TOKENS)), caches)
                            acks.start_soon(acknowledge, ticket, digest)
                            pending = [t for t in pending if not t.settled] + [ticket]
                            while len(pending) >= 3 and not stop_saving.is_set():
                                with trio.move_on_after(0.05):
                                    await pending[0].wait()
                                pending = [t for t in pending if not t.settled]
                            n += 1
                    # Leaving the tier's block drains what is still queued (graceful).
                outer.cancel_scope.cancel()
    return 1 if forced else 0


if __name__ == "__main__":
    status = trio.run(main, sys.argv[1])
    if status:
        # Forced: everything was cancelled, every thread joined, every file closed. Skip the
        # interpreter's teardown (freeing each MLX buffer one by one takes about half a
        # second on a busy machine), as a server's second-signal exit would.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
