"""The hostile drill's corpus: crafted cache files, each breaking one rule of the reader.

:func:`build_corpus` makes them from a synthetic cache; the hostile drill loads each one and
``tests/drills/corpus/make_corpus.py`` writes them for the tests. :func:`seal` recomputes a
header's preamble so a mutation reaches the field validation past the hash check.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from typing import Any

import attrs
import xxhash
from kvtrio.drills.workload import CacheDir, EntrySpec, write_entry
from kvtrio.storage.format import FORMAT_VERSION, PREAMBLE, align_up

__all__ = [
    "CorpusCase",
    "base_files",
    "build_corpus",
    "dumps_header",
    "pad_header",
    "seal",
    "small_files",
    "split_sealed",
]


def seal(doc_bytes: bytes, *, version: int = FORMAT_VERSION) -> bytes:
    """Preamble + header bytes: a header whose length and hash match (past rule 1), of the
    version the writers write (the base files' own: a mutation then reaches the field
    checks, not the header/preamble version check)."""
    return PREAMBLE.pack(
        b"KVTRIO\r\n", version, len(doc_bytes), xxhash.xxh3_64_intdigest(doc_bytes)
    )


def split_sealed(raw: bytes) -> tuple[bytes, bytes, bytes]:
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    return (
        raw[: PREAMBLE.size],
        raw[PREAMBLE.size : PREAMBLE.size + header_len],
        raw[PREAMBLE.size + header_len :],
    )


def dumps_header(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


@attrs.frozen
class CorpusCase:
    """One crafted file: its name, bytes, and the error a load must raise."""

    name: str
    rule: str  # the validation rule it breaks
    data: bytes
    layout: str  # "single" (a cache file) or "blocks" (a manifest)
    error: str  # "CorruptCacheError", "CacheMissError" or "UnknownCacheKindError"
    prefix: str  # the message starts with this (the field at fault)


def small_files(cache_dir: CacheDir) -> list[tuple[bytes, str]]:
    """A small cache file and manifest (short headers: more cases per second)."""
    single, manifest = base_files(cache_dir, name="small", n_tokens=10)
    return [(single, "single"), (manifest, "blocks")]


def base_files(
    cache_dir: CacheDir, *, name: str = "base", n_tokens: int = 20
) -> tuple[bytes, bytes]:
    spec = EntrySpec(name, 2, n_tokens)
    write_entry(cache_dir, spec, "single")
    write_entry(cache_dir, spec, "blocks")
    with open(cache_dir.path_of(name, "single"), "rb") as f:
        single = f.read()
    with open(cache_dir.path_of(name, "blocks"), "rb") as f:
        manifest = f.read()
    return single, manifest


def build_corpus(cache_dir: CacheDir) -> list[CorpusCase]:
    """One crafted hostile file per validation rule (the base entry is written first)."""
    single, manifest = base_files(cache_dir)
    s_pre, s_body, s_rest = split_sealed(single)
    _, m_body, _ = split_sealed(manifest)
    s_doc = json.loads(s_body)
    m_doc = json.loads(m_body)
    cases: list[CorpusCase] = []

    def doc_case(
        name: str, rule: str, edit: Callable[[Any], Any], prefix: str, layout: str = "single"
    ) -> None:
        doc = copy.deepcopy(s_doc if layout == "single" else m_doc)
        edit(doc)
        body = dumps_header(doc)
        rest = s_rest if layout == "single" else b""
        pad = b"" if layout == "blocks" else pad_header(len(body), len(s_body))
        cases.append(
            CorpusCase(
                name, rule, seal(body) + body + pad + rest, layout, "CorruptCacheError", prefix
            )
        )

    def raw_case(name: str, rule: str, data: bytes, prefix: str, layout: str = "single") -> None:
        cases.append(CorpusCase(name, rule, data, layout, "CorruptCacheError", prefix))

    def t0(doc: Any) -> Any:
        return doc["caches"][0]["tensors"][0]

    raw_case("short", "preamble shorter than 24 bytes", single[:10], "preamble:")
    raw_case("magic", "magic", b"NOTKVTRI" + single[8:], "preamble.magic:")
    raw_case(
        "version",
        "unsupported format version",
        struct.pack("<8sI", b"KVTRIO\r\n", 99) + single[12:],
        "preamble.format_version:",
    )
    raw_case(
        "header-cap",
        "header length over the cap",
        single[:12] + struct.pack("<I", 2**31) + single[16:],
        "preamble.header_length:",
    )
    raw_case(
        "header-past-end",
        "header length past the end of the file",
        s_pre + s_body[:100],
        "preamble.header_length:",
    )
    flipped = bytearray(single)
    flipped[PREAMBLE.size + 10] ^= 0x01
    raw_case("header-hash", "header xxh3", bytes(flipped), "header: xxh3")
    bad_utf8 = s_body.replace(b'"drill"', b'"dri\xffl"', 1)
    raw_case("utf8", "header not UTF-8", seal(bad_utf8) + bad_utf8, "header: not UTF-8")
    deep = b'{"a":' * 100 + b"1" + b"}" * 100
    raw_case("deep-json", "JSON nesting depth", seal(deep) + deep, "header: JSON nested deeper")
    broken = s_body[:-1]
    raw_case("json", "invalid JSON", seal(broken) + broken, "header: invalid JSON")
    dup = s_body.replace(b'"codec":', b'"codec":"x","codec":', 1)
    raw_case("duplicate-key", "duplicate JSON keys", seal(dup) + dup, "header: duplicate JSON key")
    nan = s_body.replace(b'"created_at":0.0', b'"created_at":NaN', 1)
    raw_case("nan", "non-finite numbers", seal(nan) + nan, "header: non-finite number")
    doc_case("unknown-field", "unknown fields", lambda d: d.update(evil=1), "evil: unknown field")
    doc_case("missing-field", "missing fields", lambda d: d.pop("tokens"), "tokens: missing")
    doc_case(
        "version-mismatch",
        "header/preamble version",
        lambda d: d.update(format_version=FORMAT_VERSION + 1),
        "format_version:",
    )
    doc_case("codec", "codec id", lambda d: d.update(codec="pickle"), "codec: unknown codec")
    doc_case("layout", "layout", lambda d: d.update(layout="raid"), "layout: unknown layout")
    doc_case(
        "block-tokens-missing",
        "block_tokens in the blocks layout",
        lambda d: d.update(block_tokens=None),
        "block_tokens: missing",
        "blocks",
    )
    doc_case(
        "block-tokens-single",
        "block_tokens in the single layout",
        lambda d: d.update(block_tokens=8),
        "block_tokens: not allowed",
    )
    doc_case("created-at", "created_at type", lambda d: d.update(created_at="now"), "created_at:")
    doc_case(
        "token-negative",
        "token values bounded",
        lambda d: d["tokens"].__setitem__(0, -1),
        "tokens[0]:",
    )
    doc_case(
        "token-huge",
        "token values bounded",
        lambda d: d["tokens"].__setitem__(0, 2**40),
        "tokens[0]:",
    )
    doc_case("token-type", "token type", lambda d: d["tokens"].__setitem__(0, 1.5), "tokens[0]:")
    doc_case("meta-type", "meta is a string map", lambda d: d.update(meta={"a": 1}), "meta.a:")
    doc_case(
        "string-cap", "string length cap", lambda d: d.update(model_id="m" * 5000), "model_id:"
    )
    doc_case("entries-cap", "entry count cap", lambda d: d.update(caches=[{}] * 4097), "caches:")
    doc_case(
        "offset", "offset bounded", lambda d: d["caches"][0].update(offset=-5), "caches[0].offset:"
    )
    doc_case(
        "min-offset",
        "min_reusable_offset <= offset",
        lambda d: d["caches"][0].update(min_reusable_offset=10**6),
        "caches[0].min_reusable_offset:",
    )
    doc_case(
        "trimmable",
        "trimmable is a boolean",
        lambda d: d["caches"][0].update(trimmable=1),
        "caches[0].trimmable:",
    )
    doc_case(
        "field-nested",
        "per-kind field values are flat",
        lambda d: d["caches"][0]["fields"].update(x=[[1]]),
        "caches[0].fields.x[0]:",
    )
    doc_case(
        "field-type",
        "per-kind field types",
        lambda d: d["caches"][0]["fields"].update(x=1.5),
        "caches[0].fields.x:",
    )

    def nest(d: Any) -> None:
        entry = d["caches"][0]
        for _ in range(6):
            entry = {**entry, "tensors": [], "children": [entry]}
        d["caches"][0] = entry

    doc_case("depth", "cache nesting depth", nest, "caches[0].children[0].children[0]")
    doc_case(
        "dtype",
        "dtype from the closed list",
        lambda d: t0(d).update(dtype="object"),
        "caches[0].tensors[0].dtype:",
    )
    doc_case(
        "ndim", "ndim bounded", lambda d: t0(d).update(shape=[1] * 9), "caches[0].tensors[0].shape:"
    )
    doc_case(
        "dim",
        "dims bounded",
        lambda d: t0(d).update(shape=[2**41, 1, 1, 1]),
        "caches[0].tensors[0].shape[0]:",
    )
    doc_case(
        "shape-product",
        "prod(shape) * itemsize == bytes",
        lambda d: t0(d).update(shape=[2**20, 2**20, 2**20, 8]),
        "caches[0].tensors[0].bytes:",
    )
    doc_case(
        "bytes-cap",
        "tensor bytes cap",
        lambda d: t0(d).update(bytes=2**60),
        "caches[0].tensors[0].bytes:",
    )
    doc_case(
        "token-axis",
        "token_axis inside the shape",
        lambda d: t0(d).update(token_axis=7),
        "caches[0].tensors[0].token_axis:",
    )
    doc_case(
        "blocks-in-single",
        "blocks not in the single layout",
        lambda d: t0(d).update(blocks=[]),
        "caches[0].tensors[0].blocks:",
    )
    doc_case(
        "off-align", "offsets aligned", lambda d: t0(d).update(off=100), "caches[0].tensors[0].off:"
    )
    doc_case(
        "xxh3-hex",
        "xxh3 is 16 hex digits",
        lambda d: t0(d).update(xxh3="zz" * 8),
        "caches[0].tensors[0].xxh3:",
    )
    doc_case(
        "off-past-end",
        "tensors inside the file",
        lambda d: t0(d).update(off=2**30),
        "caches[0].tensors[0].off:",
    )
    doc_case(
        "overlap",
        "tensors do not overlap",
        lambda d: d["caches"][0]["tensors"][1].update(off=0),
        "caches[0].tensors[",
    )
    doc_case(
        "off-in-blocks",
        "off/xxh3 not in the blocks layout",
        lambda d: t0(d).update(off=0),
        "caches[0].tensors[0]:",
        "blocks",
    )
    doc_case(
        "block-name",
        "block names fullmatch [0-9a-f]{64}",
        lambda d: t0(d)["blocks"][0].update(sha256="../../../../etc/passwd"),
        "caches[0].tensors[0].blocks[0].sha256:",
        "blocks",
    )
    doc_case(
        "block-name-upper",
        "block names are lowercase",
        lambda d: t0(d)["blocks"][0].update(sha256=t0(d)["blocks"][0]["sha256"].upper()),
        "caches[0].tensors[0].blocks[0].sha256:",
        "blocks",
    )
    doc_case(
        "blocks-sum",
        "block bytes add up to the tensor",
        lambda d: t0(d)["blocks"][0].update(bytes=1),
        "caches[0].tensors[0].blocks:",
        "blocks",
    )

    def few_blocks(d: Any) -> None:
        t0(d)["blocks"] = t0(d)["blocks"][:1]
        t0(d)["blocks"][0]["bytes"] = t0(d)["bytes"]

    doc_case(
        "block-count",
        "one block per token block",
        few_blocks,
        "caches[0].tensors[0].blocks:",
        "blocks",
    )
    doc_case(
        "attachment",
        "attachment fields",
        lambda d: d.update(attachments=[{"schema": 1}]),
        "attachments[0]",
    )

    data = bytearray(single)
    data[align_up(PREAMBLE.size + len(s_body)) + 5] ^= 0x40
    raw_case(
        "tensor-hash", "tensor bytes match their xxh3", bytes(data), "caches[0].tensors[0].xxh3:"
    )
    last_off = max(t["off"] for e in s_doc["caches"] for t in e["tensors"])
    cut = single[: align_up(PREAMBLE.size + len(s_body)) + last_off + 10]
    raw_case("tensor-truncated", "tensors inside the file", cut, "caches[1].tensors[1].off:")
    # Issue 15: the length is exactly what the header implies, both ways.
    raw_case("cut-by-one-byte", "file length as the header implies", single[:-1], "header:")
    raw_case("trailing-byte", "file length as the header implies", single + b"\0", "header:")
    raw_case(
        "manifest-trailing-byte",
        "manifest length as the preamble implies",
        manifest + b"\0",
        "header:",
        "blocks",
    )
    future = copy.deepcopy(s_doc)
    future["caches"][0]["kind"] = "zz"  # as long as "kv": the data start stays put
    body = dumps_header(future)
    assert len(body) == len(s_body)
    cases.append(
        CorpusCase(
            "unknown-kind",
            "a kind with no codec is unsupported, not corrupt (never deleted)",
            seal(body) + body + s_rest,  # s_rest: the base's own padding, then its data
            "single",
            "UnknownCacheKindError",
            "caches[0].kind:",
        )
    )

    def huge(d: Any) -> None:
        # Every field valid: 256 blocks of 1 GiB (the per-block cap), 256 GiB in all.
        slot = t0(d)
        slot.update(shape=[1, 1, 2**24, 2**12], dtype="float32", bytes=2**38)
        slot["blocks"] = [
            {"sha256": f"{i:064x}", "bytes": 2**30, "xxh3": f"{i:016x}"} for i in range(256)
        ]
        d["caches"] = [{**d["caches"][0], "tensors": [slot], "children": []}]
        d["block_tokens"] = 2**16

    huge_doc = copy.deepcopy(m_doc)
    huge(huge_doc)
    body = dumps_header(huge_doc)
    cases.append(
        CorpusCase(
            "huge-declared",
            "memory bounded by the bytes on disk",
            seal(body) + body,
            "blocks",
            "CacheMissError",
            "caches[0].tensors[0].blocks[0]:",
        )
    )
    absent = copy.deepcopy(m_doc)
    t0(absent)["blocks"][0]["sha256"] = "0" * 64
    body = dumps_header(absent)
    cases.append(
        CorpusCase(
            "block-missing",
            "a missing block is a clean miss",
            seal(body) + body,
            "blocks",
            "CacheMissError",
            "caches[0].tensors[0].blocks[0]:",
        )
    )
    return cases


def pad_header(body_len: int, base_len: int) -> bytes:
    """Padding so a rewritten header keeps the base file's data start (16 KiB aligned)."""
    start = align_up(PREAMBLE.size + base_len)
    return bytes(max(0, start - PREAMBLE.size - body_len))
