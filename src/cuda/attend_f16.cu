// Attention under the f16 numeric (AttentionNumeric::kF16; docs/CUDA.md,
// "The f16 numeric"): FlashAttention's blocking on Hopper's warpgroup
// tensor-core instructions (wgmma), with every boundary at a fixed multiple
// of the position so that a query's arithmetic never depends on the tile of
// queries it came in.
//
// A CTA is one warpgroup. It takes one tile of queries (F16Tile:
// consecutive queries of one item, all query heads of one KV head as
// kF16Rows (query, head) rows, 16 a warp) and one split of
// kF16AttendSplitRows positions, and streams that split's 64-row key tiles
// (at multiples of 64) through shared memory. Each tile is one step of
// every row's online softmax: f32 dot products s (wgmma, the query's f16
// rows from registers and K from shared memory), the row's running maximum
// m, weights exp2(fma(s, c, -m c)) rounded to f16, their sum against a ones
// column (mma.m16n8k16) and the weights times V (wgmma), with f32
// accumulation. Rows a query does not see (past it, before its window,
// outside the split) are masked to weight 0; a tile wholly masked for a row
// leaves its state as it was (the rescale factor is exactly 1 and the
// weights are zeros), so the tiles a row runs through are in effect its
// own. A query of one split has its outputs written by its CTA; a query
// of more has each (query, split, head) partial go to the workspace, and a
// second kernel combines them in split order.
//
// The query rows are independent in the MMAs: an output element is the dot
// product of its own A row with B, whatever the other rows hold, so a query
// decoded alone gives the bits it gives inside a prefill tile. Decode and
// prefill under this numeric run this kernel alone, so every output comes
// from the same instructions.
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attend_f16.cuh"
#include "attend_rows.cuh"
#include "kernels.h"
#include "kvring/store.h"
#include "ptx.cuh"

namespace kvring::cuda {
namespace {

constexpr int HD = kTensorHeadDim;
constexpr int kThreads = kF16Threads;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps * 16 == kF16Rows, "16 rows a warp");
constexpr int kKeys = static_cast<int>(kF16AttendTile);
constexpr std::int64_t kSplitRows = kF16AttendSplitRows;
constexpr int kRowBytes = HD * 2;             // one f16 head row
constexpr int kChunks = kRowBytes / 16;       // 16-byte pieces a row
constexpr int kTileBytes = kKeys * kRowBytes;
static_assert(kSplitRows % kKeys == 0, "a split is whole tiles");
static_assert(kThreads * 8 == kKeys * kChunks, "each thread copies 8 pieces of K and of V a tile");

// Shared memory: K and V tiles per stage, each as two 64-dim halves of
// 128-byte rows (the wgmma 128-byte swizzle's layout; ptx.cuh): piece c of
// row r at half c / 8, piece (c % 8) ^ (r % 8). K is the K-major B of
// the dot products, V the N-major B of the weights times V.
template <int kStages>
struct F16Smem {
  uint4 k[kStages][kTileBytes / 16];
  uint4 v[kStages][kTileBytes / 16];
};
constexpr unsigned kHalfBytes = kKeys * 128;  // one 64-dim half of a tile

__device__ __forceinline__ unsigned piece(int row, int c) {
  return static_cast<unsigned>((c >> 3) * kHalfBytes + row * 128 + (((c & 7) ^ (row & 7)) << 4));
}
[[maybe_unused]] __device__ __forceinline__ std::uint32_t pack_f16(float lo, float hi) {
  return static_cast<std::uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<std::uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
}

// What a CTA reads: the planes of its item, the chunk, the split's rows.
struct TileRows {
  HeadRows rows;
  std::int64_t lo, hi;  // rows [lo, hi] hold data some row of the tile sees
};

// Enqueues key tile `base` into a stage: rows outside [lo, hi] are
// written as zeros. A tile wholly inside the chunk, or inside the plane
// without crossing the ring's end or a block's, is evenly spaced rows.
[[maybe_unused]] __device__ __forceinline__ void issue(const AttendParams& P, const TileRows& T,
                                                      std::int64_t base, unsigned k_stage,
                                                      unsigned v_stage) {
  const int c = static_cast<int>(threadIdx.x) & (kChunks - 1);
  const int r0 = static_cast<int>(threadIdx.x) / kChunks;
  constexpr int kRowStep = kThreads / kChunks;
  const HeadRows& h = T.rows;
  const std::uint16_t* k0 = nullptr;
  const std::uint16_t* v0 = nullptr;
  std::int64_t stride = 0;
  if (base >= T.lo && base + kKeys - 1 <= T.hi) {
    if (base >= h.chunk_start) {
      const std::int64_t off = base * P.kv_dim + h.chunk_offset;
      k0 = P.chunk_k + off;
      v0 = P.chunk_v + off;
      stride = P.kv_dim;
    } else if (base + kKeys <= h.chunk_start) {
      std::int64_t physical = base + h.shift;
      if (physical >= h.capacity) physical -= h.capacity;
      const bool even = h.table == nullptr ? physical + kKeys <= h.capacity
                                           : (physical & h.block_mask) + kKeys <= h.block_mask + 1;
      if (even) {
        const std::int64_t off = h.plane_offset(physical);
        k0 = h.k + off;
        v0 = h.v + off;
        stride = h.row_stride;
      }
    }
  }
  if (k0 != nullptr) {
    const std::int64_t off = r0 * stride + 8 * c;
    k0 += off;
    v0 += off;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const unsigned at = piece(r0 + j * kRowStep, c);
      cp_async16(k_stage + at, k0, true);
      cp_async16(v_stage + at, v0, true);
      k0 += kRowStep * stride;
      v0 += kRowStep * stride;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = r0 + j * kRowStep;
    const std::int64_t L = base + r;
    const bool ok = L >= T.lo && L <= T.hi;
    const RowPtr row = ok ? row_at(P, h, L) : RowPtr{h.k, h.k};
    const unsigned at = piece(r, c);
    cp_async16(k_stage + at, row.k + (ok ? 8 * c : 0), ok);
    cp_async16(v_stage + at, row.v + (ok ? 8 * c : 0), ok);
  }
}

// How far back a query sees: rows from max(0, p - reach).
__device__ __forceinline__ std::int64_t reach_of(const AttendParams& P) {
  return P.window > 0 ? P.window - 1 : (std::int64_t{1} << 62);
}
// The split of the first row a query at position p sees.
__device__ __forceinline__ std::int64_t first_split_of(std::int64_t p, std::int64_t reach) {
  return max(std::int64_t{0}, p - reach) / kSplitRows;
}

// A weight's exponent s c - m c (shift = -m c), taken as at most 0, NaN
// kept. m c is the maximum's product rounded toward -inf (max_product), so
// the maximum's exponent is at least 0 before the min and exactly 0 after
// it: rounded to nearest, past |m c| of about 2^24, its rounding would
// make the maximum's f16 weight overflow or vanish (docs/DESIGN.md,
// "Attention numerics"). The CPU backend takes the same steps.
__device__ __forceinline__ float weight_exponent(float s, float c, float shift) {
  const float e = fmaf(s, c, shift);
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(e), "f"(0.0f));
  return r;
}
__device__ __forceinline__ float max_product(float m, float c) { return __fmul_rd(m, c); }

// An output value with -0 written as +0 (the f16 numeric's zero output).
__device__ __forceinline__ float plus_zero(float x) { return x == 0.0f ? 0.0f : x; }

// Tile x of the launch (F16Params::tiles).
__device__ __forceinline__ F16Tile tile_of(const F16Params& A, int x, std::int64_t reach) {
  if (A.tiles != nullptr) return A.tiles[x];
  const AttendQueryItem& it = A.P.single;
  const int per = f16_tile_queries(A.P.n_heads / A.P.n_kv_heads);
  const std::int32_t i0 = (A.first_tile + x) * per;
  F16Tile t;
  t.position = it.first_position + i0;
  t.item = 0;
  t.q_first = it.q_first + i0;
  t.n_queries = min(per, it.n_queries - i0);
  t.first_split = static_cast<std::int32_t>(first_split_of(t.position, reach));
  return t;
}

// Output row `qi` (position p), head h: its splits' partials in split
// order, lane i holding dims 4i .. 4i + 3. A zero output is written as +0.
__device__ __forceinline__ void combine(const F16Params& A, int qi, std::int64_t p, int h, int lane,
                                        std::int64_t reach) {
  const AttendParams& P = A.P;
  const int n = static_cast<int>(p / kSplitRows - first_split_of(p, reach)) + 1;
  const float* part =
      A.ws + (static_cast<std::int64_t>(qi) * A.query_splits * P.n_heads + h) * kF16PartFloats;
  const std::int64_t step = static_cast<std::int64_t>(P.n_heads) * kF16PartFloats;
  float M = -INFINITY;
  for (int i = 0; i < n; ++i) M = fmaxf(M, __ldcg(part + i * step));
  float L = 0.0f;
  float4 O = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int i = 0; i < n; ++i) {
    const float* e = part + i * step;
    const float w = weight_of(__ldcg(e), M);
    L += __ldcg(e + 1) * w;
    const float4 x = __ldcg(reinterpret_cast<const float4*>(e + 4 + 4 * lane));
    O.x += x.x * w;
    O.y += x.y * w;
    O.z += x.z * w;
    O.w += x.w * w;
  }
  const float d = sink_divisor(L, M, P.sinks, h);
  float4 r = make_float4(O.x / d, O.y / d, O.z / d, O.w / d);
  r = make_float4(plus_zero(r.x), plus_zero(r.y), plus_zero(r.z), plus_zero(r.w));
  *reinterpret_cast<float4*>(P.out + static_cast<std::int64_t>(qi) * P.out_stride +
                             static_cast<std::int64_t>(h) * HD + 4 * lane) = r;
}

}  // namespace

// A CTA whose copies run kStages - 1 tiles ahead of its MMAs.
template <int kStages>
__device__ __forceinline__ void attend_f16_body(const F16Params& A) {
  static_assert(sizeof(F16Smem<kStages>) == f16_smem_bytes(kStages), "the launch's shared memory");
  const AttendParams& P = A.P;
  const std::int64_t reach = reach_of(P);
  const F16Tile tile = tile_of(A, static_cast<int>(blockIdx.x), reach);
  const AttendQueryItem it = P.items != nullptr ? P.items[tile.item] : P.single;
  const int kv_head = static_cast<int>(blockIdx.y);
  const int G = P.n_heads / P.n_kv_heads;
  const std::int64_t p_first = tile.position;
  const std::int64_t p_last = tile.position + tile.n_queries - 1;
  const std::int64_t lo_first = max(std::int64_t{0}, p_first - reach);
  const std::int64_t s = tile.first_split + static_cast<std::int64_t>(blockIdx.z);
  const std::int64_t split_a = s * kSplitRows;
  if (split_a > p_last) return;
  const std::int64_t a = max(split_a, lo_first);
  const std::int64_t b = min(split_a + kSplitRows, p_last + 1);
  const std::int64_t t0 = a / kKeys * kKeys;
  const int n_tiles = static_cast<int>((b - t0 + kKeys - 1) / kKeys);

  extern __shared__ __align__(1024) uint4 smem_raw[];
  F16Smem<kStages>& S = *reinterpret_cast<F16Smem<kStages>*>(smem_raw);
  QueryRange qr{};
  take_plane(qr, it);
  const TileRows T{HeadRows(P, qr, HD, kv_head), a, b - 1};
  const unsigned k_base = static_cast<unsigned>(__cvta_generic_to_shared(S.k[0]));
  const unsigned v_base = static_cast<unsigned>(__cvta_generic_to_shared(S.v[0]));
  // The first kStages - 1 tiles go out before the query is read.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_tiles)
      issue(P, T, t0 + static_cast<std::int64_t>(st) * kKeys, k_base + st * kTileBytes,
            v_base + st * kTileBytes);
    cp_async_commit();
  }

  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;

  // The lane's two rows, g and g + 8 of the warp's 16: (query, head), the
  // rows each sees, and whether split s is one of its splits.
  std::int64_t lo_r[2], p_r[2];
  bool live[2];
  int qrow[2], head[2];
  float q[2][32];  // dims 16 kk + 2t + {0, 1, 8, 9} as q[.][4 kk + {0, 1, 2, 3}]
  float c_r[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = warp * 16 + g + 8 * rr;
    const int ql = row / G;
    const bool valid = ql < tile.n_queries;
    qrow[rr] = tile.q_first + ql;
    head[rr] = kv_head * G + row % G;
    p_r[rr] = p_first + ql;
    lo_r[rr] = max(std::int64_t{0}, p_r[rr] - reach);
    live[rr] = valid && s >= lo_r[rr] / kSplitRows && s <= p_r[rr] / kSplitRows;
    if (valid) {
      const float* src = P.q + static_cast<std::int64_t>(qrow[rr]) * P.q_stride +
                         static_cast<std::int64_t>(head[rr]) * HD + 2 * t;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const float2 x0 = *reinterpret_cast<const float2*>(src + 16 * kk);
        const float2 x1 = *reinterpret_cast<const float2*>(src + 16 * kk + 8);
        q[rr][4 * kk] = x0.x;
        q[rr][4 * kk + 1] = x0.y;
        q[rr][4 * kk + 2] = x1.x;
        q[rr][4 * kk + 3] = x1.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) q[rr][i] = 0.0f;
    }
  }
  __syncwarp();
  // Each row's power-of-two scale (over its 128 dims: the quad's lanes),
  // then its f16 A fragments: a0a1 row g dims 16kk + 2t + {0,1}, a2a3 row
  // g + 8, a4a5 row g dims 16kk + 8 + 2t + {0,1}, a6a7 row g + 8.
  std::uint32_t qf[8][4];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(q[rr][i]));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
    float down;
    const float up = query_scale(amax, down);
    c_r[rr] = down * P.scale_log2;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      qf[kk][rr] = pack_f16(q[rr][4 * kk] * up, q[rr][4 * kk + 1] * up);
      qf[kk][2 + rr] = pack_f16(q[rr][4 * kk + 2] * up, q[rr][4 * kk + 3] * up);
    }
  }

  // Outputs: o[4 j + e] is dims 8j + 2t + {0, 1} of rows g (e = 0, 1) and
  // g + 8 (e = 2, 3), the C layout of 16 m16n8 tiles.
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  // Per row: the running maximum of its dot products m, m times c (mc),
  // and the sum of its weights as a ones column on the tensor cores (ls:
  // elements 0 and 2 are rows g and g + 8).
  float m[2] = {-INFINITY, -INFINITY}, mc[2] = {-INFINITY, -INFINITY};
  float ls[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  constexpr std::uint32_t kOnes = 0x3c003c00u;  // f16 1.0 twice
  // Tiles inside every row's range need no masks: rows [lo_max, p_min] are
  // seen by every query of the tile (and by the rows past its last query,
  // which are never written).
  const std::int64_t lo_max = max(std::int64_t{0}, p_last - reach);
  const std::int64_t p_min = p_first;

  for (int ti = 0; ti < n_tiles; ++ti) {
    const int st = ti % kStages;
    const int ahead = ti + kStages - 1;  // the tile this step sends for
    if (ahead < n_tiles)
      issue(P, T, t0 + static_cast<std::int64_t>(ahead) * kKeys, k_base + (ahead % kStages) * kTileBytes,
            v_base + (ahead % kStages) * kTileBytes);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    fence_proxy_async_shared();  // the tile's copies, to the tensor cores' reads
    __syncwarp();  // the copies' per-row branches end before the barrier
    __syncthreads();
    const unsigned ks = k_base + st * kTileBytes, vs = v_base + st * kTileBytes;
    const std::int64_t base = t0 + static_cast<std::int64_t>(ti) * kKeys;

    // Dot products on the warpgroup: sc[4 j + e] holds keys 8j + 2t + {0,
    // 1} of rows g (e = 0, 1) and g + 8 (e = 2, 3), accumulated over the
    // dims in order of k-step kq (32 bytes of a K row, in its half kq / 4).
    float sc[32];
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < 8; ++kq)
      wgmma_m64n64k16(sc, qf[kq], wgmma_desc_sw128(ks + (kq >> 2) * kHalfBytes + (kq & 3) * 32, 16, 1024),
                      kq > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(sc);
    if (base < lo_max || base + kKeys - 1 > p_min) {
      // A tile at a range's edge: rows a row does not see are -inf.
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int first = live[rr] ? static_cast<int>(max(std::int64_t{-1}, min(lo_r[rr] - base, std::int64_t{kKeys}))) : kKeys;
        const int last = live[rr] ? static_cast<int>(max(std::int64_t{-1}, min(p_r[rr] - base, std::int64_t{kKeys}))) : -1;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * j + 2 * t + e;
            sc[4 * j + 2 * rr + e] = col >= first && col <= last ? sc[4 * j + 2 * rr + e] : -INFINITY;
          }
        }
      }
    }
    __syncwarp();
    // One online-softmax step per row: weights exp2(s c - m c) in f16.
    float alpha[2];
    std::uint32_t pw[8][2];  // f16 pairs: pw[j][rr] = keys 8j + 2t + {0, 1} of row rr
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      // The tile's maximum as a tree (fmaxf is exact, so any order).
      float mx[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) mx[j] = fmaxf(sc[4 * j + 2 * rr], sc[4 * j + 2 * rr + 1]);
#pragma unroll
      for (int w = 4; w > 0; w >>= 1)
#pragma unroll
        for (int j = 0; j < w; ++j) mx[j] = fmaxf(mx[j], mx[j + w]);
      float mt = mx[0];
      mt = fmaxf(mt, __shfl_xor_sync(kFullMask, mt, 1));
      mt = fmaxf(mt, __shfl_xor_sync(kFullMask, mt, 2));
      const float m_new = fmaxf(m[rr], mt);
      const float mc_new = max_product(m_new, c_r[rr]);
      alpha[rr] = m_new == m[rr] ? 1.0f : exp2f(mc[rr] - mc_new);
      // With nothing seen yet (m_new = -inf) every weight is exp2(-inf) = 0.
      const float shift = m_new == -INFINITY ? 0.0f : -mc_new;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const __half2 w = __floats2half2_rn(exp2f(weight_exponent(sc[4 * j + 2 * rr], c_r[rr], shift)),
                                            exp2f(weight_exponent(sc[4 * j + 2 * rr + 1], c_r[rr], shift)));
        pw[j][rr] = *reinterpret_cast<const std::uint32_t*>(&w);
      }
      m[rr] = m_new;
      mc[rr] = mc_new;
    }
    // Where every row of the warp keeps its maximum the factor is 1 and
    // the products are skipped.
    if (!__all_sync(kFullMask, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }
    ls[0] *= alpha[0];
    ls[1] *= alpha[0];
    ls[2] *= alpha[1];
    ls[3] *= alpha[1];
    // Weights times V on the warpgroup: k-step kk is keys 16kk .. 16kk +
    // 15 (score tiles 2kk and 2kk + 1, whose C layout is the A layout),
    // V's rows 16kk on as the N-major B; the weights' sums against ones.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const std::uint32_t pa[4] = {pw[2 * kk][0], pw[2 * kk][1], pw[2 * kk + 1][0], pw[2 * kk + 1][1]};
      wgmma_m64n128k16_nb(o, pa, wgmma_desc_sw128(vs + kk * 16 * 128, kHalfBytes, 1024));
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const std::uint32_t pa[4] = {pw[2 * kk][0], pw[2 * kk][1], pw[2 * kk + 1][0], pw[2 * kk + 1][1]};
      mma16816(ls, pa, kOnes, kOnes);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(o);
    __syncthreads();  // the stage is refilled next step
  }
  const float l[2] = {ls[0], ls[2]};

  // Each live row of a query with one split: its output, o / l, as the
  // combine of one partial gives it (weight 1) and with zero written as
  // +0. Of a query with more: its partial, m c, l, then its 128
  // unnormalized outputs.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    if (!live[rr]) continue;
    if (p_r[rr] / kSplitRows == lo_r[rr] / kSplitRows) {
      float* dst = P.out + static_cast<std::int64_t>(qrow[rr]) * P.out_stride +
                   static_cast<std::int64_t>(head[rr]) * HD + 2 * t;
      const float d = sink_divisor(l[rr], mc[rr], P.sinks, head[rr]);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) =
            make_float2(plus_zero(o[4 * j + 2 * rr] / d), plus_zero(o[4 * j + 2 * rr + 1] / d));
      }
      continue;
    }
    const std::int64_t entry =
        ((static_cast<std::int64_t>(qrow[rr]) * A.query_splits + (s - lo_r[rr] / kSplitRows)) *
             P.n_heads +
         head[rr]) *
        kF16PartFloats;
    float* dst = A.ws + entry;
    if (t == 0) *reinterpret_cast<float2*>(dst) = make_float2(mc[rr], l[rr]);
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<float2*>(dst + 4 + 8 * j + 2 * t) = make_float2(o[4 * j + 2 * rr], o[4 * j + 2 * rr + 1]);
  }
}

// wgmma exists in sm_90a code only: code for other targets traps, and the
// store refuses the f16 numeric where its device would run that code
// (f16_numeric_status).
__global__ void __launch_bounds__(kF16Threads, 3) attend_f16_kernel(const F16Params A) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  attend_f16_body<2>(A);
#else
  __trap();
#endif
}
__global__ void __launch_bounds__(kF16Threads, 2) attend_f16_deep_kernel(const F16Params A) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  attend_f16_body<3>(A);
#else
  __trap();
#endif
}

// One warp per (query, head) of a query with more than one split: pair
// blockIdx.y * 4 + warp of tile blockIdx.x.
__global__ void __launch_bounds__(kF16Threads) attend_f16_combine_kernel(const F16Params A) {
  const AttendParams& P = A.P;
  const std::int64_t reach = reach_of(P);
  const F16Tile tile = tile_of(A, static_cast<int>(blockIdx.x), reach);
  const int pair = static_cast<int>(blockIdx.y) * kWarps + (static_cast<int>(threadIdx.x) >> 5);
  if (pair >= tile.n_queries * P.n_heads) return;
  const int ql = pair / P.n_heads;
  const std::int64_t p = tile.position + ql;
  if (p / kSplitRows == first_split_of(p, reach)) return;  // written by its CTA
  combine(A, tile.q_first + ql, p, pair % P.n_heads, static_cast<int>(threadIdx.x) & 31, reach);
}

}  // namespace kvring::cuda
