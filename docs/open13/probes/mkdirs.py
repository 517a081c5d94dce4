# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
import sys
from pathlib import Path

from kvtrio.bench import scale

for n in map(int, sys.argv[2:]):
    d = Path(sys.argv[1]) / f"n{n}"
    scale._populate(d, n)
    print(n, scale._child(d, n, 200, False, scale.TOKENS)["rebuild_s"])
