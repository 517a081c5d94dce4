# mypy: ignore-errors
"""Loaded by the servers exp14.py starts: KVX_ONECALL=1 gives the restore's warm-up main's
one model call (``batched=False``) instead of gpu14's BatchGenerator turn."""

import os

if os.environ.get("KVX_ONECALL"):
    import kvtrio.serve.restore as restore

    _warm_up = restore.warm_up
    restore.warm_up = lambda adapter, model, tokens, batched=False: _warm_up(adapter, model, tokens)
