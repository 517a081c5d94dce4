"""The one description of the paged decode kernels, rendered to CUDA and to Metal.

Each kernel body exists once, here, written against a few neutral names; :func:`render`
spells them for one language. :mod:`kvtrio.metal.kernels_cuda` and
:mod:`kvtrio.metal.kernels_metal` hold only what truly differs: the helper headers (``kvt_*``
functions: conversions, shuffles, tensor-core products, loads) and the factory that hands a
rendered body to ``mx.fast.cuda_kernel`` or ``mx.fast.metal_kernel``. Names are replaced
textually, not by preprocessor macros, because MLX's Metal front end finds the thread-position
attributes a kernel uses by looking for their names in its source.

Theory of operation (both languages):

1. A call serves a batch of B sequences of one block pool (B = 1 for a single sequence). The
   ``table`` input is one int32 array::

       [P, B, W,  (length, blocks_at, first_item) x B,  sequence of item x W,  block tables]

   ``P`` is the tokens per work item (a whole number of the kernel's token steps), ``W`` the
   number of work items: sequence b's ``ceil(length / P)`` partitions, items
   ``first_item .. first_item + parts - 1``; its block numbers start at ``table[blocks_at]``.
   The host builds it once per call (:class:`kvtrio.metal.attention.BatchPagedAttentionView`),
   so a call allocates no other argument array and the scale is a template constant (its
   float bits).
2. Grid: x = work items (one thread block each), y = kv heads times query-row chunks. Short
   and long sequences are cut into items of the same size, so the whole batch fills the GPU
   together (split-K across the batch). A block reads every key and value of its item once
   and serves all query rows of its kv head in the chunk (grouped-query attention reads KV
   once).
3. Scalar kernel: a token is read by ``TL = D / 8`` lanes, 8 elements each (16 bytes for
   16-bit types), so a warp reads ``32 / TL`` tokens per load; each lane keeps ``U`` tokens'
   keys and values in flight before using them (with PIPE, the next step's too). Scores are
   reduced across the TL lanes by xor shuffles. The tensor-core kernel (float16/bfloat16,
   PARTIAL_MMA) is described above its body.
4. Softmax is online in base 2 (queries are pre-scaled by ``scale * log2(e)``): per row a
   running maximum ``m``, normalizer ``l`` and unnormalized accumulator; masked tokens score
   -inf, and a weight whose maximum is still -inf is 0, never NaN.
5. Lanes of a warp that hold different tokens merge by shuffles, warps merge through shared
   memory, and the block writes one partial (accumulator, m, l) per row and item: partials
   ``[HQ * N, W, D]`` and ``[HQ * N, W, 2]``.
6. The merge kernel (one block per sequence and query row) combines the sequence's items with
   the log-sum-exp rule and writes ``out[b, head, query, :]`` in the output dtype.
7. Fused merge (CUDA, tensor-core kernel, ``KernelTuning.fused_merge``): one launch instead
   of two. The partials go to a scratch output, each block counts itself done with an atomic
   add after a device-scope fence, and the last block of a sequence and block row merges
   (PARTIAL_MMA_FUSED, described above its body).
"""

from __future__ import annotations

import re

__all__ = ["MERGE", "NAMES", "PARTIAL", "PARTIAL_MMA", "PARTIAL_MMA_FUSED", "render"]

# Neutral name -> (CUDA, Metal).
NAMES: dict[str, tuple[str, str]] = {
    "KVT_TID_X": ("threadIdx.x", "thread_position_in_threadgroup.x"),
    "KVT_TID_Y": ("threadIdx.y", "thread_position_in_threadgroup.y"),
    "KVT_BLOCK_X": ("blockIdx.x", "threadgroup_position_in_grid.x"),
    "KVT_BLOCK_Y": ("blockIdx.y", "threadgroup_position_in_grid.y"),
    "KVT_BLOCKS_X": ("gridDim.x", "threadgroups_per_grid.x"),
    "KVT_BLOCKS_Y": ("gridDim.y", "threadgroups_per_grid.y"),
    "KVT_SHARED": ("__shared__", "threadgroup"),
    "KVT_BARRIER": ("__syncthreads", "threadgroup_barrier"),
    "KVT_THREADGROUP_MEM": ("", "mem_flags::mem_threadgroup"),
    "kvt_min": ("min", "metal::min"),
}
_LANGUAGES = ("cuda", "metal")
_NAME = re.compile(r"\b(" + "|".join(NAMES) + r")\b")


def render(body: str, language: str) -> str:
    """The kernel body spelled for ``language`` (``"cuda"`` or ``"metal"``)."""
    column = _LANGUAGES.index(language)
    return _NAME.sub(lambda m: NAMES[m.group(1)][column], body)


# The work item this thread block serves (shared by both partition kernels): its sequence,
# the sequence's length, where its block numbers start, and the item's token range.
_ITEM = r"""
  const int item = KVT_BLOCK_X;
  const int items = KVT_BLOCKS_X;
  const int P = table[0];
  const int B = table[1];
  const int seq = table[3 + 3 * B + item];
  const int length = table[3 + 3 * seq];
  const int blocks_at = table[3 + 3 * seq + 1];
  const int part = item - table[3 + 3 * seq + 2];
  const int start = part * P;
  const int stop = kvt_min(length, start + P);
  const int q_base = seq * HK * R;
"""

# The block's partial for each of its rows, written after the warps merged through shared
# memory (RB rows a block, sm_acc/sm_ml as each kernel lays them out).
_STORE = r"""
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  for (int i = tid; i < RB * D; i += WARPS * 32) {
    const int r = i / D;
    const int d = i % D;
    if (r0 + r >= R) continue;
    float top = KVT_NEG_INF;
    for (int w = 0; w < WARPS; ++w) top = kvt_max(top, sm_ml[(w * RB + r) * 2]);
    float a = 0.f;
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      const float weight = kvt_weight(sm_ml[(w * RB + r) * 2], top);
      a += weight * sm_acc[(w * RB + r) * D + d];
      total += weight * sm_ml[(w * RB + r) * 2 + 1];
    }
    const int row = hk * R + r0 + r;
    out[(row * items + item) * D + d] = a;
    if (d == 0) {
      normal[(row * items + item) * 2] = top;
      normal[(row * items + item) * 2 + 1] = total;
    }
  }
"""

PARTIAL = (
    r"""
  constexpr int TL = D / 8;
  constexpr int TPW = 32 / TL;
  constexpr int R = G * N;
  constexpr int RB = RC;
  constexpr int CH = (R + RC - 1) / RC;
  constexpr int STEP = WARPS * TPW * U;
  const int tid = KVT_TID_X;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = warp * TPW + lane / TL;
  const int sl = lane % TL;
  const int hk = KVT_BLOCK_Y / CH;
  const int r0 = (KVT_BLOCK_Y % CH) * RC;
"""
    + _ITEM
    + r"""
  const float scale = kvt_int_as_float(SCALE_BITS);
  float qv[RC][8];
  int visible[RC];
  float m[RC];
  float l[RC];
  float acc[RC][8];
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    const int lr = kvt_min(r0 + r, R - 1);
    const int row = q_base + hk * R + lr;
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
    const int t = kvt_min((first) + u * WARPS * TPW + group, stop - 1); \
    const int row = (table[blocks_at + t / BS] * HK + hk) * BS + t % BS; \
    KVT_LOAD_K(row, kd[u]); \
    KVT_LOAD_V(row, vd[u]); \
  }
  KVT_RAW kv[U];
  KVT_RAW vv[U];
  if (PIPE && start < stop) {
    KVT_FETCH(start, kv, vv);
  }
  for (int base = start; base < stop; base += STEP) {
    KVT_RAW kn[U];
    KVT_RAW vn[U];
    if (!PIPE) {
      KVT_FETCH(base, kv, vv);
    } else if (base + STEP < stop) {
      KVT_FETCH(base + STEP, kn, vn);
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
  KVT_SHARED float sm_acc[WARPS * RC * D];
  KVT_SHARED float sm_ml[WARPS * RC * 2];
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
"""
    + _STORE
)

# The float16/bfloat16 partition kernel on tensor cores. Grid as in PARTIAL, with blocks of
# 8 query rows (one mma column tile; rows past the last are zero). Warp w takes the item's
# token steps w, w + WARPS, ...; a step is TILES 16-token tiles, all loaded before any is
# used (more bytes in flight per warp); with WIDE_L2 each load asks L2 for the whole
# 256-byte line around it (a token row of 128 float16 dims is one such line). Lane 4 g + c
# loads tokens g and g + 8 of a tile, dims 32 j + 8 c .. + 8 of each (16 bytes per j), keys
# and values alike.
# - Scores S (16 tokens x 8 rows) = K (16 x D) Q^T, D / 16 mma steps. The mma's reduction
#   index k stands for a permutation of the dims; the query words use the same one, so the
#   dot products are exact sums over all dims. Lane 4 g + c gets the scores of tokens g and
#   g + 8 for rows 2c and 2c + 1, so it keeps m and l of those two rows.
# - Out^T (D x 8 rows) += V^T (D x 16 tokens) P^T (16 tokens x 8 rows): kvt_trans turns the
#   lane's value words and its weights into the operand layouts (dim rows are a permutation
#   too, undone when the accumulators are stored).
_MMA_HEAD = r"""
  constexpr int R = G * N;
  constexpr int RB = 8;
  constexpr int CH = (R + 7) / 8;
  constexpr int DJ = D / 32;
  constexpr int STEP = WARPS * 16 * TILES;
  const int tid = KVT_TID_X;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int hk = KVT_BLOCK_Y / CH;
  const int r0 = (KVT_BLOCK_Y % CH) * 8;
"""
_MMA_BODY = r"""
  const float scale = kvt_int_as_float(SCALE_BITS);
  // The mma's B operand: query row r0 + g (zero past the last row), dims as the keys'.
  uint32_t qw[DJ][4];
#pragma unroll
  for (int j = 0; j < DJ; ++j) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int lr = r0 + g;
      const int at = (q_base + hk * R + kvt_min(lr, R - 1)) * D + 32 * j + 8 * c + 2 * w;
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
  for (int step = start + warp * 16 * TILES; step < stop; step += STEP) {
    uint4 ka[TILES][DJ];
    uint4 kb[TILES][DJ];
    uint4 va[TILES][DJ];
    uint4 vb[TILES][DJ];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const int ta = kvt_min(step + 16 * tile + g, stop - 1);
      const int tb = kvt_min(step + 16 * tile + g + 8, stop - 1);
      const int rowa = (table[blocks_at + ta / BS] * HK + hk) * BS + ta % BS;
      const int rowb = (table[blocks_at + tb / BS] * HK + hk) * BS + tb % BS;
#pragma unroll
      for (int j = 0; j < DJ; ++j) {
        ka[tile][j] = kvt_load16<WIDE_L2>(keys + rowa * D + 32 * j + 8 * c);
        kb[tile][j] = kvt_load16<WIDE_L2>(keys + rowb * D + 32 * j + 8 * c);
      }
#pragma unroll
      for (int j = 0; j < DJ; ++j) {
        va[tile][j] = kvt_load16<WIDE_L2>(values + rowa * D + 32 * j + 8 * c);
        vb[tile][j] = kvt_load16<WIDE_L2>(values + rowb * D + 32 * j + 8 * c);
      }
    }
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const int base = step + 16 * tile;
      // s: tokens base + g (rows 2c, 2c+1), then base + g + 8 (same rows).
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < DJ; ++j) {
        kvt_mma(keys, s, ka[tile][j].x, kb[tile][j].x, ka[tile][j].y, kb[tile][j].y,
                qw[j][0], qw[j][1], lane);
        kvt_mma(keys, s, ka[tile][j].z, kb[tile][j].z, ka[tile][j].w, kb[tile][j].w,
                qw[j][2], qw[j][3], lane);
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
        kvt_mma(keys, acc[2 * j], kvt_trans(va[tile][j].x, lane), kvt_trans(va[tile][j].y, lane),
                kvt_trans(vb[tile][j].x, lane), kvt_trans(vb[tile][j].y, lane), p0, p1, lane);
        kvt_mma(keys, acc[2 * j + 1], kvt_trans(va[tile][j].z, lane),
                kvt_trans(va[tile][j].w, lane), kvt_trans(vb[tile][j].z, lane),
                kvt_trans(vb[tile][j].w, lane), p0, p1, lane);
      }
    }
  }
  // Each lane's l covers its own tokens: sum over the 8 lanes of its rows.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o *= 2) l[e] += kvt_shfl_xor(l[e], o);
  }
  KVT_SHARED float sm_acc[WARPS * 8 * D];
  KVT_SHARED float sm_ml[WARPS * 8 * 2];
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
"""
PARTIAL_MMA = _MMA_HEAD + _ITEM + _MMA_BODY + _STORE

# The fused merge (CUDA only, KernelTuning.fused_merge): one output scratch holds per
# (sequence, block row) a counter word, then the partials and normalizers PARTIAL_MMA writes
# as outputs. Every word of the scratch starts as the call's init value, whose float bits are
# INIT_BITS (MLX fills every output with it), so a counter counts up from INIT_BITS: each call
# has its own counters and no call ever sees another's.
_FUSED_SCRATCH = r"""
  const int counters = ((B * KVT_BLOCKS_Y + 3) / 4) * 4;
  float* out = scratch + counters;
  float* normal = out + HK * R * items * D;
"""

# After its partials are stored, a block fences them (device scope), and one thread counts the
# block done; the block that finds itself the sequence's last of this block row (counter at
# parts - 1 before its add) merges the sequence's items for its rows by log-sum-exp, as MERGE
# does, and writes ``result[b, head, query, :]``.
_FUSED_MERGE = r"""
  kvt_fence_device();
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  KVT_SHARED int sm_last;
  const int parts = (length + P - 1) / P;
  const int first = table[3 + 3 * seq + 2];
  if (tid == 0) {
    const unsigned int old = kvt_count(scratch, seq * KVT_BLOCKS_Y + KVT_BLOCK_Y);
    sm_last = (old - (unsigned int)INIT_BITS) == (unsigned int)(parts - 1) ? 1 : 0;
  }
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  if (sm_last) {
    kvt_fence_device();
    for (int i = tid; i < RB * D; i += WARPS * 32) {
      const int r = i / D;
      const int d = i % D;
      if (r0 + r >= R) continue;
      const int row = hk * R + r0 + r;
      float top = KVT_NEG_INF;
      for (int p = 0; p < parts; ++p) {
        top = kvt_max(top, normal[(row * items + first + p) * 2]);
      }
      float a = 0.f;
      float total = 0.f;
      for (int p = 0; p < parts; ++p) {
        const float weight = kvt_weight(normal[(row * items + first + p) * 2], top);
        a += weight * out[(row * items + first + p) * D + d];
        total += weight * normal[(row * items + first + p) * 2 + 1];
      }
      result[(q_base + row) * D + d] = from_f<OutT>(a / total);
    }
  }
"""
PARTIAL_MMA_FUSED = _MMA_HEAD + _ITEM + _FUSED_SCRATCH + _MMA_BODY + _STORE + _FUSED_MERGE

# One block per (sequence, query row): the sequence's items merged by log-sum-exp.
MERGE = r"""
  constexpr int THREADS = D * J;
  const int d = KVT_TID_X;
  const int j = KVT_TID_Y;
  const int flat = j * D + d;
  const int seq = KVT_BLOCK_Y / HQN;
  const int row = KVT_BLOCK_Y % HQN;
  const int items = normal_shape[1];
  const int P = table[0];
  const int length = table[3 + 3 * seq];
  const int first = table[3 + 3 * seq + 2];
  const int parts = (length + P - 1) / P;
  KVT_SHARED float sm_weight[MAX_PARTS];
  KVT_SHARED float sm_reduce[THREADS / 32];
  KVT_SHARED float sm_acc[THREADS];
  float top = KVT_NEG_INF;
  for (int p = flat; p < parts; p += THREADS) {
    top = kvt_max(top, normal[(row * items + first + p) * 2]);
  }
  for (int o = 16; o > 0; o /= 2) top = kvt_max(top, kvt_shfl_xor(top, o));
  if (flat % 32 == 0) sm_reduce[flat / 32] = top;
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  top = KVT_NEG_INF;
  for (int w = 0; w < THREADS / 32; ++w) top = kvt_max(top, sm_reduce[w]);
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  float total = 0.f;
  for (int p = flat; p < parts; p += THREADS) {
    const float weight = kvt_weight(normal[(row * items + first + p) * 2], top);
    sm_weight[p] = weight;
    total += weight * normal[(row * items + first + p) * 2 + 1];
  }
  for (int o = 16; o > 0; o /= 2) total += kvt_shfl_xor(total, o);
  if (flat % 32 == 0) sm_reduce[flat / 32] = total;
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  total = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) total += sm_reduce[w];
  float a = 0.f;
  for (int p = j; p < parts; p += J) {
    a += sm_weight[p] * partials[(row * items + first + p) * D + d];
  }
  sm_acc[flat] = a;
  KVT_BARRIER(KVT_THREADGROUP_MEM);
  if (j == 0) {
    for (int k = 1; k < J; ++k) a += sm_acc[k * D + d];
    out[(seq * HQN + row) * D + d] = from_f<OutT>(a / total);
  }
"""
