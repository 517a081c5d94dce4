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

PARTIAL_SOURCE = r"""
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
  // table = [length, block numbers...]; partitions split the length evenly, whole steps each.
  const int length = table[0];
  const int part_size = ((length + parts - 1) / parts + WARPS * TPW * U - 1) / (WARPS * TPW * U)
      * (WARPS * TPW * U);
  const float scale = kvt_int_as_float(SCALE_BITS);
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
    for (int e = 0; e < 8; ++e) qv[r][e] = to_f(q[row * D + sl * 8 + e]) * scale;
    visible[r] = CAUSAL ? length - N + lr % N + 1 : length;
    m[r] = KVT_NEG_INF;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }
  // Keys and values of U tokens per lane, loaded one block step ahead when PIPE is set.
#define KVT_FETCH(first, kd, vd) \
  for (int u = 0; u < U; ++u) { \
    const int t = metal::min((first) + u * WARPS * TPW + group, stop - 1); \
    const int row = (table[1 + t / BS] * HK + hk) * BS + t % BS; \
    KVT_LOAD_K(row, kd[u]); \
    KVT_LOAD_V(row, vd[u]); \
  }
  KVT_RAW kv[U];
  KVT_RAW vv[U];
  if (PIPE && start < stop) {
    KVT_FETCH(start, kv, vv);
  }
  for (int base = start; base < stop; base += WARPS * TPW * U) {
    KVT_RAW kn[U];
    KVT_RAW vn[U];
    if (!PIPE) {
      KVT_FETCH(base, kv, vv);
    } else if (base + WARPS * TPW * U < stop) {
      KVT_FETCH(base + WARPS * TPW * U, kn, vn);
    }
    float s[U * RC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k8[8];
      kvt_unpack(kv[u], k8);
#pragma unroll
      for (int r = 0; r < RC; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += qv[r][e] * k8[e];
#pragma unroll
        for (int o = TL / 2; o > 0; o /= 2) dot += kvt_shfl_xor(dot, o);
        s[u * RC + r] = dot;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * WARPS * TPW + group;
#pragma unroll
      for (int r = 0; r < RC; ++r) {
        s[u * RC + r] = (tok < stop && tok < visible[r]) ? s[u * RC + r] : KVT_NEG_INF;
      }
    }
    // Branch-free online softmax: while a row's maximum is -inf its weights are all 0.
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      float top = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) top = kvt_max(top, s[u * RC + r]);
      const float corr = kvt_weight(m[r], top);
      l[r] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[u * RC + r] = kvt_weight(s[u * RC + r], top);
        l[r] += s[u * RC + r];
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= corr;
      m[r] = top;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float v8[8];
      kvt_unpack(vv[u], v8);
#pragma unroll
      for (int r = 0; r < RC; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] += s[u * RC + r] * v8[e];
      }
    }
    if (PIPE) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        kv[u] = kn[u];
        vv[u] = vn[u];
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
  constexpr int THREADS = D * J;
  const int d = thread_position_in_threadgroup.x;
  const int j = thread_position_in_threadgroup.y;
  const int flat = j * D + d;
  const int row = threadgroup_position_in_grid.y;
  const int parts = normal_shape[1];
  threadgroup float sm_weight[MAX_PARTS];
  threadgroup float sm_reduce[THREADS / 32];
  threadgroup float sm_acc[THREADS];
  float top = KVT_NEG_INF;
  for (int p = flat; p < parts; p += THREADS) top = kvt_max(top, normal[(row * parts + p) * 2]);
  for (int o = 16; o > 0; o /= 2) top = kvt_max(top, kvt_shfl_xor(top, o));
  if (flat % 32 == 0) sm_reduce[flat / 32] = top;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  top = KVT_NEG_INF;
  for (int w = 0; w < THREADS / 32; ++w) top = kvt_max(top, sm_reduce[w]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.f;
  for (int p = flat; p < parts; p += THREADS) {
    const float weight = kvt_weight(normal[(row * parts + p) * 2], top);
    sm_weight[p] = weight;
    total += weight * normal[(row * parts + p) * 2 + 1];
  }
  for (int o = 16; o > 0; o /= 2) total += kvt_shfl_xor(total, o);
  if (flat % 32 == 0) sm_reduce[flat / 32] = total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  total = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) total += sm_reduce[w];
  float a = 0.f;
  for (int p = j; p < parts; p += J) a += sm_weight[p] * partials[(row * parts + p) * D + d];
  sm_acc[flat] = a;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (j == 0) {
    for (int k = 1; k < J; ++k) a += sm_acc[k * D + d];
    out[row * D + d] = from_f<OutT>(a / total);
  }
"""

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
def merge() -> Any:
    """The log-sum-exp merge of partitions."""
    return mx.fast.metal_kernel(
        name="kvtrio_paged_merge",
        input_names=["partials", "normal"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )
