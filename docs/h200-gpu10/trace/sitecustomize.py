# mypy: ignore-errors
"""Loaded by Python at start when this folder is on PYTHONPATH: with KVTRIO_TRACE_DIR set,
a server process (its command line has --port) records its timings (gpu10trace)."""

import os

if os.environ.get("KVTRIO_TRACE_DIR"):
    try:
        import gpu10trace

        gpu10trace.install()
    except Exception as exc:
        print("gpu10trace: not installed:", exc, flush=True)
