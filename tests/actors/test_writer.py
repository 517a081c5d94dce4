"""Writer: the write path option (``direct``) reaches storage unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.writer import Writer
from kvtrio.runtime.offload import InlineOffload
from kvtrio.storage.format import Header
from kvtrio.storage.writer import Segmented

PAGE = 4096


async def _direct_used(tmp_path: Path, tensors: list[Segmented], **options: Any) -> object:
    seen: list[object] = []

    def spy(*args: object, direct: object = "unset", **kwargs: object) -> None:
        seen.append(direct)
        raise FileNotFoundError("spy")

    writer = Writer(InlineOffload(), background=None, **options)
    plan = Header(layout="single", tokens=(), caches=(), created_at=0.0)
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr("kvtrio.actors.writer.write_single", spy)
        with pytest.raises(FileNotFoundError, match=r"^spy$"):
            await writer.write_single(str(tmp_path / "x.kvc"), plan, tensors)
    return seen[0]


async def test_the_default_leaves_the_write_path_to_storage(tmp_path: Path) -> None:
    """``direct=None`` is forwarded as is, whatever the segments' alignment: storage picks."""
    cut: list[Segmented] = [[memoryview(bytes(PAGE + 256)), memoryview(bytes(PAGE))]]
    assert await _direct_used(tmp_path, cut) is None


@pytest.mark.parametrize("direct", [True, False])
async def test_an_explicit_choice_is_forwarded(tmp_path: Path, direct: bool) -> None:
    cut: list[Segmented] = [[memoryview(bytes(PAGE + 256)), memoryview(bytes(PAGE))]]
    assert await _direct_used(tmp_path, cut, direct=direct) is direct
