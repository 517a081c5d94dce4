"""Codecs at the boundary (issue 15, item 6).

On the landed code a paged cache file failed to load (CorruptCacheError, which the tier
answers by deleting the entry) unless the caller had imported kvtrio.metal first; an
unknown kind was CorruptCacheError too; a RotatingKVCache with keep == max_size saved
but did not load; import_mlx_lm raised RecursionError, KeyError, TypeError or MLX's
RuntimeError on hostile files and wrote files load_cache refused.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvtrio
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtrio.api import import_mlx_lm
from kvtrio.errors import KvtrioError

from .conftest import make_kv, mlx_cache


def test_a_paged_cache_loads_without_importing_metal_first(tmp_path: Path) -> None:
    from kvtrio.metal import BlockPool, make_paged_cache

    pool = BlockPool(num_blocks=8, kv_heads=2, block_size=4, head_dim=8)
    cache = make_paged_cache(pool)
    cache.update_and_fetch(mx.ones((1, 2, 6, 8)), mx.ones((1, 2, 6, 8)))
    path = tmp_path / "paged.kvt"
    kvtrio.save_cache(path, list(range(6)), [cache])
    script = (
        "import sys, kvtrio\n"
        "assert not any(m.startswith('kvtrio.metal') for m in sys.modules)\n"
        f"loaded = kvtrio.load_cache({str(path)!r})\n"
        "print(type(loaded.caches[0]).__name__, loaded.caches[0].offset)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PagedKVCache", "6"]


def _rotating_keep_all(seed: int) -> Any:
    rng = random.Random(seed)
    size = rng.randint(1, 8)
    cache = mlx_cache.RotatingKVCache(max_size=size, keep=size)
    mx.random.seed(seed)
    for _ in range(rng.randint(1, 5)):
        n = rng.choice([1, 1, rng.randint(1, 12)])
        cache.update_and_fetch(mx.random.normal((1, 1, n, 2)), mx.random.normal((1, 1, n, 2)))
    return cache


@pytest.mark.parametrize("seed", range(12))
def test_rotating_cache_with_keep_equal_to_max_size_round_trips(tmp_path: Path, seed: int) -> None:
    live = _rotating_keep_all(seed)
    path = tmp_path / "r.kvt"
    kvtrio.save_cache(path, list(range(live.offset)), [live])
    loaded = kvtrio.load_cache(path).caches[0]
    assert (loaded._idx, loaded.offset, loaded.keep) == (live._idx, live.offset, live.keep)
    step = mx.random.normal((1, 1, 1, 2))
    for got, want in zip(
        loaded.update_and_fetch(step, step), live.update_and_fetch(step, step), strict=True
    ):
        assert mx.array_equal(got, want).item()


# -- import_mlx_lm on hostile files: only typed errors, and every file it writes loads


def _valid_mlx_lm_file(tmp_path: Path) -> bytes:
    src = tmp_path / "valid.safetensors"
    rotating = mlx_cache.RotatingKVCache(max_size=8, keep=2)
    rotating.update_and_fetch(mx.ones((1, 1, 5, 4)), mx.ones((1, 1, 5, 4)))
    mlx_cache.save_prompt_cache(str(src), [make_kv([5]), rotating], {"model": "m"})
    return src.read_bytes()


def _split_safetensors(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join_safetensors(header: Any, data: bytes) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def hostile_files(draw: st.DrawFn, valid: bytes) -> bytes:
    header, data = _split_safetensors(valid)
    how = draw(st.sampled_from(["metadata", "tensor", "bytes", "truncate"]))
    if how == "metadata":
        meta = header.setdefault("__metadata__", {})
        key = draw(st.sampled_from(["meta_state", "class_name", "0", "model", "zz"]))
        value = draw(json_values)
        meta[key] = value if draw(st.booleans()) else json.dumps(value)
        if draw(st.booleans()):  # mlx-lm's own structure keys, nested strangely
            meta["meta_state"] = json.dumps(draw(json_values))
        return _join_safetensors(header, data)
    if how == "tensor":
        names = sorted(k for k in header if k != "__metadata__")
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["shape", "dtype", "data_offsets"]))
        header[name][field] = draw(json_values)
        return _join_safetensors(header, data)
    if how == "truncate":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    raw = bytearray(valid)
    for _ in range(draw(st.integers(1, 8))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


@pytest.fixture(scope="module")
def valid_mlx_lm(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _valid_mlx_lm_file(tmp_path_factory.mktemp("mlxlm"))


def test_import_mlx_lm_fuzz_raises_only_typed_errors_and_writes_only_loadable_files(
    tmp_path: Path, valid_mlx_lm: bytes
) -> None:
    outcomes = {"refused": 0, "imported": 0}

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(raw=hostile_files(valid_mlx_lm))
    def one(raw: bytes) -> None:
        src = tmp_path / "in.safetensors"
        dst = tmp_path / "out.kvt"
        src.write_bytes(raw)
        dst.unlink(missing_ok=True)
        try:
            import_mlx_lm(src, dst)
        except KvtrioError:
            outcomes["refused"] += 1
            assert not dst.exists()
        else:
            outcomes["imported"] += 1
            kvtrio.load_cache(dst)  # every file it writes loads
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".kvtrio-tmp")]

    one()
    print(outcomes)
    assert outcomes["refused"] > 50 and outcomes["imported"] > 0, outcomes
