"""IoOptions: the one record of the I/O paths' tuning switches, passed in explicitly.

Every switch of the save, load and Redis paths lives here, with the default chosen by
measurement (docs/benchmarks.md; docs/tuning.md lists them). The public entry points
take one (``kvtrio.save_cache`` / ``load_cache``, ``ColdTier.open``,
``open_tiered_cache``, ``RedisBlockStore.open`` / ``open_store``) and hand it down to the
writer, the reader, the host buffers and the Redis store; no library module reads the
environment. The ``KVTRIO_*`` environment variables are read once, at the program's
edge (the CLI and the benches), by :meth:`IoOptions.from_environ`. None of the switches
changes the bytes on disk or skips a check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from kvtrio.errors import InvalidInputError

__all__ = [
    "DEFAULT_IO_OPTIONS",
    "SCRIPT_LOAD_STREAMS",
    "ENVIRONMENT",
    "IoOptions",
    "default_redis_hash_threads",
    "default_tier_load_streams",
    "usable_cpus",
]


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


#: Tensor reads one ``load_cache`` runs at once when ``load_streams`` is None: 4 (as
#: MLX's own file reader) loaded 1.1-1.2x faster than 2 on the 2-vCPU development VM and
#: on a 16-core host, where a script's load waits mostly on the device.
SCRIPT_LOAD_STREAMS = 4


def default_tier_load_streams() -> int:
    """Reads one ``ColdTier`` load runs at once when ``load_streams`` is None: one per
    four usable CPUs, at most four; one below eight CPUs. On the 2-vCPU development VM,
    in one process, alternating, 1 GiB cold loads ran at 1.25-1.53 GB/s with heartbeat
    p99 1.61-1.65 ms with one stream, against 1.16-1.31 GB/s and 2.28-2.91 ms with two,
    and a 4 MB served entry loaded no faster split in two (a server's event loop and
    model steps share the CPU with the reads); on a 16-core host the reads and sha256
    checks of several streams run on cores otherwise idle (docs/tuning.md)."""
    cpus = usable_cpus()
    return 1 if cpus < 8 else min(4, cpus // 4)


def _int_at_least(minimum: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator: an int (not bool) >= ``minimum``, else InvalidInputError."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidInputError(
                f"{attribute.name}: expected an int >= {minimum}, got {value!r}"
            )

    return check


def default_redis_hash_threads() -> int:
    """One helper per four usable CPUs, at most four: none on a two-core machine, where
    Redis, the receiver and the hashing already share every core (docs/benchmarks.md)."""
    return min(4, usable_cpus() // 4)


@attrs.frozen(kw_only=True)
class IoOptions:
    """How the I/O paths do their work (never what they write or what they check)."""

    #: Saves write through aligned O_DIRECT bounce buffers instead of buffered writes
    #: streamed from the MLX buffers (Linux only; a filesystem without O_DIRECT falls
    #: back to buffered).
    save_direct: bool = False
    #: A save's xxh3 runs on a helper thread while the writing thread writes.
    save_hash_thread: bool = True
    #: A save writes the segments of the live MLX buffer in place (off: ``mx.contiguous``
    #: copies each strided view first).
    zero_copy: bool = True
    #: Tensor reads one load runs at once (each checks its own tensors' hashes), in
    #: ``load_cache`` and in a ``ColdTier`` alike (a tier's load splits a step of several
    #: tensors among them). None: each path's measured default,
    #: :data:`SCRIPT_LOAD_STREAMS` (4) for ``load_cache``,
    #: :func:`default_tier_load_streams` (by the CPU count) for a tier, which shares the
    #: CPU with a server's event loop and model steps.
    load_streams: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_int_at_least(1))
    )
    #: Cold loads read with O_DIRECT into 4 KiB-aligned destinations (off: buffered reads
    #: with readahead, measured faster).
    load_direct: bool = False
    #: Buffered loads drop what they read from the page cache, two chunks behind.
    drop_behind: bool = True
    #: ``POSIX_FADV_WILLNEED`` of each tensor's whole range before reading it.
    willneed: bool = False
    #: A load's xxh3 runs on a helper thread while the next chunk is read.
    load_hash_thread: bool = False
    #: Load destinations are allocated without a fill (off: MLX zero-fills them on the
    #: owner thread before the reader fills them).
    alloc_untouched: bool = True
    #: The ``madvise`` pre-fault helpers may run at all (off: never, whatever else says).
    prefault: bool = True
    #: A helper thread pre-faults (``MADV_POPULATE_WRITE``) destinations ahead of reads.
    prefault_ahead: bool = False
    #: Pre-faulted ranges ask for transparent huge pages.
    prefault_huge: bool = False
    #: Helper threads re-hashing (sha256) a verified Redis read's blocks; 0 hashes each
    #: block on the receiving thread as it arrives.
    redis_hash_threads: int = attrs.field(
        factory=default_redis_hash_threads, validator=_int_at_least(0)
    )

    def streams(self, default: int) -> int:
        """``load_streams``, or ``default`` (the calling path's) when it is None."""
        return default if self.load_streams is None else self.load_streams

    @property
    def prefaults_ahead(self) -> bool:
        """Whether a load pre-faults its destinations (asked for, and not switched off)."""
        return self.prefault and self.prefault_ahead

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], base: IoOptions | None = None) -> IoOptions:
        """``base`` (default: the defaults) with the ``KVTRIO_*`` overrides found in
        ``environ`` (:data:`ENVIRONMENT`). For the program's edge: the CLI and the
        benches call it with ``os.environ``; library code takes an IoOptions instead.
        Raises ValueError naming the variable when a number is not a valid count."""
        changes: dict[str, Any] = {}
        for name, (field, parse) in ENVIRONMENT.items():
            raw = environ.get(name, "").strip()
            if raw:
                changes[field] = parse(name, raw)
        return attrs.evolve(base if base is not None else DEFAULT_IO_OPTIONS, **changes)


def _on_unless(off: str) -> Callable[[str, str], bool]:
    return lambda name, raw: raw != off


def _count(minimum: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
        return value

    return parse


def _on_if_linux(name: str, raw: str) -> bool:
    return raw == "1" and sys.platform.startswith("linux")


#: Environment variable -> (the IoOptions field it overrides, how its text is read).
#: Each switch reads as it always has: ``=1`` turns an off-by-default switch on, ``=0``
#: turns an on-by-default one off, counts are integers.
ENVIRONMENT: Mapping[str, tuple[str, Callable[[str, str], bool | int]]] = {
    "KVTRIO_SAVE_DIRECT": ("save_direct", _on_if_linux),
    "KVTRIO_SAVE_HASH_THREAD": ("save_hash_thread", _on_unless("0")),
    "KVTRIO_SAVE_COPY": ("zero_copy", lambda name, raw: raw != "1"),
    "KVTRIO_LOAD_THREADS": ("load_streams", _count(1)),
    "KVTRIO_LOAD_DIRECT": ("load_direct", lambda name, raw: raw == "1"),
    "KVTRIO_LOAD_DROP_BEHIND": ("drop_behind", _on_unless("0")),
    "KVTRIO_LOAD_WILLNEED": ("willneed", lambda name, raw: raw == "1"),
    "KVTRIO_LOAD_HASH_THREAD": ("load_hash_thread", lambda name, raw: raw == "1"),
    "KVTRIO_ALLOC_UNTOUCHED": ("alloc_untouched", _on_unless("0")),
    "KVTRIO_PREFAULT": ("prefault", _on_unless("0")),
    "KVTRIO_PREFAULT_AHEAD": ("prefault_ahead", lambda name, raw: raw == "1"),
    "KVTRIO_PREFAULT_HUGE": ("prefault_huge", lambda name, raw: raw == "1"),
    "KVTRIO_REDIS_HASH_THREADS": ("redis_hash_threads", _count(0)),
}

#: The defaults (what every entry point uses when given no options).
DEFAULT_IO_OPTIONS = IoOptions()
