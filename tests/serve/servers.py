"""Start ``kvtrio serve`` or plain ``mlx_lm.server`` on 127.0.0.1 for the serve tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import attrs

START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class Server:
    process: subprocess.Popen[str]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"server did not exit; log:\n{self.log.read_text()}") from None

    def output(self) -> str:
        return self.log.read_text()


def _wait_listening(process: subprocess.Popen[str], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited {process.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError(f"server did not listen within {START_TIMEOUT}s:\n{log.read_text()}")


def _wait_line(process: subprocess.Popen[str], line: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while line not in log.read_text():
        if process.poll() is not None:
            raise AssertionError(f"server exited {process.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {line!r} within {START_TIMEOUT}s:\n{log.read_text()}")
        time.sleep(0.05)


def _start(argv: Sequence[str], port: int, log: Path, ready: str | None = None) -> Server:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    out: IO[str] = log.open("w")
    process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    out.close()
    _wait_listening(process, port, log)
    if ready is not None:
        _wait_line(process, ready, log)
    return Server(process, port, log)


def wait_line(server: Server, line: str) -> None:
    """Wait until ``server``'s output holds ``line`` (AssertionError past START_TIMEOUT)."""
    _wait_line(server.process, line, server.log)


#: What ``kvtrio serve`` prints once its cold tier is open (it opens in the background).
COLD_READY = "kvtrio serve: cold tier ready"


def start_kvtrio(
    model: Path,
    cache_dir: Path,
    log: Path,
    *extra: str,
    port: int | None = None,
    wait_cold: bool = True,
) -> Server:
    """``kvtrio serve`` listening, and (``wait_cold``) its cold tier open."""
    port = port or free_port()
    argv = [sys.executable, "-m", "kvtrio", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--cache-dir", str(cache_dir), "--log-level", "WARNING"]
    return _start([*argv, *extra], port, log, COLD_READY if wait_cold else None)


def start_mlx_lm(model: Path, log: Path, *extra: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
    argv += ["--port", str(port), "--log-level", "WARNING"]
    return _start([*argv, *extra], port, log)


def exit_summary(server: Server) -> dict[str, int]:
    """The counters ``kvtrio serve`` prints when it stops."""
    match = re.search(
        r"RAM entries written: (\d+), hot hits (\d+), cold hits (\d+), misses (\d+), "
        r"disk loads set aside (\d+), lookups before the cold tier was open (\d+)",
        server.output(),
    )
    assert match is not None, server.output()
    names = ("spilled", "hits_hot", "hits_cold", "misses", "prefetches", "before_open")
    return dict(zip(names, map(int, match.groups()), strict=True))


def exit_wear(server: Server) -> dict[str, float]:
    """The disk wear ``kvtrio serve`` prints when it stops."""
    match = re.search(
        r"disk wear \(bytes written (\d+), bytes read (\d+), bytes read back (\d+), "
        r"reuse ratio ([\d.]+), admitted (\d+), refused (\d+), bytes refused (\d+)\)",
        server.output(),
    )
    assert match is not None, server.output()
    names = ("written", "read", "reused", "ratio", "admitted", "refused", "bytes_refused")
    return dict(zip(names, map(float, match.groups()), strict=True))
