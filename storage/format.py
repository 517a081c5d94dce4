"""The on-disk format of a kvtrio cache: preamble, JSON header, aligned tensors.

A cache file (layout ``"single"``) is::

    preamble   24 bytes: magic b"KVTRIO\\r\\n", u32 format version, u32 header length,
               u64 xxh3-64 of the header bytes (all little-endian)
    header     UTF-8 JSON, ``header length`` bytes
    padding    zeros up to the next 16 KiB boundary (``data_start``)
    tensors    each at ``data_start + slot.off``, ``off`` a multiple of 16 KiB

A manifest (layout ``"blocks"``) is the preamble and header alone; each tensor slot
names a list of sha256 blocks held by a :class:`~kvtrio.storage.blockstore.BlockStore`.
docs/format.md is the user-facing description.

The untrusted-header rules are kept by :mod:`kvtrio.storage.headerparse`; writers check
what they publish with the same rules (:mod:`kvtrio.storage.writable`).

Records are frozen attrs classes. A *plan* header (from ``cacheio.snapshot``) has slots
without placement (``off``/``xxh3``/``blocks`` all ``None``); the writers return the
*placed* header they wrote. ``encode_header`` + ``parse_header`` round-trip placed headers.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Literal

import attrs
import xxhash
from kvtrio.storage.dtypes import DTYPES

__all__ = [
    "ALIGN",
    "BLOCK_XXH3_VERSION",
    "CODEC_ID",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PREAMBLE",
    "SUPPORTED_VERSIONS",
    "Attachment",
    "BlockRef",
    "CacheEntry",
    "FieldValue",
    "Header",
    "Layout",
    "TensorSlot",
    "align_up",
    "encode_file_prefix",
    "encode_header",
    "encode_preamble",
    "place_single",
    "piece_nbytes",
    "piece_ranges",
    "xxh3_hex",
]

MAGIC: Final = b"KVTRIO\r\n"
FORMAT_VERSION: Final = 2
#: Every format version this library reads. A version, once written, stays here forever.
SUPPORTED_VERSIONS: Final = frozenset({1, 2})
#: The first version whose block references carry their block's xxh3-64 (every one of
#: them, in the blocks layout); version 1's carry none and are verified by sha256 alone.
BLOCK_XXH3_VERSION: Final = 2
CODEC_ID: Final = "kvtrio-mlx-1"
ALIGN: Final = 16 * 1024
PREAMBLE: Final = struct.Struct("<8sIIQ")
MAX_HEADER_BYTES: Final = 64 * 1024 * 1024

# Bounds for untrusted headers. Generous for real caches, small enough that a crafted
# header cannot make the reader loop or allocate without limit.
MAX_TOKENS: Final = 1 << 24
MAX_TOKEN_VALUE: Final = (1 << 31) - 1
MAX_ENTRIES: Final = 4096
MAX_DEPTH: Final = 4
MAX_TENSORS_PER_ENTRY: Final = 64
MAX_ATTACHMENTS: Final = 256
MAX_NDIM: Final = 8
MAX_DIM: Final = 1 << 40
MAX_TENSOR_BYTES: Final = 1 << 44
MAX_BLOCKS_PER_TENSOR: Final = 1 << 20
MAX_BLOCK_BYTES: Final = 1 << 30
MAX_FIELDS: Final = 64
MAX_STRING: Final = 4096
MAX_META: Final = 256
MAX_JSON_DEPTH: Final = 64
# Writers pad each tensor's tail to this boundary (storage.writer); a file written before
# they did ends at its last tensor's last byte (tests/golden/v1).
TAIL_ALIGN: Final = 4096

#: The closed list of dtypes and their item sizes (MLX names; :mod:`kvtrio.storage.dtypes`).
DTYPE_SIZES: Final[Mapping[str, int]] = {d.name: d.itemsize for d in DTYPES}

Layout = Literal["single", "blocks"]
#: Per-kind header fields hold JSON scalars or short lists of them.
FieldValue = int | bool | str | None | tuple[int | bool | str | None, ...]

_HEX16 = frozenset("0123456789abcdef")


def align_up(n: int, align: int = ALIGN) -> int:
    """The smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


def xxh3_hex(data: Any) -> str:
    """xxh3-64 of a buffer as 16 lowercase hex digits (releases the GIL on large buffers)."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


@attrs.frozen
class BlockRef:
    """One content-addressed block of a tensor: its sha256 name, byte count and (format
    version 2 on) the xxh3-64 of its bytes, by which a load from a store that only its
    own process writes verifies it (docs/format.md, validation rule 10)."""

    sha256: str
    nbytes: int
    xxh3: str | None = None


@attrs.frozen
class TensorSlot:
    """One tensor: what it is, and (once placed) where its bytes are and their hash.

    ``token_axis`` names the axis along which the block layout splits the tensor into
    token blocks (KV tensors: 2), or None for tensors stored as one block.
    Single layout: ``off`` (from ``data_start``, 16 KiB aligned) and ``xxh3`` are set.
    Block layout: ``blocks`` is set, in piece order (see :func:`piece_ranges`).
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    token_axis: int | None = None
    off: int | None = None
    xxh3: str | None = None
    blocks: tuple[BlockRef, ...] | None = None


@attrs.frozen
class CacheEntry:
    """One cache layer: its kind, offsets, per-kind fields, tensors and nested caches."""

    kind: str
    offset: int
    min_reusable_offset: int
    trimmable: bool
    fields: Mapping[str, FieldValue]
    tensors: tuple[TensorSlot, ...]
    children: tuple[CacheEntry, ...] = ()


@attrs.frozen
class Attachment:
    """Extra tensors saved beside the caches (e.g. a model's recurrent side state)."""

    schema: str
    metadata: Mapping[str, str]
    tensors: tuple[TensorSlot, ...]


@attrs.frozen
class Header:
    """The whole header. ``tokens`` are the prompt tokens the caches hold."""

    layout: Layout
    tokens: tuple[int, ...]
    caches: tuple[CacheEntry, ...]
    created_at: float
    model_id: str | None = None
    config_fingerprint: str | None = None
    attachments: tuple[Attachment, ...] = ()
    meta: Mapping[str, str] = attrs.field(factory=dict)
    block_tokens: int | None = None
    codec: str = CODEC_ID
    format_version: int = FORMAT_VERSION

    def slots(self) -> Iterator[TensorSlot]:
        """Every tensor slot in file order: caches depth-first, then attachments."""
        for entry in self.caches:
            yield from _entry_slots(entry)
        for attachment in self.attachments:
            yield from attachment.tensors

    @property
    def min_reusable_offset(self) -> int:
        """The largest minimum reusable offset of any layer: never trim below it."""
        return max((_entry_min_offset(e) for e in self.caches), default=0)

    @property
    def trimmable(self) -> bool:
        """Whether every layer may be trimmed (a wrapped rotating cache may not)."""
        return all(_entry_trimmable(e) for e in self.caches)

    @property
    def nbytes(self) -> int:
        """Total tensor bytes."""
        return sum(slot.nbytes for slot in self.slots())

    def with_slots(self, slots: Sequence[TensorSlot]) -> Header:
        """This header with its slots (in :meth:`slots` order) replaced by ``slots``."""
        it = iter(slots)
        caches = tuple(_replace_entry_slots(e, it) for e in self.caches)
        attachments = tuple(
            attrs.evolve(a, tensors=tuple(next(it) for _ in a.tensors)) for a in self.attachments
        )
        if next(it, None) is not None:
            raise ValueError("more slots than the header has")
        return attrs.evolve(self, caches=caches, attachments=attachments)


def _entry_slots(entry: CacheEntry) -> Iterator[TensorSlot]:
    yield from entry.tensors
    for child in entry.children:
        yield from _entry_slots(child)


def _entry_min_offset(entry: CacheEntry) -> int:
    return max([entry.min_reusable_offset, *(_entry_min_offset(c) for c in entry.children)])


def _entry_trimmable(entry: CacheEntry) -> bool:
    return entry.trimmable and all(_entry_trimmable(c) for c in entry.children)


def _replace_entry_slots(entry: CacheEntry, it: Iterator[TensorSlot]) -> CacheEntry:
    tensors = tuple(next(it) for _ in entry.tensors)
    children = tuple(_replace_entry_slots(c, it) for c in entry.children)
    return attrs.evolve(entry, tensors=tensors, children=children)


def piece_ranges(slot: TensorSlot, block_tokens: int | None) -> list[tuple[int, int]]:
    """The token ranges ``[start, stop)`` of a slot's pieces in the block layout.

    A tensor with a ``token_axis`` is split every ``block_tokens`` tokens (the last piece
    may be short); any other tensor, or any tensor when ``block_tokens`` is None, is one
    piece covering its whole extent along axis 0 (or ``(0, 0)`` for a 0-d tensor).
    A tensor with zero tokens still has one (empty) piece.
    """
    if slot.token_axis is None or block_tokens is None:
        return [(0, slot.shape[0] if slot.shape else 0)]
    n = slot.shape[slot.token_axis]
    if n == 0:
        return [(0, 0)]
    return [(start, min(start + block_tokens, n)) for start in range(0, n, block_tokens)]


def piece_nbytes(slot: TensorSlot, start: int, stop: int) -> int:
    """Bytes of the piece of ``slot`` covering tokens ``[start, stop)``."""
    if slot.token_axis is None:
        return slot.nbytes
    other = math.prod(d for i, d in enumerate(slot.shape) if i != slot.token_axis)
    return other * (stop - start) * DTYPE_SIZES[slot.dtype]


def place_single(header: Header) -> Header:
    """Assign 16 KiB-aligned offsets to every slot (hashes still unset), layout single."""
    placed: list[TensorSlot] = []
    cursor = 0
    for slot in header.slots():
        placed.append(attrs.evolve(slot, off=cursor, xxh3=None, blocks=None))
        cursor = align_up(cursor + slot.nbytes)
    return attrs.evolve(header.with_slots(placed), layout="single", block_tokens=None)


# --------------------------------------------------------------------------- encoding


def _slot_json(slot: TensorSlot, layout: Layout) -> dict[str, Any]:
    out: dict[str, Any] = {
        "shape": list(slot.shape),
        "dtype": slot.dtype,
        "bytes": slot.nbytes,
        "token_axis": slot.token_axis,
    }
    if layout == "single":
        out["off"] = slot.off
        # Fixed width either way, so a header encodes to the same length before and
        # after its hashes are known.
        out["xxh3"] = slot.xxh3 if slot.xxh3 is not None else "0" * 16
    else:
        out["blocks"] = [_block_json(b) for b in slot.blocks or ()]
    return out


def _block_json(ref: BlockRef) -> dict[str, Any]:
    if ref.xxh3 is None:  # format version 1
        return {"sha256": ref.sha256, "bytes": ref.nbytes}
    return {"sha256": ref.sha256, "bytes": ref.nbytes, "xxh3": ref.xxh3}


def _field_json(value: FieldValue) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _entry_json(entry: CacheEntry, layout: Layout) -> dict[str, Any]:
    return {
        "kind": entry.kind,
        "offset": entry.offset,
        "min_reusable_offset": entry.min_reusable_offset,
        "trimmable": entry.trimmable,
        "fields": {k: _field_json(v) for k, v in sorted(entry.fields.items())},
        "tensors": [_slot_json(s, layout) for s in entry.tensors],
        "children": [_entry_json(c, layout) for c in entry.children],
    }


def encode_header(header: Header) -> bytes:
    """The header's canonical UTF-8 JSON bytes."""
    doc = {
        "format_version": header.format_version,
        "codec": header.codec,
        "layout": header.layout,
        "model_id": header.model_id,
        "config_fingerprint": header.config_fingerprint,
        "created_at": header.created_at,
        "block_tokens": header.block_tokens,
        "tokens": list(header.tokens),
        "meta": dict(sorted(header.meta.items())),
        "caches": [_entry_json(e, header.layout) for e in header.caches],
        "attachments": [
            {
                "schema": a.schema,
                "metadata": dict(sorted(a.metadata.items())),
                "tensors": [_slot_json(s, header.layout) for s in a.tensors],
            }
            for a in header.attachments
        ],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def encode_preamble(header_bytes: bytes, version: int = FORMAT_VERSION) -> bytes:
    """The 24-byte preamble for ``header_bytes``."""
    return PREAMBLE.pack(MAGIC, version, len(header_bytes), xxhash.xxh3_64_intdigest(header_bytes))


def encode_file_prefix(header: Header) -> tuple[bytes, int]:
    """Preamble + header + zero padding, and ``data_start`` (its length)."""
    body = encode_header(header)
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"header is {len(body)} bytes, over the {MAX_HEADER_BYTES}-byte cap")
    prefix = encode_preamble(body, header.format_version) + body
    data_start = align_up(len(prefix))
    return prefix + bytes(data_start - len(prefix)), data_start
