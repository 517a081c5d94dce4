"""One constructor for a cold tier's stores, local or shared: :func:`open_store`.

``open_store("/var/cache/kvtrio")`` gives the local directory stores (``blocks/`` and
``manifests/`` under the directory); ``open_store("redis://host:6379/0?prefix=kvtrio")``
(or ``rediss://`` for TLS) gives the Redis stores, sharing one connection pool, so every
host opening the same URL shares blocks, manifests and the prefix index.

Both pairs are the same two interfaces,
:class:`~kvtrio.storage.blockstore.BlockStore` and
:class:`~kvtrio.storage.manifeststore.ManifestStore`: the block-layout writer publishes a
manifest with ``ManifestStore.put`` once its blocks are durable, and readers get it back
with :func:`~kvtrio.storage.reader.read_manifest`, whichever store it is.
"""

from __future__ import annotations

import os

from kvtrio.storage.blockstore import BlockStore, LocalBlockStore
from kvtrio.storage.fileops import OS_FILE_OPS, FileOps
from kvtrio.storage.manifeststore import (
    LocalManifestStore,
    ManifestStore,
    RedisManifestStore,
)
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, IoOptions
from kvtrio.storage.redisstore import RedisBlockStore, connect, is_redis_url, parse_redis_url

__all__ = ["is_redis_url", "open_store"]


def open_store(
    url_or_path: str | os.PathLike[str],
    *,
    file_ops: FileOps = OS_FILE_OPS,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> tuple[BlockStore, ManifestStore]:
    """The block store and manifest store of a cold tier at ``url_or_path`` (``options``:
    the Redis store's verified reads use ``redis_hash_threads``).

    Raises StoreUnavailableError when a Redis URL's server does not answer (or redis-py
    is not installed), ValueError for a malformed URL.
    """
    target_text = os.fspath(url_or_path)
    if is_redis_url(target_text):
        target = parse_redis_url(target_text)
        client = connect(target)
        return RedisBlockStore(client, target, options), RedisManifestStore(client, target)
    root = os.path.abspath(target_text)
    blocks = LocalBlockStore(os.path.join(root, "blocks"), file_ops)
    manifests = LocalManifestStore(os.path.join(root, "manifests"), file_ops)
    return blocks, manifests
