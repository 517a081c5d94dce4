"""One direct call's kernel calls, kept per view and call shape, and replayed compiled.

Building a direct call on the host is mostly MLX's own work inside each
``mx.fast.cuda_kernel`` call: it renders the kernel's whole translation unit (header, the
argument list, the template constants and the body) as a new string per call and makes a new
primitive holding it. A :class:`Launch` keeps everything of a call but its queries, and from
its second call on (``KernelTuning.compiled_launch``) runs the calls through ``mx.compile``:
MLX traces them once, then each later call replays the traced graph, new arrays around the
same primitives, with no kernel call from Python and no source rendered. The first call stays
plain, so a view used once (a decode step that captures a view per layer) never pays for a
trace. A launch that cannot be traced (a kernel stand-in that reads its inputs' values, or
compilation disabled) keeps the plain calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
import mlx.core as mx

__all__ = ["Launch", "LaunchMode"]


class LaunchMode:
    """How a :class:`Launch` runs its calls (``Launch.mode``)."""

    PLAIN = "plain"  # the kernel calls, from Python, every call
    COMPILED = "compiled"  # traced once by mx.compile, replayed since
    UNTRACEABLE = "untraceable"  # the trace failed once: plain calls for good


@attrs.define(eq=False)
class Launch:
    """One direct call's kernel calls with everything but the queries bound (kept per view
    and call shape by :meth:`BatchPagedAttentionView.attend_direct`)."""

    partial: Any  # the partition kernel (or the fused one)
    partial_kw: dict[str, Any]
    tail: tuple[mx.array, ...]  # its inputs after the queries: keys, values, table, ...
    merge: Any  # the merge kernel, or None when the partition kernel merges
    merge_kw: dict[str, Any]
    compiled: bool = False  # replay through mx.compile from the second call on
    mode: str = LaunchMode.PLAIN
    calls: int = 0
    _replay: Any = None
    _plain: Callable[..., list[mx.array]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._plain = _body(self.partial, self.partial_kw, self.merge, self.merge_kw)

    @property
    def table(self) -> mx.array:
        """The kernel block table: the tail's third array (keys, values, table, ...)."""
        return self.tail[2]

    def run(self, queries: mx.array) -> mx.array:
        self.calls += 1
        if self.mode == LaunchMode.COMPILED:
            return cast(mx.array, self._replay(queries, *self.tail)[0])
        if self.compiled and self.mode == LaunchMode.PLAIN and self.calls > 1:
            replay = mx.compile(self._plain)
            try:
                out: mx.array = replay(queries, *self.tail)[0]
            except Exception:  # not traceable: the plain call below raises any real error
                self.mode = LaunchMode.UNTRACEABLE
            else:
                self._replay, self.mode = replay, LaunchMode.COMPILED
                return out
        return self._plain(queries, *self.tail)[0]


def _body(partial: Any, partial_kw: dict[str, Any], merge: Any,
          merge_kw: dict[str, Any]) -> Callable[..., list[mx.array]]:
    """The kernel calls of one launch as a function of its arrays (queries, then the tail).
    It holds no array and not the launch, so a replay kept by the launch makes no cycle: a
    dropped view frees its pool arrays at once."""

    def body(queries: mx.array, *tail: mx.array) -> list[mx.array]:
        outputs = partial(inputs=[queries, *tail], **partial_kw)
        if merge is not None:
            # the table is the tail's third array (keys, values, table, ...)
            outputs = merge(inputs=[outputs[0], outputs[1], tail[2]], **merge_kw)
        return [outputs[0]]

    return body
