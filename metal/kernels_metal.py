"""Metal source of the split-K paged decode attention (through ``mx.fast.metal_kernel``).

Line for line the twin of :mod:`kvtrio.metal.kernels_cuda` (whose docstring states the theory
of operation): only thread ids, threadgroup-memory qualifiers, barriers and the ``kvt_*``
helpers in the headers differ. No Apple GPU was reachable where this was written: the Metal
kernel is untested on hardware; its tests run where Metal is available and skip elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

__all__ = ["HEADER", "HEADER_QUANTIZED", "MERGE_SOURCE", "PARTIAL_SOURCE", "merge", "partial"]

_COMMON = """
#define KVT_NEG_INF (-INFINITY)

template <typename T> inline float to_f(T x) { return float(x); }
template <typename T> inline T from_f(float x) { return T(x); }

inline float kvt_shfl_xor(float x, int offset) { return simd_shuffle_xor(x, ushort(offset)); }
inline float kvt_exp2(float x) { return metal::exp2(x); }
inline float kvt_max(float a, float b) { return metal::max(a, b); }
// Weight of a running maximum m against a larger one: 0 while m is still -inf.
inline float kvt_weight(float m, float top) {
  return m == KVT_NEG_INF ? 0.f : metal::exp2(m - top);
}
"""

# Eight consecutive elements of a float pool.
HEADER = (
    _COMMON
    + """
template <typename T>
inline void kvt_load8(const device T* p, thread float* out) {
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = to_f(p[e]);
}
#define KVT_LOAD_K(row, out) kvt_load8(keys + (row) * D + sl * 8, out)
#define KVT_LOAD_V(row, out) kvt_load8(values + (row) * D + sl * 8, out)
"""
)

# Eight consecutive elements of an affine-quantized pool (mx.quantize layout, 4 or 8 bits):
# rounded to T after scale * q + bias, as mx.dequantize produces them.
HEADER_QUANTIZED = (
    _COMMON
    + """
template <int BITS, int GS, typename T>
inline void kvt_load8q(
    const device uint32_t* packed, const device T* scales, const device T* biases, int elem,
    thread float* out) {
  const float s = to_f(scales[elem / GS]);
  const float b = to_f(biases[elem / GS]);
  if (BITS == 4) {
    const uint32_t w = packed[elem / 8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_f(from_f<T>(s * float((w >> (4 * e)) & 15u) + b));
  } else {
    const uint2 w = *((const device uint2*)(packed + elem / 4));
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t x = e < 4 ? w.x : w.y;
      out[e] = to_f(from_f<T>(s * float((x >> (8 * (e % 4))) & 255u) + b));
    }
  }
}
#define KVT_LOAD_K(row, out) kvt_load8q<BITS, GS, T>(keys, ks, kb, (row) * D + sl * 8, out)
#define KVT_LOAD_V(row, out) kvt_load8q<BITS, GS, T>(values, vs, vb, (row) * D + sl * 8, out)
"""
)

PARTIAL_SOURCE = """
  constexpr int TL = D / 8;
  constexpr int TPW = 32 / TL;
  constexpr int R = G * N;
  constexpr int CH = (R + RC - 1) / RC;
  const int tid = thread_position_in_threadgroup.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = warp * TPW + lane / TL;
  const int sl = lane % TL;
  const int part = threadgroup_position_in_grid.x;
  const int parts = threadgroups_per_grid.x;
  const int hk = threadgroup_position_in_grid.y / CH;
  const int r0 = (threadgroup_position_in_grid.y % CH) * RC;
  const int length = params[0];
  const int part_size = params[1];
  const int start = part * part_size;
  const int stop = metal::min(length, start + part_size);
  float qv[RC][8];
  int visible[RC];
  float m[RC];
  float l[RC];
  float acc[RC][8];
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    const int lr = metal::min(r0 + r, R - 1);
    const int row = hk * R + lr;
#pragma unroll
    for (int e = 0; e < 8; ++e) qv[r][e] = to_f(q[row * D + sl * 8 + e]) * scale[0];
    visible[r] = CAUSAL ? length - N + lr % N + 1 : length;
    m[r] = KVT_NEG_INF;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }
  for (int base = start; base < stop; base += WARPS * TPW * U) {
    float kv[U][8];
    float vv[U][8];
    int tok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      tok[u] = base + u * WARPS * TPW + group;
      const int t = metal::min(tok[u], stop - 1);
      const int row = (table[t / BS] * HK + hk) * BS + t % BS;
      KVT_LOAD_K(row, kv[u]);
      KVT_LOAD_V(row, vv[u]);
    }
    float s[U][RC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < RC; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += qv[r][e] * kv[u][e];
#pragma unroll
        for (int o = TL / 2; o > 0; o /= 2) dot += kvt_shfl_xor(dot, o);
        s[u][r] = (tok[u] < stop && tok[u] < visible[r]) ? dot : KVT_NEG_INF;
      }
    }
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      float top = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) top = kvt_max(top, s[u][r]);
      if (top != KVT_NEG_INF) {
        const float corr = kvt_weight(m[r], top);
        float p[U];
        float total = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          p[u] = kvt_exp2(s[u][r] - top);
          total += p[u];
        }
        l[r] = l[r] * corr + total;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float a = acc[r][e] * corr;
#pragma unroll
          for (int u = 0; u < U; ++u) a += p[u] * vv[u][e];
          acc[r][e] = a;
        }
        m[r] = top;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    float top = m[r];
#pragma unroll
    for (int o = TL; o < 32; o *= 2) top = kvt_max(top, kvt_shfl_xor(top, o));
    const float w = kvt_weight(m[r], top);
    l[r] *= w;
#pragma unroll
    for (int o = TL; o < 32; o *= 2) l[r] += kvt_shfl_xor(l[r], o);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      acc[r][e] *= w;
#pragma unroll
      for (int o = TL; o < 32; o *= 2) acc[r][e] += kvt_shfl_xor(acc[r][e], o);
    }
    m[r] = top;
  }
  threadgroup float sm_acc[WARPS * RC * D];
  threadgroup float sm_ml[WARPS * RC * 2];
  if (lane < TL) {
#pragma unroll
    for (int r = 0; r < RC; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) sm_acc[(warp * RC + r) * D + sl * 8 + e] = acc[r][e];
      if (sl == 0) {
        sm_ml[(warp * RC + r) * 2] = m[r];
        sm_ml[(warp * RC + r) * 2 + 1] = l[r];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < RC * D; i += WARPS * 32) {
    const int r = i / D;
    const int d = i % D;
    if (r0 + r >= R) continue;
    float top = KVT_NEG_INF;
    for (int w = 0; w < WARPS; ++w) top = kvt_max(top, sm_ml[(w * RC + r) * 2]);
    float a = 0.f;
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      const float weight = kvt_weight(sm_ml[(w * RC + r) * 2], top);
      a += weight * sm_acc[(w * RC + r) * D + d];
      total += weight * sm_ml[(w * RC + r) * 2 + 1];
    }
    const int row = hk * R + r0 + r;
    out[(row * parts + part) * D + d] = a;
    if (d == 0) {
      normal[(row * parts + part) * 2] = top;
      normal[(row * parts + part) * 2 + 1] = total;
    }
  }
"""

MERGE_SOURCE = """
  const int d = thread_position_in_grid.x;
  const int row = thread_position_in_grid.y;
  if (d >= D) return;
  const int parts = normal_shape[1];
  float top = KVT_NEG_INF;
  for (int p = 0; p < parts; ++p) top = kvt_max(top, normal[(row * parts + p) * 2]);
  float a = 0.f;
  float total = 0.f;
  for (int p = 0; p < parts; ++p) {
    const float weight = kvt_weight(normal[(row * parts + p) * 2], top);
    a += weight * partials[(row * parts + p) * D + d];
    total += weight * normal[(row * parts + p) * 2 + 1];
  }
  out[row * D + d] = from_f<OutT>(a / total);
"""

_INPUTS = ["q", "keys", "values", "table", "params", "scale"]
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
def merge() -> Any:
    """The log-sum-exp merge of partitions."""
    return mx.fast.metal_kernel(
        name="kvtrio_paged_merge",
        input_names=["partials", "normal"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )
