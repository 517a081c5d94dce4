"""``kvtrio serve --redis URL``: the cold tier in a test-owned redis-server, shared by two
server processes that have cache directories of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtrio.serve.modeldir import write_tiny_model_dir
from kvtrio.tests.redis.conftest import RedisServer
from kvtrio.tests.serve.servers import exit_summary, start_kvtrio

pytest.importorskip("openai")

TURN1 = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly. " * 3},
    {"role": "user", "content": "What is the capital of France?"},
]


def _chat(client: Any, messages: list[dict[str, str]]) -> tuple[Any, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model="default_model", messages=messages, temperature=0.0, max_tokens=6
    )
    return raw, raw.parse()


def test_a_second_server_on_another_cache_dir_gets_a_cold_hit_from_redis(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    import redis

    db = redis.Redis(host="127.0.0.1", port=redis_server.port, db=0)
    db.flushall()
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    model_dir = write_tiny_model_dir(tmp_path / "model")

    first = start_kvtrio(model_dir, tmp_path / "cache-a", tmp_path / "a.txt", "--redis", url)
    raw, one = _chat(first.client(), TURN1)
    assert raw.headers["X-Kvtrio-Cache"] == "miss"
    assert first.stop() == 0, first.output()
    assert exit_summary(first)["spilled"] >= 1
    assert db.dbsize() > 0

    turn2 = [
        *TURN1,
        {"role": "assistant", "content": one.choices[0].message.content or ""},
        {"role": "user", "content": "And of Italy?"},
    ]
    # The warm restart off: it would load the entry back into RAM before turn 2 (a hot
    # hit, served from Redis all the same); this test is of the lookup's own Redis load.
    second = start_kvtrio(
        model_dir, tmp_path / "cache-b", tmp_path / "b.txt", "--redis", url, "--restore-bytes", "0"
    )
    raw, two = _chat(second.client(), turn2)
    assert second.stop() == 0, second.output()
    assert raw.headers["X-Kvtrio-Cache"] == "cold"
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens and exit_summary(second)["hits_cold"] == 1
    for directory in (tmp_path / "cache-a", tmp_path / "cache-b"):  # nothing went to disk
        assert not directory.exists() or not any(p.is_file() for p in directory.rglob("*"))
