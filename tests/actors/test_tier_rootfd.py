"""docs/design.md invariant 18, ColdTier's rule 7 (issue 15, item 3): nothing under a
local tier's root is reached by a path the kernel resolves again; every operation walks
from the root's descriptor and never follows a link (kvtrio.storage.rootfd)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from kvtrio.actors.tier import ColdTier

Prefill = Callable[[Sequence[int]], list[Any]]
TOKENS = list(range(1, 40))


async def test_a_tier_delete_never_follows_a_caches_link_to_a_lookalike(
    tmp_path: Path, prefilled: Prefill
) -> None:
    """``caches/`` swapped for a link, while the tier runs, to a directory holding a file
    of the entry's name: deleting the entry removes the tier's own file, in its own
    (moved) directory, and nothing there (path-based, the unlink of
    ``<root>/caches/k.kvc`` went through the link and deleted the lookalike)."""
    root = tmp_path / "tier"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    async with ColdTier.open(root, inline=True) as tier:
        caches = await tier.owner.run(prefilled, TOKENS)
        assert (await (await tier.save("k", TOKENS, caches)).wait()).written
        lookalike = outside / "k.kvc"
        lookalike.write_bytes((root / "caches" / "k.kvc").read_bytes())
        (root / "caches").rename(root / "caches.real")
        (root / "caches").symlink_to(outside)
        assert await tier.delete("k") > 0
    assert lookalike.exists()
    assert not (root / "caches.real" / "k.kvc").exists()


async def test_nothing_outside_the_root_is_opened_by_a_tier_session(
    tmp_path: Path, prefilled: Prefill
) -> None:
    """The hostile drill's audit hook over a whole session (open, save, load, list,
    delete) with ``blocks/`` swapped for a link half way: no open outside the root, and
    every descriptor-relative open is one name with O_NOFOLLOW."""
    from kvtrio.drills.hostile import _install_audit

    root = tmp_path / "tier"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    audit = _install_audit()
    audit.root, audit.active, audit.bad = str(root), True, []
    try:
        async with ColdTier.open(root, layout="blocks", block_tokens=16, inline=True) as tier:
            caches = await tier.owner.run(prefilled, TOKENS)
            assert (await (await tier.save("k", TOKENS, caches)).wait()).written
            await tier.load("k")
            await tier.list()
            (root / "blocks").rename(root / "blocks.real")
            (root / "blocks").symlink_to(outside)
            with pytest.raises(Exception):  # noqa: B017 - any refusal; what matters is below
                await tier.load("k")
            await tier.delete("k")
    finally:
        audit.active = False
    assert audit.opened > 0
    assert audit.bad == []
