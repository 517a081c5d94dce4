"""CUDA spelling of the split-K paged decode attention (through ``mx.fast.cuda_kernel``).

The kernel bodies are :mod:`kvtrio.metal.kernels` (one description for both languages, whose
docstring states the theory of operation), rendered for CUDA; this module holds the CUDA
helpers they call (``kvt_*``, in the headers) and the kernel factories.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
from kvtrio.metal import kernels

__all__ = [
    "HEADER",
    "FUSED_MERGE",
    "HEADER_MMA",
    "HEADER_MMA_FUSED",
    "HEADER_QUANTIZED",
    "MERGE_SOURCE",
    "NAME",
    "PARTIAL_MMA_FUSED_SOURCE",
    "PARTIAL_MMA_SOURCE",
    "PARTIAL_SOURCE",
    "TENSOR_CORES",
    "TRACEABLE",
    "merge",
    "partial",
    "partial_mma",
    "partial_mma_fused",
]

_COMMON = """
#define KVT_NEG_INF (-cuda::std::numeric_limits<float>::infinity())

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

__device__ __forceinline__ float kvt_shfl_xor(float x, int offset) {
  return __shfl_xor_sync(0xffffffffu, x, offset);
}
__device__ __forceinline__ float kvt_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float kvt_int_as_float(int bits) { return __int_as_float(bits); }
__device__ __forceinline__ float kvt_max(float a, float b) { return fmaxf(a, b); }
// Weight of a running maximum m against a larger one: 0 while m is still -inf.
__device__ __forceinline__ float kvt_weight(float m, float top) {
  return m == KVT_NEG_INF ? 0.f : exp2f(m - top);
}
"""

# A lane's share of a token row: 8 consecutive elements, kept packed in registers
# (kvt_raw) until used; one 16-byte load for 16-bit types.
HEADER = (
    _COMMON
    + """
template <typename T, bool WIDE = (sizeof(T) > 2)>
struct kvt_raw {
  uint4 w;
};
template <typename T>
struct kvt_raw<T, true> {
  float4 a;
  float4 b;
};
template <typename T>
__device__ __forceinline__ void kvt_fetch(const T* p, kvt_raw<T>& raw) {
  if constexpr (sizeof(T) == 2) {
    raw.w = *reinterpret_cast<const uint4*>(p);
  } else {
    raw.a = reinterpret_cast<const float4*>(p)[0];
    raw.b = reinterpret_cast<const float4*>(p)[1];
  }
}
template <typename T>
__device__ __forceinline__ void kvt_unpack(const kvt_raw<T>& raw, float* out) {
  if constexpr (sizeof(T) == 2) {
    const T* h = reinterpret_cast<const T*>(&raw.w);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_f(h[e]);
  } else {
    out[0] = raw.a.x; out[1] = raw.a.y; out[2] = raw.a.z; out[3] = raw.a.w;
    out[4] = raw.b.x; out[5] = raw.b.y; out[6] = raw.b.z; out[7] = raw.b.w;
  }
}
#define KVT_RAW kvt_raw<T>
#define KVT_LOAD_K(row, raw) kvt_fetch(keys + (row) * D + sl * 8, raw)
#define KVT_LOAD_V(row, raw) kvt_fetch(values + (row) * D + sl * 8, raw)
"""
)

# The same for an affine-quantized pool (mx.quantize layout, 4 or 8 bits): packed words plus
# the group's scale and bias; unpacked as scale * q + bias in float32.
HEADER_QUANTIZED = (
    _COMMON
    + """
struct kvt_qraw {
  uint2 w;
  float s;
  float b;
};
template <int BITS, int GS, typename T>
__device__ __forceinline__ void kvt_fetchq(
    const uint32_t* packed, const T* scales, const T* biases, int elem, kvt_qraw& raw) {
  if constexpr (BITS == 4) {
    raw.w.x = packed[elem / 8];
  } else {
    raw.w = *reinterpret_cast<const uint2*>(packed + elem / 4);
  }
  raw.s = to_f(scales[elem / GS]);
  raw.b = to_f(biases[elem / GS]);
}
template <int BITS>
__device__ __forceinline__ void kvt_unpackq(const kvt_qraw& raw, float* out) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t x = (BITS == 4 || e < 4) ? raw.w.x : raw.w.y;
    const int shift = BITS == 4 ? 4 * e : 8 * (e % 4);
    out[e] = raw.s * float((x >> shift) & ((1u << BITS) - 1u)) + raw.b;
  }
}
#define KVT_RAW kvt_qraw
#define KVT_LOAD_K(row, raw) kvt_fetchq<BITS, GS, T>(keys, ks, kb, (row) * D + sl * 8, raw)
#define KVT_LOAD_V(row, raw) kvt_fetchq<BITS, GS, T>(values, vs, vb, (row) * D + sl * 8, raw)
#define kvt_unpack(raw, out) kvt_unpackq<BITS>(raw, out)
"""
)


# Tensor-core helpers of the float16/bfloat16 kernel (PARTIAL_MMA_SOURCE). A "word" is two
# 16-bit elements in 32 bits (lower address in the low half). The first argument (a pointer
# of the pool's element type) only picks the overload. Fragment layout of
# mma.m16n8k16 (lane = 4 g + c): A words (row g, cols 2c..2c+1), (row g + 8, same),
# (row g, cols 2c+8..2c+9), (row g + 8, same); B words (rows 2c..2c+1, col g),
# (rows 2c+8..2c+9, col g); C floats (row g, cols 2c, 2c+1), (row g + 8, same).
HEADER_MMA = (
    HEADER
    + """
__device__ __forceinline__ uint32_t kvt_pack(const __half*, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t kvt_pack(const __nv_bfloat16*, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// d (16 x 8, float) += a (16 x 16) * b (16 x 8), one warp, fragments as above.
__device__ __forceinline__ void kvt_mma(
    const __half*, float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
    uint32_t b0, uint32_t b1, int lane) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kvt_mma(
    const __nv_bfloat16*, float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
    uint32_t b0, uint32_t b1, int lane) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// An 8 x 8 matrix of 16-bit elements, lane 4 g + c holding row g, cols 2c..2c+1, transposed
// (the lane then holds rows 2c..2c+1 of column g).
__device__ __forceinline__ uint32_t kvt_trans(uint32_t x, int lane) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
// 16 bytes of a key or value row, through the read-only data path (WIDE: asking L2 to
// fetch the 256-byte line around them).
template <bool WIDE>
__device__ __forceinline__ uint4 kvt_load16(const void* p) {
  if constexpr (WIDE) {
    uint4 r;
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}
"""
)


# The fused merge's synchronisation (kernels.PARTIAL_MMA_FUSED): a device-scope fence, and a
# relaxed atomic add of one to a counter word of the (float32) scratch, returning its bits.
HEADER_MMA_FUSED = (
    HEADER_MMA
    + """
__device__ __forceinline__ void kvt_fence_device() { __threadfence(); }
__device__ __forceinline__ unsigned int kvt_count(float* words, int index) {
  return atomicAdd(reinterpret_cast<unsigned int*>(words) + index, 1u);
}
"""
)


PARTIAL_SOURCE = kernels.render(kernels.PARTIAL, "cuda")
PARTIAL_MMA_SOURCE = kernels.render(kernels.PARTIAL_MMA, "cuda")
PARTIAL_MMA_FUSED_SOURCE = kernels.render(kernels.PARTIAL_MMA_FUSED, "cuda")
MERGE_SOURCE = kernels.render(kernels.MERGE, "cuda")

# The tensor-core kernel is the default for float16/bfloat16 pools (KernelTuning.mma=None).
TENSOR_CORES = True

# The tensor-core kernel can merge in the same launch (KernelTuning.fused_merge).
FUSED_MERGE = True

# Its kernel calls can be traced by mx.compile (KernelTuning.compiled_launch).
TRACEABLE = True

# The backend's name in kvtrio.metal.attention.MEASURED_BACKENDS.
NAME = "cuda"

_INPUTS = ["q", "keys", "values", "table"]
_QUANTIZED_INPUTS = [*_INPUTS, "ks", "kb", "vs", "vb"]


@functools.cache
def partial(quantized: bool) -> Any:
    """The partition kernel (float or affine-quantized pool)."""
    return mx.fast.cuda_kernel(
        name="kvtrio_paged_partial_q" if quantized else "kvtrio_paged_partial",
        input_names=_QUANTIZED_INPUTS if quantized else _INPUTS,
        output_names=["out", "normal"],
        source=PARTIAL_SOURCE,
        header=HEADER_QUANTIZED if quantized else HEADER,
    )


@functools.cache
def partial_mma() -> Any:
    """The float16/bfloat16 partition kernel on tensor cores (mma.sync)."""
    return mx.fast.cuda_kernel(
        name="kvtrio_paged_partial_mma",
        input_names=_INPUTS,
        output_names=["out", "normal"],
        source=PARTIAL_MMA_SOURCE,
        header=HEADER_MMA,
    )


@functools.cache
def partial_mma_fused() -> Any:
    """The tensor-core partition kernel that also merges (the last block of a sequence)."""
    return mx.fast.cuda_kernel(
        name="kvtrio_paged_partial_mma_fused",
        input_names=_INPUTS,
        output_names=["result", "scratch"],
        source=PARTIAL_MMA_FUSED_SOURCE,
        header=HEADER_MMA_FUSED,
    )


@functools.cache
def merge() -> Any:
    """The log-sum-exp merge of each sequence's work items."""
    return mx.fast.cuda_kernel(
        name="kvtrio_paged_merge",
        input_names=["partials", "normal", "table"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )
