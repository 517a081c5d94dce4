"""kvtrio.storage: bytes on disk. CPU only, no trio (codecs is the one MLX module).

- :mod:`~kvtrio.storage.format`: the versioned file format; header records; validation.
- :mod:`~kvtrio.storage.fileops`: the injectable file operations (``FaultyFileOps``).
- :mod:`~kvtrio.storage.codecs`: mlx-lm caches <-> header entries + tensors (owner thread).
- :mod:`~kvtrio.storage.writer` / :mod:`~kvtrio.storage.reader`: durable writes, checked reads.
- :mod:`~kvtrio.storage.blockstore`: content-addressed blocks (``LocalBlockStore``).
- :mod:`~kvtrio.storage.maintenance`: GC and verify.
- :mod:`~kvtrio.storage.fingerprint`: a model config's fingerprint.
- :mod:`~kvtrio.storage.tuning`: reading the numeric ``KVTRIO_*`` switches.

docs/format.md describes the format for users.
"""

from __future__ import annotations
