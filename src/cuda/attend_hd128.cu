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

// Which head rows of a tile a copy moves (bits).
constexpr int kCopyK = 1, kCopyV = 2, kCopyKV = kCopyK | kCopyV;

// Enqueues the K and/or V rows (kParts) of the tile at `base` (rows < b;
// rows past b are written as zeros) stage_off bytes past the lane's
// destinations.
template <int kParts>
__device__ __forceinline__ void issue_tile(const AttendParams& P,
                                           const HeadRows& rows, std::int64_t base, std::int64_t b,
                                           const TileCopy& tc, unsigned stage_off) {
  // Evenly spaced rows: a whole tile inside the chunk, or inside the plane
  // without crossing the ring's end or a block's (tiles of a full plane
  // start at multiples of 16 rows, and blocks hold a power of two of at
  // least 16, so a whole tile never crosses one).
  const std::uint16_t* k0 = nullptr;
  const std::uint16_t* v0 = nullptr;
  std::int64_t stride = 0;
  std::int64_t ring_first = -1;  // a whole ring tile across the ring's end: its first physical row
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
      } else if (rows.table == nullptr) {
        ring_first = physical;
      }
    }
  }
  if (k0 != nullptr) {
    const std::int64_t off = tc.half * stride + 8 * tc.c;
    k0 += off;
    v0 += off;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (kParts & kCopyK) cp_async16(tc.k_dst + stage_off + k * 2 * kRowBytes, k0, true, tc.policy);
      if (kParts & kCopyV)
        cp_async16(tc.v_dst[k & 3] + stage_off + (k >> 2) * 8 * kRowBytes, v0, true, tc.policy);
      k0 += 2 * stride;
      v0 += 2 * stride;
    }
    return;
  }
  if (ring_first >= 0) {
    // The rows run to the ring's end, then on from its row 0: the same
    // rows row_at finds, without its per-row tests.
    const std::int64_t first = ring_first + tc.half;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      std::int64_t physical = first + 2 * k;
      if (physical >= rows.capacity) physical -= rows.capacity;
      const std::int64_t off = physical * rows.row_stride + rows.head_offset + 8 * tc.c;
      if (kParts & kCopyK) cp_async16(tc.k_dst + stage_off + k * 2 * kRowBytes, rows.k + off, true, tc.policy);
      if (kParts & kCopyV)
        cp_async16(tc.v_dst[k & 3] + stage_off + (k >> 2) * 8 * kRowBytes, rows.v + off, true, tc.policy);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const std::int64_t L = base + 2 * k + tc.half;
    const bool ok = L < b;
    const RowPtr row = ok ? row_at(P, rows, L) : RowPtr{rows.k, rows.k};
    if (kParts & kCopyK)
      cp_async16(tc.k_dst + stage_off + k * 2 * kRowBytes, row.k + (ok ? 8 * tc.c : 0), ok,
                 tc.policy);
    if (kParts & kCopyV)
      cp_async16(tc.v_dst[k & 3] + stage_off + (k >> 2) * 8 * kRowBytes,
                 row.v + (ok ? 8 * tc.c : 0), ok, tc.policy);
  }
}

// The work item of blockIdx.y: its KV head and its query heads head0 ..
// head0 + heads_valid (a set of at most kTensorHeads of the KV head's group).
struct HeadSet {
  int kv_head, head0, heads_valid;
};
__device__ __forceinline__ HeadSet head_set(const FirstTiles& F) {
  const int item = static_cast<int>(blockIdx.y);
  const int kv_head = F.sets == 1 ? item : item / F.sets;
  const int set = item - kv_head * F.sets;
  return {kv_head, kv_head * F.group + set * kTensorHeads, min(kTensorHeads, F.group - set * kTensorHeads)};
}

// Query g's dims 8t + [0, 4) as float4 0; dims 32(i/2) + 8t + 4(i%2) +
// [0, 4) are float4 (i >> 1) * 8 + (i & 1).
__device__ __forceinline__ const float4* query_src(const AttendParams& P, const QueryRange& r, const HeadSet& hs,
                                                   int g, int t) {
  return reinterpret_cast<const float4*>(P.q + static_cast<std::int64_t>(r.qi) * P.q_stride +
                                         static_cast<std::int64_t>(hs.head0 + g) * kTensorHeadDim + 8 * t);
}

// Query g's dims 32i + 8t + [0, 8) as qv[8i + ...]; zeros for a head past
// the set's.
__device__ __forceinline__ void load_query(const AttendParams& P, const QueryRange& r, const HeadSet& hs,
                                           int g, int t, float (&qv)[32]) {
  if (g < hs.heads_valid) {
    const float4* src = query_src(P, r, hs, g, t);
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
}

// The query's A operands of QK^T: the query scaled by a power of two
// (exact) so its largest element lies in [2^14, 2^15), in hi and lo halves,
// and in `down` the factor that scales a score back. The lo halves then
// stay normal f16 for every element that matters, whatever the query's
// magnitude. query_up gives the scale of query g (the same in its 4
// lanes), kstep_operands the operands of k-step s from x = qv[4s .. 4s +
// 4): k-step s = 2i + e covers dims 32i + 8t + 4e + [0, 4).
__device__ __forceinline__ float query_up(const float (&qv)[32], float& down) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(qv[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
  return query_scale(amax, down);
}
__device__ __forceinline__ uint4 kstep_operands(float4 x, float up) {
  const Halves qa0 = split_f16(x.x * up);
  const Halves qa1 = split_f16(x.y * up);
  const Halves qa2 = split_f16(x.z * up);
  const Halves qa3 = split_f16(x.w * up);
  return make_uint4(pack(qa0.hi, qa1.hi),   // row g,     k 2t, 2t+1   <- first two
                    pack(qa0.lo, qa1.lo),   // row g + 8, k 2t, 2t+1
                    pack(qa2.hi, qa3.hi),   // row g,     k 2t+8, 2t+9 <- last two
                    pack(qa2.lo, qa3.lo));  // row g + 8, k 2t+8, 2t+9
}
__device__ __forceinline__ void set_kstep(std::uint32_t (&qa)[8][4], int s, uint4 w) {
  qa[s][0] = w.x;
  qa[s][1] = w.y;
  qa[s][2] = w.z;
  qa[s][3] = w.w;
}
__device__ __forceinline__ void query_operands(const float (&qv)[32], std::uint32_t (&qa)[8][4], float& down) {
  const float up = query_up(qv, down);
#pragma unroll
  for (int s = 0; s < 8; ++s)
    set_kstep(qa, s, kstep_operands(make_float4(qv[4 * s], qv[4 * s + 1], qv[4 * s + 2], qv[4 * s + 3]), up));
}

// query_operands' result, with each k-step's operands made by one warp of
// the CTA kernel (warp s those of k-step s, from `own`: the four values
// query_operands takes from qv[4s .. 4s + 4)) and handed to every warp
// through shared memory: the same bits, from an eighth of the conversion
// code and an eighth of the query's loads. Each warp loads only its
// k-step: the largest magnitude of query g over the 16 dims of k-step s
// goes to amax[g][s], and every lane takes the largest of the 8 (fmaxf is
// exact and ignores NaNs, so the grouping gives query_up's value). A
// launch's code reaches each SM anew, so a short decode's time follows the
// instructions on its path (docs/CUDA.md, "Code on the critical path").
// Two CTA barriers: every thread of the CTA calls it.
__device__ __forceinline__ void query_operands_shared(float4 own, int warp, int lane, float (&amax)[kTensorHeads][kAttendWarps],
                                                      uint4 (&shared)[kAttendWarps][32],
                                                      std::uint32_t (&qa)[8][4], float& down) {
  static_assert(kAttendWarps == 8 && kTensorHeads == 8, "a warp a k-step, 8 query heads");
  const int g = lane >> 2;
  float m = fmaxf(fmaxf(fabsf(own.x), fabsf(own.y)), fmaxf(fabsf(own.z), fabsf(own.w)));
  m = fmaxf(m, __shfl_xor_sync(kFullMask, m, 1));
  m = fmaxf(m, __shfl_xor_sync(kFullMask, m, 2));
  if ((lane & 3) == 0) amax[g][warp] = m;
  __syncthreads();
  const float4 a0 = *reinterpret_cast<const float4*>(&amax[g][0]);
  const float4 a1 = *reinterpret_cast<const float4*>(&amax[g][4]);
  const float head_max = fmaxf(fmaxf(fmaxf(a0.x, a0.y), fmaxf(a0.z, a0.w)), fmaxf(fmaxf(a1.x, a1.y), fmaxf(a1.z, a1.w)));
  shared[warp][lane] = kstep_operands(own, query_scale(fmaxf(0.0f, head_max), down));
  __syncthreads();
#pragma unroll
  for (int s = 0; s < 8; ++s) set_kstep(qa, s, shared[s][lane]);
}

// The scores (log2 units) of query g against keys base + 2t, + 2t + 1,
// + 8 + 2t, + 8 + 2t + 1 of the K tile at k_frag + stage_off; -inf for rows
// from b on. Rows past the range were copied as zeros, so their scores are
// finite before the mask.
__device__ __forceinline__ void tile_scores(const std::uint32_t (&qa)[8][4], const unsigned (&k_frag)[4],
                                            unsigned stage_off, float down, float scale_log2,
                                            std::int64_t base, std::int64_t b, int t, float (&x)[4]) {
  uint4 kr[2][4];  // [nt][i]: row 8nt + g, piece 4i + t
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) kr[nt][i] = lds128(k_frag[i] + stage_off + nt * 8 * kRowBytes);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 8; ++s) mma16816(c, qa[s], word(kr[nt], 2 * s), word(kr[nt], 2 * s + 1));
    x[2 * nt] = (c[0] + c[2]) * down * scale_log2;      // key base + 8nt + 2t
    x[2 * nt + 1] = (c[1] + c[3]) * down * scale_log2;  // key base + 8nt + 2t + 1
  }
  if (base + kAttendTile > b) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (base + (i >> 1) * 8 + 2 * t + (i & 1) >= b) x[i] = -INFINITY;
  }
}

// The largest of query g's scores in the tile (the same in its 4 lanes).
__device__ __forceinline__ float tile_max_of(const float (&x)[4]) {
  float m = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  m = fmaxf(m, __shfl_xor_sync(kFullMask, m, 1));
  return fmaxf(m, __shfl_xor_sync(kFullMask, m, 2));
}

// The weights' A operands of PV, exactly where their scores landed.
__device__ __forceinline__ void weight_operands(const float (&pr)[4], std::uint32_t (&pa)[4]) {
  const Halves p0 = split_f16(pr[0]), p1 = split_f16(pr[1]);
  const Halves p2 = split_f16(pr[2]), p3 = split_f16(pr[3]);
  pa[0] = pack(p0.hi, p1.hi);  // row g,     keys 2t, 2t+1
  pa[1] = pack(p0.lo, p1.lo);  // row g + 8, keys 2t, 2t+1
  pa[2] = pack(p2.hi, p3.hi);  // row g,     keys 2t+8, 2t+9
  pa[3] = pack(p2.lo, p3.lo);  // row g + 8, keys 2t+8, 2t+9
}

// The lane's fragment addresses in a warp's area (stage 0; `v_base` where
// a stage's V tile starts): K piece 4i + t of row g (row 8 + g lies 8 rows
// on); for the ldmatrix of dim tiles 2jj and 2jj + 1, lane 8m + rr gives
// row 8(m & 1) + rr, piece 2jj + (m >> 1).
struct Fragments {
  unsigned k[4];
  unsigned v;
  int v_row, v_piece;
  __device__ Fragments(unsigned area, unsigned v_base, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) k[i] = area + g * kRowBytes + ((4 * i + t) ^ k_swizzle(g)) * 16;
    v_row = ((lane >> 3) & 1) * 8 + (lane & 7);
    v = area + v_base + v_row * kRowBytes;
    v_piece = lane >> 4;
  }
  // V's B operands of dim tiles 2jj, 2jj + 1 (keys 2t, 2t+1 then 2t+8,
  // 2t+9 of dim 8j + g).
  __device__ __forceinline__ void v_operands(unsigned stage_off, int jj, std::uint32_t (&vb)[4]) const {
    ldmatrix_x4_trans(vb, v + stage_off + ((2 * jj + v_piece) ^ v_swizzle(v_row)) * 16);
  }
};

// Where a lane's copies go in a warp's area (`v_base` where a stage's V
// tile starts), with L2 policy `policy`.
__device__ __forceinline__ TileCopy tile_copy(unsigned area, unsigned v_base, int lane, std::uint64_t policy) {
  TileCopy tc;
  tc.policy = policy;
  tc.half = lane >> 4;
  tc.c = lane & 15;
  tc.k_dst = area + tc.half * kRowBytes + (tc.c ^ k_swizzle(tc.half)) * 16;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int row = 2 * k + tc.half;
    tc.v_dst[k] = area + v_base + row * kRowBytes + (tc.c ^ v_swizzle(row)) * 16;
  }
  return tc;
}

}  // namespace

// The body of both launches' kernels (KernelArgs, InlineArgs).
template <class Args>
__device__ __forceinline__ void attend_hd128_cta(const Args& A) {
  extern __shared__ uint4 smem_raw[];
  TensorSmem& S = *reinterpret_cast<TensorSmem*>(smem_raw);
  if (A.P.cluster) cluster_begin(S.inbox);  // finish waits for every CTA's arrival
  constexpr int HD = kTensorHeadDim;
  const FirstTiles& F = A.F;
  const AttendParams& P = A.P;
  Shared& sh = S.sh;
  // What the parameters alone give is worked out before the programmatic
  // wait, while the grid before may still run, where the launch's items
  // are in its parameters; uploaded items are read after it (ptx.cuh,
  // enter_dependent).
  const bool params_only = items_in_params(A);
  if (!params_only) enter_dependent();
  QueryRange r;
  if (!query_range(F, P, launch_items(A), r)) {
    if (params_only) enter_dependent();
    if (P.resident) clock_idle(P);
    // An idle rank of a cluster waits for the arrivals at the start only:
    // no store reaches it, and the combine holds no cluster barrier
    // (finish_heads).
    if (P.cluster) cluster_wait();
    return;
  }
  const HeadSet hs = head_set(F);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  // Rows [a, b) of the CTA's run of splits (one split unless F.split_run
  // says more); the current split ends at split_end.
  std::int64_t a = r.lo + r.split * r.split_rows;
  const std::int64_t b = min(a + F.split_run * r.split_rows, r.p + 1);
  std::int64_t split_end = a + r.split_rows;
  // A one-token prefill's own row p is stored by the warp whose tiles
  // (from the run's first row on, one in kAttendWarps of its
  // kAttendTile-row tiles) hold it.
  const bool stores_own_row = P.own_rows && b > r.p && ((r.p - a) / kAttendTile) % kAttendWarps == warp;
  HeadRows rows(P, r, HD, hs.kv_head);
  if (r.split < P.first_blocks_n && rows.table != nullptr) {
    std::int64_t physical = a + rows.shift;
    if (physical >= rows.capacity) physical -= rows.capacity;
    rows.known_index = physical >> rows.block_shift;
    rows.known_block = P.first_blocks[r.split];
  }
  a += warp * kAttendTile;
  const unsigned area = static_cast<unsigned>(__cvta_generic_to_shared(S.area[warp]));
  const TileCopy tc = tile_copy(area, kTileBytes, lane, tile_policy(F.read_once != 0));
  r.n_splits = split_count(r);
  if (params_only) enter_dependent();

  // The own row goes to the plane first.
  if (stores_own_row) store_own_row(P, r, rows, hs.kv_head, HD, lane);
  // The query's load goes out next: behind the first tiles of every CTA it
  // would come back late, with the tiles already waiting. A warp loads its
  // k-step of the query alone (query_operands_shared).
  const float4 own = g < hs.heads_valid ? query_src(P, r, hs, g, t)[(warp >> 1) * 8 + (warp & 1)]
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  // Then the first tiles, before the query is used.
  // A resident CTA's clock count lands with thread 0's first tiles.
  if (P.resident && threadIdx.x == 0) clock_copy(P, sh);
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (a + st * kWarpStride < b)
      issue_tile<kCopyKV>(P, rows, a + st * kWarpStride, b, tc, static_cast<unsigned>(st * kStageBytes));
    cp_async_commit();
  }
  const Fragments fr(area, kTileBytes, lane);
  float down;
  std::uint32_t qa[8][4];
  query_operands_shared(own, warp, lane, S.amax, S.qa, qa, down);

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
      if (ahead < b) issue_tile<kCopyKV>(P, rows, ahead, b, tc, static_cast<unsigned>(st * kStageBytes));
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // this tile's group is complete
    __syncwarp();
    const unsigned stage_off = static_cast<unsigned>(stage * kStageBytes);
    stage = stage + 1 == kStages ? 0 : stage + 1;
    // Rows past the range were copied as zeros: their probability is 0,
    // and 0 * V must not be NaN from whatever the plane holds there.
    float x[4];
    tile_scores(qa, fr.k, stage_off, down, P.scale_log2, base, b, t, x);
    const float m_new = fmaxf(m, tile_max_of(x));
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = weight_of(x[i], m_new);
    // A rescale by alpha = 1 (no query's maximum moved) changes no bit, nor
    // does one from m = -inf (alpha = 0), whose query's outputs and sum are
    // still the +0 of weights that were all 0 (0 x l + tile_l == 0 +
    // tile_l; a NaN from 0 x a non-finite V stays a NaN), so the warp skips
    // both: the first tile never rescales.
    const float tile_l = (pr[0] + pr[1]) + (pr[2] + pr[3]);
    if (__any_sync(kFullMask, m_new != m && m != -INFINITY)) {
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
    weight_operands(pr, pa);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      std::uint32_t vb[4];
      fr.v_operands(stage_off, jj, vb);
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
      publish_in_run(P, sh, WarpOutputs{reinterpret_cast<const float*>(S.area[0] + stage_off), kWarpArea / 4, true}, r);
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
  const int run_first = static_cast<int>(F.query_major ? blockIdx.z : blockIdx.x) * F.split_run;
  finish_heads(P, sh, &S.inbox, &reinterpret_cast<Warp0Finish*>(S.area[0])->resident,
               WarpOutputs{reinterpret_cast<const float*>(S.area[0]), kWarpArea / 4, true}, r, run_first,
               hs.heads_valid, hs.head0);
}
__global__ void __launch_bounds__(kAttendThreads, 1) attend_hd128_kernel(const KernelArgs A) { attend_hd128_cta(A); }
__global__ void __launch_bounds__(kAttendThreads, 1)
    attend_hd128_inline_kernel(const __grid_constant__ InlineArgs A) {
  attend_hd128_cta(A);
}

// ---- A warp a split ---------------------------------------------------------

// Enqueues tile q of a warp-split kernel's warp's sequence into stage
// `stage` of its area (nothing where the tile has no rows), as one commit
// group either way. The sequence: the warp's splits first, first +
// kWarpSplitWarps, ..., 2 kSplitTiles tiles each, its K tiles then its V
// tiles; seq tiles in all.
__device__ __forceinline__ void issue_sequence_tile(const AttendParams& P, const HeadRows& rows,
                                                    const QueryRange& r, const TileCopy& tc, int first,
                                                    int seq, int q, int stage) {
  if (q < seq) {
    const std::int64_t a =
        r.lo + static_cast<std::int64_t>(first + kWarpSplitWarps * (q / (2 * kSplitTiles))) * r.split_rows;
    const std::int64_t b = min(a + r.split_rows, r.p + 1);
    const std::int64_t base = a + (q % kSplitTiles) * kAttendTile;
    const unsigned off = static_cast<unsigned>(stage * kTileBytes);
    if (base < b) {
      if ((q / kSplitTiles) % 2 == 0)
        issue_tile<kCopyK>(P, rows, base, b, tc, off);
      else
        issue_tile<kCopyV>(P, rows, base, b, tc, off);
    }
  }
  cp_async_commit();
}

// Where every split of a launch is kAttendMinSplitRows rows, the CTA kernel
// gives each of its warps one tile of a split, and the split's partial is
// the warps' partials combined in warp order. Each warp's partial is one
// online-softmax step from nothing: its maximum m_w the tile's, its weights
// exp2(x - m_w), its sum and outputs those weights' alone. Then M = max
// m_w, each warp's weight exp2(m_w - M), and l and o summed by fma in warp
// order (combine_warps, cta_value). This kernel's warp takes those steps
// over a whole split's tiles in turn: the K tiles first, each tile's
// maximum, weight sum and weight operands into its scratch, then the V
// tiles, each tile's outputs made from zero, weighted and added into the
// split's in tile order. So a split's partial has the CTA kernel's bits,
// and needs no barrier: the CTA's kWarpSplitWarps warps take the splits of
// its run in turn (warp w the run's splits w, w + kWarpSplitWarps, ...),
// publish them, and the run arrives once at its end (arrive_run), whose
// last arrival combines as the CTA kernel's.
// The body of both launches' kernels (KernelArgs, InlineArgs).
template <class Args>
__device__ __forceinline__ void attend_hd128_warps(const Args& A) {
  enter_dependent();
  constexpr int HD = kTensorHeadDim;
  static_assert(kSplitTiles == kAttendWarps, "a split is one tile for each warp of the CTA kernel");
  constexpr int kTotal = kTensorHeads * HD;
  const FirstTiles& F = A.F;
  const AttendParams& P = A.P;
  extern __shared__ uint4 smem_raw[];
  WarpSplitSmem& S = *reinterpret_cast<WarpSplitSmem*>(smem_raw);
  QueryRange r;
  if (!query_range(F, P, launch_items(A), r)) return;
  const HeadSet hs = head_set(F);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  // A one-token prefill's own row p, in the query's last split, goes to
  // the plane first, from the warp that takes that split (below).
  if (P.own_rows) {
    const int last = split_count(r) - 1;
    if (r.split + F.split_run > last && last >= r.split + warp && (last - r.split - warp) % kWarpSplitWarps == 0)
      store_own_row(P, r, HeadRows(P, r, HD, hs.kv_head), hs.kv_head, HD, lane);
  }
  float qv[32];
  load_query(P, r, hs, g, t, qv);

  r.n_splits = split_count(r);
  const int run_first = r.split;
  const int run_end = min(run_first + F.split_run, r.n_splits);
  // The warp's splits (first, first + kWarpSplitWarps, ... below run_end) as
  // one sequence of tiles: 2 kSplitTiles a split, its K tiles then its V
  // tiles.
  const int first = run_first + warp;
  const int seq =
      first < run_end ? (run_end - first + kWarpSplitWarps - 1) / kWarpSplitWarps * 2 * kSplitTiles : 0;
  const HeadRows rows(P, r, HD, hs.kv_head);
  WarpSplitArea& mine = S.area[warp];
  WarpSplitScratch& scratch = mine.scratch;
  const unsigned area = static_cast<unsigned>(__cvta_generic_to_shared(mine.stages));
  const TileCopy tc = tile_copy(area, 0, lane, tile_policy(F.read_once != 0));
#pragma unroll 1
  for (int st = 0; st < kWarpSplitStages - 1; ++st)
    issue_sequence_tile(P, rows, r, tc, first, seq, st, st);

  float down;
  std::uint32_t qa[8][4];
  query_operands(qv, qa, down);
  const Fragments fr(area, 0, lane);
  const Workspace ws = workspace_of(P, r, kTensorHeads);
  float* const out = P.out + static_cast<std::int64_t>(r.qi) * P.out_stride +
                     static_cast<std::int64_t>(hs.head0) * HD;
  int q = 0, stage = 0;
  // Waits for tile q, after refilling the stage the tile before it was
  // read from (every lane's reads of it done) with tile q + stages - 1;
  // returns the tile's stage offset.
  auto next = [&]() -> unsigned {
    __syncwarp();
    issue_sequence_tile(P, rows, r, tc, first, seq, q + kWarpSplitStages - 1,
                        stage == 0 ? kWarpSplitStages - 1 : stage - 1);
    cp_async_wait<kWarpSplitStages - 1>();
    __syncwarp();
    const unsigned off = static_cast<unsigned>(stage * kTileBytes);
    stage = stage + 1 == kWarpSplitStages ? 0 : stage + 1;
    ++q;
    return off;
  };

#pragma unroll 1
  for (int split = first; q < seq; split += kWarpSplitWarps) {
    const std::int64_t a = r.lo + static_cast<std::int64_t>(split) * r.split_rows;
    const std::int64_t b = min(a + r.split_rows, r.p + 1);
    // Each tile as the CTA kernel's warp takes it, from m = -inf, l = 0:
    // its maximum, its lanes' weight sums added in the quad's butterfly,
    // its weight operands. A tile without rows keeps m = -inf, l = 0. The
    // split's maximum over the tiles in tile order, as combine_warps.
    float M = -INFINITY;
#pragma unroll 1
    for (int w = 0; w < kSplitTiles; ++w) {
      const unsigned off = next();
      const std::int64_t base = a + w * kAttendTile;
      float m = -INFINITY, l = 0.0f;
      if (base < b) {
        float x[4];
        tile_scores(qa, fr.k, off, down, P.scale_log2, base, b, t, x);
        m = fmaxf(-INFINITY, tile_max_of(x));
        float pr[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) pr[i] = weight_of(x[i], m);
        l = (pr[0] + pr[1]) + (pr[2] + pr[3]);
        l += __shfl_xor_sync(kFullMask, l, 1);
        l += __shfl_xor_sync(kFullMask, l, 2);
        std::uint32_t pa[4];
        weight_operands(pr, pa);
        scratch.pa[w][lane] = make_uint4(pa[0], pa[1], pa[2], pa[3]);
      }
      scratch.m[w][lane] = m;
      scratch.l[w][lane] = l;
      M = fmaxf(M, m);
    }
    // Each tile's weight and the split's weight sum, as combine_warps.
    float L = 0.0f;
#pragma unroll 1
    for (int w = 0; w < kSplitTiles; ++w) {
      const float wt = weight_of(scratch.m[w][lane], M);
      L = __fmaf_rn(scratch.l[w][lane], wt, L);
      scratch.l[w][lane] = wt;
    }
    // The outputs, as cta_value: each tile's weights times V from zero
    // (its hi and lo rows added), weighted, added in tile order; a tile
    // without rows adds 0 times its weight.
    float o[16][2];
#pragma unroll
    for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = 0.0f;
#pragma unroll 1
    for (int w = 0; w < kSplitTiles; ++w) {
      const unsigned off = next();
      const float wt = scratch.l[w][lane];
      if (a + w * kAttendTile < b) {
        const uint4 p4 = scratch.pa[w][lane];
        const std::uint32_t pa[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          std::uint32_t vb[4];
          fr.v_operands(off, jj, vb);
          float c0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma16816(c0, pa, vb[0], vb[1]);
          mma16816(c1, pa, vb[2], vb[3]);
          o[2 * jj][0] = __fmaf_rn(c0[0] + c0[2], wt, o[2 * jj][0]);
          o[2 * jj][1] = __fmaf_rn(c0[1] + c0[3], wt, o[2 * jj][1]);
          o[2 * jj + 1][0] = __fmaf_rn(c1[0] + c1[2], wt, o[2 * jj + 1][0]);
          o[2 * jj + 1][1] = __fmaf_rn(c1[1] + c1[3], wt, o[2 * jj + 1][1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          o[j][0] = __fmaf_rn(0.0f, wt, o[j][0]);
          o[j][1] = __fmaf_rn(0.0f, wt, o[j][1]);
        }
      }
    }
    // Query g's dims 8j + 2t, 8j + 2t + 1: the output of a query of one
    // split, else the split's partial in its workspace slot.
    if (r.n_splits == 1) {
      if (g < hs.heads_valid) {
        const float d = sink_divisor(L, M, sinks_from(P, hs.head0), g);
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<float2*>(out + g * HD + 8 * j + 2 * t) = make_float2(o[j][0] / d, o[j][1] / d);
      }
    } else {
      float* po = ws.o + static_cast<std::int64_t>(split) * kTotal + g * HD + 2 * t;
#pragma unroll
      for (int j = 0; j < 16; ++j) *reinterpret_cast<float2*>(po + 8 * j) = make_float2(o[j][0], o[j][1]);
      if (t == 0) {
        ws.ml[(split * kTensorHeads + g) * 2] = M;
        ws.ml[(split * kTensorHeads + g) * 2 + 1] = L;
      }
    }
  }
  if (r.n_splits == 1) return;
  combine_arrived<true>(S.sh, ws, r, arrive_run(ws.counters, r.n_splits, run_first, run_end - 1, S.sh),
                        kTensorHeads, HD, hs.heads_valid, out, sinks_from(P, hs.head0));
}
__global__ void __launch_bounds__(kWarpSplitThreads, 2) attend_hd128_warp_kernel(const KernelArgs A) {
  attend_hd128_warps(A);
}
__global__ void __launch_bounds__(kWarpSplitThreads, 2)
    attend_hd128_warp_inline_kernel(const __grid_constant__ InlineArgs A) {
  attend_hd128_warps(A);
}

}  // namespace kvring::cuda
