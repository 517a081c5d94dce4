"""main's cold load against this branch's, in one process, alternated round by round,
with naive's load beside them (the entry of ``kvtrio.bench.loadcost``).

    python docs/load10/oldnew.py MAIN_CHECKOUT ROUNDS [TOKENS]

Variants: ``main`` (main's allocate_slot: one allocation per token block; main's
_read_pipelined and restore: every join after the last read), ``alloc`` (this branch's
allocate_slot, main's pipeline), ``new`` (this branch). Each also ``_parts``: timed by
loadcost's wrappers.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any

from kvtrio.actors import owner as owner_module
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.tier import ColdTier
from kvtrio.bench import loadcost
from kvtrio.storage import hostbuffers


def _main_module(checkout: str, relative: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(checkout) / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    checkout, rounds = sys.argv[1], int(sys.argv[2])
    tokens_n = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    caches = loadcost.make_caches(tokens_n)
    tokens = list(range(2, 2 + tokens_n))
    times: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="kvtrio-oldnew-") as root:
        naive_path = str(Path(root) / "naive.safetensors")
        loadcost.mlx_cache.save_prompt_cache(naive_path, caches)
        kvtrio = loadcost._Kvtrio(str(Path(root) / "tier"), tokens, caches)
        # main's modules, executed only once the entry is written: executing main's
        # hostbuffers re-declares the argtypes of ctypes' shared PyObject_GetBuffer with
        # its own _PyBuffer class, so this branch's zero-copy save raises ArgumentError.
        old_buffers = _main_module(checkout, "storage/hostbuffers.py", "main_hostbuffers")
        old_tier = _main_module(checkout, "actors/tier.py", "main_tier")
        old_owner = _main_module(checkout, "actors/owner.py", "main_owner")
        # main's restore calls this branch's module functions (so the wrappers time them).
        setattr(old_owner, "_join", lambda *a: owner_module._join(*a))  # noqa: B010
        setattr(old_owner, "_assemble", lambda *a: owner_module._assemble(*a))  # noqa: B010
        variants: dict[str, tuple[Any, Any, Any]] = {
            "main": (
                old_buffers.allocate_slot,
                old_tier.ColdTier._read_pipelined,
                old_owner.MlxOwner.restore,
            ),
            "alloc": (
                hostbuffers.allocate_slot,
                old_tier.ColdTier._read_pipelined,
                old_owner.MlxOwner.restore,
            ),
            "new": (hostbuffers.allocate_slot, ColdTier._read_pipelined, MlxOwner.restore),
        }
        new = variants["new"]
        for round_ in range(rounds):
            order = ["naive", *variants, *(f"{v}_parts" for v in variants)]
            if round_ % 2:
                order.reverse()
            for name in order:
                variant = name.split("_")[0]
                if variant == "naive":
                    took, got = loadcost._timed(
                        lambda: loadcost._load_naive(naive_path), [Path(naive_path)], False
                    )
                else:
                    allocate, pipelined, restore = variants[variant]
                    hostbuffers.allocate_slot = allocate
                    ColdTier._read_pipelined = pipelined  # type: ignore[method-assign]
                    MlxOwner.restore = restore  # type: ignore[method-assign]
                    spans = loadcost._Spans()
                    if name.endswith("_parts"):
                        with loadcost._instrumented(spans):
                            took, got = loadcost._timed(kvtrio.load, [], False)
                    else:
                        took, got = loadcost._timed(kvtrio.load, [], False)
                    for part, seconds in spans.seconds.items():
                        parts[variant][part].append(seconds)
                assert loadcost._same(got, caches), name
                del got
                times[name].append(took)
        hostbuffers.allocate_slot, ColdTier._read_pipelined, MlxOwner.restore = new  # type: ignore[method-assign]
        kvtrio.cache.close()
    for name, values in times.items():
        print(
            f"{name:12s} median {statistics.median(values) * 1e3:7.1f} ms  "
            f"({', '.join(f'{v * 1e3:.0f}' for v in values)})"
        )
    for variant, by_part in parts.items():
        print(variant)
        for part, values in by_part.items():
            print(f"  {part:45s} {statistics.median(values) * 1e3:7.1f}")
    print(json.dumps({"times": times, "parts": parts}))


if __name__ == "__main__":
    main()
