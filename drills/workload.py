"""Synthetic caches for the drills: headers and bytes made without MLX, and their checks.

The drills write many small caches through the storage layer's own writer cores
(:func:`kvtrio.storage.writer.write_single` / :func:`~kvtrio.storage.writer.write_blocks`)
on plain memoryviews, so a crash child never imports MLX. Every cache is named by an
:class:`EntrySpec`, from which its exact bytes can be regenerated: whoever checks a
cache after a crash knows what it must contain.

Conversations share prefixes (every entry is a prefix of one of a few *roots*), so the
block layout dedups and GC has shared blocks to get wrong.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
from collections.abc import Collection, Iterator

import attrs
from kvtrio.errors import CacheMissError, CorruptCacheError
from kvtrio.storage.blockstore import BLOCK_NAME_RE, LocalBlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, TMP_SUFFIX, FileOps
from kvtrio.storage.format import (
    CacheEntry,
    Header,
    Layout,
    TensorSlot,
    piece_nbytes,
    piece_ranges,
)
from kvtrio.storage.reader import allocate_buffers, read_header, read_tensors
from kvtrio.storage.writer import WriteResult, write_blocks, write_single

__all__ = [
    "BLOCK_TOKENS",
    "CacheDir",
    "EntrySpec",
    "LoadOutcome",
    "expected_pieces",
    "load_entry",
    "plan_header",
    "scan_final_names",
    "tmp_debris",
    "write_entry",
]

#: Tokens per block in the block layout (small, so small caches have several blocks).
BLOCK_TOKENS = 8
_HEADS, _HEAD_DIM, _LAYERS = 2, 8, 2
_ITEMSIZE = 2  # float16
_ROOT_TOKENS = 64


@attrs.frozen
class EntrySpec:
    """One synthetic cache: the first ``n_tokens`` tokens of conversation ``root``."""

    name: str
    root: int
    n_tokens: int

    def encode(self) -> str:
        return f"{self.name}:{self.root}:{self.n_tokens}"

    @classmethod
    def decode(cls, text: str) -> EntrySpec:
        name, root, n_tokens = text.split(":")
        return cls(name, int(root), int(n_tokens))

    @classmethod
    def random(cls, name: str, rng: random.Random, *, roots: int = 4) -> EntrySpec:
        return cls(name, rng.randrange(roots), rng.randint(1, _ROOT_TOKENS))


def _root_tokens(root: int) -> list[int]:
    return random.Random(f"root-{root}").choices(range(32000), k=_ROOT_TOKENS)


def plan_header(spec: EntrySpec) -> Header:
    """A plan header for ``spec``: ``_LAYERS`` KV layers, keys and values [1, H, T, D]."""
    shape = (1, _HEADS, spec.n_tokens, _HEAD_DIM)
    nbytes = _HEADS * spec.n_tokens * _HEAD_DIM * _ITEMSIZE
    slot = TensorSlot(shape=shape, dtype="float16", nbytes=nbytes, token_axis=2)
    layer = CacheEntry(
        kind="kv",
        offset=spec.n_tokens,
        min_reusable_offset=0,
        trimmable=True,
        fields={},
        tensors=(slot, slot),
    )
    return Header(
        layout="single",
        tokens=tuple(_root_tokens(spec.root)[: spec.n_tokens]),
        caches=(layer,) * _LAYERS,
        created_at=0.0,
        model_id="drill",
        config_fingerprint="drill-v1",
        meta={"drill": spec.name},
    )


def _piece_bytes(spec: EntrySpec, slot_index: int, start: int, stop: int, nbytes: int) -> bytes:
    # Keyed on the prefix end, not the entry: entries of one root share their blocks.
    return random.Random(f"{spec.root}/{slot_index}/{start}/{stop}").randbytes(nbytes)


@functools.lru_cache(maxsize=256)
def _expected(spec: EntrySpec, layout: Layout) -> tuple[tuple[bytes, ...], ...]:
    header = plan_header(spec)
    out: list[tuple[bytes, ...]] = []
    for i, slot in enumerate(header.slots()):
        pieces = [
            _piece_bytes(spec, i, a, b, piece_nbytes(slot, a, b))
            for a, b in piece_ranges(slot, BLOCK_TOKENS)
        ]
        out.append(tuple(pieces) if layout == "blocks" else (b"".join(pieces),))
    return tuple(out)


def expected_pieces(spec: EntrySpec, layout: Layout) -> list[list[bytes]]:
    """The bytes of every piece of every slot (the single layout: one piece per slot).

    The single layout's tensor is the concatenation of its block-layout pieces, so both
    layouts hold the same bytes for the same spec.
    """
    return [list(pieces) for pieces in _expected(spec, layout)]


@attrs.define
class CacheDir:
    """Where a drill keeps its caches: ``caches/`` (single), ``manifests/`` and ``blocks/``."""

    root: str
    file_ops: FileOps = OS_FILE_OPS

    @property
    def caches(self) -> str:
        return os.path.join(self.root, "caches")

    @property
    def manifests(self) -> str:
        return os.path.join(self.root, "manifests")

    @property
    def blocks(self) -> str:
        return os.path.join(self.root, "blocks")

    def make(self) -> CacheDir:
        for sub in (self.caches, self.manifests, self.blocks):
            os.makedirs(sub, exist_ok=True)
        return self

    def block_store(self) -> LocalBlockStore:
        return LocalBlockStore(self.blocks, file_ops=self.file_ops)

    def path_of(self, name: str, layout: Layout) -> str:
        return os.path.join(self.caches if layout == "single" else self.manifests, name)

    def with_ops(self, file_ops: FileOps) -> CacheDir:
        return CacheDir(self.root, file_ops)


def write_entry(
    cache_dir: CacheDir, spec: EntrySpec, layout: Layout, *, cancel: object = None
) -> WriteResult:
    """Write ``spec`` durably through the storage writer cores; returns after the ack point."""
    header = plan_header(spec)
    pieces = expected_pieces(spec, layout)
    path = cache_dir.path_of(spec.name, layout)
    if layout == "single":
        return write_single(
            path, header, [memoryview(p[0]) for p in pieces], file_ops=cache_dir.file_ops
        )
    return write_blocks(
        path,
        header,
        [[memoryview(b) for b in p] for p in pieces],
        cache_dir.block_store(),
        block_tokens=BLOCK_TOKENS,
        file_ops=cache_dir.file_ops,
    )


@attrs.frozen
class LoadOutcome:
    """How a load ended: ``ok`` with the pieces read, or a clean ``miss``, or ``corrupt``."""

    kind: str  # "ok", "miss", "corrupt"
    pieces: list[list[bytes]] | None = None
    error: str = ""


def load_entry(cache_dir: CacheDir, name: str, layout: Layout) -> LoadOutcome:
    """Load ``name`` with verification. Any error but a clean miss or corruption propagates."""
    path = cache_dir.path_of(name, layout)
    try:
        cache_file = read_header(path, file_ops=cache_dir.file_ops)
        buffers = allocate_buffers(cache_file.header)
        read_tensors(
            cache_file,
            [[memoryview(b) for b in slot] for slot in buffers],
            store=cache_dir.block_store() if layout == "blocks" else None,
            verify=True,
            file_ops=cache_dir.file_ops,
        )
    except FileNotFoundError:
        return LoadOutcome("miss", error="file not found")
    except CacheMissError as exc:
        return LoadOutcome("miss", error=str(exc))
    except CorruptCacheError as exc:
        return LoadOutcome("corrupt", error=str(exc))
    return LoadOutcome("ok", pieces=[[bytes(b) for b in slot] for slot in buffers])


def scan_final_names(
    cache_dir: CacheDir, layout: Layout, *, skip: Collection[str] = ()
) -> Iterator[tuple[str, str]]:
    """Every file under a final name that fails its checks: (path, why).

    Cache files and manifests named in ``skip`` are left out (the caller loads them).

    A cache file must read and verify; a manifest must parse (its blocks may be missing:
    that is a clean miss, not a torn file); a block must hash to its name.
    """
    directory = cache_dir.caches if layout == "single" else cache_dir.manifests
    for name in sorted(os.listdir(directory)):
        if name.endswith(TMP_SUFFIX) or name in skip:
            continue
        if layout == "single":
            outcome = load_entry(cache_dir, name, layout)
            if outcome.kind != "ok":
                yield os.path.join(directory, name), outcome.error
        else:
            try:
                read_header(os.path.join(directory, name))
            except CorruptCacheError as exc:
                yield os.path.join(directory, name), str(exc)
    if layout == "blocks":
        for name in sorted(os.listdir(cache_dir.blocks)):
            if BLOCK_NAME_RE.fullmatch(name) is None:
                continue
            with open(os.path.join(cache_dir.blocks, name), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            if digest != name:
                yield os.path.join(cache_dir.blocks, name), "block does not hash to its name"


def tmp_debris(cache_dir: CacheDir) -> list[str]:
    """Every tmp file (crash debris) left in the cache directory."""
    return [
        os.path.join(sub, name)
        for sub in (cache_dir.caches, cache_dir.manifests, cache_dir.blocks)
        for name in os.listdir(sub)
        if name.endswith(TMP_SUFFIX)
    ]
