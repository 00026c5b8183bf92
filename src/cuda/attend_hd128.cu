// The tensor-core attention kernel (head_dim 128; attend_hd128.cuh,
// docs/CUDA.md, "head_dim 128, on tensor cores").
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attend_hd128.cuh"
#include "attend_rows.cuh"
#include "combine.cuh"
#include "kernels.h"
#include "ptx.cuh"

namespace kvring::cuda {
namespace {

// The tensor-core kernel's warps take the tiles of the split in turn: warp
// w reads the tiles at a + w * kAttendTile, then every kWarpStride rows on,
// up to b. The CTA's 8 warps thus stream one window of rows together, not
// 8 ranges an eighth of a split apart, and no warp runs on alone at the
// end (docs/PERFORMANCE.md, "Tiles in turn").
constexpr std::int64_t kWarpStride = kAttendWarps * kAttendTile;

// ---- head_dim 128 on tensor cores ------------------------------------------
//
// One warp computes 8 query heads of one KV head over 16-row tiles with
// mma.m16n8k16 (f16 operands, f32 accumulation). f32 values enter the
// tensor cores as two f16 halves, hi = f16(x) and lo = f16(x - hi), which
// together carry about 22 bits: rows 0-7 of the A operand hold the hi
// halves of the 8 queries (or probabilities), rows 8-15 the lo halves, and
// the two result rows are added in f32. K and V are exact in f16.
//
// Lane (g, t) = (lane / 4, lane % 4):
//  - QK^T: A = query halves; in k-step s = 2i + e the k index <-> dims
//    32i + 8t + 4e + {0..3} (a permutation of the dims that both operands
//    share), so the lane holds dims {32i + 8t + [0, 8)} of its query and of
//    key rows g and 8 + g: four 16-byte pieces a row. Scores land as
//    S[query g][keys 2t, 2t+1] (and 8 + ...).
//  - PV: A = the probabilities exactly where the scores landed; B = V with
//    n index <-> dim 8j + n in dim-tile j, which ldmatrix.trans gathers from
//    the rows of the tile (keys 2t, 2t+1, 2t+8, 2t+9 of dim 8j + g). Output
//    lands as O[query g][dims 8j + 2t, 8j + 2t + 1].
// A query's arithmetic is the same instruction sequence whatever else the
// warp holds: the other rows of an MMA never enter its dot products.

// The L2 policy of the tiles. When each row is read by one CTA (one query
// an item, as in a decode, and at most 8 query heads per KV head), they are
// marked evict-first:
// they, rather than the kernel's code, parameters and partials, then make
// room for the tiles behind them (docs/CUDA.md; the gain is in
// docs/PERFORMANCE.md). Rows that other CTAs read again (other queries',
// or other head sets') keep the default priority.
__device__ __forceinline__ std::uint64_t tile_policy(bool read_once) {
  const std::uint64_t first = l2_evict_first_policy();
  const std::uint64_t normal = l2_evict_normal_policy();
  return read_once ? first : normal;
}

struct Halves {
  std::uint32_t hi, lo;  // f16 bits in the low 16 bits
};
__device__ __forceinline__ Halves split_f16(float x) {
  const __half h = __float2half_rn(x);
  const __half l = __float2half_rn(x - __half2float(h));
  return {__half_as_ushort(h), __half_as_ushort(l)};
}
__device__ __forceinline__ std::uint32_t pack(std::uint32_t low, std::uint32_t high) {
  return low | (high << 16);
}

// Word w (0..4N-1) of N 16-byte vectors; w is a compile-time constant after
// unrolling, so the vectors stay in registers.
template <int N>
__device__ __forceinline__ std::uint32_t word(const uint4 (&v)[N], int w) {
  const uint4& x = v[w >> 2];
  switch (w & 3) {
    case 0: return x.x;
    case 1: return x.y;
    case 2: return x.z;
    default: return x.w;
  }
}
// Where a lane's copies of a tile go (shared addresses in stage 0; piece k
// of K at k_dst + k * 2 rows, of V at v_dst[k % 4] + (k / 4) * 8 rows) and
// which piece of which row it copies.
struct TileCopy {
  unsigned k_dst;
  unsigned v_dst[4];
  int half, c;
  std::uint64_t policy;
};

// Enqueues the tile at `base` (rows < b; rows past b are written as zeros)
// into stage `stage` of the warp's area.
__device__ __forceinline__ void issue_tile(const AttendParams& P,
                                           const HeadRows& rows, std::int64_t base, std::int64_t b,
                                           const TileCopy& tc, int stage) {
  const unsigned stage_off = static_cast<unsigned>(stage * kStageBytes);
  // Evenly spaced rows: a whole tile inside the chunk, or inside the plane
  // without crossing the ring's end or a block's (tiles of a full plane
  // start at multiples of 16 rows, and blocks hold a power of two of at
  // least 16, so a whole tile never crosses one).
  const std::uint16_t* k0 = nullptr;
  const std::uint16_t* v0 = nullptr;
  std::int64_t stride = 0;
  if (base + kAttendTile <= b) {
    if (base >= rows.chunk_start) {
      const std::int64_t off = base * P.kv_dim + rows.chunk_offset;
      k0 = P.chunk_k + off;
      v0 = P.chunk_v + off;
      stride = P.kv_dim;
    } else if (base + kAttendTile <= rows.chunk_start) {
      std::int64_t physical = base + rows.shift;
      if (physical >= rows.capacity) physical -= rows.capacity;
      const bool even = rows.table == nullptr
                            ? physical + kAttendTile <= rows.capacity
                            : (physical & rows.block_mask) + kAttendTile <= rows.block_mask + 1;
      if (even) {
        const std::int64_t off = rows.plane_offset(physical);
        k0 = rows.k + off;
        v0 = rows.v + off;
        stride = rows.row_stride;
      }
    }
  }
  if (k0 != nullptr) {
    const std::int64_t off = tc.half * stride + 8 * tc.c;
    k0 += off;
    v0 += off;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      cp_async16(tc.k_dst + stage_off + k * 2 * kRowBytes, k0, true, tc.policy);
      cp_async16(tc.v_dst[k & 3] + stage_off + (k >> 2) * 8 * kRowBytes, v0, true, tc.policy);
      k0 += 2 * stride;
      v0 += 2 * stride;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const std::int64_t L = base + 2 * k + tc.half;
    const bool ok = L < b;
    const RowPtr row = ok ? row_at(P, rows, L) : RowPtr{rows.k, rows.k};
    cp_async16(tc.k_dst + stage_off + k * 2 * kRowBytes, row.k + (ok ? 8 * tc.c : 0), ok,
               tc.policy);
    cp_async16(tc.v_dst[k & 3] + stage_off + (k >> 2) * 8 * kRowBytes, row.v + (ok ? 8 * tc.c : 0),
               ok, tc.policy);
  }
}

}  // namespace

__global__ void __launch_bounds__(kAttendThreads, 1) attend_hd128_kernel(const KernelArgs A) {
  constexpr int HD = kTensorHeadDim;
  const FirstTiles& F = A.F;
  const AttendParams& P = A.P;
  extern __shared__ uint4 smem_raw[];
  TensorSmem& S = *reinterpret_cast<TensorSmem*>(smem_raw);
  Shared& sh = S.sh;
  QueryRange r;
  if (!query_range(F, P, r)) return idle_in_cluster(P);
  const int item = static_cast<int>(blockIdx.y);
  const int kv_head = F.sets == 1 ? item : item / F.sets;
  const int set = item - kv_head * F.sets;
  const int head0 = kv_head * F.group + set * kTensorHeads;
  const int heads_valid = min(kTensorHeads, F.group - set * kTensorHeads);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;

  // Query g's dims 32i + 8t + [0, 8) as qv[8i + ...]. Its loads go out
  // first: behind the first tiles of every CTA they would come back late,
  // with the tiles already waiting.
  float qv[32];
  if (g < heads_valid) {
    const float4* src = reinterpret_cast<const float4*>(
        P.q + static_cast<std::int64_t>(r.qi) * P.q_stride +
        static_cast<std::int64_t>(head0 + g) * HD + 8 * t);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 x = src[(i >> 1) * 8 + (i & 1)];  // dims 32(i/2) + 8t + 4(i%2) + [0, 4)
      qv[4 * i] = x.x;
      qv[4 * i + 1] = x.y;
      qv[4 * i + 2] = x.z;
      qv[4 * i + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) qv[i] = 0.0f;
  }
  // Then the first tiles, before the query is used.
  // Rows [a, b) of the CTA's run of splits (one split unless F.split_run
  // says more); the current split ends at split_end.
  std::int64_t a = r.lo + r.split * r.split_rows;
  const std::int64_t b = min(a + F.split_run * r.split_rows, r.p + 1);
  std::int64_t split_end = a + r.split_rows;
  a += warp * kAttendTile;
  const HeadRows rows(P, r, HD, kv_head);
  const unsigned area = static_cast<unsigned>(__cvta_generic_to_shared(S.area[warp]));
  TileCopy tc;
  tc.policy = tile_policy(F.read_once != 0);
  tc.half = lane >> 4;
  tc.c = lane & 15;
  tc.k_dst = area + tc.half * kRowBytes + (tc.c ^ k_swizzle(tc.half)) * 16;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int row = 2 * k + tc.half;
    tc.v_dst[k] = area + kTileBytes + row * kRowBytes + (tc.c ^ v_swizzle(row)) * 16;
  }
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (a + st * kWarpStride < b) issue_tile(P, rows, a + st * kWarpStride, b, tc, st);
    cp_async_commit();
  }
  r.n_splits = split_count(r);
  // The lane's fragment addresses in stage 0: K piece 4i + t of row g (row
  // 8 + g lies 8 rows on); for the ldmatrix of dim tiles 2jj and 2jj + 1,
  // lane 8m + rr gives row 8(m & 1) + rr, piece 2jj + (m >> 1).
  unsigned k_frag[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) k_frag[i] = area + g * kRowBytes + ((4 * i + t) ^ k_swizzle(g)) * 16;
  const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7);
  const unsigned v_frag = area + kTileBytes + v_row * kRowBytes;
  const int v_piece = lane >> 4;

  // The query, scaled by a power of two (exact) so its largest element
  // lies in [2^14, 2^15): the lo halves then stay normal f16 for every
  // element that matters, whatever the query's magnitude.
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(qv[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
  float down;
  const float up = query_scale(amax, down);
  std::uint32_t qa[8][4];
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const Halves qa0 = split_f16(qv[4 * s] * up);
    const Halves qa1 = split_f16(qv[4 * s + 1] * up);
    const Halves qa2 = split_f16(qv[4 * s + 2] * up);
    const Halves qa3 = split_f16(qv[4 * s + 3] * up);
    // k-step s = 2i + e covers dims 32i + 8t + 4e + [0, 4) = qv[4s .. 4s + 4).
    qa[s][0] = pack(qa0.hi, qa1.hi);  // row g,     k 2t, 2t+1   <- first two
    qa[s][1] = pack(qa0.lo, qa1.lo);  // row g + 8, k 2t, 2t+1
    qa[s][2] = pack(qa2.hi, qa3.hi);  // row g,     k 2t+8, 2t+9 <- last two
    qa[s][3] = pack(qa2.lo, qa3.lo);  // row g + 8, k 2t+8, 2t+9
  }

  float m = -INFINITY;  // uniform over the 4 lanes of query g
  float l = 0.0f;       // this lane's share of query g's weight sum
  float o[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  int stage = 0;
#pragma unroll 1
  for (std::int64_t base = a; base < b; base += kWarpStride) {
    // Lanes read pieces other lanes copied: every lane's reads of the
    // previous tile come before the refill of its stage, and every lane's
    // copies of this tile (cp.async.wait_group waits for the lane's own)
    // before the reads.
    __syncwarp();
    {
      // Refill the stage the previous tile was read from.
      const std::int64_t ahead = base + (kStages - 1) * kWarpStride;
      const int st = stage == 0 ? kStages - 1 : stage - 1;
      if (ahead < b) issue_tile(P, rows, ahead, b, tc, st);
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // this tile's group is complete
    __syncwarp();
    const unsigned stage_off = static_cast<unsigned>(stage * kStageBytes);
    uint4 kr[2][4];  // [nt][i]: row 8nt + g, piece 4i + t
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) kr[nt][i] = lds128(k_frag[i] + stage_off + nt * 8 * kRowBytes);
    stage = stage + 1 == kStages ? 0 : stage + 1;

    // Rows past the range were copied as zeros: their probability is 0,
    // and 0 * V must not be NaN from whatever the plane holds there.
    float x[4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < 8; ++s) mma16816(c, qa[s], word(kr[nt], 2 * s), word(kr[nt], 2 * s + 1));
      x[2 * nt] = (c[0] + c[2]) * down * P.scale_log2;      // key base + 8nt + 2t
      x[2 * nt + 1] = (c[1] + c[3]) * down * P.scale_log2;  // key base + 8nt + 2t + 1
    }
    if (base + kAttendTile > b) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (base + (i >> 1) * 8 + 2 * t + (i & 1) >= b) x[i] = -INFINITY;
    }

    float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = weight_of(x[i], m_new);
    // A rescale by alpha = 1 (no query's maximum moved) changes no bit, so
    // the warp skips it.
    const float tile_l = (pr[0] + pr[1]) + (pr[2] + pr[3]);
    if (__any_sync(kFullMask, m_new != m)) {
      const float alpha = weight_of(m, m_new);
      l = __fmaf_rn(l, alpha, tile_l);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[j][0] *= alpha;
        o[j][1] *= alpha;
        o[j][2] *= alpha;
        o[j][3] *= alpha;
      }
    } else {
      l += tile_l;  // == fma(l, 1, tile_l)
    }
    m = m_new;
    std::uint32_t pa[4];
    {
      const Halves p0 = split_f16(pr[0]), p1 = split_f16(pr[1]);
      const Halves p2 = split_f16(pr[2]), p3 = split_f16(pr[3]);
      pa[0] = pack(p0.hi, p1.hi);  // row g,     keys 2t, 2t+1
      pa[1] = pack(p0.lo, p1.lo);  // row g + 8, keys 2t, 2t+1
      pa[2] = pack(p2.hi, p3.hi);  // row g,     keys 2t+8, 2t+9
      pa[3] = pack(p2.lo, p3.lo);  // row g + 8, keys 2t+8, 2t+9
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      // Dim tiles 2jj and 2jj + 1: keys 2t, 2t+1 then 2t+8, 2t+9 of dim 8j + g.
      std::uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_frag + stage_off + ((2 * jj + v_piece) ^ v_swizzle(v_row)) * 16);
      mma16816(o[2 * jj], pa, vb[0], vb[1]);
      mma16816(o[2 * jj + 1], pa, vb[2], vb[3]);
    }
    if (base + kWarpStride >= split_end && split_end < b) {
      // The split ends with this tile and another split of the run follows.
      // Every warp took the same number of tiles of this (whole) split, so
      // all of them are here, and the stage just read is free in each
      // warp's area until the next tile refills it: the warp partials go
      // there, and the CTA's partial goes out as a split's would on its own.
      __syncwarp();
      float lsum = l;
      lsum += __shfl_xor_sync(kFullMask, lsum, 1);
      lsum += __shfl_xor_sync(kFullMask, lsum, 2);
      if (t == 0) {
        sh.m[warp][g] = m;
        sh.l[warp][g] = lsum;
      }
      float* po = reinterpret_cast<float*>(S.area[warp] + stage_off) + g * HD + 2 * t;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<float2*>(po + rotated_column(8 * j, g)) = make_float2(o[j][0] + o[j][2], o[j][1] + o[j][3]);
      __syncthreads();
      publish_in_run(P, sh, WarpOutputs{reinterpret_cast<const float*>(S.area[0] + stage_off), kWarpArea / 4, true}, r,
                     kTensorHeads);
      ++r.split;
      split_end += r.split_rows;
      m = -INFINITY;
      l = 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    }
  }
  cp_async_wait<0>();  // nothing may still land in the area the partial reuses
  __syncwarp();

  // Each lane summed its own keys; add the 4 lanes of query g in a fixed
  // butterfly (a + b == b + a, so all 4 lanes hold the same bits).
  l += __shfl_xor_sync(kFullMask, l, 1);
  l += __shfl_xor_sync(kFullMask, l, 2);
  if (t == 0) {
    sh.m[warp][g] = m;
    sh.l[warp][g] = l;
  }
  float* so = reinterpret_cast<float*>(S.area[warp]) + g * HD + 2 * t;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    *reinterpret_cast<float2*>(so + rotated_column(8 * j, g)) = make_float2(o[j][0] + o[j][2], o[j][1] + o[j][3]);
  __syncthreads();
  CombineSpace& space = reinterpret_cast<Warp0Finish*>(S.area[0])->combine;
  const int run_first = static_cast<int>(F.query_major ? blockIdx.z : blockIdx.x) * F.split_run;
  finish<true>(P, sh, space.part_o, &space.resident,
               WarpOutputs{reinterpret_cast<const float*>(S.area[0]), kWarpArea / 4, true}, r, run_first,
               kTensorHeads, heads_valid, head0);
}

}  // namespace kvring::cuda
