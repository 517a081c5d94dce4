"""kvtrio.serve: mlx-lm's server with kvtrio's cold tier beneath its prompt cache.

:mod:`kvtrio.serve.adapter` (``TieredLRUPromptCache``, a drop-in for mlx-lm's
LRUPromptCache in any threaded server), :mod:`kvtrio.serve.bridge` (the tier's trio loop
on a background thread) and :mod:`kvtrio.serve.server` (``kvtrio serve``).
"""
