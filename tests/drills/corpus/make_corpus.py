"""Write the hostile-file corpus: one crafted file per validation rule, plus expected.json.

Run from the repository root: ``.venv/bin/python tests/drills/corpus/make_corpus.py``.
The files are built by :func:`kvtrio.drills.hostile_corpus.build_corpus` from a synthetic cache
(deterministic: fixed tokens, bytes and ``created_at``), so rerunning it rewrites the
same bytes unless the format changed. Manifests (``*.manifest``) need the blocks of the
base entry, which the test writes again with :mod:`kvtrio.drills.workload`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from kvtrio.drills.hostile_corpus import build_corpus
from kvtrio.drills.workload import CacheDir

HERE = Path(__file__).resolve().parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cases = build_corpus(CacheDir(tmp).make())
    expected = {}
    for old in HERE.glob("*.kvc"):
        old.unlink()
    for old in HERE.glob("*.manifest"):
        old.unlink()
    for case in cases:
        name = f"{case.name}.{'kvc' if case.layout == 'single' else 'manifest'}"
        (HERE / name).write_bytes(case.data)
        expected[name] = {"rule": case.rule, "error": case.error, "prefix": case.prefix}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(cases)} hostile files to {HERE}")


if __name__ == "__main__":
    main()
