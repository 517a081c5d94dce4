"""storage/hashpool.py: the one helper-thread hasher of save, load and Redis reads.

The guarantee it exists for (docs/design.md invariant 6: no thread is abandoned while it
holds the caller's buffers): however a batch's ``with`` block is left -- normally, by an
error, by a cancellation -- no job is still running when it has been left.
"""

from __future__ import annotations

import threading
import time

import pytest
import xxhash
from kvtrio.errors import OperationCancelled
from kvtrio.storage.hashpool import HashPool


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvtrio-test-hash")]


def test_one_thread_feeds_a_streaming_hash_in_order() -> None:
    chunks = [bytes([i]) * 100_000 for i in range(32)]
    hasher = xxhash.xxh3_64()
    with HashPool(1, name="kvtrio-test-hash") as pool, pool.batch() as batch:
        for chunk in chunks:
            batch.submit(hasher.update, chunk)
    assert hasher.hexdigest() == xxhash.xxh3_64(b"".join(chunks)).hexdigest()
    assert _helpers() == []


def test_no_threads_hash_inline() -> None:
    ran: list[str] = []
    with HashPool(0) as pool, pool.batch() as batch:
        assert batch.inline
        batch.submit(lambda: ran.append(threading.current_thread().name))
        assert ran == [threading.current_thread().name]  # at once, on this thread


def test_wait_raises_the_first_failure_in_order_after_every_job() -> None:
    finished: list[int] = []

    def job(index: int) -> None:
        time.sleep(0.02 * (5 - index))  # later jobs finish first
        finished.append(index)
        if index in (3, 1):
            raise ValueError(f"job {index}")

    with HashPool(4, name="kvtrio-test-hash") as pool:
        batch = pool.batch()
        for index in range(5):
            batch.submit(job, index)
        with pytest.raises(ValueError, match=r"^job 1$"):
            batch.wait()
        assert sorted(finished) == [0, 1, 2, 3, 4]
        batch.wait()  # the batch is empty again: nothing left to raise


@pytest.mark.parametrize("error", [OperationCancelled("cancelled"), KeyError("boom")])
def test_leaving_on_an_error_waits_for_the_running_job(error: BaseException) -> None:
    """A cancellation (or any error) while a job runs: the with block is left only after
    the job has finished reading, and jobs not started never start."""
    started = threading.Event()
    ran: list[str] = []

    def slow() -> None:
        started.set()
        time.sleep(0.2)
        ran.append("slow")

    with HashPool(1, name="kvtrio-test-hash") as pool:
        with pytest.raises(type(error)):
            with pool.batch() as batch:
                batch.submit(slow)
                batch.submit(ran.append, "queued")
                assert started.wait(5)
                raise error
        assert ran == ["slow"]


def test_a_failing_job_does_not_hide_the_error_that_left_the_block() -> None:
    def bad() -> None:
        raise ValueError("hash job failed")

    with HashPool(1) as pool:
        with pytest.raises(OperationCancelled):
            with pool.batch() as batch:
                batch.submit(bad)
                time.sleep(0.05)
                raise OperationCancelled("cancelled")


def test_close_joins_the_threads() -> None:
    pool = HashPool(3, name="kvtrio-test-hash")
    with pool.batch() as batch:
        for _ in range(6):
            batch.submit(time.sleep, 0.01)
    assert _helpers()
    pool.close()
    assert _helpers() == []
    pool.close()  # idempotent


def test_negative_thread_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^threads must be >= 0, not -1$"):
        HashPool(-1)
