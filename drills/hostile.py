"""Hostile files: a crafted corpus (one file per validation rule) and mutation cases.

Theory of operation
-------------------
Promises under test (docs/design.md, untrusted-header rules; invariant 4):

1. Only CorruptCacheError (or, for a manifest naming an absent block, CacheMissError: a
   clean miss) escapes a load of a hostile file; never another exception, never a hang.
2. Memory stays bounded by the file: the tracemalloc peak of a whole load is at most
   ``_MEMORY_FACTOR`` times the bytes on disk (manifest plus present blocks) plus a
   fixed allowance, whatever the header claims.
3. No path outside the cache directory is opened, and no link inside it is followed:
   an audit hook (``sys.addaudithook``, event ``open``) watches every open of the load.
4. Every single-bit flip of a header (preamble and JSON) is detected.

Cases, all seeded and deterministic:

- ``bitflip``: every bit of the preamble and header of a cache file and of a manifest;
- ``resealed``: a JSON-level mutation (a value replaced by a hostile one, a key dropped
  or added, a node duplicated or nested deeply) whose preamble is recomputed, so the
  mutation reaches the field validation past the hash check;
- ``bytes``: byte-level edits of the header text, re-sealed the same way;
- ``truncated``: the file cut at a random length.

Most run in memory (preamble and header parse); every ``_FILE_EVERY``-th case is also
written into the cache directory and loaded end to end (reader, block store, hashes)
under the audit hook and tracemalloc. The corpus (:func:`build_corpus`) is run the same
way; ``tests/drills/corpus/make_corpus.py`` writes it for the tests.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from kvtrio.drills.hostile_corpus import (
    base_files,
    build_corpus,
    dumps_header,
    pad_header,
    seal,
    small_files,
    split_sealed,
)
from kvtrio.drills.report import DrillResult, Tally
from kvtrio.drills.workload import CacheDir
from kvtrio.errors import CacheMissError, CorruptCacheError, UnknownCacheKindError
from kvtrio.storage.format import PREAMBLE, Layout
from kvtrio.storage.headerparse import parse_header, parse_preamble

__all__ = ["load_hostile", "run_hostile_drill"]

_MEMORY_FACTOR = 8
_MEMORY_ALLOWANCE = 2 * 1024 * 1024
#: Growth of the drill process's peak RSS (MLX allocations included) over the whole run.
_RSS_ALLOWANCE = 256 * 1024 * 1024
_FILE_EVERY = 100
#: The ColdTier child's address-space limit: a load that tries to allocate what a hostile
#: header claims fails inside it instead of taking the machine's memory.
_TIER_CHILD_AS = 3 * 1024**3
_TIER_SAMPLES = 100


# --------------------------------------------------------------------------- loading


_CODE_SUFFIXES = (".py", ".pyc", ".so", ".pth")


@attrs.define
class _Audit:
    """An audit hook that records opens outside ``root`` or of links inside it."""

    root: str = ""
    active: bool = False
    opened: int = 0
    bad: list[str] = attrs.field(factory=list)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active or event != "open":
            return
        path, _, flags = args
        if not isinstance(path, str | bytes):
            return  # an fd
        text = os.fsdecode(path)
        if text.endswith(_CODE_SUFFIXES):
            return  # a lazy import of library code, not a path taken from the file
        self.opened += 1
        if not os.path.isabs(text):
            # Relative to a directory descriptor (a tier's rooted file operations,
            # kvtrio.storage.rootfd; the audit event does not carry the descriptor): one
            # name, never a link.
            nofollow = isinstance(flags, int) and bool(flags & os.O_NOFOLLOW)
            if os.sep in text or text == ".." or not nofollow:
                self.bad.append(f"opened a relative path that may leave the root: {text}")
            return
        real = os.path.abspath(text)
        if real != self.root and not real.startswith(self.root + os.sep):
            self.bad.append(f"opened outside the cache directory: {text}")
        elif os.path.islink(real) and not (isinstance(flags, int) and flags & os.O_NOFOLLOW):
            self.bad.append(f"opened a link without O_NOFOLLOW: {text}")


_AUDIT = _Audit()
_installed = False


def _install_audit() -> _Audit:
    global _installed
    if not _installed:
        sys.addaudithook(_AUDIT)
        _installed = True
    return _AUDIT


#: The outcome :func:`load_hostile` reports for each error a corpus case may expect.
OUTCOME_OF_ERROR = {
    "CorruptCacheError": "corrupt",
    "CacheMissError": "miss",
    "UnknownCacheKindError": "unsupported",
}


def load_hostile(path: str, cache_dir: CacheDir) -> tuple[str, str]:
    """Load ``path`` through the public :func:`kvtrio.load_cache` (verify on, the cache
    directory's block store): ("ok" | "corrupt" | "miss" | "unsupported", message); an
    unknown cache kind is "unsupported" (UnknownCacheKindError: not corruption).

    Whatever else escapes propagates (the drill counts it as a violation).
    """
    from kvtrio.api import load_cache

    try:
        load_cache(path, store=cache_dir.block_store(), verify=True)
    except CorruptCacheError as exc:
        return "corrupt", str(exc)
    except CacheMissError as exc:
        return "miss", str(exc)
    except UnknownCacheKindError as exc:
        return "unsupported", str(exc)
    return "ok", ""


def _disk_bytes(path: str, cache_dir: CacheDir) -> int:
    total = os.path.getsize(path)
    for name in os.listdir(cache_dir.blocks):
        total += os.lstat(os.path.join(cache_dir.blocks, name)).st_size
    return total


def _load_checked(path: str, cache_dir: CacheDir, tally: Tally, where: str) -> str:
    """:func:`load_hostile` under the audit hook and tracemalloc, checking promises 1-3."""
    audit = _install_audit()
    audit.root = os.path.abspath(cache_dir.root)
    audit.bad.clear()
    size = _disk_bytes(path, cache_dir)
    tracemalloc.start()
    audit.active = True
    try:
        outcome, _ = load_hostile(path, cache_dir)
    except BaseException as exc:
        outcome = "escaped"
        tally.violation(f"{where}: {type(exc).__name__} escaped: {str(exc)[:200]}")
    finally:
        audit.active = False
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    tally.add("end-to-end loads")
    tally.peak("peak memory / bytes on disk", round(peak / max(size, 1), 3))
    if peak > _MEMORY_FACTOR * size + _MEMORY_ALLOWANCE:
        tally.violation(f"{where}: load peaked at {peak} bytes for {size} bytes on disk")
    for text in audit.bad:
        tally.violation(f"{where}: {text}")
    return outcome


# --------------------------------------------------------------------------- mutations

_HOSTILE_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**53 + 1,
    2**63,
    2**64 + 7,
    -(2**63),
    10**30,
    1.5,
    -0.0,
    1e308,
    "",
    "x" * 5000,
    "../../etc/passwd",
    "/etc/passwd",
    "\u0000",
    "é",
    [],
    [0],
    [-1],
    [2**40] * 9,
    [[1]],
    {},
    {"a": 1},
    "float16",
    "int64",
    "object",
    "blocks",
    "single",
    "0" * 64,
    "f" * 64,
    "../" + "a" * 61,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if len(prefix) > 12:
        return
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:4]):
            yield from _paths(value, (*prefix, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


@attrs.frozen
class _Base:
    """A valid file to mutate: its bytes, header text and the JSON paths into it."""

    raw: bytes
    layout: str
    body: bytes
    rest: bytes
    paths: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, raw: bytes, layout: str) -> _Base:
        _, body, rest = split_sealed(raw)
        return cls(raw, layout, body, rest, tuple(_paths(json.loads(body)))[1:])

    def wrap(self, new_body: bytes) -> bytes:
        """Re-sealed: a fresh preamble, and the data kept at its aligned offset."""
        if self.layout != "single":
            return seal(new_body) + new_body
        return seal(new_body) + new_body + pad_header(len(new_body), len(self.body)) + self.rest


def _mutate_doc(base: _Base, rng: random.Random) -> bytes:
    doc = json.loads(base.body)  # a fresh copy (C speed)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        path = rng.choice(base.paths)
        try:
            parent, key = _get(doc, path[:-1]), path[-1]
            roll = rng.random()
            if roll < 0.55:
                parent[key] = rng.choice(_HOSTILE_VALUES)
            elif roll < 0.65 and isinstance(parent, dict):
                del parent[key]
            elif roll < 0.75 and isinstance(parent, dict):
                parent[rng.choice(("extra", "off", "blocks", "xxh3", "children"))] = 1
            elif roll < 0.85:
                node = parent[key]
                parent[key] = [node, node] if not isinstance(node, list) else node * 50
            elif roll < 0.92:
                nested: Any = parent[key]
                for _ in range(rng.choice((10, 70, 2000))):
                    nested = [nested]
                parent[key] = nested
            else:
                value = parent[key]
                if isinstance(value, int) and not isinstance(value, bool):
                    parent[key] = value + rng.choice((-1, 1, 16384, -16384, 2**40))
        except (KeyError, IndexError, TypeError):
            continue
    try:
        return dumps_header(doc)
    except (RecursionError, ValueError):
        return b"[" * 3000


def _mutate_bytes(body: bytes, rng: random.Random) -> bytes:
    data = bytearray(body)
    for _ in range(rng.choice((1, 1, 2, 4))):
        at = rng.randrange(len(data))
        roll = rng.random()
        if roll < 0.4:
            data[at] = rng.choice(b'{}[]",:0123456789-e.aznt\\\x00\xff')
        elif roll < 0.7:
            del data[at : at + rng.randint(1, 8)]
        else:
            data[at:at] = rng.choice((b'"', b",", b"]", b"}", b'"k":1,', b"9" * 400, b"\xc3"))
    return bytes(data)


def _parse_in_memory(raw: bytes, file_size: int) -> str:
    preamble = parse_preamble(raw[: PREAMBLE.size], file_size)
    body = raw[PREAMBLE.size : PREAMBLE.size + preamble.header_len]
    parse_header(body, preamble, file_size)
    return "ok"


def _memory_case(raw: bytes, file_size: int, tally: Tally, where: str) -> str:
    try:
        return _parse_in_memory(raw, file_size)
    except CorruptCacheError:
        return "corrupt"
    except BaseException as exc:
        tally.violation(f"{where}: {type(exc).__name__} escaped: {str(exc)[:200]}")
        return "escaped"


# --------------------------------------------------------------------------- the corpus


# --------------------------------------------------------------------------- through ColdTier


def _tier_child(cases_dir: str, tier_root: str, start: int) -> int:
    """``python -m kvtrio.drills.hostile tier-child``: load every case file of ``cases_dir``
    from index ``start`` through a ColdTier, printing ``B name`` before and
    ``R name outcome`` after each; the parent learns which case crashed the process."""
    import trio
    from kvtrio.actors.tier import ColdTier

    names = sorted(os.listdir(cases_dir))[start:]

    async def main() -> None:
        async with ColdTier.open(tier_root, layout="blocks", inline=True) as tier:
            for name in names:
                print(f"B {name}", flush=True)
                shutil.copyfile(os.path.join(cases_dir, name), tier.path_of("hostile"))
                try:
                    await tier.load("hostile")
                    outcome = "ok"
                except CorruptCacheError:
                    outcome = "corrupt"
                except CacheMissError:
                    outcome = "miss"
                except UnknownCacheKindError:
                    outcome = "unsupported"
                except Exception as exc:
                    outcome = f"escaped {type(exc).__name__}: {str(exc)[:120]}"
                print(f"R {name} {outcome}", flush=True)

    trio.run(main)
    return 0


def _run_tier(
    cases: list[tuple[str, bytes]], cache_dir: CacheDir, workdir: Path, tally: Tally
) -> None:
    """Load ``cases`` through ColdTier in a child process with an address-space limit;
    a case that kills the process is a violation, and the child restarts after it."""
    import resource
    import subprocess

    cases_dir = workdir / "tier-cases"
    tier_root = workdir / "tier"
    shutil.rmtree(cases_dir, ignore_errors=True)
    shutil.rmtree(tier_root, ignore_errors=True)
    cases_dir.mkdir(parents=True)
    shutil.copytree(cache_dir.blocks, tier_root / "blocks")
    for name, data in cases:
        (cases_dir / name).write_bytes(data)
    names = sorted(n for n, _ in cases)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (_TIER_CHILD_AS, _TIER_CHILD_AS))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is expected news

    start = 0
    while start < len(names):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtrio.drills.hostile",
                "tier-child",
                str(cases_dir),
                str(tier_root),
                str(start),
            ],
            capture_output=True,
            text=True,
            preexec_fn=limit,
            timeout=600,
            check=False,
        )
        began = None
        for line in proc.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "B":
                began = rest
            elif kind == "R":
                name, _, outcome = rest.partition(" ")
                tally.add("tier loads")
                tally.add(f"tier outcome: {outcome.split(':')[0]}")
                if outcome.startswith("escaped"):
                    tally.violation(f"tier {name.removesuffix('.case')}: {outcome}")
                began = None
                start += 1
        if proc.returncode != 0:
            if began is None:
                tally.violation(f"tier child failed: {proc.returncode}: {proc.stderr[-300:]}")
                return
            tally.add("tier loads")
            tally.violation(
                f"tier {began.removesuffix('.case')}: the process died "
                f"({_signal_name(proc.returncode)}) loading it through ColdTier"
            )
            start += 1


def _signal_name(returncode: int) -> str:
    import signal

    if returncode < 0:
        return signal.Signals(-returncode).name
    return f"exit {returncode}"


def _run_corpus(cache_dir: CacheDir, tally: Tally) -> list[tuple[str, bytes]]:
    """Load every corpus file; return them as (case file name, bytes) for the tier run."""
    out: list[tuple[str, bytes]] = []
    for case in build_corpus(cache_dir):
        out.append((f"corpus-{case.name}.case", case.data))
        path = os.path.join(
            cache_dir.caches if case.layout == "single" else cache_dir.manifests,
            f"corpus-{case.name}",
        )
        with open(path, "wb") as f:
            f.write(case.data)
        outcome = _load_checked(path, cache_dir, tally, f"corpus {case.name}")
        want = OUTCOME_OF_ERROR[case.error]
        tally.add("corpus cases")
        if outcome != want:
            tally.violation(f"corpus {case.name} ({case.rule}): {outcome}, expected {want}")
        os.unlink(path)
    return out


# --------------------------------------------------------------------------- the drill


def run_hostile_drill(*, full: bool, seed: int, workdir: Path) -> DrillResult:
    """Corpus + 100,000 mutation cases (1,000,000 with ``full``) + every header bit flip."""
    tally = Tally("hostile")
    started = time.perf_counter()
    root = workdir / "cache"
    shutil.rmtree(root, ignore_errors=True)
    cache_dir = CacheDir(str(root)).make()
    single, manifest = base_files(cache_dir)
    _warm_up(cache_dir)
    base_rss = _max_rss()
    tier_cases = _run_corpus(cache_dir, tally)
    corpus_size = len(tier_cases)
    _bitflips(single, "single", cache_dir, tally)
    _bitflips(manifest, "blocks", cache_dir, tally)
    rng = random.Random(f"hostile/{seed}")
    target = int(os.environ.get("KVTRIO_DRILL_CASES", 0)) or (1_000_000 if full else 100_000)
    small = small_files(cache_dir)
    bases = [_Base.of(raw, layout) for raw, layout in small]
    for case in range(target):
        base = bases[case % 2]
        roll = rng.random()
        if roll < 0.45:
            kind = "resealed"
            data = base.wrap(_mutate_doc(base, rng))
        elif roll < 0.8:
            kind = "bytes"
            data = base.wrap(_mutate_bytes(base.body, rng))
        elif roll < 0.9:
            kind = "bits"
            flipped = bytearray(base.raw[: PREAMBLE.size + len(base.body)])
            for _ in range(rng.randint(2, 8)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            data = bytes(flipped) + base.raw[len(flipped) :]
        else:
            kind = "truncated"
            data = base.raw[: rng.randrange(len(base.raw))]
        where = f"case {case} ({kind}, {base.layout})"
        tally.add("hostile cases")
        tally.add(f"hostile cases: {kind}")
        if case % _FILE_EVERY == 0:
            if len(tier_cases) < corpus_size + _TIER_SAMPLES:
                tier_cases.append((f"m{case:07d}.case", data))
            layout: Layout = "single" if base.layout == "single" else "blocks"
            path = cache_dir.path_of(f"m{case}", layout)
            with open(path, "wb") as f:
                f.write(data)
            outcome = _load_checked(path, cache_dir, tally, where)
            os.unlink(path)
        else:
            outcome = _memory_case(data, len(data), tally, where)
        if outcome != "escaped":
            tally.add(f"outcome: {outcome}")
    growth = _max_rss() - base_rss
    tally.set("peak RSS growth (bytes)", growth)
    if growth > _RSS_ALLOWANCE:
        tally.violation(f"the drill's peak RSS grew {growth} bytes over {_RSS_ALLOWANCE}")
    tally.set("seconds: in-process cases", round(time.perf_counter() - started, 1))
    tier_started = time.perf_counter()
    _run_tier(tier_cases, cache_dir, workdir, tally)
    tally.set("seconds: ColdTier loads", round(time.perf_counter() - tier_started, 1))
    tally.set("losses", tally.violation_count)
    return tally.result(time.perf_counter() - started)


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up(cache_dir: CacheDir) -> None:
    """Load valid files once, so lazy imports and MLX start-up are not charged to a case."""
    for layout in ("single", "blocks"):
        load_hostile(cache_dir.path_of("base", layout), cache_dir)


def _bitflips(raw: bytes, layout: str, cache_dir: CacheDir, tally: Tally) -> None:
    """Every single-bit flip of the preamble and header must be detected."""
    _, header_len, _ = PREAMBLE.unpack_from(raw)[1:]
    end = PREAMBLE.size + header_len
    data = bytearray(raw)
    for bit in range(end * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        outcome = _memory_case(bytes(data), len(data), tally, f"bitflip {layout} bit {bit}")
        data[bit // 8] ^= 1 << (bit % 8)
        tally.add(f"header bit flips ({layout})")
        if outcome == "ok":
            tally.violation(f"bitflip {layout} bit {bit}: undetected")
    tally.add("hostile cases", end * 8)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "tier-child":
        sys.exit(_tier_child(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit("usage: python -m kvtrio.drills.hostile tier-child CASES_DIR TIER_ROOT START")
