"""The kernel bodies exist once (kvtrio.metal.kernels) and render to both languages.

No GPU is needed. The Metal side cannot run here, so these keep its spelling honest: the
rendered bodies keep no neutral name, and the Metal body is the CUDA body with only thread
ids, shared-memory qualifiers, barriers and ``metal::min`` changed (an independent restatement
of the translation). Where nvcc is installed, every CUDA instantiation the library launches
compiles for sm_90, as MLX wraps it (tests/metal/cuda_build.py).
"""

from __future__ import annotations

import re

import pytest
from kvtrio.metal import kernels, kernels_cuda, kernels_metal

from . import cuda_build

_CUDA_TO_METAL = [
    ("threadIdx.x", "thread_position_in_threadgroup.x"),
    ("threadIdx.y", "thread_position_in_threadgroup.y"),
    ("blockIdx.x", "threadgroup_position_in_grid.x"),
    ("blockIdx.y", "threadgroup_position_in_grid.y"),
    ("gridDim.x", "threadgroups_per_grid.x"),
    ("__shared__", "threadgroup"),
    ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
]
BODIES = [("PARTIAL_SOURCE", "PARTIAL"), ("PARTIAL_MMA_SOURCE", "PARTIAL_MMA"),
          ("MERGE_SOURCE", "MERGE")]


def _as_metal(source: str) -> str:
    for cuda, metal in _CUDA_TO_METAL:
        source = source.replace(cuda, metal)
    return re.sub(r"(?<![\w:])min\(", "metal::min(", source)


@pytest.mark.parametrize(("name", "body"), BODIES)
def test_both_languages_render_the_one_body(name: str, body: str) -> None:
    for module, language in ((kernels_cuda, "cuda"), (kernels_metal, "metal")):
        rendered = getattr(module, name)
        assert rendered == kernels.render(getattr(kernels, body), language)
        left = [n for n in kernels.NAMES if re.search(rf"\b{n}\b", rendered)]
        assert left == []


@pytest.mark.parametrize(("name", "body"), BODIES)
def test_metal_body_mirrors_cuda(name: str, body: str) -> None:
    assert getattr(kernels_metal, name) == _as_metal(getattr(kernels_cuda, name))


@pytest.mark.parametrize(
    ("header", "helpers"),
    [
        ("HEADER", ["kvt_fetch", "kvt_unpack", "kvt_weight", "kvt_shfl_xor"]),
        ("HEADER_QUANTIZED", ["kvt_fetchq", "kvt_unpackq", "kvt_weight"]),
        ("HEADER_MMA", ["kvt_mma", "kvt_trans", "kvt_pack", "kvt_load16",
                        "kvt_weight"]),
    ],
)
def test_both_headers_define_the_helpers(header: str, helpers: list[str]) -> None:
    for source in (getattr(kernels_cuda, header), getattr(kernels_metal, header)):
        missing = [h for h in helpers if re.search(rf"\b{h}\(", source) is None]
        assert missing == []


@pytest.mark.skipif(cuda_build.nvcc() is None, reason="needs nvcc (CUDA's compiler)")
@pytest.mark.parametrize("index", range(len(cuda_build.instantiations())))
def test_cuda_kernels_compile_for_hopper(index: int) -> None:
    label, unit = cuda_build.instantiations()[index]
    done = cuda_build.compile_unit(unit)
    assert done.returncode == 0, (label, done.stderr[-2000:])
