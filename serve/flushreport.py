"""What ``kvtrio serve``'s SIGTERM wrote: the deadline of the close's disk writes, and the
exit lines that say, entry by entry, which RAM entries did not land and why.

Theory of operation:

1. The close hands every RAM entry of the tier's model to the tier (a flush: written
   whatever the admission policy says, never shed). Each one is noted as a
   :class:`FlushedEntry`: its token count, then the key the tier gave it, or why it never
   reached the tier (:class:`HandOver`: not saveable, the tier closed or not open, its
   spill failed).
2. The writes get a stated deadline, :func:`flush_deadline`: ``--flush-timeout`` seconds
   when given, else ``2 x --grace + 5`` plus one second per :data:`FLUSH_BYTES_PER_SECOND`
   bytes of RAM entries (a slow disk or a busy owner thread has its time; a deadline
   that ignored the volume cut a large flush short). It is printed when the close
   starts.
3. At exit, :class:`FlushReport` asks the tier where each handed-over entry's write
   stands (:meth:`~kvtrio.actors.tiered.TieredPromptCache.landing`, on the tier's loop
   thread, which still runs when the deadline passed) and :func:`print_exit` prints one
   line of counts by why and one line per entry that did not land. An entry handed to
   the tier whose spill had not queued its write by the deadline (it waits for an owner
   job) is ``not queued``.
4. The exit status follows the report (:attr:`FlushReport.complete`): 0 only when every
   entry handed over is on disk or was left out by design (``gone``: written, then
   evicted by ``--cold-bytes``; ``not saveable``: a cache kind kvtrio cannot write);
   an entry lost to a failed write, a dead tier, or the deadline makes it 1, so a
   shutdown drill or a supervisor sees the loss without reading the lines.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:  # the tier's modules load with the tier (kvtrio serve starts without)
    from kvtrio.actors.tieredtypes import Landing
    from kvtrio.serve.adapter import TieredLRUPromptCache

__all__ = [
    "BY_DESIGN",
    "FLUSH_BYTES_PER_SECOND",
    "FlushReport",
    "FlushedEntry",
    "HandOver",
    "flush_deadline",
    "print_exit",
]

# The slowest write speed (hashing, writing and syncing a RAM entry) the default deadline
# allows for: one second more per this many bytes of RAM entries.
FLUSH_BYTES_PER_SECOND = 50_000_000


class HandOver(enum.Enum):
    """Why a RAM entry the close handed over has no write in the tier (rule 1)."""

    NOT_QUEUED = "not queued"  # its spill had not reached the tier by the deadline
    NOT_SAVEABLE = "not saveable"  # a cache kind kvtrio cannot save (kept RAM-only)
    TIER_CLOSED = "cold tier closed"
    TIER_NOT_OPEN = "cold tier not open"
    SPILL_FAILED = "spill failed"  # the tier's spill raised (logged)


@attrs.define(eq=False)
class FlushedEntry:
    """One RAM entry the close handed over: its tokens, and its key once the tier took it
    (or why it never did)."""

    tokens: int
    key: str | None = None
    why: HandOver | None = None


def flush_deadline(grace: float, nbytes: int, flush_timeout: float | None = None) -> float:
    """Seconds the close's disk writes get (rule 2)."""
    if flush_timeout is not None:
        return flush_timeout
    return 2 * grace + 5 + nbytes / FLUSH_BYTES_PER_SECOND


#: Why an entry may be missing from disk at exit with the shutdown still a success
#: (rule 4): evicted by the cold budget after it was written, or a kind not saveable.
BY_DESIGN = frozenset({"gone", HandOver.NOT_SAVEABLE.value})


@attrs.frozen
class FlushReport:
    """Where the close's writes stood at exit (rule 3): how many were handed over, how
    many landed, and each one that did not: (tokens, key or None, why)."""

    handed: int
    landed: int
    lost: tuple[tuple[int, str | None, str], ...]

    @classmethod
    def of(cls, entries: Sequence[FlushedEntry], landings: Mapping[str, Landing]) -> FlushReport:
        landed = 0
        lost = []
        for entry in entries:
            if entry.why is not None:
                why = entry.why.value
            elif entry.key is None:
                why = HandOver.NOT_QUEUED.value
            else:
                landing = landings.get(entry.key)
                if landing is None:  # the tier's loop had ended: nothing to ask
                    why = HandOver.NOT_QUEUED.value
                elif landing.value == "on disk":  # Landing.DURABLE (the tier not imported)
                    landed += 1
                    continue
                else:
                    why = landing.value
            lost.append((entry.tokens, entry.key, why))
        return cls(len(entries), landed, tuple(lost))

    @property
    def complete(self) -> bool:
        """Rule 4: every entry on disk, or left out by design (``gone``, ``not
        saveable``); False when one was lost to a failure or the deadline."""
        return all(why in BY_DESIGN for _, _, why in self.lost)

    def counts(self) -> dict[str, int]:
        """Entries that did not land, by why (most first)."""
        return dict(Counter(why for _, _, why in self.lost).most_common())


def print_exit(adapter: TieredLRUPromptCache, *, lookups_before_open: int) -> FlushReport:
    """``kvtrio serve``'s exit lines: what it did, what a restart will find on disk
    (each RAM entry of the close that did not land, and why), and the disk's wear; the
    close's report (rule 4 reads the exit status from it)."""
    stats = adapter.statistics()
    print(
        f"kvtrio serve: stopped (RAM entries written: {stats.spilled}, "
        f"hot hits {stats.hits_hot}, cold hits {stats.hits_cold}, misses {stats.misses}, "
        f"disk loads set aside {stats.prefetches}, lookups before the cold tier was open "
        f"{lookups_before_open})",
        flush=True,
    )
    report = adapter.flush_report()
    whys = "".join(f", {why} {n}" for why, n in report.counts().items())
    print(
        f"kvtrio serve: RAM entries at exit (handed {report.handed}, on disk "
        f"{report.landed}, not landed {len(report.lost)}{whys})",
        flush=True,
    )
    for tokens, key, why in report.lost:
        print(f"kvtrio serve: not on disk: {tokens} tokens, key {key or '-'}: {why}", flush=True)
    cold = adapter.cold_statistics()
    if cold is not None:  # what a restart will find (the bench keeps this line per round)
        print(
            f"kvtrio serve: cold tier at exit (entries {cold.cold_entries}, bytes "
            f"{cold.cold_bytes}, budget {cold.cold_budget}, pending writes dropped "
            f"{cold.pending_dropped}, drops {cold.drops}, evictions {cold.cold_evictions}, "
            f"write errors {cold.cold_errors}, pending writes left {cold.pending_writes}, "
            f"writes not landed: shed {cold.unwritten_dropped}, cancelled "
            f"{cold.unwritten_cancelled}, failed {cold.unwritten_failed}, refused "
            f"{cold.unwritten_refused}, disk error {cold.unwritten_error})",
            flush=True,
        )
    wear = adapter.wear()
    if wear is not None:
        print(
            f"kvtrio serve: disk wear (bytes written {wear.bytes_written}, "
            f"bytes read {wear.bytes_read}, bytes read back {wear.bytes_reused}, "
            f"reuse ratio {wear.reuse_ratio:.3f}, admitted {wear.admitted}, "
            f"refused {wear.refused}, bytes refused {wear.bytes_refused})",
            flush=True,
        )
    return report
