"""Bit-exact round trips of every cache kind, both layouts, attachments and empty caches."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
import pytest
from kvtrio.errors import CacheMismatchError
from kvtrio.storage.cacheio import AttachmentData
from kvtrio.storage.format import Layout
from kvtrio.storage.reader import read_header, read_tensors
from kvtrio.storage.structure import trim_caches
from mlx_lm.models import cache as _mlx_cache_module

from .conftest import BUILDERS, EMPTY_BUILDERS, assert_same, kv, logical_state, tokens_for

mlx_cache: Any = _mlx_cache_module

LAYOUTS = ["single", "blocks"]


def _save_load(
    path: Path, caches: list[Any], layout: Layout, tokens: list[int] | None = None, **kw: Any
) -> Any:
    tokens = tokens_for(caches) if tokens is None else tokens
    kvtrio.save_cache(path, tokens, caches, layout=layout, **kw)
    loaded = kvtrio.load_cache(path)
    assert list(loaded.tokens) == tokens
    return loaded


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_every_kind_round_trips_bit_exact(tmp_path: Path, kind: str, layout: Layout) -> None:
    original = BUILDERS[kind]()
    loaded = _save_load(tmp_path / "c.kvt", [original], layout)
    assert_same(logical_state(loaded.caches[0]), logical_state(original))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["kv", "rotating", "rotating_wrapped", "quantized", "chunked"])
def test_loaded_cache_continues_like_the_live_one(
    tmp_path: Path, kind: str, layout: Layout
) -> None:
    """The next update_and_fetch on the loaded cache returns what the live one returns."""
    live = BUILDERS[kind]()
    loaded = _save_load(tmp_path / "c.kvt", [live], layout).caches[0]
    for step in range(3):
        k, v = kv(1, seed=1000 + step)
        assert_same(list(loaded.update_and_fetch(k, v)), list(live.update_and_fetch(k, v)))
    assert_same(logical_state(loaded), logical_state(live))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", sorted(EMPTY_BUILDERS))
def test_empty_caches_round_trip_to_empty_caches(tmp_path: Path, kind: str, layout: Layout) -> None:
    original = EMPTY_BUILDERS[kind]()
    loaded = _save_load(tmp_path / "e.kvt", [original], layout).caches[0]
    assert type(loaded) is type(original)
    assert loaded.empty()
    assert_same(logical_state(loaded), logical_state(original))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attachments_round_trip(tmp_path: Path, layout: Layout) -> None:
    arrays = (mx.arange(12, dtype=mx.int32).reshape(3, 4), mx.ones((2, 2), dtype=mx.bfloat16))
    attachment = AttachmentData("mtp-draft/v1", {"layer": "7"}, arrays)
    loaded = _save_load(
        tmp_path / "a.kvt", [BUILDERS["kv"]()], layout, meta={"attachments": [attachment]}
    )
    (got,) = loaded.attachments
    assert got.schema == "mtp-draft/v1" and dict(got.metadata) == {"layer": "7"}
    assert_same(list(got.arrays), list(arrays))


def test_header_records_model_identity_and_meta(tmp_path: Path) -> None:
    meta = {"model_id": "tiny", "config_fingerprint": "sha256:ab", "conversation": "c1"}
    loaded = _save_load(tmp_path / "m.kvt", [BUILDERS["kv"]()], "single", meta=meta)
    assert loaded.header.model_id == "tiny"
    assert loaded.header.config_fingerprint == "sha256:ab"
    assert dict(loaded.header.meta) == {"conversation": "c1"}


def test_published_file_is_private_and_no_tmp_is_left(tmp_path: Path) -> None:
    """docs/design.md invariant 4: only the final name remains, mode 0600."""
    kvtrio.save_cache(tmp_path / "p.kvt", [], [BUILDERS["kv"]()])
    assert os.listdir(tmp_path) == ["p.kvt"]
    assert (tmp_path / "p.kvt").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("layout", LAYOUTS)
def test_min_reusable_offset_is_stored_and_enforced(tmp_path: Path, layout: Layout) -> None:
    cache = BUILDERS["kv"]()
    cache.min_reusable_offset = 250
    loaded = _save_load(tmp_path / "r.kvt", [cache], layout)
    assert loaded.header.min_reusable_offset == 250
    restored = loaded.caches[0]
    assert restored.min_reusable_offset == 250
    with pytest.raises(
        CacheMismatchError,
        match=(
            r"^caches\[0\]: trimming 60 of 302 tokens goes below "
            r"the minimum reusable offset 250$"
        ),
    ):
        trim_caches([restored], 60)
    assert restored.offset == 302
    assert trim_caches([restored], 52) == 52
    assert restored.offset == 250


def test_wrapped_rotating_cache_is_not_trimmable(tmp_path: Path) -> None:
    loaded = _save_load(tmp_path / "w.kvt", [BUILDERS["rotating_wrapped"]()], "single")
    assert not loaded.header.trimmable
    with pytest.raises(
        CacheMismatchError, match=r"^caches\[0\]: RotatingKVCache is not trimmable$"
    ):
        trim_caches(loaded.caches, 1)
    unwrapped = _save_load(tmp_path / "u.kvt", [BUILDERS["rotating"]()], "single")
    assert unwrapped.header.trimmable


def test_mixed_cache_list_preserves_layer_order(tmp_path: Path) -> None:
    caches = [BUILDERS[k]() for k in ("kv", "rotating_wrapped", "arrays", "list", "quantized")]
    # Layers of different lengths: only an empty token list (none recorded) fits them all.
    loaded = _save_load(tmp_path / "x.kvt", caches, "blocks", tokens=[])
    for got, want in zip(loaded.caches, caches, strict=True):
        assert_same(logical_state(got), logical_state(want))


def test_trimmed_kv_cache_saves_only_live_tokens(tmp_path: Path) -> None:
    cache = BUILDERS["kv"]()
    cache.trim(100)
    loaded = _save_load(tmp_path / "t.kvt", [cache], "single")
    assert loaded.caches[0].keys.shape[2] == 202
    assert_same(logical_state(loaded.caches[0]), logical_state(cache))


class NotACache:
    """A cache class no codec is registered for."""


def test_unknown_cache_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^no kvtrio codec for cache type NotACache$"):
        kvtrio.save_cache(tmp_path / "u.kvt", [], [NotACache()])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_any_number_of_read_threads_loads_bit_exact(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_cache reads tensors on ``IoOptions.load_streams`` threads; the count never
    changes the result (slot order kept, every hash checked), and never more than that
    many reads run at once."""
    from kvtrio import api

    originals = [BUILDERS[kind]() for kind in sorted(BUILDERS)]
    kvtrio.save_cache(tmp_path / "c.kvt", [], originals)  # layers of different lengths
    running = peak = 0
    lock = threading.Lock()

    def slow_read(*args: Any, **kwargs: Any) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            time.sleep(0.01)
            read_tensors(*args, **kwargs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(api, "read_tensors", slow_read)
    options = kvtrio.IoOptions(load_streams=threads)
    loaded = kvtrio.load_cache(tmp_path / "c.kvt", options=options)
    monkeypatch.undo()
    slots = sum(1 for _ in read_header(str(tmp_path / "c.kvt")).header.slots())
    assert 1 <= peak <= min(threads, slots) and (threads == 1 or peak > 1)
    for got, want in zip(loaded.caches, originals, strict=True):
        assert_same(logical_state(got), logical_state(want))


@pytest.mark.parametrize(
    ("raw", "expected"), [("", 4), ("1", 1), (" 6 ", 6), ("0", None), ("x", None)]
)
def test_load_threads_setting(raw: str, expected: int | None) -> None:
    """KVTRIO_LOAD_THREADS, read at the CLI's edge, sets ``load_streams``."""
    environ = {"KVTRIO_LOAD_THREADS": raw}
    if expected is None:
        with pytest.raises(ValueError, match=r"^KVTRIO_LOAD_THREADS="):
            kvtrio.IoOptions.from_environ(environ)
    else:
        got = kvtrio.IoOptions.from_environ(environ)
        assert got.streams(4) == expected and got.streams(1) == (1 if raw == "" else expected)
