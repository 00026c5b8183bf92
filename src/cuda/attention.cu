// Batched decode and prefill attention: every query of a batch of
// sequences in one launch, each over its own plane (a slot's sliding ring
// or a block table into the shared pool) read in place through its ring
// state, plus the rows of its prefill chunk. Each query finds its item
// (AttendQueryItem, device memory) by binary search on its index.
//
// Grid: x = split of the query's visible rows, y = work item (query heads
// that share a KV head), z = query (x and z swapped in query-major
// launches, FirstTiles). Each warp of a CTA reduces its own rows of the
// split (kernels.h) in logical order with an online softmax; the CTA
// combines its warps in warp order; a query with several splits combines
// their partials in a fixed tree (in two levels beyond kAttendSingleLevel
// splits), on one of three paths: when the whole grid fits the GPU at
// once, every split stores its partial as epoch-tagged words, waits for
// the others' and combines a share of the output; else through the shared
// memory of a thread-block cluster when the item's splits form one; else
// through the global workspace, where the last CTA to arrive combines.
// Every boundary is a function of the query's logical range alone
// (kernels.h), and no value is ever accumulated in arrival order, so the
// bits of a query's output depend only on its row values in logical order.
//
// Numerics: f32 scores, softmax and accumulation, exp2 with the scale
// log2(e)/sqrt(head_dim) folded into the scores.
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>

#include "attend_rows.cuh"
#include "combine.cuh"
#include "kernels.h"
#include "ptx.cuh"
#include "testing.h"

namespace kvring::cuda {
namespace {

// The tensor-core kernel's warps take the tiles of the split in turn: warp
// w reads the tiles at a + w * kAttendTile, then every kWarpStride rows on,
// up to b. The CTA's 8 warps thus stream one window of rows together, not
// 8 ranges an eighth of a split apart, and no warp runs on alone at the
// end: at 131072 rows the decode ends about 1.7 us sooner on the H200
// (docs/PERFORMANCE.md).
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

// The L2 policy of the tiles. When each row is read by one CTA (one query,
// and at most 8 query heads per KV head), they are marked evict-first:
// they, rather than the kernel's code, parameters and partials, then make
// room for the tiles behind them, and a cold decode of a long plane ends
// about 1.4 us sooner on the H200 (docs/PERFORMANCE.md). Rows that other
// CTAs read again (other queries', or other head sets') keep the default
// priority.
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

// Each warp streams its tiles through kStages shared-memory stages with
// cp.async, kStages - 1 tiles ahead of the one it computes: 16 KB in flight
// per warp on top of the registers, which the 8 warps an SM holds (about
// 250 registers a lane) could not keep in flight alone.
//
// A stage holds the tile's 16 head rows of K, then of V, 256 bytes (16
// pieces of 16 bytes) a row. Lane l copies piece l % 16 of rows 2k + l / 16
// (k < 8) of both, so each copy instruction of the warp moves two whole
// rows: whole sectors, one 128-byte line of shared memory per 8 lanes, and
// one pointer with constant steps when the tile's rows lie evenly spaced.
// Piece c of row r lands at c ^ swizzle(r), which stays within the piece's
// 128-byte half of the row and puts the reads of every quarter warp on 8
// distinct bank groups: K is read as pieces 4i + t of rows g and 8 + g
// (swizzle 4(r & 1)), V by ldmatrix as one piece of 8 consecutive rows
// (swizzle r & 7).
constexpr int kStages = 3;
constexpr int kRowBytes = kTensorHeadDim * 2;
constexpr int kTileBytes = kAttendTile * kRowBytes;
constexpr int kStageBytes = 2 * kTileBytes;       // K, then V
constexpr int kWarpArea = kStages * kStageBytes;  // bytes per warp
static_assert(kAttendTile == 16 && kRowBytes == 256, "the swizzles assume 16 rows of 16 pieces");

__device__ __forceinline__ int k_swizzle(int row) { return (row & 1) << 2; }
__device__ __forceinline__ int v_swizzle(int row) { return row & 7; }

struct TensorSmem {
  Shared sh;
  // Per warp; its output partial [head * 128 + dim] after the loop, and in
  // warp 0's, behind its partial, the CTA's partial for a cluster combine.
  alignas(128) unsigned char area[kAttendWarps][kWarpArea];
};
constexpr int kPartialBytes = kTensorHeads * kTensorHeadDim * 4;
// Warp 0's area after the loop: its output partial, then the CTA's combine
// space.
struct Warp0Finish {
  float partial[kTensorHeads * kTensorHeadDim];
  CombineSpace combine;
};
static_assert(offsetof(Warp0Finish, combine) == kPartialBytes &&
                  sizeof(Warp0Finish) == kPartialBytes + sizeof(CombineSpace) &&
                  sizeof(Warp0Finish) <= kWarpArea,
              "warp 0's area holds its partial and the combine space");

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
  // first: behind the first tiles of every CTA (16 MB at 131072 rows) they
  // would come back microseconds later, with the tiles already waiting.
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
  std::int64_t a, b;
  split_rows_of(r, a, b);
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
  // amax in [2^(e-1), 2^e) for e = biased exponent - 126; both factors are
  // normal powers of two, so scaling and unscaling are exact.
  const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 126;
  const int shift = min(max(15 - e, -126), 126);
  const float up = __uint_as_float(static_cast<unsigned>(127 + shift) << 23);
  const float down = __uint_as_float(static_cast<unsigned>(127 - shift) << 23);
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
    *reinterpret_cast<float2*>(so + 8 * j) = make_float2(o[j][0] + o[j][2], o[j][1] + o[j][3]);
  __syncthreads();
  CombineSpace& space = reinterpret_cast<Warp0Finish*>(S.area[0])->combine;
  finish<true>(P, sh, space.part_o, &space.resident,
               WarpOutputs{reinterpret_cast<const float*>(S.area[0]), kWarpArea / 4}, r,
               kTensorHeads, heads_valid, head0);
}

// ---- Any head_dim up to 256 --------------------------------------------------
//
// One CTA per query head; lane i holds dims i, i + 32, ... Each key's score
// is the lane's partial dot product summed over the warp in a butterfly,
// which leaves the same bits in every lane; the online softmax then runs
// key by key in logical order.

constexpr int kGeneralDimsPerLane = kGeneralMaxHeadDim / 32;
constexpr int kGeneralKeys = 4;  // keys in flight per warp step

__device__ __forceinline__ float f16_value(std::uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

__global__ void __launch_bounds__(kAttendThreads, 2) attend_general_kernel(const KernelArgs A) {
  const FirstTiles& F = A.F;
  const AttendParams& P = A.P;
  __shared__ Shared sh;
  __shared__ float warp_o[kAttendWarps][kGeneralMaxHeadDim];
  __shared__ alignas(16) float part_o[kPartFloats];
  QueryRange r;
  if (!query_range(F, P, r)) return idle_in_cluster(P);
  r.n_splits = split_count(r);
  const int hd = P.head_dim;
  const int head = static_cast<int>(blockIdx.y);
  const int kv_head = head / F.group;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;

  float qv[kGeneralDimsPerLane];
  const float* q = P.q + static_cast<std::int64_t>(r.qi) * P.q_stride +
                   static_cast<std::int64_t>(head) * hd;
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < hd ? q[d] : 0.0f;
  }

  std::int64_t a, b;
  warp_rows(r, warp, a, b);
  const HeadRows rows(P, r, hd, kv_head);
  float m = -INFINITY, l = 0.0f;
  float o[kGeneralDimsPerLane];
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) o[i] = 0.0f;

#pragma unroll 1
  for (std::int64_t base = a; base < b; base += kGeneralKeys) {
    float s[kGeneralKeys];
    float vv[kGeneralKeys][kGeneralDimsPerLane];
#pragma unroll
    for (int u = 0; u < kGeneralKeys; ++u) {
      s[u] = 0.0f;
      const bool live = base + u < b;
      RowPtr row{nullptr, nullptr};
      if (live) row = row_at(P, rows, base + u);
#pragma unroll
      for (int i = 0; i < kGeneralDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        vv[u][i] = 0.0f;
        if (live && d < hd) {
          s[u] += qv[i] * f16_value(row.k[d]);
          vv[u][i] = f16_value(row.v[d]);
        }
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
      for (int u = 0; u < kGeneralKeys; ++u) s[u] += __shfl_xor_sync(kFullMask, s[u], off);
#pragma unroll
    for (int u = 0; u < kGeneralKeys; ++u) {
      if (base + u >= b) break;
      const float x = s[u] * P.scale_log2;
      const float m_new = fmaxf(m, x);
      const float alpha = weight_of(m, m_new);
      const float p = weight_of(x, m_new);
      l = l * alpha + p;
#pragma unroll
      for (int i = 0; i < kGeneralDimsPerLane; ++i) o[i] = o[i] * alpha + p * vv[u][i];
      m = m_new;
    }
  }

  if (lane == 0) {
    sh.m[warp][0] = m;
    sh.l[warp][0] = l;
  }
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) warp_o[warp][d] = o[i];
  }
  __syncthreads();
  finish<false>(P, sh, part_o, nullptr, WarpOutputs{warp_o[0], kGeneralMaxHeadDim}, r, 1, 1,
                head);
}

}  // namespace

AttendGrid attend_grid(int n_heads, int n_kv_heads, int head_dim) {
  if (head_dim == kTensorHeadDim) {
    const int group = n_heads / n_kv_heads;
    return {n_kv_heads * ((group + kTensorHeads - 1) / kTensorHeads), kTensorHeads};
  }
  return {n_heads, 1};
}

std::int64_t attend_slot_floats(int n_heads, int n_kv_heads, int head_dim) {
  const AttendGrid g = attend_grid(n_heads, n_kv_heads, head_dim);
  return static_cast<std::int64_t>(g.items) * g.heads_per_item * (head_dim + 2);
}

bool kernels_run_here() {
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, attend_general_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

namespace {

// The largest cluster of CTAs of `kernel` this device runs at once (1: no
// clusters). Queried once per kernel; a failed query clears its error.
template <class Kernel>
int max_cluster(Kernel kernel, std::size_t smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  for (int size : {16, 8, 4, 2}) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(size), 1, 1);
    cfg.blockDim = dim3(kAttendThreads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(size);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
    if (e == cudaSuccess && clusters >= 1) return size;
    (void)cudaGetLastError();
  }
  return 1;
}

// Launches by combine path, for the tests.
struct PathCounters {
  std::atomic<long> resident{0}, cluster{0}, last_arrival{0}, query_major{0};
};
PathCounters path_counts;
std::atomic<std::uint32_t> next_epoch{0};

// The FirstTiles of a launch.
FirstTiles first_tiles(const AttendParams& P) {
  FirstTiles f{};
  f.reach = P.window > 0 ? P.window - 1 : std::numeric_limits<std::int64_t>::max() / 2;
  f.group = P.n_heads / P.n_kv_heads;
  f.sets = (f.group + kTensorHeads - 1) / kTensorHeads;
  f.n_heads = P.n_heads;
  f.read_once = P.n_queries == 1 && f.sets == 1 ? 1 : 0;
  return f;
}

// Launches `kernel` over `grid` (x = split, y = item, z = query). When the
// grid has at most `resident_ctas` CTAs (and the tagged partials have
// room), it is a resident grid through a cooperative launch; else the
// splits of each item (grid.x of them) form one cluster when there are
// several and a cluster that large runs; else they combine by last
// arrival, as they also do when the device turns the cooperative launch
// down (too large, or not supported or permitted here); a last-arrival
// launch of several queries runs query-major when `query_major_ok` says so.
template <class Kernel>
cudaError_t launch(Kernel kernel, int cluster_limit, int resident_ctas, bool query_major_ok,
                   dim3 grid, std::size_t smem, AttendParams params, cudaStream_t stream) {
  const std::int64_t ctas = static_cast<std::int64_t>(grid.x) * grid.y * grid.z;
  const bool resident = grid.x >= 2 && params.tagged != nullptr &&
                        ctas <= std::min(resident_ctas, params.tagged_ctas);
  const bool cluster = !resident && grid.x >= 2 && static_cast<int>(grid.x) <= cluster_limit;
  params.cluster = cluster ? 1 : 0;
  params.resident = resident ? 1 : 0;
  FirstTiles first = first_tiles(params);
  first.query_major = query_major_ok && !resident && !cluster && grid.x >= 2 && grid.z >= 2 ? 1 : 0;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = first.query_major ? dim3(grid.z, grid.y, grid.x) : grid;
  cfg.blockDim = dim3(kAttendThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  if (cluster) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = grid.x;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
  } else {
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
  }
  cfg.attrs = &attr;
  cfg.numAttrs = cluster || resident ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, KernelArgs{first, params});
  if (resident && (e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported ||
                   e == cudaErrorNotPermitted)) {
    (void)cudaGetLastError();
    return launch(kernel, cluster_limit, 0, query_major_ok, grid, smem, params, stream);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // reported here, not by a later call
  } else if (grid.x >= 2) {
    (resident ? path_counts.resident : cluster ? path_counts.cluster : path_counts.last_arrival)
        .fetch_add(1, std::memory_order_relaxed);
    if (first.query_major) path_counts.query_major.fetch_add(1, std::memory_order_relaxed);
  }
  return e;
}

// The CTAs of `kernel` this device holds at once, when it takes
// cooperative launches (0 otherwise, or when a query fails; its error is
// cleared).
template <class Kernel>
int resident_capacity(Kernel kernel, std::size_t smem) {
  int device = 0, cooperative = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kAttendThreads, smem) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return cooperative ? sms * per_sm : 0;
}

std::atomic<int> cluster_cap{0};
std::atomic<bool> resident_allowed{true};

// What a device's launches need, set up on its first launch: the
// tensor-core kernel's opt-in to more than the 48 KB default of shared
// memory (a per-device attribute), each kernel's largest cluster, and how
// many CTAs of the tensor-core kernel a resident grid may have (the
// general kernel always combines by last arrival).
struct DeviceSetup {
  cudaError_t opted_in = cudaSuccess;
  int hd128_cluster = 1;
  int general_cluster = 1;
  int hd128_resident = 0;
  std::int64_t l2_bytes = 0;  // 0: unknown
};

cudaError_t device_setup(DeviceSetup& out) {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  // The last device this thread launched on, so that a launch takes the
  // lock only on a thread's first launch or a change of device.
  thread_local int cached_device = -1;
  thread_local DeviceSetup cached;
  if (device == cached_device) {
    out = cached;
    return cudaSuccess;
  }
  static std::mutex mu;
  static std::map<int, DeviceSetup> by_device;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = by_device.find(device);
  if (it == by_device.end()) {
    DeviceSetup s;
    s.opted_in = cudaFuncSetAttribute(attend_hd128_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(TensorSmem));
    if (s.opted_in != cudaSuccess) (void)cudaGetLastError();
    if (s.opted_in == cudaSuccess) {
      s.hd128_cluster = max_cluster(attend_hd128_kernel, sizeof(TensorSmem));
      s.hd128_resident = resident_capacity(attend_hd128_kernel, sizeof(TensorSmem));
    }
    s.general_cluster = max_cluster(attend_general_kernel, 0);
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) == cudaSuccess) {
      s.l2_bytes = l2;
    } else {
      (void)cudaGetLastError();
    }
    it = by_device.emplace(device, s).first;
  }
  cached_device = device;
  cached = it->second;
  out = cached;
  return cudaSuccess;
}

// The cluster limit of the attention kernel for `head_dim`, capped for tests.
int cluster_limit(const DeviceSetup& s, int head_dim) {
  const int limit = head_dim == kTensorHeadDim ? s.hd128_cluster : s.general_cluster;
  const int cap = cluster_cap.load();
  return cap > 0 ? std::min(cap, limit) : limit;
}

// The most CTAs of a resident grid of the kernel for `head_dim` (only the
// tensor-core kernel runs as one), and the most a launch may have now (0
// while a test turns resident grids off).
int resident_ctas(const DeviceSetup& s, int head_dim) {
  return head_dim == kTensorHeadDim ? s.hd128_resident : 0;
}
int resident_limit(const DeviceSetup& s, int head_dim) {
  return resident_allowed.load() ? resident_ctas(s, head_dim) : 0;
}

// Whether a last-arrival launch of several queries runs query-major: when
// the K and V rows its last query sees outgrow the L2 (or as a test set).
std::atomic<int> query_major_mode{0};
bool query_major_wanted(const DeviceSetup& s, const AttendParams& P) {
  const int mode = query_major_mode.load();
  if (mode != 0) return mode > 0;
  return s.l2_bytes > 0 && P.most_rows * P.kv_dim * 4 > s.l2_bytes;
}

}  // namespace

namespace testing {
void set_attend_cluster_cap(int cap) { cluster_cap.store(cap); }
void set_attend_resident(bool allowed) { resident_allowed.store(allowed); }
void set_attend_query_major(int mode) { query_major_mode.store(mode); }
AttendPathCounts attend_path_counts() {
  return {path_counts.resident.load(), path_counts.cluster.load(), path_counts.last_arrival.load(),
          path_counts.query_major.load()};
}
int attend_splits_for(std::int64_t n) { return static_cast<int>(attend_splits(n)); }
void set_attend_next_epoch(std::uint32_t epoch) { next_epoch.store(epoch); }
int attend_resident_limit(int head_dim) {
  DeviceSetup s;
  if (device_setup(s) != cudaSuccess) return 0;
  return resident_limit(s, head_dim);
}
int attend_cluster_limit(int head_dim) {
  DeviceSetup s;
  if (device_setup(s) != cudaSuccess) return 0;
  if (head_dim == kTensorHeadDim && s.opted_in != cudaSuccess) return 0;
  return cluster_limit(s, head_dim);
}
}  // namespace testing

std::uint32_t testing_next_epoch() { return next_epoch.exchange(0); }

int attend_resident_ctas(int head_dim) {
  DeviceSetup s;
  return device_setup(s) == cudaSuccess ? resident_ctas(s, head_dim) : 0;
}

cudaError_t launch_attend(const AttendParams& params, cudaStream_t stream) {
  if (params.n_queries <= 0) return cudaSuccess;
  const AttendGrid g = attend_grid(params.n_heads, params.n_kv_heads, params.head_dim);
  const dim3 grid(static_cast<unsigned>(params.max_splits), static_cast<unsigned>(g.items),
                  static_cast<unsigned>(params.n_queries));
  DeviceSetup s;
  const cudaError_t e = device_setup(s);
  if (e != cudaSuccess) return e;
  if (params.head_dim == kTensorHeadDim) {
    if (s.opted_in != cudaSuccess) return s.opted_in;
    return launch(attend_hd128_kernel, cluster_limit(s, params.head_dim),
                  resident_limit(s, params.head_dim), query_major_wanted(s, params), grid,
                  sizeof(TensorSmem), params, stream);
  }
  return launch(attend_general_kernel, cluster_limit(s, params.head_dim), 0,
                query_major_wanted(s, params), grid, 0, params, stream);
}

}  // namespace kvring::cuda
