"""CUDA source of the split-K paged decode attention (through ``mx.fast.cuda_kernel``).

Line for line the twin of :mod:`kvtrio.metal.kernels_metal`: the kernel bodies differ only in
how a thread finds its ids, in shared-memory qualifiers and barriers; the helpers they call
(``kvt_*``) are defined per language in the headers.

Theory of operation (both languages):

1. Grid: x = sequence partitions of ``part_size`` tokens (one thread block each), y = kv
   heads times query-row chunks. A block reads every key and value of its partition once and
   serves all query rows of its kv head in the chunk (grouped-query attention reads KV once).
2. A token is read by ``TL = D / 8`` lanes, 8 elements each (16 bytes for 16-bit types), so a
   warp reads ``32 / TL`` tokens per load; each lane keeps ``U`` tokens' keys and values in
   flight before using them (with PIPE, the next step's too). Scores are reduced across the
   TL lanes by xor shuffles. The table input is ``[length, block numbers...]`` and the scale
   a template constant (its float bits), so a call allocates no argument arrays.
3. Softmax is online in base 2 (queries are pre-scaled by ``scale * log2(e)``): per row a
   running maximum ``m``, normalizer ``l`` and unnormalized accumulator; masked tokens score
   -inf, and a weight whose maximum is still -inf is 0, never NaN.
4. Lanes of a warp that hold different tokens merge by shuffles, warps merge through shared
   memory, and the block writes one partial (accumulator, m, l) per row and partition.
5. The merge kernel combines the partitions with the log-sum-exp rule and casts to the
   output dtype.

For float16/bfloat16 pools the partition kernel is PARTIAL_MMA_SOURCE instead (on tensor
cores; the comment above it explains how it differs), with the same partials and merge.
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
// 16 bytes of a key or value row, through the read-only data path.
__device__ __forceinline__ uint4 kvt_load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
"""
)

PARTIAL_SOURCE = r"""
  constexpr int TL = D / 8;
  constexpr int TPW = 32 / TL;
  constexpr int R = G * N;
  constexpr int CH = (R + RC - 1) / RC;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = warp * TPW + lane / TL;
  const int sl = lane % TL;
  const int part = blockIdx.x;
  const int parts = gridDim.x;
  const int hk = blockIdx.y / CH;
  const int r0 = (blockIdx.y % CH) * RC;
  // table = [length, block numbers...]; partitions split the length evenly, whole steps each.
  const int length = table[0];
  const int part_size = ((length + parts - 1) / parts + WARPS * TPW * U - 1) / (WARPS * TPW * U)
      * (WARPS * TPW * U);
  const float scale = kvt_int_as_float(SCALE_BITS);
  const int start = part * part_size;
  const int stop = min(length, start + part_size);
  float qv[RC][8];
  int visible[RC];
  float m[RC];
  float l[RC];
  float acc[RC][8];
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    const int lr = min(r0 + r, R - 1);
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
    const int t = min((first) + u * WARPS * TPW + group, stop - 1); \
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
  __shared__ float sm_acc[WARPS * RC * D];
  __shared__ float sm_ml[WARPS * RC * 2];
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
  __syncthreads();
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

# The float16/bfloat16 partition kernel on tensor cores. Grid as in PARTIAL_SOURCE, with
# blocks of 8 query rows (one mma column tile; rows past the last are zero). Warp w takes
# the partition's 16-token tiles w, w + WARPS, ...; lane 4 g + c loads tokens g and g + 8
# of the tile, dims 32 j + 8 c .. + 8 of each (16 bytes per j), keys and values alike.
# - Scores S (16 tokens x 8 rows) = K (16 x D) Q^T, D / 16 mma steps. The mma's reduction
#   index k stands for a permutation of the dims; the query words use the same one, so the
#   dot products are exact sums over all dims. Lane 4 g + c gets the scores of tokens g and
#   g + 8 for rows 2c and 2c + 1, so it keeps m and l of those two rows.
# - Out^T (D x 8 rows) += V^T (D x 16 tokens) P^T (16 tokens x 8 rows): kvt_trans turns the
#   lane's value words and its weights into the operand layouts (dim rows are a permutation
#   too, undone when the accumulators are stored).
PARTIAL_MMA_SOURCE = r"""
  constexpr int R = G * N;
  constexpr int CH = (R + 7) / 8;
  constexpr int DJ = D / 32;
  constexpr int STEP = WARPS * 16;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int part = blockIdx.x;
  const int parts = gridDim.x;
  const int hk = blockIdx.y / CH;
  const int r0 = (blockIdx.y % CH) * 8;
  // table = [length, block numbers...]; partitions split the length evenly, whole steps each.
  const int length = table[0];
  const int part_size = ((length + parts - 1) / parts + STEP - 1) / STEP * STEP;
  const float scale = kvt_int_as_float(SCALE_BITS);
  const int start = part * part_size;
  const int stop = min(length, start + part_size);
  // The mma's B operand: query row r0 + g (zero past the last row), dims as the keys'.
  uint32_t qw[DJ][4];
#pragma unroll
  for (int j = 0; j < DJ; ++j) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int lr = r0 + g;
      const int at = (hk * R + min(lr, R - 1)) * D + 32 * j + 8 * c + 2 * w;
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
    const int ta = min(base + g, stop - 1);
    const int tb = min(base + g + 8, stop - 1);
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
  __shared__ float sm_acc[WARPS * 8 * D];
  __shared__ float sm_ml[WARPS * 8 * 2];
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
  __syncthreads();
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
  const int d = threadIdx.x;
  const int j = threadIdx.y;
  const int flat = j * D + d;
  const int row = blockIdx.y;
  const int parts = normal_shape[1];
  __shared__ float sm_weight[MAX_PARTS];
  __shared__ float sm_reduce[THREADS / 32];
  __shared__ float sm_acc[THREADS];
  float top = KVT_NEG_INF;
  for (int p = flat; p < parts; p += THREADS) top = kvt_max(top, normal[(row * parts + p) * 2]);
  for (int o = 16; o > 0; o /= 2) top = kvt_max(top, kvt_shfl_xor(top, o));
  if (flat % 32 == 0) sm_reduce[flat / 32] = top;
  __syncthreads();
  top = KVT_NEG_INF;
  for (int w = 0; w < THREADS / 32; ++w) top = kvt_max(top, sm_reduce[w]);
  __syncthreads();
  float total = 0.f;
  for (int p = flat; p < parts; p += THREADS) {
    const float weight = kvt_weight(normal[(row * parts + p) * 2], top);
    sm_weight[p] = weight;
    total += weight * normal[(row * parts + p) * 2 + 1];
  }
  for (int o = 16; o > 0; o /= 2) total += kvt_shfl_xor(total, o);
  if (flat % 32 == 0) sm_reduce[flat / 32] = total;
  __syncthreads();
  total = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) total += sm_reduce[w];
  float a = 0.f;
  for (int p = j; p < parts; p += J) a += sm_weight[p] * partials[(row * parts + p) * D + d];
  sm_acc[flat] = a;
  __syncthreads();
  if (j == 0) {
    for (int k = 1; k < J; ++k) a += sm_acc[k * D + d];
    out[row * D + d] = from_f<OutT>(a / total);
  }
"""

# The tensor-core kernel is the default for float16/bfloat16 pools (KernelTuning.mma=None).
TENSOR_CORES = True

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
def merge() -> Any:
    """The log-sum-exp merge of partitions."""
    return mx.fast.cuda_kernel(
        name="kvtrio_paged_merge",
        input_names=["partials", "normal"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )
