# mypy: ignore-errors
"""With ``PYTHONPATH=docs/stall13`` and ``STALL13_OUT=DIR``: every ``kvtrio bench scale``
child that makes a timed open (``--child-open``) records what :mod:`gc_probe` records and
writes it to ``DIR/<pid>.json`` at exit, so the bench's own run is probed unchanged."""

import os
import sys

if "--child-open" in sys.argv and os.environ.get("STALL13_OUT"):
    import atexit
    import json

    import gc_probe

    _REC = gc_probe._install()

    def _dump():
        path = os.path.join(os.environ["STALL13_OUT"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({**_REC, "argv": sys.argv}, f)

    atexit.register(_dump)
