"""``kvtrio gc``'s mark step from the tier's catalogue (real ColdTier, tiny mlx-lm model):
with a cleanly closed catalogue no manifest is read and the same blocks stay; a missing,
unclean or disagreeing catalogue falls back to the manifests, and the grace period holds
either way.

Guards docs/design.md invariants 10 and 15.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import WritePolicy, open_tiered_cache
from kvtrio.storage.blockstore import LocalBlockStore
from kvtrio.storage.catalogue import CATALOGUE_NAME, Catalogue
from kvtrio.storage.fileops import OS_FILE_OPS, FaultyFileOps
from kvtrio.storage.maintenance import GcReport, collect_garbage
from kvtrio.storage.reader import read_header
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill

BLOCK = 64
ENTRIES = 3


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return build_tiny_model(seed=5)


def _prompt(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


async def _fill(directory: Path, tiny: TinyModel, seeds: range) -> None:
    async with (
        MlxOwner.inline() as owner,
        open_tiered_cache(
            directory,
            ModelKey(tiny.model_id, tiny.fingerprint),
            owner=owner,
            hot_budget=1 << 30,
            cold_budget=1 << 40,
            policy=WritePolicy.WRITE_THROUGH,
            block_size=BLOCK,
            min_free_bytes=0,
        ) as cache,
    ):
        for seed in seeds:
            tokens = _prompt(seed)
            caches = make_caches(tiny)
            prefill(tiny, caches, tokens)
            await cache.insert(tokens, caches)
        await cache.wait_writes_settled()


def _gc(directory: Path, *, grace_s: float = 0.0) -> tuple[GcReport, int]:
    """One pass with the catalogue; the report and how many files GC opened to read."""
    ops = FaultyFileOps(OS_FILE_OPS, lambda op: None)
    report = collect_garbage(
        str(directory / "caches"),
        LocalBlockStore(str(directory / "blocks")),
        grace_s=grace_s,
        file_ops=ops,
        catalogue_dir=str(directory),
    )
    return report, ops.calls.get("open", 0)


def _orphan(directory: Path) -> Path:
    """A block no manifest names, old enough for any grace period used here."""
    orphan = directory / "blocks" / ("ab" * 32)
    orphan.write_bytes(b"debris")
    return orphan


async def test_gc_with_a_clean_catalogue_reads_no_manifest(
    tmp_path: Path, tiny: TinyModel
) -> None:
    await _fill(tmp_path, tiny, range(ENTRIES))
    blocks_before = sorted(p.name for p in (tmp_path / "blocks").iterdir())
    orphan = _orphan(tmp_path)
    report, opened = _gc(tmp_path)
    assert (report.manifests, report.catalogued, opened) == (ENTRIES, ENTRIES, 0)
    assert not orphan.exists() and report.deleted_blocks == 1
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == blocks_before
    catalogue = Catalogue.open_read_only(str(tmp_path))
    assert catalogue is not None and catalogue.was_clean  # left as it was found
    catalogue.close()


@pytest.mark.parametrize("state", ["missing", "unclean", "corrupt"])
async def test_gc_without_a_usable_catalogue_reads_every_manifest(
    tmp_path: Path, tiny: TinyModel, state: str
) -> None:
    await _fill(tmp_path, tiny, range(ENTRIES))
    path = tmp_path / CATALOGUE_NAME
    if state == "missing":
        Catalogue.remove(str(tmp_path))
    elif state == "unclean":  # a crash, or an owner still at work
        Catalogue.open(str(tmp_path)).close(clean=False)
    else:
        path.write_bytes(b"not a database" * 100)
    blocks_before = sorted(p.name for p in (tmp_path / "blocks").iterdir())
    report, opened = _gc(tmp_path)
    assert (report.manifests, report.catalogued) == (ENTRIES, 0)
    assert opened >= ENTRIES
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == blocks_before


async def test_gc_reads_the_manifests_the_catalogue_does_not_describe(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """A manifest added behind the catalogue's back keeps its blocks (it is read); so does
    one replaced by another of a different size."""
    other = tmp_path / "other"
    await _fill(other, tiny, range(10, 12))
    await _fill(tmp_path, tiny, range(ENTRIES))
    added, replacement = sorted((other / "caches").iterdir())
    victim = sorted((tmp_path / "caches").iterdir())[0]
    shutil.copy(added, tmp_path / "caches" / added.name)
    if victim.stat().st_size == replacement.stat().st_size:
        pytest.skip("the replacement happens to have the same size")
    shutil.copy(replacement, victim)
    for block in (other / "blocks").iterdir():
        shutil.copy(block, tmp_path / "blocks" / block.name)
    report, _ = _gc(tmp_path)
    assert (report.manifests, report.catalogued) == (ENTRIES + 1, ENTRIES - 1)
    for manifest in (added, replacement):  # every block the copied manifests name stays
        header = read_header(str(manifest)).header
        for slot in header.slots():
            for ref in slot.blocks or ():
                assert (tmp_path / "blocks" / ref.sha256).exists()


async def test_gc_with_the_catalogue_keeps_the_grace_period(
    tmp_path: Path, tiny: TinyModel
) -> None:
    await _fill(tmp_path, tiny, range(ENTRIES))
    orphan = _orphan(tmp_path)
    report, _ = _gc(tmp_path, grace_s=3600.0)
    assert orphan.exists() and report.young_unreferenced == 1 and report.catalogued == ENTRIES


async def test_gc_reads_a_manifest_rewritten_to_the_same_size(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """A manifest replaced behind the catalogue's back by another of exactly its size is
    read, not trusted from its row (the row records the manifest's mtime too): the blocks
    the new manifest names stay."""
    other = tmp_path / "other"  # the same prompts through other weights: other blocks
    await _fill(other, build_tiny_model(seed=6), range(ENTRIES))
    await _fill(tmp_path, tiny, range(ENTRIES))
    # Manifests of one prompt differ in size only by the digits of their creation time.
    pairs = [
        (victim, replacement)
        for victim in sorted((tmp_path / "caches").iterdir())
        for replacement in sorted((other / "caches").iterdir())
        if victim.stat().st_size == replacement.stat().st_size
    ]
    if not pairs:
        pytest.skip("no two manifests happen to have the same size")
    victim, replacement = pairs[0]
    before = victim.stat().st_mtime_ns
    shutil.copy(replacement, victim)
    assert victim.stat().st_size == replacement.stat().st_size
    if victim.stat().st_mtime_ns == before:
        pytest.skip("the file system's clock did not move between the two writes")
    for block in (other / "blocks").iterdir():
        shutil.copy(block, tmp_path / "blocks" / block.name)
    report, _ = _gc(tmp_path)
    assert (report.manifests, report.catalogued) == (ENTRIES, ENTRIES - 1)
    header = read_header(str(victim)).header
    for slot in header.slots():
        for ref in slot.blocks or ():
            assert (tmp_path / "blocks" / ref.sha256).exists()
