# mypy: ignore-errors
"""`python3 .gpu11/benchrun.py bench serve ARGS`: kvtrio's CLI (from whichever tree is on
PYTHONPATH), with the spill phase's per-round check also keeping S's gaps: every "during"
gap (ms, in arrival order), the 5 largest, and the quiet stream's p99/max. No other change:
bench/serve.py's _spill_round is wrapped, its figures untouched."""

import sys

from kvtrio.bench import serve as bs

_orig = bs._spill_round


def _spill_round(*a, **k):
    alone, during, check = _orig(*a, **k)
    check["gaps_ms_during"] = [round(1e3 * g, 2) for g in during]
    check["top5_ms_during"] = sorted(check["gaps_ms_during"], reverse=True)[:5]
    check["itl_max_ms_quiet"] = 1e3 * max(alone, default=float("nan"))
    check["itl_p99_ms_quiet_round"] = 1e3 * bs.pct(alone, 0.99)
    check["samples_quiet"] = len(alone)
    return alone, during, check


bs._spill_round = _spill_round
from kvtrio.cli import main  # noqa: E402

raise SystemExit(main(sys.argv[1:]))
