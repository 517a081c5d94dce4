"""ColdTier on a redis:// URL: blocks and manifests in Redis, shared by two tiers."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.tier import ColdTier
from kvtrio.bench.redis_server import server_binary
from kvtrio.errors import CacheMissError

Prefill = Callable[[Sequence[int]], list[Any]]
Dump = Callable[[Sequence[Any]], list[bytes]]
REDIS_SERVER = server_binary()
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server binary"),
]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A private redis-server (no persistence) on a free loopback port."""
    pytest.importorskip("redis")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert REDIS_SERVER is not None
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
            "--save", "", "--appendonly", "no"]  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0?prefix=kvtrio-tier-test"
    finally:
        process.terminate()
        process.wait(10)


async def test_two_tiers_share_caches_through_redis(
    redis_url: str, prefilled: Prefill, kv_bytes: Dump
) -> None:
    tokens = list(range(1, 200))
    async with ColdTier.open(redis_url, layout="blocks") as writer_host:
        caches = await writer_host.owner.run(prefilled, tokens)
        want = await writer_host.owner.run(kv_bytes, caches)
        result = await (await writer_host.save("shared", tokens, caches)).wait()
        assert result.written and result.write is not None
        assert result.write.new_block_bytes > 0
    async with ColdTier.open(redis_url, layout="blocks") as reader_host:
        assert [e.key for e in await reader_host.list()] == ["shared"]
        loaded = await reader_host.load("shared")
        assert await reader_host.owner.run(kv_bytes, loaded.caches) == want
        assert await reader_host.delete("shared") > 0
        with pytest.raises(CacheMissError, match=r"^cold tier has no entry 'shared'$"):
            await reader_host.load("shared")
    assert reader_host.statistics().snapshots.live == 0


async def test_a_redis_tier_needs_the_blocks_layout(redis_url: str) -> None:
    with pytest.raises(ValueError, match=r"^a Redis cold tier stores blocks: use layout='blocks'$"):
        async with ColdTier.open(redis_url):
            pass
