"""Thread time slices: kvtrio's threads ask for a long slice, restore shared threads after."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.reader import Reader
from kvtrio.actors.sched import BACKGROUND_SLICE, background_slice, set_thread_slice, thread_slice
from kvtrio.actors.writer import Writer
from kvtrio.runtime.offload import CancelToken, ThreadOffload
from kvtrio.storage.format import Header


def _custom_slices_supported() -> bool:
    """Whether this kernel reports a slice set with sched_setattr (Linux >= 6.12)."""
    result: list[bool] = []

    def probe() -> None:
        before = thread_slice()
        result.append(before is not None and set_thread_slice(0.0123) and thread_slice() == 0.0123)

    thread = threading.Thread(target=probe)  # a throwaway thread: nothing to restore
    thread.start()
    thread.join()
    return result[0]


needs_slices = pytest.mark.skipif(
    not _custom_slices_supported(), reason="this kernel has no custom time slices"
)


@needs_slices
def test_background_slice_sets_the_thread_and_restores_it() -> None:
    before = thread_slice()
    inherited: list[float | None] = []
    with background_slice(0.02):
        assert thread_slice() == 0.02
        child = threading.Thread(target=lambda: inherited.append(thread_slice()))
        child.start()
        child.join()
    assert thread_slice() == before
    assert inherited == [0.02]  # storage's helper threads, started inside a job, inherit it


@needs_slices
def test_background_none_leaves_the_thread_alone() -> None:
    before = thread_slice()
    with background_slice(None):
        assert thread_slice() == before


@needs_slices
async def test_dedicated_owner_thread_asks_for_the_background_slice() -> None:
    assert BACKGROUND_SLICE is not None
    async with MlxOwner.dedicated() as owner:
        assert await owner.run(thread_slice) == BACKGROUND_SLICE
    default = thread_slice()
    async with MlxOwner.dedicated(background=None) as owner:
        assert await owner.run(thread_slice) == default


@needs_slices
async def test_io_jobs_run_on_the_slice_and_give_the_worker_back(tmp_path: Path) -> None:
    """The offload's worker threads are shared (trio's thread cache): a job restores them."""
    offload = ThreadOffload(1)
    default = await trio.to_thread.run_sync(thread_slice)
    seen: list[float | None] = []

    def spy(*args: object, **kwargs: object) -> None:
        seen.append(thread_slice())
        raise FileNotFoundError("spy")

    writer = Writer(offload, background=0.03)
    reader = Reader(offload, background=0.04)
    monkey = pytest.MonkeyPatch()
    monkey.setattr("kvtrio.actors.writer.write_single", spy)
    monkey.setattr("kvtrio.actors.reader.read_tensors", spy)
    try:
        plan = Header(layout="single", tokens=(), caches=(), created_at=0.0)
        with pytest.raises(FileNotFoundError, match=r"^spy$"):
            await writer.write_single(str(tmp_path / "x.kvc"), plan, [])
        with pytest.raises(FileNotFoundError, match=r"^spy$"):
            await reader.read_tensors(None, [], verify=True)  # type: ignore[arg-type]
    finally:
        monkey.undo()
    assert seen == [0.03, 0.04]

    def after(token: CancelToken) -> float | None:
        return thread_slice()

    assert await offload.run(after) == default
