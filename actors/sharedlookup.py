"""Rule 8 of :mod:`kvtrio.actors.tiered`: lookups that ask a shared cold store (Redis)
for entries other hosts saved, through its prefix index.

:class:`SharedLookupMixin` is a part of :class:`~kvtrio.actors.tiered.TieredPromptCache`.
A lookup costs one index round trip (all of the query's chain hashes at once) and at most
:data:`SHARED_READS` manifest reads, never a scan of the shared catalogue.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING

import trio
from kvtrio.actors.prefix import PrefixMatch
from kvtrio.errors import KvtrioError

if TYPE_CHECKING:
    from kvtrio.actors.tieredparts import CacheParts
else:
    CacheParts = object

__all__ = ["SHARED_PAUSE_MAX", "SHARED_PAUSE_MIN", "SHARED_READS", "SharedLookupMixin"]

# At most this many manifests are read per lookup from a shared store's prefix index.
SHARED_READS = 4
# Seconds a failed index lookup pauses the next ones (doubling while failures go on).
SHARED_PAUSE_MIN = 1.0
SHARED_PAUSE_MAX = 30.0


class SharedLookupMixin(CacheParts):
    """Rule 8 of :class:`~kvtrio.actors.tiered.TieredPromptCache` (see above)."""

    async def _refresh_shared(self) -> None:
        """Add the entries of this model that other hosts stored in the shared cold store
        since the last refresh (at most one per ``shared_refresh`` seconds, one at a time).

        The catalogue is read on the store's worker threads; a store out of reach leaves
        the index as it is (the lookup goes on, at worst a miss).
        """
        assert self.shared_refresh is not None
        now = trio.current_time()
        if self._refreshing or now - self._refreshed_at < self.shared_refresh:
            return
        self._refreshing, self._refreshed_at = True, now
        self._count("shared_refreshes")
        try:
            async with aclosing(self.cold.entries()) as batches:
                infos = [info async for batch in batches for info in batch]
        except (KvtrioError, OSError):
            return
        finally:
            self._refreshing = False
        await self._add_cold_entries(
            info for info in infos if info.model == self.model and info.key not in self._records
        )

    def _pause_shared(self) -> None:
        """The shared store failed: skip its index and its loads for a doubling pause, so
        a stalled store costs a request at most one deadline (issue 15)."""
        self._count("shared_errors")
        self._shared_backoff = min(
            SHARED_PAUSE_MAX, max(SHARED_PAUSE_MIN, 2 * self._shared_backoff)
        )
        self._shared_paused_until = trio.current_time() + self._shared_backoff

    async def _find_shared(self, query: tuple[int, ...], local: PrefixMatch | None) -> bool:
        """Add to the index the entry another host saved with the longest prefix of
        ``query``, if it beats ``local`` (rule 8): one index round trip, then the manifests
        of at most :data:`SHARED_READS` candidates, deepest first, until one does.

        Runs on the store's worker threads; a store out of reach, or a registered entry
        whose manifest is gone, leaves the index as it is (at worst the lookup misses).
        After a failed index lookup, lookups skip the index for a pause (trio's clock) that
        doubles from :data:`SHARED_PAUSE_MIN` up to :data:`SHARED_PAUSE_MAX` seconds while
        the store stays out of reach, so an unreachable Redis (connect timeouts) does not
        delay every request.

        False when the store could not be asked (a failure, or the pause after one): the
        lookup's miss reason is then ``store-unreachable`` (rule 13).
        """
        shared = self.cold.shared_lookups()
        assert shared is not None, "checked at open: shared_index needs shared lookups"
        now = trio.current_time()
        if now < self._shared_paused_until:
            return False
        best = local.reuse if local is not None else 0
        try:
            candidates = await shared.find(self.model, query)
        except (KvtrioError, OSError):
            self._pause_shared()
            return False
        self._shared_backoff = 0.0
        self._count("shared_lookups")
        reads = 0
        for key, bound in candidates:
            if bound <= best or reads >= SHARED_READS:
                break  # deepest first: no later candidate can do better
            if key in self._records:
                continue  # known here: the local lookup already weighed it
            reads += 1
            try:
                info = await shared.entry(key)
            except (KvtrioError, OSError):
                return False
            if info is None or info.model != self.model:
                self._count("shared_vanished")
                if info is None:  # a stale registration: clean it up for every host
                    self._spawn(self._forget_shared, key, query)
                continue
            if key in self._records:  # added while the manifest was being read
                continue
            await self._add_cold_entries([info])
            self._count("shared_found")
            match = self._index.lookup(self.model, query)
            if match is not None and match.reuse > best:
                return True
        return True

    async def _forget_shared(self, key: str, query: tuple[int, ...]) -> None:
        shared = self.cold.shared_lookups()
        assert shared is not None, "checked at open: shared_index needs shared lookups"
        try:
            await shared.forget(key, self.model, query)
        except (KvtrioError, OSError):
            return  # best effort: the next host to miss on it tries again
