"""One named test per untrusted-header rule (docs/format.md "Validation rules").

docs/design.md invariant 4 is what they guard together.

Invariant 4: a reader never trusts a header field it has not bounds-checked, and never
returns bytes it has not checked against the header's hashes when asked to verify.
Every failure is a CorruptCacheError whose message names the field at fault.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvtrio
import pytest
from kvtrio.errors import CacheMissError, CorruptCacheError, UnknownCacheKindError
from kvtrio.storage.format import (
    ALIGN,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE,
    align_up,
    encode_preamble,
)

from .conftest import BUILDERS

Doc = dict[str, Any]


@pytest.fixture
def valid(tmp_path: Path) -> Path:
    path = tmp_path / "valid.kvt"
    kvtrio.save_cache(path, [], [BUILDERS["kv"](), BUILDERS["arrays"]()])
    return path


def _split(path: Path) -> tuple[Doc, bytes]:
    raw = path.read_bytes()
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    body = raw[PREAMBLE.size : PREAMBLE.size + header_len]
    data = raw[align_up(PREAMBLE.size + header_len) :]
    doc: Doc = json.loads(body)
    return doc, data


def _write_body(path: Path, body: bytes, data: bytes) -> None:
    prefix = encode_preamble(body) + body
    path.write_bytes(prefix + bytes(align_up(len(prefix)) - len(prefix)) + data)


def _rewrite(path: Path, mutate: Callable[[Doc], None]) -> None:
    """Change the header and re-seal it with a correct hash: only validation can object."""
    doc, data = _split(path)
    mutate(doc)
    _write_body(path, json.dumps(doc).encode(), data)


def _load_fails(path: Path, match: str) -> None:
    with pytest.raises(CorruptCacheError, match=match):
        kvtrio.load_cache(path)


def _slot(doc: Doc, i: int = 0, t: int = 0) -> Doc:
    slot: Doc = doc["caches"][i]["tensors"][t]
    return slot


# --- rule: preamble length and header hash checked before JSON parsing


def test_rule_preamble_shorter_than_its_fixed_size(valid: Path) -> None:
    valid.write_bytes(valid.read_bytes()[:10])
    _load_fails(valid, r"^preamble: file is 10 bytes, shorter than the 24-byte preamble$")


def test_rule_preamble_magic(valid: Path) -> None:
    raw = bytearray(valid.read_bytes())
    raw[0:8] = b"NOTKVTRI"
    valid.write_bytes(bytes(raw))
    _load_fails(valid, r"^preamble\.magic: not a kvtrio cache file")


@pytest.mark.parametrize("version", [0, 99])
def test_rule_preamble_unsupported_format_version(valid: Path, version: int) -> None:
    """A version past every one this library reads is a newer kvtrio's file
    (NewerFormatError, a CorruptCacheError that open and gc keep); any other unknown
    number is damage (CorruptCacheError alone)."""
    raw = bytearray(valid.read_bytes())
    struct.pack_into("<I", raw, 8, version)
    valid.write_bytes(bytes(raw))
    _load_fails(valid, rf"^preamble\.format_version: unsupported version {version} ")
    with pytest.raises(CorruptCacheError) as caught:
        kvtrio.load_cache(valid)
    assert isinstance(caught.value, kvtrio.NewerFormatError) is (version == 99)


def test_rule_header_size_capped(valid: Path) -> None:
    raw = bytearray(valid.read_bytes())
    struct.pack_into("<I", raw, 12, MAX_HEADER_BYTES + 1)
    valid.write_bytes(bytes(raw))
    _load_fails(valid, r"^preamble\.header_length: \d+ bytes is over the \d+-byte cap$")


def test_rule_header_inside_the_file(valid: Path) -> None:
    valid.write_bytes(valid.read_bytes()[: PREAMBLE.size + 5])
    _load_fails(valid, r"^preamble\.header_length: header of \d+ bytes runs past the end")


def test_rule_header_hash_checked_before_json(valid: Path) -> None:
    raw = bytearray(valid.read_bytes())
    raw[PREAMBLE.size] = ord("[")  # would also break the JSON: the hash must object first
    valid.write_bytes(bytes(raw))
    _load_fails(valid, r"^header: xxh3 mismatch \(truncated or corrupt header\)$")


def test_rule_header_utf8_only(valid: Path) -> None:
    doc, data = _split(valid)
    body = json.dumps(doc).encode().replace(b'"meta": {}', b'"meta": {"k": "\xff"}')
    _write_body(valid, body, data)
    _load_fails(valid, r"^header: not UTF-8 ")


# --- rule: duplicate JSON keys rejected; JSON strict


def test_rule_duplicate_json_keys(valid: Path) -> None:
    doc, data = _split(valid)
    body = json.dumps(doc).encode().replace(b'"meta": {}', b'"meta": {}, "meta": {}')
    _write_body(valid, body, data)
    _load_fails(valid, r"^header: duplicate JSON key 'meta'$")


def test_rule_non_finite_numbers(valid: Path) -> None:
    doc, data = _split(valid)
    body = json.dumps(doc).encode()
    body = body.replace(b'"created_at": ', b'"created_at": NaN, "x": ', 1)
    _write_body(valid, body, data)
    _load_fails(valid, r"^header: non-finite number NaN is not allowed$")


def test_rule_json_nesting_bounded(valid: Path) -> None:
    doc, data = _split(valid)
    body = json.dumps(doc).encode().replace(b'"meta": {}', b'"meta": ' + b"[" * 100000)
    _write_body(valid, body, data)
    _load_fails(valid, r"^header: JSON nested deeper than 64$")


def test_rule_unknown_fields_rejected(valid: Path) -> None:
    _rewrite(valid, lambda d: d.update(pickle="cos\nsystem\n"))
    _load_fails(valid, r"^\.pickle: unknown field$")


# --- rule: dtypes from a closed list


def test_rule_dtype_closed_list(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(dtype="object"))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.dtype: 'object' is not in the dtype list$")


# --- rule: shape products and offsets in checked arithmetic, inside the file, no overlap


def test_rule_shape_product_matches_bytes(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(shape=[2**40, 2**40, 2**40, 2**40]))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.bytes: \d+ != prod\(shape ")


def test_rule_dims_bounded(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(shape=[-1, 2]))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.shape\[0\]: -1 is outside \[0, \d+\]$")


def test_rule_ndim_bounded(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(shape=[1] * 9))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.shape: 9 items, over the cap 8$")


def test_rule_offset_inside_the_file(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(off=ALIGN * 10**6))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.off: tensor \[\d+, \d+\) runs past the data")


def test_rule_offset_aligned(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(off=_slot(d)["off"] + 1))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.off: \d+ is not a multiple of 16384$")


def test_rule_tensors_do_not_overlap(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d, 0, 1).update(off=_slot(d, 0, 0)["off"]))
    _load_fails(valid, r"^caches\[0\]\.tensors\[\d\]\.off: tensor at \d+ overlaps the previous")


def test_rule_integers_are_not_booleans(valid: Path) -> None:
    _rewrite(valid, lambda d: d["caches"][0].update(offset=True))
    _load_fails(valid, r"^caches\[0\]\.offset: expected an integer$")


# --- rule: counts, ndim and token values bounded


def test_rule_token_values_bounded(valid: Path) -> None:
    _rewrite(valid, lambda d: d.update(tokens=[1, -5]))
    _load_fails(valid, r"^tokens\[1\]: -5 is outside \[0, 2147483647\]$")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, True, 3], r"^tokens\[2\]: expected an integer$"),
        ([0, 1.0], r"^tokens\[1\]: expected an integer$"),
        ([7, "8"], r"^tokens\[1\]: expected an integer$"),
        ([5, 2**31, -1], r"^tokens\[1\]: 2147483648 is outside \[0, 2147483647\]$"),
        ([None], r"^tokens\[0\]: expected an integer$"),
    ],
)
def test_rule_token_values_bounded_names_the_first_bad_token(
    valid: Path, tokens: list[Any], message: str
) -> None:
    """The token list is checked in bulk; a failure still names the first bad index."""
    _rewrite(valid, lambda d: d.update(tokens=tokens))
    _load_fails(valid, message)


def test_rule_json_nesting_counted_outside_strings_only(valid: Path) -> None:
    """Brackets inside strings (escaped quotes included) do not count toward the depth."""
    deep = '\\"' + "[" * 100 + "\\\\"
    _rewrite(valid, lambda d: d.update(meta={"k": deep}))
    assert kvtrio.load_cache(valid).header.meta == {"k": deep}


def test_rule_tensor_count_bounded(valid: Path) -> None:
    _rewrite(valid, lambda d: d["caches"][0].update(tensors=[_slot(d)] * 65))
    _load_fails(valid, r"^caches\[0\]\.tensors: 65 items, over the cap 64$")


def test_rule_nesting_depth_bounded(valid: Path) -> None:
    def nest(d: Doc) -> None:
        entry = {k: v for k, v in d["caches"][1].items()}
        for _ in range(5):
            entry = {**entry, "kind": "list", "tensors": [], "children": [entry]}
        d["caches"] = [entry]

    _rewrite(valid, nest)
    _load_fails(valid, r"^caches\[0\](\.children\[0\])*\.children: nested deeper than 4$")


def test_rule_min_reusable_offset_within_offset(valid: Path) -> None:
    _rewrite(valid, lambda d: d["caches"][0].update(min_reusable_offset=10**6))
    _load_fails(valid, r"^caches\[0\]\.min_reusable_offset: 1000000 is past the offset \d+$")


def test_rule_codec_fields_checked_against_tensors(valid: Path) -> None:
    _rewrite(valid, lambda d: d["caches"][0].update(offset=5))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]: shape \[1, 2, 302, 64\] does not fit ")


def test_rule_unknown_kind(valid: Path) -> None:
    """Not corruption: a newer writer's kind, or a plugin not imported (never deleted)."""
    _rewrite(valid, lambda d: d["caches"][0].update(kind="pickle"))
    with pytest.raises(
        UnknownCacheKindError, match=r"^caches\[0\]\.kind: no codec for cache kind 'pickle'$"
    ):
        kvtrio.load_cache(valid)


# --- tensor bytes are verified against their hashes


def _last_tensor_end(path: Path) -> tuple[int, int]:
    """(absolute offset, absolute end) of the last tensor of a single-layout file."""
    doc, _ = _split(path)
    raw = path.read_bytes()
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    start = align_up(PREAMBLE.size + header_len)
    slots = [s for e in doc["caches"] for s in e["tensors"]]
    last = max(slots, key=lambda s: s["off"])
    return start + last["off"], start + last["off"] + last["bytes"]


def test_rule_tensor_bytes_verified(valid: Path) -> None:
    _, end = _last_tensor_end(valid)
    raw = bytearray(valid.read_bytes())
    raw[end - 1] ^= 0x01
    valid.write_bytes(bytes(raw))
    _load_fails(valid, r"^caches\[\d\]\.tensors\[\d\]\.xxh3: tensor bytes do not match their hash$")


def test_rule_truncated_data(valid: Path) -> None:
    _, end = _last_tensor_end(valid)
    valid.write_bytes(valid.read_bytes()[: end - 1])
    _load_fails(valid, r"^caches\[\d\]\.tensors\[\d\]\.off: tensor \[\d+, \d+\) runs past the data")


def test_rule_bad_xxh3_field(valid: Path) -> None:
    _rewrite(valid, lambda d: _slot(d).update(xxh3="../../etc/passwd"))
    _load_fails(valid, r"^caches\[0\]\.tensors\[0\]\.xxh3: not 16 lowercase hex digits$")


# --- block layout: names, paths, links, re-hash


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "m.kvt"
    kvtrio.save_cache(path, [], [BUILDERS["kv"]()], layout="blocks", block_tokens=128)
    return path


def test_rule_block_name_path_traversal(manifest: Path) -> None:
    _rewrite(manifest, lambda d: _slot(d)["blocks"][0].update(sha256="../../../etc/passwd"))
    _load_fails(
        manifest,
        r"^caches\[0\]\.tensors\[0\]\.blocks\[0\]\.sha256: not 64 lowercase hex digits: "
        r"'\.\./\.\./\.\./etc/passwd'$",
    )


def test_rule_block_name_uppercase_rejected(manifest: Path) -> None:
    _rewrite(manifest, lambda d: _slot(d)["blocks"][0].update(sha256="A" * 64))
    _load_fails(manifest, r"^caches\[0\]\.tensors\[0\]\.blocks\[0\]\.sha256: not 64 lowercase")


def test_well_formed_block_refs_parse_in_one_pass_to_the_field_walks_header(
    manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A well-formed manifest's block references are read in one pass, with no field walk
    per reference (a long entry has hundreds), into the header the walk gives."""
    from kvtrio.storage import headerparse
    from kvtrio.storage.reader import read_header

    walked: list[str] = []
    real = headerparse._Fields

    class Counting(real):  # type: ignore[misc,valid-type]
        def __init__(self, obj: Any, path: str, allowed: frozenset[str]) -> None:
            walked.append(path)
            super().__init__(obj, path, allowed)

    monkeypatch.setattr(headerparse, "_Fields", Counting)
    fast = read_header(str(manifest)).header
    assert walked and not any(".blocks[" in path for path in walked)
    walked.clear()
    monkeypatch.setattr(headerparse, "_plain_block_refs", lambda raw, with_xxh3: None)
    walk = read_header(str(manifest)).header
    assert any(".blocks[" in path for path in walked)
    assert fast == walk and fast.caches[0].tensors[0].blocks


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ref: ref.update(bytes=True), r"blocks\[0\]\.bytes: expected an integer$"),
        (lambda ref: ref.update(extra=1), r"blocks\[0\]\.extra: unknown field$"),
        (lambda ref: ref.pop("bytes"), r"blocks\[0\]\.bytes: missing$"),
        (lambda ref: ref.update(bytes=-1), r"blocks\[0\]\.bytes: -1 is outside \[0, \d+\]$"),
        (lambda ref: ref.pop("xxh3"), r"blocks\[0\]\.xxh3: missing$"),
        (lambda ref: ref.update(xxh3="ABCDEF0123456789"), r"blocks\[0\]\.xxh3: not 16 lowercase"),
        (lambda ref: ref.update(xxh3="0" * 15), r"blocks\[0\]\.xxh3: not 16 lowercase"),
        (lambda ref: ref.update(xxh3=7), r"blocks\[0\]\.xxh3: expected a string$"),
    ],
)
def test_rule_a_malformed_block_ref_is_named(
    manifest: Path, mutate: Callable[[Doc], object], message: str
) -> None:
    def change(doc: Doc) -> None:
        mutate(_slot(doc)["blocks"][0])

    _rewrite(manifest, change)
    _load_fails(manifest, r"^caches\[0\]\.tensors\[0\]\." + message)


def test_rule_block_sizes_match_token_blocks(manifest: Path) -> None:
    _rewrite(manifest, lambda d: _slot(d)["blocks"].pop())
    _load_fails(manifest, r"^caches\[0\]\.tensors\[0\]\.blocks: blocks hold \d+ bytes, slot has")


def test_rule_symlinked_block_is_not_followed(manifest: Path, tmp_path: Path) -> None:
    doc, _ = _split(manifest)
    name = _slot(doc)["blocks"][0]["sha256"]
    block = tmp_path / "blocks" / name
    outside = tmp_path / "outside"
    outside.write_bytes(block.read_bytes())
    block.unlink()
    os.symlink(outside, block)
    _load_fails(manifest, rf"^block {name}: is a symbolic link$")


def _flip_first_byte(block: Path) -> None:
    raw = bytearray(block.read_bytes())
    raw[0] ^= 0xFF
    block.write_bytes(bytes(raw))


def _as_version_1(path: Path) -> None:
    """Rewrite a manifest as format version 1 wrote it: block references without xxh3."""
    doc, _ = _split(path)
    doc["format_version"] = 1
    for entry in doc["caches"]:
        for slot in entry["tensors"]:
            for ref in slot["blocks"]:
                del ref["xxh3"]
    body = json.dumps(doc).encode()
    path.write_bytes(encode_preamble(body, 1) + body)


def test_rule_block_content_rehashed(manifest: Path, tmp_path: Path) -> None:
    """docs/design.md invariant 4, format rule 10: a local load checks every block against
    the xxh3 its (version 2) manifest records."""
    doc, _ = _split(manifest)
    assert doc["format_version"] == 2
    _flip_first_byte(tmp_path / "blocks" / _slot(doc)["blocks"][1]["sha256"])
    _load_fails(
        manifest, r"^caches\[0\]\.tensors\[0\]\.blocks\[1\]\.xxh3: block content does not match"
    )


def test_rule_block_checked_against_the_manifests_xxh3_not_a_second_copy(
    manifest: Path,
) -> None:
    """A manifest whose recorded xxh3 is not its block's is refused, though the block
    still hashes to its name: the check is against what the manifest says."""
    doc, _ = _split(manifest)
    _slot(doc)["blocks"][0]["xxh3"] = "0" * 16
    body = json.dumps(doc).encode()
    manifest.write_bytes(encode_preamble(body) + body)
    _load_fails(
        manifest, r"^caches\[0\]\.tensors\[0\]\.blocks\[0\]\.xxh3: block content does not match"
    )


def test_a_local_version_2_load_hashes_no_block_with_sha256(
    manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What makes a local cold load cheap: xxh3 (about 9 GB/s here) instead of sha256
    (about 1 GB/s) for every block."""
    from kvtrio.storage import reader

    def refused(piece: object) -> str:
        raise AssertionError("sha256 of a local block")

    monkeypatch.setattr(reader, "_sha256_hex", refused)
    offset = _split(manifest)[0]["caches"][0]["offset"]
    assert offset > 0 and kvtrio.load_cache(manifest).caches[0].offset == offset


def test_version_1_manifest_loads_and_checks_blocks_by_sha256(
    manifest: Path, tmp_path: Path
) -> None:
    """A manifest written by format version 1 (no xxh3 per block) still loads, each block
    checked against its sha256 name; a version-1 manifest with an xxh3 is refused."""
    _as_version_1(manifest)
    loaded = kvtrio.load_cache(manifest)
    doc, _ = _split(manifest)
    assert loaded.header.format_version == 1
    assert loaded.caches[0].offset == doc["caches"][0]["offset"]
    _flip_first_byte(tmp_path / "blocks" / _slot(doc)["blocks"][1]["sha256"])
    _load_fails(
        manifest, r"^caches\[0\]\.tensors\[0\]\.blocks\[1\]\.sha256: block content does not hash"
    )
    slot = _slot(doc)
    slot["blocks"][0]["xxh3"] = "0" * 16
    body = json.dumps(doc).encode()
    manifest.write_bytes(encode_preamble(body, 1) + body)
    _load_fails(manifest, r"^caches\[0\]\.tensors\[0\]\.blocks\[0\]\.xxh3: unknown field$")


def test_rule_block_size_checked(manifest: Path, tmp_path: Path) -> None:
    doc, _ = _split(manifest)
    name = _slot(doc)["blocks"][0]["sha256"]
    (tmp_path / "blocks" / name).write_bytes(b"short")
    _load_fails(manifest, rf"^block {name}: stored size 5 != expected \d+$")


def test_missing_block_is_a_clean_miss(manifest: Path, tmp_path: Path) -> None:
    doc, _ = _split(manifest)
    name = _slot(doc)["blocks"][0]["sha256"]
    (tmp_path / "blocks" / name).unlink()
    with pytest.raises(
        CacheMissError, match=rf"^caches\[0\]\.tensors\[0\]\.blocks\[0\]: block {name} is missing$"
    ):
        kvtrio.load_cache(manifest)


def test_magic_constant_is_stable() -> None:
    """Changing the magic would orphan every file ever written."""
    assert MAGIC == b"KVTRIO\r\n" and PREAMBLE.size == 24


def test_allocation_beyond_physical_memory_is_refused_not_crashed() -> None:
    """MLX kills the process (SIGSEGV) when an allocation fails: refuse it first."""
    from kvtrio.storage.hostbuffers import check_allocatable

    check_allocatable(1 << 20)
    with pytest.raises(MemoryError, match=r"^loading needs 1000000000000000000 bytes, more "):
        check_allocatable(10**18)
