"""Metal spelling of the split-K paged decode attention (through ``mx.fast.metal_kernel``).

The kernel bodies are :mod:`kvtrio.metal.kernels` (one description for both languages),
rendered for Metal; this module holds the Metal helpers they call (``kvt_*``, in the headers,
with the semantics of the CUDA ones) and the kernel factories. No Apple GPU was reachable
where this was written: the Metal kernels are untested on hardware, so the direct path on
Metal is opt-in and checked against the reference path on first use
(:func:`kvtrio.metal.attention.allow_unmeasured_direct`).
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
    "HEADER_QUANTIZED",
    "MERGE_SOURCE",
    "NAME",
    "PARTIAL_MMA_SOURCE",
    "PARTIAL_SOURCE",
    "TENSOR_CORES",
    "TRACEABLE",
    "merge",
    "partial",
    "partial_mma",
]

_COMMON = """
#define KVT_NEG_INF (-INFINITY)

template <typename T> inline float to_f(T x) { return float(x); }
template <typename T> inline T from_f(float x) { return T(x); }

inline float kvt_shfl_xor(float x, int offset) { return simd_shuffle_xor(x, ushort(offset)); }
inline float kvt_exp2(float x) { return metal::exp2(x); }
inline float kvt_int_as_float(int bits) { return as_type<float>(bits); }
inline float kvt_max(float a, float b) { return metal::max(a, b); }
// Weight of a running maximum m against a larger one: 0 while m is still -inf.
inline float kvt_weight(float m, float top) {
  return m == KVT_NEG_INF ? 0.f : metal::exp2(m - top);
}
"""

# A lane's share of a token row: 8 consecutive elements, kept packed in registers
# (kvt_raw) until used.
HEADER = (
    _COMMON
    + """
template <typename T>
struct kvt_raw {
  T v[8];
};
template <typename T>
inline void kvt_fetch(const device T* p, thread kvt_raw<T>& raw) {
#pragma unroll
  for (int e = 0; e < 8; ++e) raw.v[e] = p[e];
}
template <typename T>
inline void kvt_unpack(thread const kvt_raw<T>& raw, thread float* out) {
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = to_f(raw.v[e]);
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
inline void kvt_fetchq(
    const device uint32_t* packed, const device T* scales, const device T* biases, int elem,
    thread kvt_qraw& raw) {
  if (BITS == 4) {
    raw.w.x = packed[elem / 8];
  } else {
    raw.w = *((const device uint2*)(packed + elem / 4));
  }
  raw.s = to_f(scales[elem / GS]);
  raw.b = to_f(biases[elem / GS]);
}
template <int BITS>
inline void kvt_unpackq(thread const kvt_qraw& raw, thread float* out) {
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

# The helpers of the float16/bfloat16 kernel (PARTIAL_MMA_SOURCE), with the semantics of the
# CUDA ones: kvt_mma is the m16n8k16 tensor-core product and kvt_trans the 8 x 8 transpose,
# on the CUDA fragment layout (see kernels_cuda.HEADER_MMA), here emulated with SIMD-group
# shuffles and float32 multiply-adds (Apple's simdgroup_matrix has another layout). It is
# correct by construction but slower than it could be, and untested on hardware.
HEADER_MMA = (
    HEADER
    + """
inline float kvt_lo(const device half*, uint x) { return float(as_type<half2>(x).x); }
inline float kvt_hi(const device half*, uint x) { return float(as_type<half2>(x).y); }
inline float kvt_lo(const device bfloat16_t*, uint x) { return as_type<float>(x << 16); }
inline float kvt_hi(const device bfloat16_t*, uint x) { return as_type<float>(x & 0xffff0000u); }
inline uint kvt_bf16_bits(float x) {
  const uint u = as_type<uint>(x);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
inline uint kvt_pack(const device half*, float a, float b) {
  return as_type<uint>(half2(half(a), half(b)));
}
inline uint kvt_pack(const device bfloat16_t*, float a, float b) {
  return kvt_bf16_bits(a) | (kvt_bf16_bits(b) << 16);
}
// d (16 x 8, float) += a (16 x 16) * b (16 x 8), one SIMD group, CUDA's fragment layout:
// lane 4 k + c of A holds rows k, k + 8 and cols 2c, 2c+1, 2c+8, 2c+9; of B col k, rows
// 2c, 2c+1, 2c+8, 2c+9.
template <typename P>
inline void kvt_mma(
    P p, thread float* d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1, int lane) {
  const int g = lane / 4;
  const int c = lane % 4;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint ra0 = simd_shuffle(a0, ushort(4 * g + k));
    const uint ra1 = simd_shuffle(a1, ushort(4 * g + k));
    const uint ra2 = simd_shuffle(a2, ushort(4 * g + k));
    const uint ra3 = simd_shuffle(a3, ushort(4 * g + k));
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint rb0 = simd_shuffle(b0, ushort(4 * (2 * c + e) + k));
      const uint rb1 = simd_shuffle(b1, ushort(4 * (2 * c + e) + k));
      d[e] += kvt_lo(p, ra0) * kvt_lo(p, rb0) + kvt_hi(p, ra0) * kvt_hi(p, rb0)
          + kvt_lo(p, ra2) * kvt_lo(p, rb1) + kvt_hi(p, ra2) * kvt_hi(p, rb1);
      d[2 + e] += kvt_lo(p, ra1) * kvt_lo(p, rb0) + kvt_hi(p, ra1) * kvt_hi(p, rb0)
          + kvt_lo(p, ra3) * kvt_lo(p, rb1) + kvt_hi(p, ra3) * kvt_hi(p, rb1);
    }
  }
}
// An 8 x 8 matrix of 16-bit elements, lane 4 g + c holding row g, cols 2c..2c+1, transposed
// (the lane then holds rows 2c..2c+1 of column g).
inline uint kvt_trans(uint x, int lane) {
  const int g = lane / 4;
  const int c = lane % 4;
  const uint lo = simd_shuffle(x, ushort(4 * (2 * c) + g / 2));
  const uint hi = simd_shuffle(x, ushort(4 * (2 * c + 1) + g / 2));
  const uint shift = 16 * (g % 2);
  return ((lo >> shift) & 0xffffu) | (((hi >> shift) & 0xffffu) << 16);
}
// 16 bytes of a key or value row (WIDE, a CUDA cache hint, has no Metal counterpart).
template <bool WIDE, typename P>
inline uint4 kvt_load16(const device P* p) {
  return *((const device uint4*)(p));
}
"""
)


PARTIAL_SOURCE = kernels.render(kernels.PARTIAL, "metal")
PARTIAL_MMA_SOURCE = kernels.render(kernels.PARTIAL_MMA, "metal")
MERGE_SOURCE = kernels.render(kernels.MERGE, "metal")

# The tensor-core kernel (emulated here) runs only when asked for (KernelTuning(mma=True)).
TENSOR_CORES = False

# No fused merge on Metal (kernels.PARTIAL_MMA_FUSED is rendered for CUDA only: its
# cross-threadgroup fence has not been written for Metal).
FUSED_MERGE = False

# Its kernel calls can be traced by mx.compile (KernelTuning.compiled_launch).
TRACEABLE = True

# The backend's name in kvtrio.metal.attention.MEASURED_BACKENDS.
NAME = "metal"

_INPUTS = ["q", "keys", "values", "table"]
_QUANTIZED_INPUTS = [*_INPUTS, "ks", "kb", "vs", "vb"]


@functools.cache
def partial(quantized: bool) -> Any:
    """The partition kernel (float or affine-quantized pool)."""
    return mx.fast.metal_kernel(
        name="kvtrio_paged_partial_q" if quantized else "kvtrio_paged_partial",
        input_names=_QUANTIZED_INPUTS if quantized else _INPUTS,
        output_names=["out", "normal"],
        source=PARTIAL_SOURCE,
        header=HEADER_QUANTIZED if quantized else HEADER,
    )


@functools.cache
def partial_mma() -> Any:
    """The float16/bfloat16 partition kernel (tensor-core operations emulated with shuffles)."""
    return mx.fast.metal_kernel(
        name="kvtrio_paged_partial_mma",
        input_names=_INPUTS,
        output_names=["out", "normal"],
        source=PARTIAL_MMA_SOURCE,
        header=HEADER_MMA,
    )


@functools.cache
def merge() -> Any:
    """The log-sum-exp merge of each sequence's work items."""
    return mx.fast.metal_kernel(
        name="kvtrio_paged_merge",
        input_names=["partials", "normal", "table"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )
