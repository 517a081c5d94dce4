# mypy: ignore-errors
"""One round of ``kvtrio bench serve``'s spill phase in its own bench process, ordered as the
bench's round R (gpu16, issue 17; spill15.py unchanged).

Usage: python3 spill16.py R bench serve --json ... --phases spill --spill-rounds 1

The bench's :func:`round_order` is patched so its round 0 is round R (the server order
reversed every other round, as one bench run of several rounds has it); everything else
is the bench as installed (kvtrio's CLI). One bench process per round keeps every round's
JSON when a later one is cut by the call's time limit.
"""

import signal
import sys

import kvtrio.bench.serve_spill as serve_spill
from kvtrio.cli import main

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped by `running`
offset = int(sys.argv[1])
_order = serve_spill.round_order
serve_spill.round_order = lambda names, r: _order(names, r + offset)
raise SystemExit(main(sys.argv[2:]))
