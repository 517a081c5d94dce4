"""Writer: which storage write path a save takes (page-aligned segments or not)."""

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


async def test_page_aligned_segments_keep_storages_default_path(tmp_path: Path) -> None:
    aligned: list[Segmented] = [
        [memoryview(bytes(2 * PAGE)), memoryview(bytes(PAGE + 10))],  # the tail may be short
        memoryview(bytes(100)),  # one buffer: nothing to cut
    ]
    assert await _direct_used(tmp_path, aligned) is None


async def test_segments_that_cut_a_page_keep_storages_default_path_too(tmp_path: Path) -> None:
    """Storage's buffered path is no longer slower for them (tails padded before writeback)."""
    cut: list[Segmented] = [[memoryview(bytes(PAGE + 256)), memoryview(bytes(PAGE))]]
    assert await _direct_used(tmp_path, cut) is None


async def test_an_explicit_choice_wins(tmp_path: Path) -> None:
    cut: list[Segmented] = [[memoryview(bytes(PAGE + 256)), memoryview(bytes(PAGE))]]
    assert await _direct_used(tmp_path, cut, direct=False) is False
