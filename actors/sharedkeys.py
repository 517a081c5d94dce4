"""The keys of a shared prefix index (a manifest store that supports one: Redis), from
the chain hashes of :mod:`kvtrio.actors.prefix`: what a stored entry is registered under
(:func:`index_keys`) and what a query asks for (:func:`probe_keys`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvtrio.actors.prefix import ModelKey, _link, chain_hashes

__all__ = ["index_keys", "probe_keys"]


def index_keys(model: ModelKey, tokens: Sequence[int], block_size: int) -> list[str]:
    """The keys a cached sequence is registered under in a shared prefix index.

    The hex chain hash after each of its full blocks (every query sharing those blocks
    finds it), then its own key (:func:`entry_key`: an exact query finds it, even when it
    is shorter than one block).
    """
    chain = chain_hashes(model, tokens, block_size)
    parent = chain[-1] if chain else model.root()
    own = _link(parent, model, tokens[len(chain) * block_size :]).hex()
    return [*(h.hex() for h in chain), own]


def probe_keys(model: ModelKey, tokens: Sequence[int], block_size: int) -> list[tuple[str, int]]:
    """The index keys to ask for a query, deepest first, each with a bound: the most
    tokens of the query that an entry registered under that key can have in common with it.

    An entry registered under the chain hash after full block ``i`` shares blocks ``0..i``;
    unless block ``i + 1`` is the query's last, it diverges somewhere in block ``i + 1``
    (or it would be registered under the next hash too). The query's own key comes first:
    an entry under it is the query itself.
    """
    query = [int(t) for t in tokens]
    n = len(query)
    chain = chain_hashes(model, query, block_size)
    parent = chain[-1] if chain else model.root()
    out = [(_link(parent, model, query[len(chain) * block_size :]).hex(), n)]
    for i in reversed(range(len(chain))):
        bound = n if i == len(chain) - 1 else min(n, (i + 2) * block_size - 1)
        out.append((chain[i].hex(), bound))
    return out
