"""Write what you can read (issue 15, items 1 and 7): a save refuses what load would refuse.

Each test states a boundary a caller crossed on the landed code: a wrong token count, a
rounded float token, an id the reader rejects, a meta value of the wrong type, a file cut
by one byte. Every refusal is a typed kvtrio error and leaves nothing on disk.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kvtrio
import numpy as np
import pytest
from kvtrio.api import import_mlx_lm
from kvtrio.errors import (
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    InvalidInputError,
)
from kvtrio.storage.cacheio import AttachmentData

from .conftest import BUILDERS, make_kv, mlx_cache


def _nothing_written(tmp_path: Path) -> None:
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []


@pytest.mark.parametrize("layout", ["single", "blocks"])
def test_tokens_must_equal_the_cache_offset(tmp_path: Path, layout: Any) -> None:
    cache = make_kv([100])
    with pytest.raises(
        CacheMismatchError,
        match=r"^caches\[0\]\.offset: the kv cache holds 100 tokens, 3 tokens were given$",
    ):
        kvtrio.save_cache(tmp_path / "c.kvt", [1, 2, 3], [cache], layout=layout)
    _nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("kind", "n_tokens"),
    [
        ("rotating_wrapped", 203),  # offset counts every token seen, not the window
        ("chunked", 81),  # offset counts the tokens trimmed from the front too
        ("quantized", 71),
        ("list", 20),  # the KV child's offset; the SSM state child holds any count
    ],
)
def test_tokens_vs_offset_stated_per_kind(tmp_path: Path, kind: str, n_tokens: int) -> None:
    cache = BUILDERS[kind]()
    with pytest.raises(CacheMismatchError, match=r"offset: the .* holds"):
        kvtrio.save_cache(tmp_path / "c.kvt", list(range(n_tokens - 1)), [cache])
    _nothing_written(tmp_path)
    kvtrio.save_cache(tmp_path / "c.kvt", list(range(n_tokens)), [cache])
    assert len(kvtrio.load_cache(tmp_path / "c.kvt").tokens) == n_tokens


def test_ssm_state_alone_holds_any_token_count(tmp_path: Path) -> None:
    kvtrio.save_cache(tmp_path / "c.kvt", [4, 5, 6], [BUILDERS["arrays"]()])
    assert list(kvtrio.load_cache(tmp_path / "c.kvt").tokens) == [4, 5, 6]


def test_float_tokens_are_refused_not_rounded(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"^tokens\[0\]: expected an int, got float$"):
        kvtrio.save_cache(tmp_path / "c.kvt", [1.5, 2.5], [make_kv([2])])  # type: ignore[list-item]
    _nothing_written(tmp_path)


def test_token_of_2_to_the_31_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidInputError, match=r"^tokens\[1\]: 2147483648 is outside \[0, 2147483647\]$"
    ):
        kvtrio.save_cache(tmp_path / "c.kvt", [1, 2**31], [make_kv([2])])
    _nothing_written(tmp_path)


def test_numpy_token_ids_are_ints(tmp_path: Path) -> None:
    tokens = np.array([3, 4], dtype=np.int64)
    kvtrio.save_cache(tmp_path / "c.kvt", tokens, [make_kv([2])])  # type: ignore[arg-type]
    assert list(kvtrio.load_cache(tmp_path / "c.kvt").tokens) == [3, 4]


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"model_id": 5}, r"^meta\['model_id'\]: expected a str, got int$"),
        (
            {"config_fingerprint": b"x"},
            r"^meta\['config_fingerprint'\]: expected a str, got bytes$",
        ),
        ({"note": 1}, r"^meta\['note'\]: expected a str, got int$"),
        ({"model_id": "m" * 5000}, r"^meta\['model_id'\]: string of 5000 chars, over the cap"),
    ],
)
def test_meta_the_reader_would_refuse_is_refused(
    tmp_path: Path, meta: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        kvtrio.save_cache(tmp_path / "c.kvt", [1], [make_kv([1])], meta=meta)
    _nothing_written(tmp_path)


@pytest.mark.parametrize("layout", ["single", "blocks"])
def test_header_the_reader_refuses_is_never_written(tmp_path: Path, layout: Any) -> None:
    # An attachment's metadata value of the wrong type passes through the snapshot into
    # the header; the writer's own run of the reader's rules refuses it, naming the field.
    # "blocks" is write_blocks, the writer of the tier and of the Redis store too.
    attachment = AttachmentData(schema="s", metadata={"k": 7}, arrays=())  # type: ignore[dict-item]
    with pytest.raises(
        InvalidInputError, match=r"^attachments\[0\]\.metadata\.k: expected a string$"
    ):
        kvtrio.save_cache(
            tmp_path / "c.kvt",
            [1],
            [make_kv([1])],
            meta={"attachments": [attachment]},
            layout=layout,
        )
    _nothing_written(tmp_path)


def test_load_cache_expect_must_be_an_expect(tmp_path: Path) -> None:
    kvtrio.save_cache(tmp_path / "c.kvt", [1], [make_kv([1])])
    with pytest.raises(InvalidInputError, match=r"^expect: expected an Expect, got str$"):
        kvtrio.load_cache(tmp_path / "c.kvt", expect="m")  # type: ignore[arg-type]


def test_load_cache_of_a_missing_file_is_a_cache_miss(tmp_path: Path) -> None:
    with pytest.raises(CacheMissError, match=r"^no cache file at "):
        kvtrio.load_cache(tmp_path / "absent.kvt")


def test_file_truncated_by_one_byte_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "c.kvt"
    kvtrio.save_cache(path, list(range(302)), [make_kv()])
    size = path.stat().st_size
    os.truncate(path, size - 1)
    with pytest.raises(
        CorruptCacheError, match=r"^header: the file is \d+ bytes, its header implies"
    ):
        kvtrio.load_cache(path)


def test_file_with_trailing_bytes_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "c.kvt"
    kvtrio.save_cache(path, [1], [make_kv([1])])
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCacheError, match=r"^header: the file is \d+ bytes"):
        kvtrio.load_cache(path)


def test_manifest_with_trailing_bytes_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "c.kvt"
    kvtrio.save_cache(path, [1], [make_kv([1])], layout="blocks")
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCacheError, match=r"^header: the manifest is \d+ bytes"):
        kvtrio.load_cache(path)


def test_import_mlx_lm_refuses_tokens_that_disagree_with_the_cache(tmp_path: Path) -> None:
    src = tmp_path / "p.safetensors"
    mlx_cache.save_prompt_cache(str(src), [make_kv([4])], {"model": "m"})
    with pytest.raises(CacheMismatchError):
        import_mlx_lm(src, tmp_path / "p.kvt", tokens=[1, 2])
    assert not (tmp_path / "p.kvt").exists()


# -- item 3: only regular files are read, a FIFO never blocks


@contextmanager
def _unblock_fifo_after(path: Path, seconds: float) -> Iterator[None]:
    """A regression must fail, not hang: after ``seconds`` a writer opens the FIFO."""
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(seconds):
            os.close(os.open(path, os.O_RDWR))

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_a_fifo_is_a_miss_at_once_not_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "c.kvt"
    os.mkfifo(fifo)
    start = time.monotonic()
    with _unblock_fifo_after(fifo, 10.0), pytest.raises(CacheMissError, match=r"regular file$"):
        kvtrio.load_cache(fifo)
    assert time.monotonic() - start < 5.0


def test_a_directory_is_a_miss(tmp_path: Path) -> None:
    (tmp_path / "c.kvt").mkdir()
    with pytest.raises(CacheMissError, match=r"not a regular file$"):
        kvtrio.load_cache(tmp_path / "c.kvt")


def test_a_link_is_not_followed_when_links_are_refused(tmp_path: Path) -> None:
    from kvtrio.storage.reader import read_header

    kvtrio.save_cache(tmp_path / "real.kvt", [1], [make_kv([1])])
    (tmp_path / "link.kvt").symlink_to(tmp_path / "real.kvt")
    assert read_header(str(tmp_path / "link.kvt")).header.tokens == (1,)  # a user's path
    with pytest.raises(CacheMissError, match=r"a symbolic link, not followed$"):
        read_header(str(tmp_path / "link.kvt"), follow_links=False)  # under a tier's root
