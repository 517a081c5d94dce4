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

__all__ = [
    "HEADER",
    "HEADER_MMA",
    "HEADER_QUANTIZED",
    "MERGE_SOURCE",
    "PARTIAL_MMA_SOURCE",
    "PARTIAL_SOURCE",
    "TENSOR_CORES",
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
// 16 bytes of a key or value row.
template <typename P>
inline uint4 kvt_load16(const device P* p) {
  return *((const device uint4*)(p));
}
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

# The float16/bfloat16 partition kernel (kernels_cuda.PARTIAL_MMA_SOURCE explains it).
PARTIAL_MMA_SOURCE = r"""
  constexpr int R = G * N;
  constexpr int CH = (R + 7) / 8;
  constexpr int DJ = D / 32;
  constexpr int STEP = WARPS * 16;
  const int tid = thread_position_in_threadgroup.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int part = threadgroup_position_in_grid.x;
  const int parts = threadgroups_per_grid.x;
  const int hk = threadgroup_position_in_grid.y / CH;
  const int r0 = (threadgroup_position_in_grid.y % CH) * 8;
  // table = [length, block numbers...]; partitions split the length evenly, whole steps each.
  const int length = table[0];
  const int part_size = ((length + parts - 1) / parts + STEP - 1) / STEP * STEP;
  const float scale = kvt_int_as_float(SCALE_BITS);
  const int start = part * part_size;
  const int stop = metal::min(length, start + part_size);
  // The mma's B operand: query row r0 + g (zero past the last row), dims as the keys'.
  uint32_t qw[DJ][4];
#pragma unroll
  for (int j = 0; j < DJ; ++j) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int lr = r0 + g;
      const int at = (hk * R + metal::min(lr, R - 1)) * D + 32 * j + 8 * c + 2 * w;
      const float x0 = lr < R ? to_f(q[at]) : 0.f;
      const float x1 = lr < R ? to_f(q[at + 1]) : 0.f;
      qw[j][w] = kvt_pack(keys, x0, x1);
    }
  }
  int visible[2];
  float m[2];
  float l[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int lr = r0 + 2 * c + e;
    visible[e] = CAUSAL ? length - N + lr % N + 1 : length;
    m[e] = KVT_NEG_INF;
    l[e] = 0.f;
  }
  // acc[2 j + p]: the Out^T tile of dims 32 j + 8 (g / 2) + 4 p + g % 2 (+ 2) for rows 2c, 2c+1.
  float acc[2 * DJ][4];
#pragma unroll
  for (int t = 0; t < 2 * DJ; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  }
  for (int base = start + warp * 16; base < stop; base += STEP) {
    const int ta = metal::min(base + g, stop - 1);
    const int tb = metal::min(base + g + 8, stop - 1);
    const int rowa = (table[1 + ta / BS] * HK + hk) * BS + ta % BS;
    const int rowb = (table[1 + tb / BS] * HK + hk) * BS + tb % BS;
    uint4 ka[DJ];
    uint4 kb[DJ];
    uint4 va[DJ];
    uint4 vb[DJ];
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      ka[j] = kvt_load16(keys + rowa * D + 32 * j + 8 * c);
      kb[j] = kvt_load16(keys + rowb * D + 32 * j + 8 * c);
    }
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      va[j] = kvt_load16(values + rowa * D + 32 * j + 8 * c);
      vb[j] = kvt_load16(values + rowb * D + 32 * j + 8 * c);
    }
    // s: tokens base + g (rows 2c, 2c+1), then base + g + 8 (same rows).
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      kvt_mma(keys, s, ka[j].x, kb[j].x, ka[j].y, kb[j].y, qw[j][0], qw[j][1], lane);
      kvt_mma(keys, s, ka[j].z, kb[j].z, ka[j].w, kb[j].w, qw[j][2], qw[j][3], lane);
    }
    // Branch-free online softmax: while a row's maximum is -inf its weights are all 0.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool use0 = base + g < stop && base + g < visible[e];
      const bool use1 = base + g + 8 < stop && base + g + 8 < visible[e];
      const float s0 = use0 ? s[e] * scale : KVT_NEG_INF;
      const float s1 = use1 ? s[2 + e] * scale : KVT_NEG_INF;
      float top = kvt_max(s0, s1);
#pragma unroll
      for (int o = 4; o < 32; o *= 2) top = kvt_max(top, kvt_shfl_xor(top, o));
      top = kvt_max(top, m[e]);
      const float corr = kvt_weight(m[e], top);
      s[e] = kvt_weight(s0, top);
      s[2 + e] = kvt_weight(s1, top);
      l[e] = l[e] * corr + s[e] + s[2 + e];
      m[e] = top;
#pragma unroll
      for (int t = 0; t < 2 * DJ; ++t) {
        acc[t][e] *= corr;
        acc[t][2 + e] *= corr;
      }
    }
    // P^T as the B operand: tokens 2c..2c+1 (then + 8) of the tile, row g.
    const uint32_t p0 = kvt_trans(kvt_pack(keys, s[0], s[1]), lane);
    const uint32_t p1 = kvt_trans(kvt_pack(keys, s[2], s[3]), lane);
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      kvt_mma(keys, acc[2 * j], kvt_trans(va[j].x, lane), kvt_trans(va[j].y, lane),
              kvt_trans(vb[j].x, lane), kvt_trans(vb[j].y, lane), p0, p1, lane);
      kvt_mma(keys, acc[2 * j + 1], kvt_trans(va[j].z, lane), kvt_trans(va[j].w, lane),
              kvt_trans(vb[j].z, lane), kvt_trans(vb[j].w, lane), p0, p1, lane);
    }
  }
  // Each lane's l covers its own tokens: sum over the 8 lanes of its rows.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o *= 2) l[e] += kvt_shfl_xor(l[e], o);
  }
  threadgroup float sm_acc[WARPS * 8 * D];
  threadgroup float sm_ml[WARPS * 8 * 2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * c + e;
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int d = 32 * j + 8 * (g / 2) + 4 * p + g % 2;
        sm_acc[(warp * 8 + r) * D + d] = acc[2 * j + p][e];
        sm_acc[(warp * 8 + r) * D + d + 2] = acc[2 * j + p][2 + e];
      }
    }
    if (g == 0) {
      sm_ml[(warp * 8 + r) * 2] = m[e];
      sm_ml[(warp * 8 + r) * 2 + 1] = l[e];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = tid; i < 8 * D; i += WARPS * 32) {
    const int r = i / D;
    const int d = i % D;
    if (r0 + r >= R) continue;
    float top = KVT_NEG_INF;
    for (int w = 0; w < WARPS; ++w) top = kvt_max(top, sm_ml[(w * 8 + r) * 2]);
    float a = 0.f;
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      const float weight = kvt_weight(sm_ml[(w * 8 + r) * 2], top);
      a += weight * sm_acc[(w * 8 + r) * D + d];
      total += weight * sm_ml[(w * 8 + r) * 2 + 1];
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

# The tensor-core kernel (emulated here) runs only when asked for (KernelTuning(mma=True)).
TENSOR_CORES = False

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
    """The log-sum-exp merge of partitions."""
    return mx.fast.metal_kernel(
        name="kvtrio_paged_merge",
        input_names=["partials", "normal"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )
