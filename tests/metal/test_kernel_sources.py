"""The Metal kernels are the CUDA kernels line for line (runs anywhere, no GPU needed).

The bodies may differ only in how a thread finds its ids, in shared-memory qualifiers, in
barriers and in ``metal::min``; everything else is in the ``kvt_*`` helpers each language's
headers define. The Metal side cannot run here, so this is what keeps it from drifting.
"""

from __future__ import annotations

import re

import pytest
from kvtrio.metal import kernels_cuda, kernels_metal

_CUDA_TO_METAL = [
    ("threadIdx.x", "thread_position_in_threadgroup.x"),
    ("threadIdx.y", "thread_position_in_threadgroup.y"),
    ("blockIdx.x", "threadgroup_position_in_grid.x"),
    ("blockIdx.y", "threadgroup_position_in_grid.y"),
    ("gridDim.x", "threadgroups_per_grid.x"),
    ("__shared__", "threadgroup"),
    ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
]


def _as_metal(source: str) -> str:
    for cuda, metal in _CUDA_TO_METAL:
        source = source.replace(cuda, metal)
    return re.sub(r"(?<![\w:])min\(", "metal::min(", source)


@pytest.mark.parametrize("name", ["PARTIAL_SOURCE", "PARTIAL_MMA_SOURCE", "MERGE_SOURCE"])
def test_metal_body_mirrors_cuda(name: str) -> None:
    assert getattr(kernels_metal, name) == _as_metal(getattr(kernels_cuda, name))


@pytest.mark.parametrize(
    ("header", "helpers"),
    [
        ("HEADER", ["kvt_fetch", "kvt_unpack", "kvt_weight", "kvt_shfl_xor"]),
        ("HEADER_QUANTIZED", ["kvt_fetchq", "kvt_unpackq", "kvt_weight"]),
        ("HEADER_MMA", ["kvt_mma", "kvt_trans", "kvt_pack", "kvt_load16", "kvt_weight"]),
    ],
)
def test_both_headers_define_the_helpers(header: str, helpers: list[str]) -> None:
    for source in (getattr(kernels_cuda, header), getattr(kernels_metal, header)):
        missing = [h for h in helpers if re.search(rf"\b{h}\(", source) is None]
        assert missing == []
