"""Hostile files: a crafted corpus (one file per validation rule) and mutation cases.

Theory of operation
-------------------
Promises under test (DESIGN.md, untrusted-header rules; invariant 4):

1. Only CorruptCacheError (or, for a manifest naming an absent block, CacheMissError: a
   clean miss) escapes a load of a hostile file; never another exception, never a hang.
2. Memory stays bounded by the file: the tracemalloc peak of a whole load is at most
   ``_MEMORY_FACTOR`` times the bytes on disk (manifest plus present blocks) plus a
   fixed allowance, whatever the header claims.
3. No path outside the cache directory is opened, and no link inside it is followed:
   an audit hook (``sys.addaudithook``, event ``open``) watches every open of the load.
4. Every single-bit flip of a header (preamble and JSON) is detected.

Cases, all seeded and deterministic:

- ``bitflip``: every bit of the preamble and header of a cache file and of a manifest;
- ``resealed``: a JSON-level mutation (a value replaced by a hostile one, a key dropped
  or added, a node duplicated or nested deeply) whose preamble is recomputed, so the
  mutation reaches the field validation past the hash check;
- ``bytes``: byte-level edits of the header text, re-sealed the same way;
- ``truncated``: the file cut at a random length.

Most run in memory (preamble and header parse); every ``_FILE_EVERY``-th case is also
written into the cache directory and loaded end to end (reader, block store, hashes)
under the audit hook and tracemalloc. The corpus (:func:`build_corpus`) is run the same
way; ``tests/drills/corpus/make_corpus.py`` writes it for the tests.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import struct
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import xxhash
from kvtrio.drill_report import DrillResult, Tally
from kvtrio.drill_workload import CacheDir, EntrySpec, write_entry
from kvtrio.errors import CacheMissError, CorruptCacheError
from kvtrio.storage.format import PREAMBLE, Layout, align_up, parse_header, parse_preamble

__all__ = ["CorpusCase", "build_corpus", "load_hostile", "run_hostile_drill"]

_MEMORY_FACTOR = 8
_MEMORY_ALLOWANCE = 2 * 1024 * 1024
#: Growth of the drill process's peak RSS (MLX allocations included) over the whole run.
_RSS_ALLOWANCE = 256 * 1024 * 1024
_FILE_EVERY = 100
#: The ColdTier child's address-space limit: a load that tries to allocate what a hostile
#: header claims fails inside it instead of taking the machine's memory.
_TIER_CHILD_AS = 3 * 1024**3
_TIER_SAMPLES = 100


def seal(doc_bytes: bytes, *, version: int = 1) -> bytes:
    """Preamble + header bytes: a header whose length and hash match (past rule 1)."""
    return PREAMBLE.pack(
        b"KVTRIO\r\n", version, len(doc_bytes), xxhash.xxh3_64_intdigest(doc_bytes)
    )


def _split(raw: bytes) -> tuple[bytes, bytes, bytes]:
    _, _, header_len, _ = PREAMBLE.unpack_from(raw)
    return (
        raw[: PREAMBLE.size],
        raw[PREAMBLE.size : PREAMBLE.size + header_len],
        raw[PREAMBLE.size + header_len :],
    )


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- loading


_CODE_SUFFIXES = (".py", ".pyc", ".so", ".pth")


@attrs.define
class _Audit:
    """An audit hook that records opens outside ``root`` or of links inside it."""

    root: str = ""
    active: bool = False
    opened: int = 0
    bad: list[str] = attrs.field(factory=list)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active or event != "open":
            return
        path, _, flags = args
        if not isinstance(path, str | bytes):
            return  # an fd
        text = os.fsdecode(path)
        if text.endswith(_CODE_SUFFIXES):
            return  # a lazy import of library code, not a path taken from the file
        self.opened += 1
        real = os.path.abspath(text)
        if not real.startswith(self.root + os.sep):
            self.bad.append(f"opened outside the cache directory: {text}")
        elif os.path.islink(real) and not (isinstance(flags, int) and flags & os.O_NOFOLLOW):
            self.bad.append(f"opened a link without O_NOFOLLOW: {text}")


_AUDIT = _Audit()
_installed = False


def _install_audit() -> _Audit:
    global _installed
    if not _installed:
        sys.addaudithook(_AUDIT)
        _installed = True
    return _AUDIT


def load_hostile(path: str, cache_dir: CacheDir) -> tuple[str, str]:
    """Load ``path`` through the public :func:`kvtrio.load_cache` (verify on, the cache
    directory's block store): ("ok" | "corrupt" | "miss", message).

    Whatever else escapes propagates (the drill counts it as a violation).
    """
    from kvtrio.api import load_cache

    try:
        load_cache(path, store=cache_dir.block_store(), verify=True)
    except CorruptCacheError as exc:
        return "corrupt", str(exc)
    except CacheMissError as exc:
        return "miss", str(exc)
    return "ok", ""


def _disk_bytes(path: str, cache_dir: CacheDir) -> int:
    total = os.path.getsize(path)
    for name in os.listdir(cache_dir.blocks):
        total += os.lstat(os.path.join(cache_dir.blocks, name)).st_size
    return total


def _load_checked(path: str, cache_dir: CacheDir, tally: Tally, where: str) -> str:
    """:func:`load_hostile` under the audit hook and tracemalloc, checking promises 1-3."""
    audit = _install_audit()
    audit.root = os.path.abspath(cache_dir.root)
    audit.bad.clear()
    size = _disk_bytes(path, cache_dir)
    tracemalloc.start()
    audit.active = True
    try:
        outcome, _ = load_hostile(path, cache_dir)
    except BaseException as exc:
        outcome = "escaped"
        tally.violation(f"{where}: {type(exc).__name__} escaped: {str(exc)[:200]}")
    finally:
        audit.active = False
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    tally.add("end-to-end loads")
    tally.peak("peak memory / bytes on disk", round(peak / max(size, 1), 3))
    if peak > _MEMORY_FACTOR * size + _MEMORY_ALLOWANCE:
        tally.violation(f"{where}: load peaked at {peak} bytes for {size} bytes on disk")
    for text in audit.bad:
        tally.violation(f"{where}: {text}")
    return outcome


# --------------------------------------------------------------------------- mutations

_HOSTILE_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**53 + 1,
    2**63,
    2**64 + 7,
    -(2**63),
    10**30,
    1.5,
    -0.0,
    1e308,
    "",
    "x" * 5000,
    "../../etc/passwd",
    "/etc/passwd",
    "\u0000",
    "é",
    [],
    [0],
    [-1],
    [2**40] * 9,
    [[1]],
    {},
    {"a": 1},
    "float16",
    "int64",
    "object",
    "blocks",
    "single",
    "0" * 64,
    "f" * 64,
    "../" + "a" * 61,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if len(prefix) > 12:
        return
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:4]):
            yield from _paths(value, (*prefix, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


@attrs.frozen
class _Base:
    """A valid file to mutate: its bytes, header text and the JSON paths into it."""

    raw: bytes
    layout: str
    body: bytes
    rest: bytes
    paths: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, raw: bytes, layout: str) -> _Base:
        _, body, rest = _split(raw)
        return cls(raw, layout, body, rest, tuple(_paths(json.loads(body)))[1:])

    def wrap(self, new_body: bytes) -> bytes:
        """Re-sealed: a fresh preamble, and the data kept at its aligned offset."""
        if self.layout != "single":
            return seal(new_body) + new_body
        return seal(new_body) + new_body + _pad(len(new_body), len(self.body)) + self.rest


def _mutate_doc(base: _Base, rng: random.Random) -> bytes:
    doc = json.loads(base.body)  # a fresh copy (C speed)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        path = rng.choice(base.paths)
        try:
            parent, key = _get(doc, path[:-1]), path[-1]
            roll = rng.random()
            if roll < 0.55:
                parent[key] = rng.choice(_HOSTILE_VALUES)
            elif roll < 0.65 and isinstance(parent, dict):
                del parent[key]
            elif roll < 0.75 and isinstance(parent, dict):
                parent[rng.choice(("extra", "off", "blocks", "xxh3", "children"))] = 1
            elif roll < 0.85:
                node = parent[key]
                parent[key] = [node, node] if not isinstance(node, list) else node * 50
            elif roll < 0.92:
                nested: Any = parent[key]
                for _ in range(rng.choice((10, 70, 2000))):
                    nested = [nested]
                parent[key] = nested
            else:
                value = parent[key]
                if isinstance(value, int) and not isinstance(value, bool):
                    parent[key] = value + rng.choice((-1, 1, 16384, -16384, 2**40))
        except (KeyError, IndexError, TypeError):
            continue
    try:
        return _dumps(doc)
    except (RecursionError, ValueError):
        return b"[" * 3000


def _mutate_bytes(body: bytes, rng: random.Random) -> bytes:
    data = bytearray(body)
    for _ in range(rng.choice((1, 1, 2, 4))):
        at = rng.randrange(len(data))
        roll = rng.random()
        if roll < 0.4:
            data[at] = rng.choice(b'{}[]",:0123456789-e.aznt\\\x00\xff')
        elif roll < 0.7:
            del data[at : at + rng.randint(1, 8)]
        else:
            data[at:at] = rng.choice((b'"', b",", b"]", b"}", b'"k":1,', b"9" * 400, b"\xc3"))
    return bytes(data)


def _parse_in_memory(raw: bytes, file_size: int) -> str:
    preamble = parse_preamble(raw[: PREAMBLE.size], file_size)
    body = raw[PREAMBLE.size : PREAMBLE.size + preamble.header_len]
    parse_header(body, preamble, file_size)
    return "ok"


def _memory_case(raw: bytes, file_size: int, tally: Tally, where: str) -> str:
    try:
        return _parse_in_memory(raw, file_size)
    except CorruptCacheError:
        return "corrupt"
    except BaseException as exc:
        tally.violation(f"{where}: {type(exc).__name__} escaped: {str(exc)[:200]}")
        return "escaped"


# --------------------------------------------------------------------------- the corpus


@attrs.frozen
class CorpusCase:
    """One crafted file: its name, bytes, and the error a load must raise."""

    name: str
    rule: str  # the validation rule it breaks
    data: bytes
    layout: str  # "single" (a cache file) or "blocks" (a manifest)
    error: str  # "CorruptCacheError" or "CacheMissError"
    prefix: str  # the message starts with this (the field at fault)


def _small_files(cache_dir: CacheDir) -> list[tuple[bytes, str]]:
    """A small cache file and manifest (short headers: more cases per second)."""
    single, manifest = _base_files(cache_dir, name="small", n_tokens=10)
    return [(single, "single"), (manifest, "blocks")]


def _base_files(
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
    single, manifest = _base_files(cache_dir)
    s_pre, s_body, s_rest = _split(single)
    _, m_body, _ = _split(manifest)
    s_doc = json.loads(s_body)
    m_doc = json.loads(m_body)
    cases: list[CorpusCase] = []

    def doc_case(
        name: str, rule: str, edit: Callable[[Any], Any], prefix: str, layout: str = "single"
    ) -> None:
        doc = copy.deepcopy(s_doc if layout == "single" else m_doc)
        edit(doc)
        body = _dumps(doc)
        rest = s_rest if layout == "single" else b""
        pad = b"" if layout == "blocks" else _pad(len(body), len(s_body))
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
        lambda d: d.update(format_version=2),
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

    def huge(d: Any) -> None:
        # Every field valid: 256 blocks of 1 GiB (the per-block cap), 256 GiB in all.
        slot = t0(d)
        slot.update(shape=[1, 1, 2**24, 2**12], dtype="float32", bytes=2**38)
        slot["blocks"] = [{"sha256": f"{i:064x}", "bytes": 2**30} for i in range(256)]
        d["caches"] = [{**d["caches"][0], "tensors": [slot], "children": []}]
        d["block_tokens"] = 2**16

    huge_doc = copy.deepcopy(m_doc)
    huge(huge_doc)
    body = _dumps(huge_doc)
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
    body = _dumps(absent)
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


def _pad(body_len: int, base_len: int) -> bytes:
    """Padding so a rewritten header keeps the base file's data start (16 KiB aligned)."""
    start = align_up(PREAMBLE.size + base_len)
    return bytes(max(0, start - PREAMBLE.size - body_len))


# --------------------------------------------------------------------------- through ColdTier


def _tier_child(cases_dir: str, tier_root: str, start: int) -> int:
    """``python -m kvtrio.drill_hostile tier-child``: load every case file of ``cases_dir``
    from index ``start`` through a ColdTier, printing ``B name`` before and
    ``R name outcome`` after each; the parent learns which case crashed the process."""
    import trio
    from kvtrio.actors.tier import ColdTier

    names = sorted(os.listdir(cases_dir))[start:]

    async def main() -> None:
        async with ColdTier.open(tier_root, layout="blocks", inline=True) as tier:
            for name in names:
                print(f"B {name}", flush=True)
                shutil.copyfile(os.path.join(cases_dir, name), tier.path_of("hostile"))
                try:
                    await tier.load("hostile")
                    outcome = "ok"
                except CorruptCacheError:
                    outcome = "corrupt"
                except CacheMissError:
                    outcome = "miss"
                except Exception as exc:
                    outcome = f"escaped {type(exc).__name__}: {str(exc)[:120]}"
                print(f"R {name} {outcome}", flush=True)

    trio.run(main)
    return 0


def _run_tier(
    cases: list[tuple[str, bytes]], cache_dir: CacheDir, workdir: Path, tally: Tally
) -> None:
    """Load ``cases`` through ColdTier in a child process with an address-space limit;
    a case that kills the process is a violation, and the child restarts after it."""
    import resource
    import subprocess

    cases_dir = workdir / "tier-cases"
    tier_root = workdir / "tier"
    shutil.rmtree(cases_dir, ignore_errors=True)
    shutil.rmtree(tier_root, ignore_errors=True)
    cases_dir.mkdir(parents=True)
    shutil.copytree(cache_dir.blocks, tier_root / "blocks")
    for name, data in cases:
        (cases_dir / name).write_bytes(data)
    names = sorted(n for n, _ in cases)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (_TIER_CHILD_AS, _TIER_CHILD_AS))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is expected news

    start = 0
    while start < len(names):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtrio.drill_hostile",
                "tier-child",
                str(cases_dir),
                str(tier_root),
                str(start),
            ],
            capture_output=True,
            text=True,
            preexec_fn=limit,
            timeout=600,
            check=False,
        )
        began = None
        for line in proc.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "B":
                began = rest
            elif kind == "R":
                name, _, outcome = rest.partition(" ")
                tally.add("tier loads")
                tally.add(f"tier outcome: {outcome.split(':')[0]}")
                if outcome.startswith("escaped"):
                    tally.violation(f"tier {name.removesuffix('.case')}: {outcome}")
                began = None
                start += 1
        if proc.returncode != 0:
            if began is None:
                tally.violation(f"tier child failed: {proc.returncode}: {proc.stderr[-300:]}")
                return
            tally.add("tier loads")
            tally.violation(
                f"tier {began.removesuffix('.case')}: the process died "
                f"({_signal_name(proc.returncode)}) loading it through ColdTier"
            )
            start += 1


def _signal_name(returncode: int) -> str:
    import signal

    if returncode < 0:
        return signal.Signals(-returncode).name
    return f"exit {returncode}"


def _run_corpus(cache_dir: CacheDir, tally: Tally) -> list[tuple[str, bytes]]:
    """Load every corpus file; return them as (case file name, bytes) for the tier run."""
    out: list[tuple[str, bytes]] = []
    for case in build_corpus(cache_dir):
        out.append((f"corpus-{case.name}.case", case.data))
        path = os.path.join(
            cache_dir.caches if case.layout == "single" else cache_dir.manifests,
            f"corpus-{case.name}",
        )
        with open(path, "wb") as f:
            f.write(case.data)
        outcome = _load_checked(path, cache_dir, tally, f"corpus {case.name}")
        want = "corrupt" if case.error == "CorruptCacheError" else "miss"
        tally.add("corpus cases")
        if outcome != want:
            tally.violation(f"corpus {case.name} ({case.rule}): {outcome}, expected {want}")
        os.unlink(path)
    return out


# --------------------------------------------------------------------------- the drill


def run_hostile_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """Corpus + 100,000 mutation cases (1,000,000 with ``full``) + every header bit flip."""
    tally = Tally("hostile")
    started = time.perf_counter()
    root = workdir / "cache"
    shutil.rmtree(root, ignore_errors=True)
    cache_dir = CacheDir(str(root)).make()
    single, manifest = _base_files(cache_dir)
    _warm_up(cache_dir)
    base_rss = _max_rss()
    tier_cases = _run_corpus(cache_dir, tally)
    _bitflips(single, "single", cache_dir, tally)
    _bitflips(manifest, "blocks", cache_dir, tally)
    rng = random.Random(f"hostile/{seed}")
    target = int(os.environ.get("KVTRIO_DRILL_CASES", 0)) or (1_000_000 if full else 100_000)
    small = _small_files(cache_dir)
    bases = [_Base.of(raw, layout) for raw, layout in small]
    for case in range(target):
        base = bases[case % 2]
        roll = rng.random()
        if roll < 0.45:
            kind = "resealed"
            data = base.wrap(_mutate_doc(base, rng))
        elif roll < 0.8:
            kind = "bytes"
            data = base.wrap(_mutate_bytes(base.body, rng))
        elif roll < 0.9:
            kind = "bits"
            flipped = bytearray(base.raw[: PREAMBLE.size + len(base.body)])
            for _ in range(rng.randint(2, 8)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            data = bytes(flipped) + base.raw[len(flipped) :]
        else:
            kind = "truncated"
            data = base.raw[: rng.randrange(len(base.raw))]
        where = f"case {case} ({kind}, {base.layout})"
        tally.add("hostile cases")
        tally.add(f"hostile cases: {kind}")
        if case % _FILE_EVERY == 0:
            if len(tier_cases) < 52 + _TIER_SAMPLES:
                tier_cases.append((f"m{case:07d}.case", data))
            layout: Layout = "single" if base.layout == "single" else "blocks"
            path = cache_dir.path_of(f"m{case}", layout)
            with open(path, "wb") as f:
                f.write(data)
            outcome = _load_checked(path, cache_dir, tally, where)
            os.unlink(path)
        else:
            outcome = _memory_case(data, len(data), tally, where)
        if outcome != "escaped":
            tally.add(f"outcome: {outcome}")
    growth = _max_rss() - base_rss
    tally.set("peak RSS growth (bytes)", growth)
    if growth > _RSS_ALLOWANCE:
        tally.violation(f"the drill's peak RSS grew {growth} bytes over {_RSS_ALLOWANCE}")
    tally.set("seconds: in-process cases", round(time.perf_counter() - started, 1))
    tier_started = time.perf_counter()
    _run_tier(tier_cases, cache_dir, workdir, tally)
    tally.set("seconds: ColdTier loads", round(time.perf_counter() - tier_started, 1))
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up(cache_dir: CacheDir) -> None:
    """Load valid files once, so lazy imports and MLX start-up are not charged to a case."""
    for layout in ("single", "blocks"):
        load_hostile(cache_dir.path_of("base", layout), cache_dir)


def _bitflips(raw: bytes, layout: str, cache_dir: CacheDir, tally: Tally) -> None:
    """Every single-bit flip of the preamble and header must be detected."""
    _, header_len, _ = PREAMBLE.unpack_from(raw)[1:]
    end = PREAMBLE.size + header_len
    data = bytearray(raw)
    for bit in range(end * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        outcome = _memory_case(bytes(data), len(data), tally, f"bitflip {layout} bit {bit}")
        data[bit // 8] ^= 1 << (bit % 8)
        tally.add(f"header bit flips ({layout})")
        if outcome == "ok":
            tally.violation(f"bitflip {layout} bit {bit}: undetected")
    tally.add("hostile cases", end * 8)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "tier-child":
        sys.exit(_tier_child(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit("usage: python -m kvtrio.drill_hostile tier-child CASES_DIR TIER_ROOT START")
