"""Compile the CUDA kernels as MLX's ``mx.fast.cuda_kernel`` would wrap them, with nvcc.

No GPU is needed: nvcc builds Hopper code on any machine. This catches compile errors and
shows registers and spills (``ptxas -v``) before a kernel costs device time. MLX's own
prelude (``mlx/backend/cuda/device/utils.cuh``) is not shipped with its wheels, so a small
one stands in for the names the kernels use from it. Run as a script for the resource report:
``python tests/metal/cuda_build.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtrio.metal import kernels_cuda

_PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cuda/std/limits>
#define inf cuda::std::numeric_limits<float>::infinity()
struct Shape {
  int32_t v[10];
  __device__ int32_t operator[](int i) const { return v[i]; }
};
"""

_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
          "int32": "int32_t", "uint32": "uint32_t"}

Arg = tuple[str, str]  # (name, dtype)


def wrap(
    name: str,
    header: str,
    source: str,
    inputs: list[Arg],
    outputs: list[Arg],
    template: list[tuple[str, int | bool | str]],
) -> str:
    """The translation unit MLX builds for one instantiation (its build_kernel, restated)."""
    params = []
    for arg, dtype in inputs:
        params.append(f"    const {_TYPES[dtype]}* {arg}")
        if f"{arg}_shape" in source:
            params.append(f"    const __grid_constant__ Shape {arg}_shape")
    params += [f"    {_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    consts = []
    for key, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {key} = {value};")
        else:
            consts.append(f"  using {key} = {_TYPES[value]};")
    return (
        _PRELUDE + header + "namespace mlx::core::cu {\n"
        f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n"
        + "\n".join(consts) + "\n" + source + "\n}\n}\n"
    )


def instantiations() -> list[tuple[str, str]]:
    """(label, translation unit) for the kernels at the shapes the library launches."""
    units = []
    f, b, q = "float16", "bfloat16", "float32"
    for dtype in (f, b):
        for tiles, wide in ((1, False), (2, False), (1, True)):
            tpl: list[tuple[str, int | bool | str]] = [
                ("HK", 8), ("G", 4), ("N", 1), ("D", 128), ("BS", 16), ("WARPS", 8),
                ("TILES", tiles), ("WIDE_L2", wide), ("CAUSAL", False),
                ("SCALE_BITS", 1040187392),
            ]
            units.append((f"mma {dtype} tiles={tiles} wide_l2={wide}", wrap(
                f"mma_{dtype}_{tiles}_{int(wide)}",
                kernels_cuda.HEADER_MMA, kernels_cuda.PARTIAL_MMA_SOURCE,
                [("q", dtype), ("keys", dtype), ("values", dtype), ("table", "int32")],
                [("out", q), ("normal", q)], tpl)))
    for dtype in (f, b):
        tpl = [("HK", 8), ("G", 4), ("N", 1), ("D", 128), ("BS", 16), ("WARPS", 8),
               ("TILES", 1), ("WIDE_L2", True), ("CAUSAL", False), ("SCALE_BITS", 1040187392),
               ("OutT", dtype), ("INIT_BITS", 0)]
        units.append((f"mma fused merge {dtype}", wrap(
            f"mma_fused_{dtype}", kernels_cuda.HEADER_MMA_FUSED,
            kernels_cuda.PARTIAL_MMA_FUSED_SOURCE,
            [("q", dtype), ("keys", dtype), ("values", dtype), ("table", "int32")],
            [("result", dtype), ("scratch", q)], tpl)))
    for dtype in (f, q):
        tpl = [("HQ", 32), ("HK", 8), ("G", 4), ("N", 1), ("D", 128), ("BS", 16), ("RC", 4),
               ("WARPS", 4), ("U", 4), ("PIPE", True), ("CAUSAL", False),
               ("SCALE_BITS", 1040187392), ("T", dtype)]
        units.append((f"scalar {dtype}", wrap(
            f"scalar_{dtype}", kernels_cuda.HEADER, kernels_cuda.PARTIAL_SOURCE,
            [("q", dtype), ("keys", dtype), ("values", dtype), ("table", "int32")],
            [("out", q), ("normal", q)], tpl)))
    for bits in (4, 8):
        tpl = [("HQ", 32), ("HK", 8), ("G", 4), ("N", 2), ("D", 128), ("BS", 16), ("RC", 4),
               ("WARPS", 4), ("U", 4), ("PIPE", True), ("CAUSAL", True),
               ("SCALE_BITS", 1040187392), ("BITS", bits), ("GS", 64), ("T", f)]
        units.append((f"quantized {bits} bits", wrap(
            f"quantized_{bits}", kernels_cuda.HEADER_QUANTIZED, kernels_cuda.PARTIAL_SOURCE,
            [("q", f), ("keys", "uint32"), ("values", "uint32"), ("table", "int32"),
             ("ks", f), ("kb", f), ("vs", f), ("vb", f)],
            [("out", q), ("normal", q)], tpl)))
    tpl = [("D", 128), ("J", 8), ("MAX_PARTS", 1024), ("HQN", 32), ("OutT", f)]
    units.append(("merge", wrap(
        "merge", kernels_cuda.HEADER, kernels_cuda.MERGE_SOURCE,
        [("partials", q), ("normal", q), ("table", "int32")], [("out", f)], tpl)))
    return units


def nvcc() -> str | None:
    return shutil.which("nvcc")


def compile_unit(unit: str, verbose: bool = False) -> subprocess.CompletedProcess[str]:
    """nvcc -cubin for sm_90 (ptxas -v with ``verbose``); the completed process."""
    compiler = nvcc()
    assert compiler is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cu"
        path.write_text(unit)
        cmd = [compiler, "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(Path(tmp) / "k.cubin"),
               str(path)]
        if verbose:
            cmd.insert(1, "-Xptxas=-v")
        return subprocess.run(cmd, capture_output=True, text=True, check=False)


if __name__ == "__main__":
    for label, unit in instantiations():
        done = compile_unit(unit, verbose=True)
        report = [ln.strip() for ln in done.stderr.splitlines() if "Used" in ln or "spill" in ln]
        print(label, "ok" if done.returncode == 0 else "FAILED")
        print("   " + "\n   ".join(report if done.returncode == 0 else done.stderr.splitlines()))
    sys.exit(0)
