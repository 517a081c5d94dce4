"""A benchmark's count or length it cannot measure is a usage error (exit 2), refused by
the parser before anything runs (``kvtrio.bench.argtypes``)."""

from __future__ import annotations

import pytest
from kvtrio.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--phases", "restart", "--lengths", "-5"],  # was measured as a length
        ["serve", "--phases", "restart", "--lengths", "abc"],  # a ValueError traceback
        ["serve", "--phases", "restart", "--lengths", ","],
        ["serve", "--phases", "restart", "--restart-rounds", "0"],  # an IndexError
        ["serve", "--phases", "restart", "--model", "."],  # no model: died at the start
        ["storage", "--rounds", "0"],  # "no median for empty data"
        ["scale", "--sizes", "abc"],
        ["scale", "--sizes", "-5"],  # a child process's traceback
        ["reuse", "--repeats", "0"],
        ["runtime", "--messages", "-1"],  # never ended
        ["runtime", "--rounds", "0"],
        ["attention", "--lengths", "abc"],
        ["tier", "--size-mib", "0"],
        ["tier", "--tensors", "-1"],
    ],
)
def test_a_bench_value_it_cannot_measure_is_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2
