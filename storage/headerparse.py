"""Reading a header: every rule of the untrusted input checked in one place.

Theory of operation (docs/format.md's validation rules, docs/design.md invariant 4, kept by
:func:`parse_header`; the records and constants are :mod:`kvtrio.storage.format`'s):

1. Nothing in the header is trusted before the preamble (magic, version, length cap,
   header inside the file) and the header's xxh3-64 have been checked.
2. The JSON is parsed strictly: UTF-8 only, no duplicate keys, no NaN/Infinity,
   bounded nesting (a RecursionError is a corrupt file, not a crash).
3. Every field is type-checked and bounded: dtypes from a closed list; ndim, dims,
   counts and token values bounded; ``prod(shape) * itemsize == bytes`` in exact
   integer arithmetic; offsets aligned, inside the file and non-overlapping;
   block names fullmatch ``[0-9a-f]{64}``.
4. Every failure is a :class:`~kvtrio.errors.CorruptCacheError` whose message starts
   with the name of the field at fault (``"caches[2].tensors[0].shape: ..."``).
5. A single-file cache is exactly as long as its header implies (:func:`file_sizes`):
   a file cut short, even inside the last tensor's padding, is corrupt.
6. Write what you can read: :func:`check_writable` runs these same rules over a header
   a writer is about to publish (and checks that every layer's offset equals the token
   count), before a byte is written; :func:`check_token_ids` and :func:`check_meta`
   check a caller's arguments with the bounds the reader applies.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Any, Final

import attrs
import xxhash
from kvtrio.errors import CorruptCacheError, NewerFormatError
from kvtrio.storage.blockstore import BLOCK_NAME_RE
from kvtrio.storage.format import (
    _HEX16,
    ALIGN,
    BLOCK_XXH3_VERSION,
    CODEC_ID,
    DTYPE_SIZES,
    MAGIC,
    MAX_ATTACHMENTS,
    MAX_BLOCK_BYTES,
    MAX_BLOCKS_PER_TENSOR,
    MAX_DEPTH,
    MAX_DIM,
    MAX_ENTRIES,
    MAX_FIELDS,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_META,
    MAX_NDIM,
    MAX_STRING,
    MAX_TENSOR_BYTES,
    MAX_TENSORS_PER_ENTRY,
    MAX_TOKEN_VALUE,
    MAX_TOKENS,
    PREAMBLE,
    SUPPORTED_VERSIONS,
    TAIL_ALIGN,
    Attachment,
    BlockRef,
    CacheEntry,
    FieldValue,
    Header,
    Layout,
    TensorSlot,
    align_up,
    piece_nbytes,
    piece_ranges,
)

__all__ = [
    "Preamble",
    "file_sizes",
    "nth_slot",
    "parse_header",
    "parse_preamble",
    "slot_names",
]


@attrs.frozen
class Preamble:
    """The checked preamble: format version, header length and hash, where data starts."""

    version: int
    header_len: int
    header_xxh3: int

    @property
    def data_start(self) -> int:
        return align_up(PREAMBLE.size + self.header_len)


def parse_preamble(raw: bytes, file_size: int) -> Preamble:
    """Check the preamble of a file of ``file_size`` bytes (rule 1)."""
    if len(raw) < PREAMBLE.size or file_size < PREAMBLE.size:
        raise CorruptCacheError(
            f"preamble: file is {file_size} bytes, shorter than the {PREAMBLE.size}-byte preamble"
        )
    magic, version, header_len, header_xxh3 = PREAMBLE.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptCacheError(f"preamble.magic: not a kvtrio cache file ({magic!r})")
    if version not in SUPPORTED_VERSIONS:
        # A version past every one this library reads is a newer kvtrio's file, kept by
        # whoever finds it; any other unknown number is damage.
        error = NewerFormatError if version > max(SUPPORTED_VERSIONS) else CorruptCacheError
        raise error(
            f"preamble.format_version: unsupported version {version} "
            f"(this library reads {sorted(SUPPORTED_VERSIONS)})"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CorruptCacheError(
            f"preamble.header_length: {header_len} bytes is over the {MAX_HEADER_BYTES}-byte cap"
        )
    if PREAMBLE.size + header_len > file_size:
        raise CorruptCacheError(
            f"preamble.header_length: header of {header_len} bytes runs past the end of a "
            f"{file_size}-byte file"
        )
    return Preamble(version=version, header_len=header_len, header_xxh3=header_xxh3)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # in C; a duplicate key leaves fewer keys than pairs
    if len(out) == len(pairs):
        return out
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise CorruptCacheError(f"header: duplicate JSON key {key!r:.80}")
        seen.add(key)
    raise AssertionError("unreachable: fewer keys than pairs, and no key repeated")


def _no_constants(name: str) -> Any:
    raise CorruptCacheError(f"header: non-finite number {name} is not allowed")


# A JSON string, possibly unterminated (it then runs to the end, as a scanner would see it).
_JSON_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
# Everything but the four bracket bytes, deleted in one pass.
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
# +1 for an opening bracket, -1 for a closing one.
_BRACKET_DELTA: Final = {0x5B: 1, 0x7B: 1, 0x5D: -1, 0x7D: -1}


def _json_depth_ok(raw: bytes) -> bool:
    """Whether the bracket nesting outside JSON strings stays within MAX_JSON_DEPTH.

    Strings are cut out by one regex and every other non-bracket byte by one translate
    (both in C), so only the brackets themselves are counted in Python: a header's size
    (e.g. a long token list) costs no per-byte Python work.
    """
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_BRACKET_DELTA.__getitem__, brackets)), default=0) <= MAX_JSON_DEPTH


def _load_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCacheError(f"header: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not _json_depth_ok(body):
        raise CorruptCacheError(f"header: JSON nested deeper than {MAX_JSON_DEPTH}")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except CorruptCacheError:
        raise
    except (ValueError, RecursionError) as exc:
        raise CorruptCacheError(f"header: invalid JSON ({str(exc)[:120]})") from None


class _Fields:
    """Typed access to one JSON object, naming the field path in every error."""

    def __init__(self, obj: Any, path: str, allowed: frozenset[str]) -> None:
        if not isinstance(obj, dict):
            raise CorruptCacheError(f"{path}: expected an object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise CorruptCacheError(f"{path}.{unknown[0]}: unknown field")
        self.obj: dict[str, Any] = obj
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str) -> Any:
        if key not in self.obj:
            raise CorruptCacheError(f"{self.name(key)}: missing")
        return self.obj[key]

    def f_int(self, key: str, lo: int, hi: int) -> int:
        return _check_int(self.get(key), self.name(key), lo, hi)

    def f_opt_int(self, key: str, lo: int, hi: int) -> int | None:
        value = self.obj.get(key)
        return None if value is None else _check_int(value, self.name(key), lo, hi)

    def f_str(self, key: str) -> str:
        return _check_str(self.get(key), self.name(key))

    def f_opt_str(self, key: str) -> str | None:
        value = self.obj.get(key)
        return None if value is None else _check_str(value, self.name(key))

    def f_bool(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise CorruptCacheError(f"{self.name(key)}: expected a boolean")
        return value

    def f_list(self, key: str, max_len: int) -> list[Any]:
        value = self.get(key)
        if not isinstance(value, list):
            raise CorruptCacheError(f"{self.name(key)}: expected a list")
        if len(value) > max_len:
            raise CorruptCacheError(f"{self.name(key)}: {len(value)} items, over the cap {max_len}")
        return value


def _check_int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptCacheError(f"{name}: expected an integer")
    if not lo <= value <= hi:
        raise CorruptCacheError(f"{name}: {value} is outside [{lo}, {hi}]")
    return value


def _check_tokens(values: list[Any]) -> tuple[int, ...]:
    """Validate the token list in C-speed passes (rule: token values bounded).

    ``type(t) is int`` excludes booleans; a JSON document only holds int, float, str,
    bool, None, list and dict, so one set of types and one min/max decide the whole list.
    Only on failure is the list walked again to name the first offending ``tokens[i]``.
    """
    if not values:
        return ()
    if set(map(type, values)) == {int} and (min(values) >= 0 and max(values) <= MAX_TOKEN_VALUE):
        return tuple(values)
    for i, t in enumerate(values):
        _check_int(t, f"tokens[{i}]", 0, MAX_TOKEN_VALUE)
    raise AssertionError("unreachable: the fast check failed but every token passed")


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise CorruptCacheError(f"{name}: expected a string")
    if len(value) > MAX_STRING:
        raise CorruptCacheError(f"{name}: string of {len(value)} chars, over the cap {MAX_STRING}")
    return value


def _check_str_map(value: Any, name: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise CorruptCacheError(f"{name}: expected an object")
    if len(value) > MAX_META:
        raise CorruptCacheError(f"{name}: {len(value)} keys, over the cap {MAX_META}")
    return {_check_str(k, name): _check_str(v, f"{name}.{k}") for k, v in value.items()}


_SLOT_KEYS = frozenset({"shape", "dtype", "bytes", "token_axis", "off", "xxh3", "blocks"})
_ENTRY_KEYS = frozenset(
    {"kind", "offset", "min_reusable_offset", "trimmable", "fields", "tensors", "children"}
)
_HEADER_KEYS = frozenset(
    {
        "format_version",
        "codec",
        "layout",
        "model_id",
        "config_fingerprint",
        "created_at",
        "block_tokens",
        "tokens",
        "meta",
        "caches",
        "attachments",
    }
)


@attrs.frozen
class _Placement:
    """How the header's version and layout place its tensors: ``block_xxh3``, whether
    every block reference carries its block's xxh3-64 (the blocks layout from format
    version 2 on: exactly then, so a version-1 reader's rules still hold for version 1)."""

    layout: Layout
    block_xxh3: bool


def _parse_slot(obj: Any, path: str, placement: _Placement) -> TensorSlot:
    layout = placement.layout
    f = _Fields(obj, path, _SLOT_KEYS)
    dtype = f.f_str("dtype")
    if dtype not in DTYPE_SIZES:
        raise CorruptCacheError(f"{f.name('dtype')}: {dtype!r:.40} is not in the dtype list")
    dims = f.f_list("shape", MAX_NDIM)
    shape = tuple(_check_int(d, f"{f.name('shape')}[{i}]", 0, MAX_DIM) for i, d in enumerate(dims))
    nbytes = f.f_int("bytes", 0, MAX_TENSOR_BYTES)
    if math.prod(shape) * DTYPE_SIZES[dtype] != nbytes:
        raise CorruptCacheError(
            f"{f.name('bytes')}: {nbytes} != prod(shape {list(shape)}) * itemsize of {dtype}"
        )
    token_axis = f.f_opt_int("token_axis", 0, max(len(shape) - 1, 0))
    if token_axis is not None and not shape:
        raise CorruptCacheError(f"{f.name('token_axis')}: a 0-d tensor has no token axis")
    if layout == "single":
        if "blocks" in f.obj:
            raise CorruptCacheError(f"{f.name('blocks')}: not allowed in the single layout")
        off = f.f_int("off", 0, MAX_TENSOR_BYTES)
        if off % ALIGN:
            raise CorruptCacheError(f"{f.name('off')}: {off} is not a multiple of {ALIGN}")
        digest = f.f_str("xxh3")
        if len(digest) != 16 or not set(digest) <= _HEX16:
            raise CorruptCacheError(f"{f.name('xxh3')}: not 16 lowercase hex digits")
        return TensorSlot(shape, dtype, nbytes, token_axis, off=off, xxh3=digest)
    if "off" in f.obj or "xxh3" in f.obj:
        raise CorruptCacheError(f"{path}: off/xxh3 are not allowed in the blocks layout")
    raw_blocks = f.f_list("blocks", MAX_BLOCKS_PER_TENSOR)
    with_xxh3 = placement.block_xxh3
    refs = _plain_block_refs(raw_blocks, with_xxh3)
    if refs is None:  # something in the list is off: the field by field walk names it
        refs = [
            _block_ref(raw, f"{f.name('blocks')}[{i}]", with_xxh3)
            for i, raw in enumerate(raw_blocks)
        ]
    total = sum(ref.nbytes for ref in refs)
    if total != nbytes:
        raise CorruptCacheError(f"{f.name('blocks')}: blocks hold {total} bytes, slot has {nbytes}")
    return TensorSlot(shape, dtype, nbytes, token_axis, blocks=tuple(refs))


_BLOCK_KEYS_V1: Final = frozenset({"sha256", "bytes"})
_BLOCK_KEYS: Final = frozenset({"sha256", "bytes", "xxh3"})
_XXH3_RE: Final = re.compile(r"[0-9a-f]{16}")


def _block_ref(raw: Any, path: str, with_xxh3: bool) -> BlockRef:
    """One block reference, field by field (each fault named by its path)."""
    b = _Fields(raw, path, _BLOCK_KEYS if with_xxh3 else _BLOCK_KEYS_V1)
    name = b.f_str("sha256")
    if BLOCK_NAME_RE.fullmatch(name) is None:
        raise CorruptCacheError(f"{b.name('sha256')}: not 64 lowercase hex digits: {name!r:.80}")
    nbytes = b.f_int("bytes", 0, MAX_BLOCK_BYTES)
    if not with_xxh3:
        return BlockRef(name, nbytes)
    digest = b.f_str("xxh3")
    if _XXH3_RE.fullmatch(digest) is None:
        raise CorruptCacheError(f"{b.name('xxh3')}: not 16 lowercase hex digits")
    return BlockRef(name, nbytes, digest)


def _plain_block_refs(raw: list[Any], with_xxh3: bool) -> list[BlockRef] | None:
    """A tensor's block references in one pass, when every item is well formed (an object
    of exactly ``sha256``, 64 lowercase hex digits, ``bytes``, an int in
    ``[0, MAX_BLOCK_BYTES]``, and with ``with_xxh3`` ``xxh3``, 16 lowercase hex digits:
    what the field by field walk accepts); None as soon as one is not, so that the walk
    can name it. A long entry has hundreds of references."""
    refs: list[BlockRef] = []
    name_ok = BLOCK_NAME_RE.fullmatch
    digest_ok = _XXH3_RE.fullmatch
    keys = _BLOCK_KEYS if with_xxh3 else _BLOCK_KEYS_V1
    for item in raw:
        if type(item) is not dict or item.keys() != keys:
            return None
        name, size = item["sha256"], item["bytes"]
        if type(name) is not str or type(size) is not int or not 0 <= size <= MAX_BLOCK_BYTES:
            return None
        if name_ok(name) is None:
            return None
        if not with_xxh3:
            refs.append(BlockRef(name, size))
            continue
        digest = item["xxh3"]
        if type(digest) is not str or digest_ok(digest) is None:
            return None
        refs.append(BlockRef(name, size, digest))
    return refs


def _parse_field_value(value: Any, name: str) -> FieldValue:
    if value is None or isinstance(value, bool | str):
        return _check_str(value, name) if isinstance(value, str) else value
    if isinstance(value, int):
        return _check_int(value, name, -MAX_TENSOR_BYTES, MAX_TENSOR_BYTES)
    if isinstance(value, list):
        if len(value) > MAX_TENSORS_PER_ENTRY:
            raise CorruptCacheError(f"{name}: list of {len(value)} items, over the cap")
        items: list[int | bool | str | None] = []
        for i, item in enumerate(value):
            parsed = _parse_field_value(item, f"{name}[{i}]")
            if isinstance(parsed, tuple):
                raise CorruptCacheError(f"{name}[{i}]: nested lists are not allowed")
            items.append(parsed)
        return tuple(items)
    raise CorruptCacheError(f"{name}: unsupported value type {type(value).__name__}")


class _Budget:
    """Counts entries across the whole header, so nesting cannot multiply the caps."""

    def __init__(self) -> None:
        self.entries = 0


def _parse_entry(
    obj: Any, path: str, placement: _Placement, depth: int, budget: _Budget
) -> CacheEntry:
    f = _Fields(obj, path, _ENTRY_KEYS)
    budget.entries += 1
    if budget.entries > MAX_ENTRIES:
        raise CorruptCacheError(f"{path}: more than {MAX_ENTRIES} cache entries")
    kind = f.f_str("kind")
    if not kind:
        raise CorruptCacheError(f"{f.name('kind')}: empty (every writer names its kind)")
    offset = f.f_int("offset", 0, MAX_TOKENS)
    min_offset = f.f_int("min_reusable_offset", 0, MAX_TOKENS)
    if min_offset > offset:
        raise CorruptCacheError(
            f"{f.name('min_reusable_offset')}: {min_offset} is past the offset {offset}"
        )
    trimmable = f.f_bool("trimmable")
    raw_fields = f.get("fields")
    if not isinstance(raw_fields, dict):
        raise CorruptCacheError(f"{f.name('fields')}: expected an object")
    if len(raw_fields) > MAX_FIELDS:
        raise CorruptCacheError(f"{f.name('fields')}: {len(raw_fields)} keys, over the cap")
    fields = {
        _check_str(k, f.name("fields")): _parse_field_value(v, f"{f.name('fields')}.{k}")
        for k, v in raw_fields.items()
    }
    tensors = tuple(
        _parse_slot(s, f"{f.name('tensors')}[{i}]", placement)
        for i, s in enumerate(f.f_list("tensors", MAX_TENSORS_PER_ENTRY))
    )
    raw_children = f.f_list("children", MAX_ENTRIES)
    if raw_children and depth >= MAX_DEPTH:
        raise CorruptCacheError(f"{f.name('children')}: nested deeper than {MAX_DEPTH}")
    children = tuple(
        _parse_entry(c, f"{f.name('children')}[{i}]", placement, depth + 1, budget)
        for i, c in enumerate(raw_children)
    )
    return CacheEntry(kind, offset, min_offset, trimmable, fields, tensors, children)


def parse_header(body: bytes, preamble: Preamble, file_size: int) -> Header:
    """Check the header bytes against the preamble, parse and validate every field.

    ``file_size`` bounds the single layout's tensors (rule 3): every tensor lies inside
    ``[data_start, file_size)`` and no two overlap. Raises CorruptCacheError naming the field.
    """
    if len(body) != preamble.header_len:
        raise CorruptCacheError(
            f"header: read {len(body)} bytes, preamble says {preamble.header_len}"
        )
    if xxhash.xxh3_64_intdigest(body) != preamble.header_xxh3:
        raise CorruptCacheError("header: xxh3 mismatch (truncated or corrupt header)")
    doc = _load_json(body)
    f = _Fields(doc, "", _HEADER_KEYS)
    version = f.f_int("format_version", 0, 1 << 31)
    if version != preamble.version:
        raise CorruptCacheError(
            f"format_version: header says {version}, preamble says {preamble.version}"
        )
    codec = f.f_str("codec")
    if codec != CODEC_ID:
        raise CorruptCacheError(f"codec: unknown codec id {codec!r:.80}")
    layout, block_tokens = _parse_layout(f)
    created_at = f.get("created_at")
    if isinstance(created_at, bool) or not isinstance(created_at, int | float):
        raise CorruptCacheError("created_at: expected a number")
    tokens = _check_tokens(f.f_list("tokens", MAX_TOKENS))
    meta = _check_str_map(f.get("meta"), "meta")
    budget = _Budget()
    placement = _Placement(layout, layout == "blocks" and version >= BLOCK_XXH3_VERSION)
    caches = tuple(
        _parse_entry(e, f"caches[{i}]", placement, 1, budget)
        for i, e in enumerate(f.f_list("caches", MAX_ENTRIES))
    )
    attachments = [
        _parse_attachment(raw, f"attachments[{i}]", placement)
        for i, raw in enumerate(f.f_list("attachments", MAX_ATTACHMENTS))
    ]
    header = Header(
        layout=layout,
        tokens=tokens,
        caches=caches,
        created_at=float(created_at),
        model_id=f.f_opt_str("model_id"),
        config_fingerprint=f.f_opt_str("config_fingerprint"),
        attachments=tuple(attachments),
        meta=meta,
        block_tokens=block_tokens,
        codec=codec,
        format_version=version,
    )
    if layout == "single":
        _check_placement(header, preamble.data_start, file_size)
    else:
        if file_size != PREAMBLE.size + preamble.header_len:
            raise CorruptCacheError(
                f"header: the manifest is {file_size} bytes, its preamble implies "
                f"{PREAMBLE.size + preamble.header_len}"
            )
        _check_blocks(header)
    return header


def _parse_layout(f: _Fields) -> tuple[Layout, int | None]:
    """The header's ``layout`` and ``block_tokens`` (present exactly in the blocks layout)."""
    layout_raw = f.f_str("layout")
    if layout_raw not in ("single", "blocks"):
        raise CorruptCacheError(f"layout: unknown layout {layout_raw!r:.40}")
    layout: Layout = "single" if layout_raw == "single" else "blocks"
    block_tokens = f.f_opt_int("block_tokens", 1, MAX_TOKENS)
    if layout == "blocks" and block_tokens is None:
        raise CorruptCacheError("block_tokens: missing in the blocks layout")
    if layout == "single" and block_tokens is not None:
        raise CorruptCacheError("block_tokens: not allowed in the single layout")
    return layout, block_tokens


def _parse_attachment(raw: Any, path: str, placement: _Placement) -> Attachment:
    a = _Fields(raw, path, frozenset({"schema", "metadata", "tensors"}))
    return Attachment(
        schema=a.f_str("schema"),
        metadata=_check_str_map(a.get("metadata"), a.name("metadata")),
        tensors=tuple(
            _parse_slot(s, f"{a.name('tensors')}[{j}]", placement)
            for j, s in enumerate(a.f_list("tensors", MAX_TENSORS_PER_ENTRY))
        ),
    )


def _check_blocks(header: Header) -> None:
    for slot, name in zip(header.slots(), slot_names(header), strict=True):
        ranges = piece_ranges(slot, header.block_tokens)
        refs = slot.blocks or ()
        if len(refs) != len(ranges):
            raise CorruptCacheError(
                f"{name}.blocks: {len(refs)} blocks, the tensor has {len(ranges)} token blocks"
            )
        for j, (ref, (start, stop)) in enumerate(zip(refs, ranges, strict=True)):
            if ref.nbytes != piece_nbytes(slot, start, stop):
                raise CorruptCacheError(
                    f"{name}.blocks[{j}].bytes: {ref.nbytes} != the token block's "
                    f"{piece_nbytes(slot, start, stop)}"
                )


def _check_placement(header: Header, data_start: int, file_size: int) -> None:
    named = [(slot, name) for slot, name in zip(header.slots(), slot_names(header), strict=True)]
    data_len = file_size - data_start
    if named and data_len < 0:
        raise CorruptCacheError(f"header: data starts at {data_start}, past the end of the file")
    end_prev = 0
    for slot, name in sorted(named, key=lambda sn: (sn[0].off or 0, sn[0].nbytes)):
        off = slot.off or 0
        if off + slot.nbytes > data_len:
            raise CorruptCacheError(
                f"{name}.off: tensor [{off}, {off + slot.nbytes}) runs past the data "
                f"({data_len} bytes)"
            )
        if off < end_prev:
            raise CorruptCacheError(f"{name}.off: tensor at {off} overlaps the previous tensor")
        end_prev = off + slot.nbytes
    sizes = file_sizes(header, data_start)
    if file_size not in sizes:
        raise CorruptCacheError(
            f"header: the file is {file_size} bytes, its header implies "
            f"{' or '.join(str(n) for n in sizes)} (truncated or padded)"
        )


def file_sizes(header: Header, data_start: int) -> tuple[int, ...]:
    """The lengths a single-file cache with this (placed) header may have (rule 5).

    The file ends where its last non-empty tensor ends, that end rounded up to
    :data:`TAIL_ALIGN` (what this library writes), or at ``data_start`` when no tensor
    holds a byte. Two lengths, because format version 1 files written before the tail
    padding end at the last tensor's last byte; both hold every byte the header names.
    """
    end = max(
        (data_start + (s.off or 0) + s.nbytes for s in header.slots() if s.nbytes),
        default=data_start,
    )
    padded = align_up(end, TAIL_ALIGN) if end > data_start else end
    return (end,) if padded == end else (end, padded)


def nth_slot(header: Header, index: int) -> TensorSlot:
    """Slot ``index`` of :meth:`Header.slots` (IndexError when there is no such slot)."""
    for i, slot in enumerate(header.slots()):
        if i == index:
            return slot
    raise IndexError(index)


def slot_names(header: Header) -> Iterator[str]:
    """The header path of every slot, in :meth:`Header.slots` order (for error messages)."""

    def entry(e: CacheEntry, path: str) -> Iterator[str]:
        for j in range(len(e.tensors)):
            yield f"{path}.tensors[{j}]"
        for k, child in enumerate(e.children):
            yield from entry(child, f"{path}.children[{k}]")

    for i, e in enumerate(header.caches):
        yield from entry(e, f"caches[{i}]")
    for i, a in enumerate(header.attachments):
        for j in range(len(a.tensors)):
            yield f"attachments[{i}].tensors[{j}]"
