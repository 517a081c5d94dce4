"""kvtrio.storage: bytes on disk. CPU only, no trio (except the MLX modules below).
It imports nothing of kvtrio but its errors (docs/design.md invariant 9).

- :mod:`~kvtrio.storage.format`: the versioned file format; header records; validation.
- :mod:`~kvtrio.storage.fileops`: the injectable file operations (``FaultyFileOps``).
- :mod:`~kvtrio.storage.dtypes`: the one table of the dtypes a file may hold.
- :mod:`~kvtrio.storage.codecs`: the codec registry and protocol (a cache kind <-> entry).
- MLX modules (owner thread): :mod:`~kvtrio.storage.cacheio` (snapshot, materialize,
  restore, adopt: caches <-> header plan + host tensors), :mod:`~kvtrio.storage.mlxlm_codecs`
  (mlx-lm's caches), :mod:`~kvtrio.storage.hostbuffers` (zero-copy host views, load
  buffers), :mod:`~kvtrio.storage.structure` (cache structure, trimming).
- :mod:`~kvtrio.storage.writer` / :mod:`~kvtrio.storage.reader`: durable writes, checked reads.
- :mod:`~kvtrio.storage.options`: ``IoOptions``, the I/O paths' tuning, passed in explicitly;
  :mod:`~kvtrio.storage.hashpool`: hashing on helper threads (save, load, Redis reads).
- :mod:`~kvtrio.storage.blockstore`: content-addressed blocks (``LocalBlockStore``);
  :mod:`~kvtrio.storage.redisstore`: the same on Redis (``RedisBlockStore``).
- :mod:`~kvtrio.storage.manifeststore`: manifests by name, on disk or on Redis.
- :mod:`~kvtrio.storage.maintenance`: GC and verify.
- :mod:`~kvtrio.storage.fingerprint`: a model config's fingerprint.

Names load on first use. docs/format.md describes the format for users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrio._lazy import lazy_exports

if TYPE_CHECKING:
    from kvtrio.storage.blockstore import BlockStore, LocalBlockStore
    from kvtrio.storage.codecs import CacheCodec, register_codec, unregister_codec
    from kvtrio.storage.fileops import FaultyFileOps, FileOps, OsFileOps
    from kvtrio.storage.fingerprint import config_fingerprint
    from kvtrio.storage.format import CacheEntry, Header, Layout, TensorSlot
    from kvtrio.storage.headerparse import parse_header
    from kvtrio.storage.maintenance import GcReport, VerifyReport, collect_garbage, verify_tree
    from kvtrio.storage.manifeststore import LocalManifestStore, ManifestStore
    from kvtrio.storage.options import IoOptions
    from kvtrio.storage.reader import CacheFile, read_header, read_tensors
    from kvtrio.storage.redisstore import RedisBlockStore
    from kvtrio.storage.writer import WriteResult, write_blocks, write_single

_EXPORTS = {
    "BlockStore": "kvtrio.storage.blockstore",
    "CacheCodec": "kvtrio.storage.codecs",
    "CacheEntry": "kvtrio.storage.format",
    "CacheFile": "kvtrio.storage.reader",
    "FaultyFileOps": "kvtrio.storage.fileops",
    "FileOps": "kvtrio.storage.fileops",
    "GcReport": "kvtrio.storage.maintenance",
    "Header": "kvtrio.storage.format",
    "IoOptions": "kvtrio.storage.options",
    "Layout": "kvtrio.storage.format",
    "LocalBlockStore": "kvtrio.storage.blockstore",
    "LocalManifestStore": "kvtrio.storage.manifeststore",
    "ManifestStore": "kvtrio.storage.manifeststore",
    "OsFileOps": "kvtrio.storage.fileops",
    "RedisBlockStore": "kvtrio.storage.redisstore",
    "TensorSlot": "kvtrio.storage.format",
    "VerifyReport": "kvtrio.storage.maintenance",
    "WriteResult": "kvtrio.storage.writer",
    "collect_garbage": "kvtrio.storage.maintenance",
    "config_fingerprint": "kvtrio.storage.fingerprint",
    "parse_header": "kvtrio.storage.headerparse",
    "read_header": "kvtrio.storage.reader",
    "read_tensors": "kvtrio.storage.reader",
    "register_codec": "kvtrio.storage.codecs",
    "unregister_codec": "kvtrio.storage.codecs",
    "verify_tree": "kvtrio.storage.maintenance",
    "write_blocks": "kvtrio.storage.writer",
    "write_single": "kvtrio.storage.writer",
}

__all__ = [
    "BlockStore",
    "CacheCodec",
    "CacheEntry",
    "CacheFile",
    "FaultyFileOps",
    "FileOps",
    "GcReport",
    "Header",
    "IoOptions",
    "Layout",
    "LocalBlockStore",
    "LocalManifestStore",
    "ManifestStore",
    "OsFileOps",
    "RedisBlockStore",
    "TensorSlot",
    "VerifyReport",
    "WriteResult",
    "collect_garbage",
    "config_fingerprint",
    "parse_header",
    "read_header",
    "read_tensors",
    "register_codec",
    "unregister_codec",
    "verify_tree",
    "write_blocks",
    "write_single",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
