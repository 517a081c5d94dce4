"""Longest-prefix lookup over a sha256 hash chain of token blocks.

Theory of operation
-------------------
A token sequence is cut into blocks of ``block_size`` tokens. Block ``i`` of a
sequence is named by a chain hash::

    h[0]   = sha256("kvtrio-prefix-v1", model id, config fingerprint)
    h[i+1] = sha256(h[i], config fingerprint, tokens of block i as little-endian u32)

so equal chain hashes mean equal prefixes of the same model and configuration,
and a different model id or fingerprint never shares a single node. An entry (a
cached token sequence) is registered at the node of every full block it covers
("passing" entries) and, as "ending", at the node of the block its tail falls in.
Its key is the chain hash extended by the tail.

Rules the index keeps:

1. A lookup walks the query's full blocks down the chain while nodes exist; every
   entry it can return passes through the deepest node reached or ends on the path.
2. Token lists are compared token by token wherever a match is decided beyond full
   blocks, so only a full sha256 collision could cause a false match.
3. Selection follows mlx-lm's ``LRUPromptCache.fetch_nearest_cache``: an exact entry
   first; else a longer entry trimmed back to the common prefix (never to the whole
   query: one token is left to compute logits) when every layer is trimmable and the
   kept length is not below the entry's minimum reusable offset, and only when it
   keeps more than the best shorter entry; else the longest entry that is a prefix
   of the query.
4. One lock guards the index: ``add``, ``remove`` and ``lookup`` take it, so a thread
   other than the one that changes the index (kvtrio serve's generation thread, while
   the tier's trio thread adds and removes entries) reads it without a round trip to that
   thread. Each holds it for one operation's Python work (a few hashes and list moves).
5. Every ``add`` and ``remove`` bumps :attr:`PrefixIndex.epoch`, and the index keeps
   its last lookup's answer with the epoch it was read at: a lookup of the same model
   and tokens at the same epoch returns it without walking the chain again (the same
   answer: nothing else changes what a lookup sees). One request's lookups share one
   walk: kvtrio serve's arrival prefetch, the generation thread's peek and the tier's
   own lookup of the same prompt.
"""

from __future__ import annotations

import array
import bisect
import enum
import hashlib
import operator
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NewType

import attrs
import numpy as np

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MatchKind",
    "ModelKey",
    "PackedTokens",
    "PrefixEntry",
    "PrefixIndex",
    "PrefixMatch",
    "chain_hashes",
    "entry_key",
    "pack_tokens",
]

DEFAULT_BLOCK_SIZE = 256
_DOMAIN = b"kvtrio-prefix-v1"
_MAX_TOKEN = 2**32 - 1
_KEY = operator.attrgetter("key")
assert array.array("I").itemsize == 4


# ModelKey -> its root chain hash (a handful of models per process; saves a sha256 per
# index operation).
_ROOTS: dict[ModelKey, bytes] = {}


@attrs.frozen
class ModelKey:
    """The namespace of a cache: model id and config fingerprint (covers kv quantization)."""

    model_id: str
    fingerprint: str

    def root(self) -> bytes:
        """The chain hash of the empty prefix for this model and configuration."""
        cached = _ROOTS.get(self)
        if cached is not None:
            return cached
        h = hashlib.sha256(_DOMAIN)
        for part in (self.model_id, self.fingerprint):
            raw = part.encode()
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        if len(_ROOTS) >= 1024:  # bounded, whatever callers make
            _ROOTS.clear()
        digest = _ROOTS[self] = h.digest()
        return digest


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        packed = array.array("I", tokens)  # unsigned: refuses ids outside [0, 2**32)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    except TypeError:  # not plain ints (numpy integers, say): numpy converts them
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
            raise ValueError("token ids must be in [0, 2**32)") from None
        return arr.astype("<u4").tobytes()
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _link(parent: bytes, model: ModelKey, tokens: Sequence[int]) -> bytes:
    return _link_bytes(parent, model, _token_bytes(tokens))


PackedTokens = NewType("PackedTokens", bytes)
"""A token sequence as u32 big-endian bytes (the catalogue's format,
:func:`kvtrio.storage.catalogue.pack_tokens`): 4 bytes a token in one object the cyclic
collector does not track, and bytes order (memcmp) is the order of the token tuples, so
the index's sorted runs compare slices of it."""


def _link_bytes(parent: bytes, model: ModelKey, little: bytes) -> bytes:
    """A chain link's digest: the parent's, the model's fingerprint, then the tokens
    ``little`` holds as u32 little-endian bytes (:func:`_token_bytes`) and their count.
    :func:`_link` and :func:`_link_packed` are this digest of other forms of the tokens."""
    h = hashlib.sha256(parent)
    h.update(model.fingerprint.encode())
    h.update((len(little) >> 2).to_bytes(8, "little"))
    h.update(little)
    return h.digest()


def _swap_u32(data: bytes) -> bytes:
    """Each u32's bytes reversed, whatever the host's order: little-endian to big-endian
    and back."""
    values = array.array("I")
    values.frombytes(data)
    values.byteswap()
    return values.tobytes()


def _big_endian(little: bytes) -> PackedTokens:
    """u32 little-endian bytes as :data:`PackedTokens` (big-endian)."""
    return PackedTokens(_swap_u32(little))


def pack_tokens(tokens: Sequence[int]) -> PackedTokens:
    """``tokens`` as :data:`PackedTokens` (ValueError for ids outside [0, 2**32))."""
    return _big_endian(_token_bytes(tokens))


def _host_order(packed: bytes) -> array.array[int]:
    values = array.array("I")
    values.frombytes(packed)
    if sys.byteorder == "little":
        values.byteswap()
    return values


def _link_packed(parent: bytes, model: ModelKey, packed: bytes) -> bytes:
    """:func:`_link` of the tokens ``packed`` holds (the same digest)."""
    return _link_bytes(parent, model, _swap_u32(packed))


def _as_packed(tokens: Sequence[int] | PackedTokens) -> PackedTokens:
    if isinstance(tokens, bytes):
        if len(tokens) % 4:
            raise ValueError("packed tokens must be whole u32 values")
        return PackedTokens(tokens)
    return pack_tokens(tokens)


def chain_hashes(model: ModelKey, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chain hash after each full block of ``tokens`` (``h[1] .. h[n]``, root excluded)."""
    out: list[bytes] = []
    parent = model.root()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _link(parent, model, tokens[start : start + block_size])
        out.append(parent)
    return out


def entry_key(model: ModelKey, tokens: Sequence[int], block_size: int) -> str:
    """The hex name of a whole token sequence: its chain, extended by the partial tail."""
    chain = chain_hashes(model, tokens, block_size)
    parent = chain[-1] if chain else model.root()
    tail = tokens[len(chain) * block_size :]
    return _link(parent, model, tail).hex()


@attrs.frozen
class PrefixEntry:
    """One cached token sequence, as the index sees it. Its tokens are held packed
    (:data:`PackedTokens`: given a sequence of ints, it packs them); :attr:`tokens`
    unpacks them on each use (O(length): the index itself works on the packed bytes)."""

    key: str
    model: ModelKey
    packed: PackedTokens = attrs.field(alias="tokens", converter=_as_packed)
    trimmable: bool = True
    min_reusable_offset: int = 0

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.min_reusable_offset <= self.length:
            raise ValueError("min_reusable_offset must lie in [0, len(tokens)]")

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(_host_order(self.packed))

    @property
    def length(self) -> int:
        """``len(self.tokens)``, without unpacking them."""
        return len(self.packed) >> 2


class MatchKind(enum.Enum):
    """How an entry answers a query."""

    EXACT = "exact"
    LONGER = "longer"  # the entry extends past the common prefix: trim it back
    SHORTER = "shorter"  # the entry is a prefix of the query


@attrs.frozen
class PrefixMatch:
    """The entry to reuse, and how much of it: ``reuse`` tokens of the query are covered."""

    entry: PrefixEntry
    kind: MatchKind
    reuse: int

    @property
    def trim(self) -> int:
        """Tokens to trim from the end of the entry's caches before use."""
        return self.entry.length - self.reuse


@attrs.define(eq=False)
class _Node:
    """A chain node: the entries passing through it, sorted by their next tokens."""

    depth: int
    # Every entry passing through (or ending at) this node, sorted by its *window*: its
    # tokens from this node's depth up to one block further. Entries sharing the most
    # tokens with a query lie next to where the query's window would be inserted.
    runs: list[PrefixEntry] = attrs.field(factory=list)
    # Tail lengths (tokens past the node's depth) of the entries ending here, with counts:
    # a "shorter" lookup probes only lengths that exist.
    tails: dict[int, int] = attrs.field(factory=dict)

    def empty(self) -> bool:
        return not self.runs


def _common_prefix(a: bytes, b: bytes, start: int) -> int:
    """Tokens shared by the packed sequences ``a`` and ``b``, known equal in their first
    ``start``: a binary search over slice comparisons (memcmp), O(log length) steps."""
    low, high = start, min(len(a), len(b)) >> 2
    if low >= high or a[4 * low : 4 * low + 4] != b[4 * low : 4 * low + 4]:
        return low  # the common case of a candidate: it differs at once
    if a[4 * low : 4 * high] == b[4 * low : 4 * high]:
        return high
    while high - low > 1:  # tokens [start, low) agree; the first difference is in [low, high)
        mid = (low + high) // 2
        if a[4 * low : 4 * mid] == b[4 * low : 4 * mid]:
            low = mid
        else:
            high = mid
    return low


# Among entries that reuse equally many tokens of a query, at most this many are weighed
# (shortest first among them; a prompt that thousands of entries share otherwise costs a
# scan of them all on every lookup).
MAX_TIES = 64


def _outward(runs: list[PrefixEntry], query: bytes, start: int, mid: int) -> Iterator[int]:
    """Indices of ``runs`` from ``mid`` outward, most tokens shared with ``query`` first
    (each side's shared length only falls as it moves away from the query's place)."""
    left, right = mid - 1, mid
    shared: dict[int, int] = {}

    def common(i: int) -> int:
        if i not in shared:
            shared[i] = _common_prefix(runs[i].packed, query, start)
        return shared[i]

    while left >= 0 or right < len(runs):
        if left >= 0 and (right >= len(runs) or common(left) >= common(right)):
            yield left
            left -= 1
        else:
            yield right
            right += 1


@attrs.define
class PrefixIndex:
    """Entries by key, and the chain nodes they pass through or end in.

    Costs (N entries, P blocks of a query, C candidates examined, b the block size):
    ``add`` and ``remove`` are O(blocks of the entry) hashes plus an O(log N) search and
    an insertion into each of its nodes' sorted runs (a list insert: a memmove of at most
    N pointers), and ``add`` of an entry sorting after every entry of its nodes (entries
    added in token order, as open does) is O(blocks) appends (open's two steps, the same:
    ``add_keys`` O(1) per entry, then ``add_runs`` O(blocks) appends per entry in token
    order); ``lookup`` is O(P) hashes
    to walk the chain, O(P * distinct tail lengths) hashes for the shorter entries, and
    O(log N + C * b) for the longer ones, with C <= :data:`MAX_TIES` per reuse length;
    never O(N).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    _entries: dict[str, PrefixEntry] = attrs.field(init=False, factory=dict)
    _nodes: dict[bytes, _Node] = attrs.field(init=False, factory=dict)
    _windows: dict[int, Callable[[PrefixEntry], bytes]] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)  # rule 4
    #: Bumped by every add and remove (rule 5).
    epoch: int = attrs.field(init=False, default=0)
    # The last lookup: (epoch, model, query as u32 little-endian bytes, its answer, the
    # chain nodes its walk reached).
    _last: tuple[int, ModelKey, bytes, PrefixMatch | None, list[_Node]] | None = attrs.field(
        init=False, default=None
    )

    def __attrs_post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[PrefixEntry]:
        return iter(list(self._entries.values()))

    def get(self, key: str) -> PrefixEntry | None:
        return self._entries.get(key)

    def make_entry(
        self,
        model: ModelKey,
        tokens: Sequence[int],
        *,
        trimmable: bool = True,
        min_reusable_offset: int = 0,
    ) -> PrefixEntry:
        """An entry for ``tokens`` with its key computed at this index's block size."""
        values = [int(t) for t in tokens]
        return PrefixEntry(
            entry_key(model, values, self.block_size),
            model,
            pack_tokens(values),
            trimmable,
            min_reusable_offset,
        )

    def _window(self, depth: int) -> Callable[[PrefixEntry], bytes]:
        """An entry's window at ``depth``: its packed tokens from that block on, one block."""
        window = self._windows.get(depth)
        if window is None:
            start = 4 * depth * self.block_size
            stop = start + 4 * self.block_size
            window = self._windows[depth] = lambda entry: entry.packed[start:stop]
        return window

    def _path(self, entry: PrefixEntry, root: bytes | None = None) -> list[bytes]:
        """The hashes of the nodes ``entry`` passes through, root first (``root``: its
        model's, when the caller has it)."""
        model, packed, step = entry.model, entry.packed, 4 * self.block_size
        parent = model.root() if root is None else root
        path = [parent]
        for start in range(0, len(packed) - step + 1, step):
            parent = _link_packed(parent, model, packed[start : start + step])
            path.append(parent)
        return path

    def add(self, entry: PrefixEntry) -> PrefixEntry | None:
        """Register ``entry``; return the entry it replaced (same key), if any."""
        with self._lock:
            return self._add(entry)

    # Open's bulk add, in two steps: the keys as the entries are made (each key's str and
    # entry still in the CPU's caches), then the runs in token order (appends). In one
    # pass in token order, each key and entry was reached again in an order unrelated to
    # where it lies in memory: at 100,000 entries, cache misses that grew that pass 15x
    # for 10x the entries (docs/bench/scale.md, thirteenth session).

    def add_keys(self, entries: Sequence[PrefixEntry]) -> None:
        """Open's bulk add, step 1: register each of ``entries`` under its key, none of
        them known to the index yet (ValueError, nothing registered, when one is). It is
        not findable by a lookup until :meth:`add_runs` has placed it."""
        with self._lock:
            fresh = dict(zip(map(_KEY, entries), entries, strict=True))
            if len(fresh) != len(entries) or not self._entries.keys().isdisjoint(fresh):
                raise ValueError("add_keys: a key is given twice or is indexed already")
            self._entries.update(fresh)
            self.epoch += 1

    def add_runs(self, entries: Iterable[PrefixEntry]) -> None:
        """Open's bulk add, step 2: each of ``entries`` (registered by :meth:`add_keys`,
        not placed yet) joins the runs of its nodes, in the order given: token order, so
        that each is appended (:meth:`add`'s outcome, one lock and root hash a batch)."""
        roots: dict[int, bytes] = {}
        with self._lock:
            self.epoch += 1
            for entry in entries:
                root = roots.get(id(entry.model))
                if root is None:
                    root = roots[id(entry.model)] = entry.model.root()
                self._place(entry, root)

    def _add(self, entry: PrefixEntry, root: bytes | None = None) -> PrefixEntry | None:
        # A new key (every one at open) costs one lookup, not a call of _remove.
        previous = self._remove(entry.key) if entry.key in self._entries else None
        self.epoch += 1
        self._place(entry, root)
        self._entries[entry.key] = entry
        return previous

    def _place(self, entry: PrefixEntry, root: bytes | None) -> None:
        """``entry`` into the runs of every node of its path (made as needed) and the tail
        count of its last; its key's registration is the caller's."""
        model, packed, step, nodes = entry.model, entry.packed, 4 * self.block_size, self._nodes
        parent, full = (model.root() if root is None else root), len(packed) // step
        for depth in range(full + 1):  # the path (_path) walked as it is made, root first
            start = depth * step
            if depth:  # the node after block depth - 1
                parent = _link_packed(parent, model, packed[start - step : start])
            found = nodes.get(parent)
            node = nodes.setdefault(parent, _Node(depth)) if found is None else found
            runs, window = node.runs, packed[start : start + step]  # its window (_window)
            if not runs or runs[-1].packed[start : start + step] <= window:
                runs.append(entry)  # in token order (open adds them so): no search
            else:
                bisect.insort(runs, entry, key=self._window(depth))
        tail = (len(packed) >> 2) - full * self.block_size
        node.tails[tail] = node.tails.get(tail, 0) + 1

    def remove(self, key: str) -> PrefixEntry | None:
        """Forget the entry named ``key``; return it, or None when absent."""
        with self._lock:
            return self._remove(key)

    def _remove(self, key: str) -> PrefixEntry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.epoch += 1
        path = self._path(entry)
        for depth, node_hash in enumerate(path):
            node = self._nodes[node_hash]
            window = self._window(depth)
            i = bisect.bisect_left(node.runs, window(entry), key=window)
            while node.runs[i] is not entry:  # equal windows: find this very entry
                i += 1
            del node.runs[i]
            if depth == len(path) - 1:
                tail = entry.length - depth * self.block_size
                node.tails[tail] -= 1
                if not node.tails[tail]:
                    del node.tails[tail]
            if node.empty():
                del self._nodes[node_hash]
        return entry

    def lookup(self, model: ModelKey, tokens: Sequence[int]) -> PrefixMatch | None:
        """The best entry to reuse for ``tokens`` (see rule 3), or None on a miss. Any
        thread (rule 4). The same query again, with no add or remove since, is answered
        from the last lookup without a walk (rule 5)."""
        if not tokens:
            return None
        little = _token_bytes(tokens)
        with self._lock:
            last = self._last
            if last is not None and last[:3] == (self.epoch, model, little):
                return last[3]
            path, hashes = self._walk(model, little)
            match = self._lookup(model, little, _big_endian(little), path, hashes)
            self._last = (self.epoch, model, little, match, path)
            return match

    def _path_of(self, model: ModelKey, little: bytes) -> list[_Node]:
        """The query's chain nodes (:meth:`_walk`), from the last lookup's when it was
        this query's at this epoch (rule 5)."""
        with self._lock:
            last = self._last
            if last is not None and last[:3] == (self.epoch, model, little):
                return last[4]
            return self._walk(model, little)[0]

    def _lookup(
        self,
        model: ModelKey,
        little: bytes,
        packed: bytes,
        path: list[_Node],
        hashes: list[bytes],
    ) -> PrefixMatch | None:
        n = len(little) >> 2
        if len(path) - 1 == n // self.block_size:  # every full block's node exists
            key = _link_bytes(hashes[-1], model, little[4 * (n - n % self.block_size) :])
            exact = self._entries.get(key.hex())
            if exact is not None and exact.packed == packed:
                return PrefixMatch(exact, MatchKind.EXACT, n)
        # else no exact entry: one is registered at the node of every full block it covers
        shorter = self._longest_shorter(model, path, hashes, little, packed)
        short_len = shorter.length if shorter is not None else 0
        longer = self._best_longer(path[-1], packed, short_len)
        if longer is not None:
            return longer
        if shorter is not None:
            return PrefixMatch(shorter, MatchKind.SHORTER, short_len)
        return None

    def refused_longer(
        self, model: ModelKey, tokens: Sequence[int], reuse: int
    ) -> tuple[PrefixEntry, int] | None:
        """The longer entry that rule 3 refused although it would have kept more than
        ``reuse`` tokens of the query (not trimmable, or below its minimum reusable offset),
        and what it would have kept; None when there is none. Same cost as :meth:`lookup`
        (explained misses, :mod:`kvtrio.actors.misses`): candidates are visited outward
        from the query's place in the deepest node's runs, most tokens kept first, and the
        first refused one is the answer."""
        if not tokens:
            return None
        little = _token_bytes(tokens)
        packed = _big_endian(little)
        n = len(little) >> 2
        deepest = self._path_of(model, little)[-1]
        start = deepest.depth * self.block_size
        window = self._window(deepest.depth)
        runs = deepest.runs
        mid = bisect.bisect_left(
            runs, packed[4 * start : 4 * (start + self.block_size)], key=window
        )
        for i in _outward(runs, packed, start, mid):
            entry = runs[i]
            common = _common_prefix(entry.packed, packed, start)
            if common >= entry.length:
                continue
            kept = min(n - 1, common)
            if kept <= reuse:
                return None
            if not (entry.trimmable and kept >= entry.min_reusable_offset):
                return entry, kept
        return None

    def _walk(self, model: ModelKey, little: bytes) -> tuple[list[_Node], list[bytes]]:
        """The nodes of the query's chain that exist (root first), and their hashes;
        ``little`` is the query as u32 little-endian bytes (:func:`_token_bytes`)."""
        parent = model.root()
        root = self._nodes.get(parent)
        if root is None:
            return [_Node(0)], [parent]
        path, hashes = [root], [parent]
        step = 4 * self.block_size
        for start in range(0, len(little) - step + 1, step):
            parent = _link_bytes(parent, model, little[start : start + step])
            node = self._nodes.get(parent)
            if node is None:
                break
            path.append(node)
            hashes.append(parent)
        return path, hashes

    def _longest_shorter(
        self,
        model: ModelKey,
        path: list[_Node],
        hashes: list[bytes],
        little: bytes,
        packed: bytes,
    ) -> PrefixEntry | None:
        """The longest entry that is a proper prefix of the query (``little``: its u32
        little-endian bytes; ``packed``: big-endian): at each node, deepest first, the
        entries ending there are probed by key, one per tail length present."""
        length = len(little) >> 2
        for node, node_hash in zip(reversed(path), reversed(hashes), strict=True):
            start = node.depth * self.block_size
            for tail in sorted(node.tails, reverse=True):
                n = start + tail
                if not 0 < n < length:
                    continue
                key = _link_bytes(node_hash, model, little[4 * start : 4 * n]).hex()
                entry = self._entries.get(key)
                if entry is not None and entry.packed == packed[: 4 * n]:
                    return entry
        return None

    def _best_longer(self, deepest: _Node, query: bytes, short_len: int) -> PrefixMatch | None:
        """The entry extending past the common prefix that reuses the most of ``query``:
        candidates are visited outward from the query's place in the node's sorted runs,
        in non-increasing order of tokens shared (rule 3's selection within each).
        ``query`` is packed (:data:`PackedTokens`)."""
        start = deepest.depth * self.block_size
        window = self._window(deepest.depth)
        runs = deepest.runs
        mid = bisect.bisect_left(runs, query[4 * start : 4 * (start + self.block_size)], key=window)
        length = len(query) >> 2
        left, right = mid - 1, mid
        shared: dict[int, int] = {}  # run index -> common prefix with the query

        def common(i: int) -> int:
            if i not in shared:
                shared[i] = _common_prefix(runs[i].packed, query, start)
            return shared[i]

        group: list[PrefixEntry] = []
        group_reuse = -1
        while True:
            best = -1
            if left >= 0 and (right >= len(runs) or common(left) >= common(right)):
                best, left = left, left - 1
            elif right < len(runs):
                best, right = right, right + 1
            reuse = -1
            if best >= 0:
                entry, shared_len = runs[best], common(best)
                if shared_len >= entry.length:
                    continue  # a prefix of the query (or the query itself): not "longer"
                reuse = min(length - 1, shared_len)
            if group and reuse != group_reuse:
                found = self._pick(group, group_reuse)
                if found is not None:
                    return found
                group = []
            if reuse <= short_len:
                return None  # nothing further can keep more than the shorter entry
            group.append(runs[best])
            group_reuse = reuse
            if len(group) == MAX_TIES:
                found = self._pick(group, group_reuse)
                if found is not None:
                    return found
                # Skip the rest of the tie: every entry sharing as many tokens lies in
                # one range of the runs around the query's place.
                low, high = self._tie_range(runs, window, query, start, common(best) - start)
                left, right = min(left, low - 1), max(right, high)
                group = []

    def _tie_range(
        self,
        runs: list[PrefixEntry],
        window: Callable[[PrefixEntry], bytes],
        query: bytes,
        start: int,
        shared: int,
    ) -> tuple[int, int]:
        """The range of ``runs`` whose windows begin with the (packed) query's first
        ``shared`` window tokens (those sharing at least that many tokens with it)."""
        if shared <= 0:
            return 0, len(runs)
        prefix = query[4 * start : 4 * (start + shared)]
        size = len(prefix)
        return (
            bisect.bisect_left(runs, prefix, key=window),
            bisect.bisect_right(runs, prefix, key=lambda entry: window(entry)[:size]),
        )

    @staticmethod
    def _pick(group: list[PrefixEntry], reuse: int) -> PrefixMatch | None:
        for entry in sorted(group, key=lambda e: (e.length, e.key)):
            if entry.trimmable and reuse >= entry.min_reusable_offset:
                return PrefixMatch(entry, MatchKind.LONGER, reuse)
        return None
