"""Which of mlx-lm's prompt caches kvtrio serve writes to disk, and in what shape
(:class:`~kvtrio.serve.adapter.TieredLRUPromptCache`'s rule 5).

Theory of operation:

1. A one-sequence batch cache (``BatchKVCache``, ``BatchRotatingKVCache``: what mlx-lm's
   BatchGenerator makes) is extracted to its per-sequence cache first, as the
   BatchGenerator itself does (:func:`per_sequence`); a batch of several sequences is
   refused with :class:`~kvtrio.errors.UnsupportedCacheError` naming the class.
2. A class without a kvtrio codec (nested ones too) is refused the same way
   (:func:`saveable`): the entry stays in RAM only, counted.
3. The tier stores an entry under the tokens every layer holds (the format's rule: a
   layer's offset is where the next model step continues). mlx-lm keys an entry by the
   prompt and every token it generated; with a draft model (speculative decoding) the
   model's caches may hold one token fewer than that key, and the draft's one fewer
   again. :func:`held_prefix` trims the longer caches down to the shortest (the entry
   is leaving RAM: nobody else holds its caches) and keys the entry by that prefix, so
   the disk entry serves the conversation's next turn less a token or two. Caches that
   cannot be trimmed to agree (a state with no offset, a window already rotated) are
   refused as in rule 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtrio.errors import UnsupportedCacheError
from mlx_lm.models import cache as _mlx_cache

__all__ = ["BATCH_CLASSES", "held_prefix", "per_sequence", "saveable"]

mlx_cache: Any = _mlx_cache

#: Batch cache classes and how a one-sequence batch becomes a per-sequence cache.
BATCH_CLASSES: tuple[str, ...] = ("BatchKVCache", "BatchRotatingKVCache")


def _batch_size(cache: Any) -> int:
    keys = getattr(cache, "keys", None)
    if keys is not None:
        return int(keys.shape[0])
    return len(cache.left_padding.tolist())


def per_sequence(caches: Sequence[Any]) -> list[Any]:
    """``caches`` with every one-sequence batch cache extracted to its per-sequence cache
    (rule 5); UnsupportedCacheError naming the class for a batch of several sequences."""
    out: list[Any] = []
    for cache in caches:
        name = type(cache).__name__
        if name in BATCH_CLASSES and type(cache) is getattr(mlx_cache, name):
            size = _batch_size(cache)
            if size != 1:
                raise UnsupportedCacheError(
                    name, f"cache class {name} holds {size} sequences: extract one first"
                )
            if getattr(cache, "keys", None) is None:  # empty: extract() needs arrays
                cache = (
                    mlx_cache.KVCache()
                    if name == "BatchKVCache"
                    else mlx_cache.RotatingKVCache(cache.max_size)
                )
            else:
                cache = cache.extract(0)
        out.append(cache)
    return out


def saveable(caches: Sequence[Any]) -> None:
    """Raise UnsupportedCacheError naming the first cache class kvtrio has no codec for
    (nested caches included)."""
    for cache in caches:
        if not _has_codec(cache):
            name = type(cache).__name__
            raise UnsupportedCacheError(name, f"cache class {name} has no kvtrio codec")
        saveable(getattr(cache, "caches", ()) if type(cache).__name__ == "CacheList" else ())


def _has_codec(cache: Any) -> bool:
    # The registry is filled by importing the codec modules: without them every class
    # read as "no codec" until something else had imported kvtrio.storage.cacheio.
    from kvtrio.storage import codecs, concat_codec, mlxlm_codecs  # noqa: F401

    try:
        codecs.codec_for_cache(cache)
    except TypeError:
        return False
    return True


def held_prefix(caches: Sequence[Any], tokens: list[int]) -> list[int]:
    """Rule 3: the tokens every cache of an entry leaving RAM holds, trimming (in place)
    the caches that hold more down to the shortest; ``tokens`` itself when they agree.
    A layer that states no count (an SSM's state) agrees with any. UnsupportedCacheError
    when they cannot be made to agree."""
    from kvtrio.actors.callerchecks import held_token_counts

    counts = [held_token_counts(cache) for cache in caches]
    stated = [n for layer in counts for n in layer]
    if all(n == len(tokens) for n in stated):
        return tokens
    shortest = min(stated)
    if shortest <= 0 or max(stated) > len(tokens):
        names = "/".join(sorted({type(cache).__name__ for cache in caches}))
        raise UnsupportedCacheError(
            names,
            f"caches holding {sorted(set(stated))} tokens for a key of {len(tokens)} "
            "cannot be stored under one token sequence",
        )
    for cache, layer in zip(caches, counts, strict=True):
        if layer and all(n == shortest for n in layer):
            continue
        name = type(cache).__name__
        if len(set(layer)) != 1 or not cache.is_trimmable():  # a state, or mixed counts
            raise UnsupportedCacheError(
                name,
                f"{name} holds {layer or 'a state of'} tokens, others {shortest}: "
                "it cannot be trimmed to agree",
            )
        cache.trim(layer[0] - shortest)
    return tokens[:shortest]
