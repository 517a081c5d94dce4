"""Fuzzing untrusted input: only CorruptCacheError ever escapes, allocations stay bounded.

docs/design.md invariant 4: a reader never trusts a header field it has not bounds-checked.
Mutations and
truncations of valid files, structurally mutated headers re-sealed with a correct hash
(so validation, not the hash, must catch them) and random headers. ~10 s here; the drills
run the long version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvtrio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtrio.errors import (
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    UnknownCacheKindError,
)
from kvtrio.storage.format import PREAMBLE, align_up, encode_preamble
from kvtrio.storage.reader import read_header

from .conftest import BUILDERS

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory: Any) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("fuzz")
    caches = [BUILDERS["kv"](), BUILDERS["rotating_wrapped"](), BUILDERS["list"]()]
    kvtrio.save_cache(d / "s.kvt", [], caches)
    kvtrio.save_cache(d / "b.kvt", [], caches, layout="blocks", block_tokens=128)
    return {"single": (d / "s.kvt").read_bytes(), "blocks": (d / "b.kvt").read_bytes()}


def _load_is_safe(path: Path, raw: bytes) -> None:
    path.write_bytes(raw)
    try:
        cache_file = read_header(str(path))
    except CorruptCacheError:
        return
    if cache_file.header.layout == "single":
        # Everything the reader will allocate fits inside the file.
        assert cache_file.header.nbytes <= len(raw)
    try:
        kvtrio.load_cache(path)
    except (CorruptCacheError, CacheMissError, CacheMismatchError, UnknownCacheKindError):
        pass  # a well-formed header may name a kind no codec knows: typed, never data


def _reseal(raw: bytes, doc: Any) -> bytes:
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    data = raw[align_up(PREAMBLE.size + header_len) :]
    body = json.dumps(doc).encode()
    prefix = encode_preamble(body) + body
    return prefix + bytes(align_up(len(prefix)) - len(prefix)) + data


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


@SETTINGS
@given(layout=st.sampled_from(["single", "blocks"]), data=st.data())
def test_fuzz_byte_mutations(
    tmp_path: Path, valid_files: dict[str, bytes], layout: str, data: st.DataObject
) -> None:
    raw = bytearray(valid_files[layout])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    _load_is_safe(tmp_path / "f.kvt", bytes(raw))


@SETTINGS
@given(layout=st.sampled_from(["single", "blocks"]), data=st.data())
def test_fuzz_truncations(
    tmp_path: Path, valid_files: dict[str, bytes], layout: str, data: st.DataObject
) -> None:
    raw = valid_files[layout]
    _load_is_safe(tmp_path / "t.kvt", raw[: data.draw(st.integers(0, len(raw) - 1))])


@SETTINGS
@given(layout=st.sampled_from(["single", "blocks"]), data=st.data(), value=json_values)
def test_fuzz_resealed_header_mutations(
    tmp_path: Path, valid_files: dict[str, bytes], layout: str, data: st.DataObject, value: Any
) -> None:
    """A header changed anywhere and re-sealed: validation alone must hold the line."""
    raw = valid_files[layout]
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    doc = json.loads(raw[PREAMBLE.size : PREAMBLE.size + header_len])
    path = data.draw(st.sampled_from(_paths(doc)))
    _load_is_safe(tmp_path / "h.kvt", _reseal(raw, _set(doc, path, value)))


def _with_kind(raw: bytes, kind: str) -> bytes:
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    doc = json.loads(raw[PREAMBLE.size : PREAMBLE.size + header_len])
    for path in _paths(doc):
        if path and path[-1] == "kind":
            _set(doc, path, kind)
    return _reseal(raw, doc)


def test_an_empty_kind_is_corrupt_and_an_unnamed_one_unknown(
    tmp_path: Path, valid_files: dict[str, bytes]
) -> None:
    """Found by the resealed-header fuzz: kind "" passed the header check and reached the
    codec lookup. No writer writes an empty kind, so it is corruption; a kind no codec
    knows is the typed UnknownCacheKindError (the tier keeps such a file)."""
    path = tmp_path / "k.kvt"
    path.write_bytes(_with_kind(valid_files["single"], ""))
    with pytest.raises(CorruptCacheError, match="kind"):
        read_header(str(path))
    path.write_bytes(_with_kind(valid_files["single"], "NoSuchCache"))
    read_header(str(path))
    with pytest.raises(UnknownCacheKindError):
        kvtrio.load_cache(path)


@SETTINGS
@given(doc=json_values)
def test_fuzz_random_headers(tmp_path: Path, valid_files: dict[str, bytes], doc: Any) -> None:
    _load_is_safe(tmp_path / "r.kvt", _reseal(valid_files["single"], doc))
