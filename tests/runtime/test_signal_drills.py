"""Subprocess drills: a process running an ActorSystem under SIGTERM.

The first SIGTERM drains (exit 0, nothing accepted is lost); a second one cancels at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

APP = Path(__file__).with_name("signal_drill_app.py")


def _start(messages: int, seconds: float, grace: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(APP), str(messages), str(seconds), str(grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_sigterm_drains_accepted_messages_and_exits_zero() -> None:
    """Drill: SIGTERM mid-work -> every accepted message is handled, exit status 0."""
    proc = _start(messages=20, seconds=0.02, grace=30.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (0, "handled=20 dropped=0 signal=SIGTERM\n", "")


def test_second_sigterm_cancels_promptly() -> None:
    """Drill: a drain that would take 100 s is cut short by the second SIGTERM."""
    proc = _start(messages=10, seconds=10.0, grace=600.0)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    # Signals that arrive together may coalesce into one, so repeat until the process ends.
    while proc.poll() is None and time.monotonic() - sent < 10.0:
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 5.0
    assert (proc.returncode, out, err) == (1, "handled=0 dropped=10 signal=SIGTERM\n", "")
