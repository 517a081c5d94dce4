"""kvtrio.metal: paged KV cache and paged attention (reference path, Metal kernel, CUDA twin).

Importing the package registers the paged cache's storage codec (header kind ``"paged"``).
"""

from __future__ import annotations

from kvtrio.metal import codec as _codec  # noqa: F401  (registers the "paged" codec)
from kvtrio.metal.attention import (
    BatchPagedAttentionView,
    PagedAttentionView,
    allow_unmeasured_direct,
    scaled_dot_product_attention,
    use_paged_attention,
)
from kvtrio.metal.cache import (
    BatchPagedKVCache,
    PagedKVCache,
    QuantizedPagedKVCache,
    make_paged_cache,
)
from kvtrio.metal.codec import restore_into
from kvtrio.metal.pool import BlockPool, BlockPoolExhausted, PoolStatistics

__all__ = [
    "BatchPagedAttentionView",
    "BatchPagedKVCache",
    "BlockPool",
    "BlockPoolExhausted",
    "PagedAttentionView",
    "PagedKVCache",
    "PoolStatistics",
    "QuantizedPagedKVCache",
    "allow_unmeasured_direct",
    "make_paged_cache",
    "restore_into",
    "scaled_dot_product_attention",
    "use_paged_attention",
]
