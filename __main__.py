"""``python -m kvtrio``: the same as the ``kvtrio`` console script."""

from __future__ import annotations

from kvtrio.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
