"""A request as kvtrio serve's generation thread sees it: which tier served it, and its
response queue.

:class:`TaggingQueue` wraps a request's response queue when the generation thread takes
the request (kvtrio serve's rule 2, :mod:`kvtrio.serve.server`): the first item it is
given is mlx-lm's ``GenerationContext``, which it tags with a :class:`Tag`; once the
request's lookup has run the tag says which tier served it, and its handler sends that
in its headers. The tag also keeps the response queue, so that a shutdown that cuts the
request can end its handler's wait (rule 4): mlx-lm's batched loop drops a stopped
request without a last item on its queue, and the handler waited for one until the
generation thread stopped, a second ``--grace`` later, its stream cut off unfinished.
"""

from __future__ import annotations

import threading
from queue import Queue
from typing import Any

import attrs
from kvtrio.serve.adapter import CacheTier, FetchInfo, TieredLRUPromptCache

__all__ = ["Tag", "TaggingQueue", "end_response"]


def _generation_context() -> Any:
    from mlx_lm.server import GenerationContext

    return GenerationContext


@attrs.define(eq=False)
class Tag:
    """Which tier served a request (rule 2); ``ready`` once known. ``responses``: the
    request's response queue (mlx-lm's, which its handler reads)."""

    responses: Queue[Any]
    ready: threading.Event = attrs.field(factory=threading.Event)
    fetch: FetchInfo | None = None


def end_response(ctx: Any) -> None:
    """Any thread: end the handler's read of the request of ``ctx`` (a request being cut
    at shutdown): the ``None`` that ends mlx-lm's response iterator, where the generation
    thread, dropping the stopped request, puts none. Its handler then finishes the reply
    as for any ended generation (a stream gets its last chunk and ``[DONE]``)."""
    tag = getattr(ctx, "kvtrio", None)
    if isinstance(tag, Tag):
        tag.responses.put(None)


class TaggingQueue:
    """A request's response queue, as the generation thread sees it (rule 2)."""

    def __init__(
        self, inner: Queue[Any], adapter: TieredLRUPromptCache, *, from_disk: bool = False
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.from_disk = from_disk  # its entry was loaded for it: a RAM hit is a disk hit
        self.start = adapter.fetch_count
        self.tag: Tag | None = None
        self.tagged = False

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if self.tag is None and isinstance(item, _generation_context()):
            self.tag = Tag(self.inner)
            item.kvtrio = self.tag
        if not self.tagged and self.adapter.fetch_count > self.start and self.tag is not None:
            self.tagged = True
            fetch = self.adapter.last_fetch
            if self.from_disk and fetch is not None and fetch.tier is CacheTier.HOT:
                fetch = FetchInfo(CacheTier.COLD, fetch.reused)
            self.tag.fetch = fetch
            self.tag.ready.set()
            # Tagged: the rest of the request's items (a token each) go straight to mlx-lm's
            # queue, one Python call fewer per token on the generation thread.
            self.put = self.inner.put  # type: ignore[method-assign]
        self.inner.put(item, *args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get(*args, **kwargs)
