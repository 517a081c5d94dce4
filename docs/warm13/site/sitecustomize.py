# mypy: ignore-errors
"""Loaded by the servers docs/warm13/exp.py starts: KVX_NOWARM=1 turns the warm-up off."""

import os

if os.environ.get("KVX_NOWARM"):
    import kvtrio.serve.restore as restore

    restore.WARM_TOKENS = 0
