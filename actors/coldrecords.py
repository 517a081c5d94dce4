"""What :class:`~kvtrio.actors.coldstore.ColdTierStore` keeps of each entry (one bytes
object, :func:`entry_record`) and the catalogue row of a manifest (:func:`header_row`):
shared by the store and its open (:mod:`kvtrio.actors.storeopen`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping

from kvtrio.actors.coldtypes import CONVERSATIONS_META
from kvtrio.storage.catalogue import CatalogueRow
from kvtrio.storage.format import Header

__all__ = [
    "DIGESTS",
    "FILE_BYTES",
    "block_names",
    "conversations_of",
    "digests",
    "entry_record",
    "file_bytes",
    "header_row",
    "manifest_bytes",
    "record_of",
]

_DIGEST = 32  # bytes of a block name (sha256)
DIGESTS = struct.Struct(f"{_DIGEST}s")  # a catalogue block list: digests end to end
FILE_BYTES = struct.Struct("<Q")  # an entry's record begins with its manifest's bytes


def entry_record(file_bytes: int, digests: bytes) -> bytes:
    """What the store keeps of an entry: its manifest's bytes (u64 little-endian), then
    its block list as the catalogue stores it (32-byte digests end to end)."""
    return FILE_BYTES.pack(file_bytes) + digests


def record_of(file_bytes: int, names: Iterable[str]) -> bytes:
    """:func:`entry_record` of block names in hex (a header's; the parser checked them as
    64 lowercase hex digits, so :func:`block_names` gives them back as they were)."""
    return entry_record(file_bytes, b"".join(map(bytes.fromhex, names)))


def digests(record: bytes) -> memoryview:
    """An entry's block list as the catalogue stores it, from its record (no copy)."""
    return memoryview(record)[FILE_BYTES.size :]


def block_names(record: bytes) -> tuple[str, ...]:
    """An entry's block names (hex), from its record (:func:`entry_record`)."""
    return tuple(digest.hex() for (digest,) in DIGESTS.iter_unpack(digests(record)))


def file_bytes(record: bytes) -> int:
    """An entry's manifest bytes, from its record (:func:`entry_record`)."""
    size: int = FILE_BYTES.unpack_from(record)[0]
    return size


def manifest_bytes(records: Iterable[bytes]) -> int:
    return sum(map(file_bytes, records))


def conversations_of(meta: Mapping[str, str]) -> tuple[str, ...]:
    """The conversation ids a header's meta names (none when absent or malformed)."""
    try:
        names = json.loads(meta.get(CONVERSATIONS_META, "[]"))
    except ValueError:
        return ()
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return ()
    return tuple(names)


def header_row(key: str, header: Header, file_bytes: int, last_use: float) -> CatalogueRow:
    return CatalogueRow(
        key=key,
        model_id=header.model_id or "",
        fingerprint=header.config_fingerprint or "",
        tokens=header.tokens,
        trimmable=header.trimmable,
        min_offset=header.min_reusable_offset,
        conversations=conversations_of(header.meta),
        file_bytes=file_bytes,
        last_use=last_use,
        blocks=tuple(
            (ref.sha256, ref.nbytes) for slot in header.slots() for ref in slot.blocks or ()
        ),
    )
