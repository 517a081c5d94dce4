"""A child process for tests/actors/test_dirlock.py: open a tiered cache on a directory,
say so on stdout, then on each stdin line act on it.

    python lock_host.py DIR LOCK_TIMEOUT

Prints ``opened <pid>`` once open (or ``locked <holder pid> <directory>`` when the lock
stays held past LOCK_TIMEOUT: DirectoryLockedError), then reads commands:
``insert N`` (a write-through insert of prompt N; answers ``inserted N``), ``count``
(answers ``entries <cold entries>``), ``close`` (flushes and exits, answering ``closed``).
"""

from __future__ import annotations

import random
import sys

import trio


def _prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(512) for _ in range(90)]


async def main(directory: str, lock_timeout: float) -> None:
    from kvtrio.actors.owner import MlxOwner
    from kvtrio.actors.prefix import ModelKey
    from kvtrio.actors.tiered import WritePolicy, open_tiered_cache
    from kvtrio.errors import DirectoryLockedError
    from kvtrio.tinymodel import build_tiny_model, make_caches, prefill

    tiny = build_tiny_model(seed=5)
    stdin = trio.wrap_file(sys.stdin)
    async with MlxOwner.inline() as owner:
        try:
            async with open_tiered_cache(
                directory,
                ModelKey(tiny.model_id, tiny.fingerprint),
                owner=owner,
                hot_budget=1 << 30,
                cold_budget=1 << 40,
                policy=WritePolicy.WRITE_THROUGH,
                block_size=64,
                lock_timeout=lock_timeout,
            ) as cache:
                print(f"opened {__import__('os').getpid()}", flush=True)
                async for line in stdin:
                    command, *rest = line.split()
                    if command == "insert":
                        n = int(rest[0])
                        caches = make_caches(tiny)
                        prefill(tiny, caches, _prompt(n))
                        await cache.insert(_prompt(n), caches)
                        print(f"inserted {n}", flush=True)
                    elif command == "count":
                        await cache.wait_writes_settled()
                        print(f"entries {cache.statistics().cold_entries}", flush=True)
                    elif command == "close":
                        break
            print("closed", flush=True)
        except DirectoryLockedError as exc:
            print(f"locked {exc.holder_pid} {exc.directory}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], float(sys.argv[2]))
