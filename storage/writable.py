"""Write what you can read: the checks a writer runs before publishing a header.

:func:`check_writable` runs the reader's own rules
(:func:`~kvtrio.storage.headerparse.parse_header`) over the header a writer is about to
publish, and checks that every layer's offset equals the token count, before a byte is
written; :func:`check_token_ids` and :func:`check_meta`
check a caller's arguments with the bounds the reader applies (issue 15).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from kvtrio.errors import CacheMismatchError, CorruptCacheError, InvalidInputError
from kvtrio.storage.format import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    MAX_META,
    MAX_STRING,
    MAX_TOKEN_VALUE,
    MAX_TOKENS,
    PREAMBLE,
    BlockRef,
    CacheEntry,
    Header,
    align_up,
    encode_header,
    encode_preamble,
    piece_nbytes,
    piece_ranges,
    place_single,
)
from kvtrio.storage.headerparse import file_sizes, parse_header, parse_preamble

__all__ = [
    "CREATED_AT_SLACK",
    "check_meta",
    "check_str_arg",
    "check_token_ids",
    "check_writable",
    "encoded_size",
]

# The header's creation time is encoded in as many digits as its value needs; a plan's
# and the written header's may differ by this many bytes at most (repr of a float: 24).
CREATED_AT_SLACK = 24


def check_token_ids(tokens: Any, name: str = "tokens") -> tuple[int, ...]:
    """A caller's token ids as the reader will accept them, or InvalidInputError.

    Ids are integers (Python or numpy; not bool, not float: ``1.5`` is refused, never
    rounded) in ``[0, 2**31 - 1]``, at most :data:`MAX_TOKENS` of them.
    """
    try:
        values = list(tokens)
    except TypeError:
        raise InvalidInputError(f"{name}: expected a sequence of ints") from None
    if len(values) > MAX_TOKENS:
        raise InvalidInputError(f"{name}: {len(values)} tokens, over the cap {MAX_TOKENS}")
    if set(map(type, values)) <= {int} and (
        not values or (min(values) >= 0 and max(values) <= MAX_TOKEN_VALUE)
    ):
        return tuple(values)
    out: list[int] = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise InvalidInputError(f"{name}[{i}]: expected an int, got {type(value).__name__}")
        number = value.__index__()
        if not 0 <= number <= MAX_TOKEN_VALUE:
            raise InvalidInputError(f"{name}[{i}]: {number} is outside [0, {MAX_TOKEN_VALUE}]")
        out.append(number)
    return tuple(out)


def check_meta(meta: Mapping[Any, Any], name: str = "meta") -> dict[str, str]:
    """A caller's string metadata as the reader will accept it, or InvalidInputError."""
    if len(meta) > MAX_META:
        raise InvalidInputError(f"{name}: {len(meta)} keys, over the cap {MAX_META}")
    out: dict[str, str] = {}
    for key, value in meta.items():
        check_str_arg(key, f"{name} keys")
        out[key] = check_str_arg(value, f"{name}[{key!r:.40}]")
    return out


def check_str_arg(value: Any, name: str) -> str:
    """A caller's header string (model id, fingerprint, meta) or InvalidInputError."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{name}: expected a str, got {type(value).__name__}")
    if len(value) > MAX_STRING:
        raise InvalidInputError(f"{name}: string of {len(value)} chars, over the cap {MAX_STRING}")
    return value


def check_writable(header: Header, *, block_tokens: int | None = None) -> None:
    """Refuse a header the reader would refuse, before a writer writes a byte (rule 6).

    ``header`` is a plan (``codecs.snapshot``); it is placed as the writer will place it
    (``block_tokens`` given: the blocks layout, with placeholder block names) and run
    through :func:`parse_header`. A failure is InvalidInputError naming the field. Every
    layer (nested ones too) must hold exactly ``len(header.tokens)`` tokens: its offset
    is what the next model step continues from, so a file whose tokens disagree with it
    would be found for a prompt it does not hold (CacheMismatchError).
    """
    n_tokens = len(header.tokens)
    for name, entry in _named_entries(header):
        if n_tokens and entry.offset != n_tokens:
            raise CacheMismatchError(
                f"{name}.offset: the {entry.kind} cache holds {entry.offset} tokens, "
                f"{n_tokens} tokens were given"
            )
    if block_tokens is None:
        placed = place_single(header)
    else:
        placed = _place_blocks_placeholder(header, block_tokens)
    body = encode_header(placed)
    if len(body) > MAX_HEADER_BYTES:
        raise InvalidInputError(f"header: {len(body)} bytes, over the {MAX_HEADER_BYTES}-byte cap")
    raw = encode_preamble(body, placed.format_version)
    size = PREAMBLE.size + len(body)
    try:
        preamble = parse_preamble(raw, size)
        if placed.layout == "single":
            size = file_sizes(placed, preamble.data_start)[-1]
        parse_header(body, preamble, size)
    except CorruptCacheError as exc:
        raise InvalidInputError(str(exc)) from None


def encoded_size(header: Header, *, block_tokens: int | None = None) -> int:
    """The bytes a save of the plan ``header`` puts on disk before anything is shared with
    what is there already: the single layout's whole file (``block_tokens`` None), or the
    blocks layout's manifest plus every block it names. Exact but for the creation
    time's digits (at most :data:`CREATED_AT_SLACK` bytes more than written)."""
    if block_tokens is None:
        placed = place_single(header)
        start = align_up(PREAMBLE.size + len(encode_header(placed)) + CREATED_AT_SLACK)
        return file_sizes(placed, start)[-1]
    placed = _place_blocks_placeholder(header, block_tokens)
    blocks = sum(ref.nbytes for slot in placed.slots() for ref in slot.blocks or ())
    return PREAMBLE.size + len(encode_header(placed)) + CREATED_AT_SLACK + blocks


def _named_entries(header: Header) -> Iterator[tuple[str, CacheEntry]]:
    def walk(entry: CacheEntry, path: str) -> Iterator[tuple[str, CacheEntry]]:
        yield path, entry
        for k, child in enumerate(entry.children):
            yield from walk(child, f"{path}.children[{k}]")

    for i, entry in enumerate(header.caches):
        yield from walk(entry, f"caches[{i}]")


def _place_blocks_placeholder(header: Header, block_tokens: int) -> Header:
    """The manifest :func:`~kvtrio.storage.writer.write_blocks` writes for ``header``,
    placeholder hashes in place of the blocks' (same widths: same length)."""
    name, digest = "0" * 64, "0" * 16
    slots = [
        attrs.evolve(
            slot,
            off=None,
            xxh3=None,
            blocks=tuple(
                BlockRef(name, piece_nbytes(slot, a, b), digest)
                for a, b in piece_ranges(slot, block_tokens)
            ),
        )
        for slot in header.slots()
    ]
    return attrs.evolve(
        header.with_slots(slots),
        layout="blocks",
        block_tokens=block_tokens,
        format_version=FORMAT_VERSION,
    )
