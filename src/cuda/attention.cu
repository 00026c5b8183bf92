// Decode and prefill attention over a plane read in place through its ring
// state, plus the rows of a prefill chunk.
//
// Grid: x = split of the query's visible rows, y = work item (query heads
// that share a KV head), z = query. Each warp of a CTA reduces its own rows
// in logical order with an online softmax; the CTA combines its warps in
// warp order; a query with several splits writes one partial per split and
// the last CTA to arrive combines them in split order. Every boundary is a
// function of the query's logical range alone (kernels.h), and no value is
// ever accumulated in arrival order, so the bits of a query's output depend
// only on its row values in logical order.
//
// Numerics: f32 scores, softmax and accumulation, exp2 with the scale
// log2(e)/sqrt(head_dim) folded into the scores.
#include <cuda_fp16.h>

#include <cmath>

#include "kernels.h"

namespace kvring::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

struct QueryRange {
  int qi;                  // query index in the launch
  std::int64_t p;          // its logical position
  std::int64_t lo;         // first visible row
  std::int64_t split_rows;
  int n_splits;
  int split;               // this CTA's split
};

// False when this CTA's split does not exist for its query (the grid is
// sized for the query with the most splits).
__device__ __forceinline__ bool query_range(const AttendParams& P, QueryRange& r) {
  r.qi = static_cast<int>(blockIdx.z);
  r.p = P.first_position + r.qi;
  r.lo = P.window > 0 ? max(std::int64_t{0}, r.p - P.window + 1) : std::int64_t{0};
  const std::int64_t n = r.p - r.lo + 1;
  r.split_rows = attend_split_rows(n);
  r.n_splits = static_cast<int>((n + r.split_rows - 1) / r.split_rows);
  r.split = static_cast<int>(blockIdx.x);
  return r.split < r.n_splits;
}

// Rows [a, b) of warp `warp` (possibly empty), a multiple of kAttendTile
// rows from lo.
__device__ __forceinline__ void warp_rows(const QueryRange& r, int warp, std::int64_t& a,
                                          std::int64_t& b) {
  const std::int64_t split_begin = r.lo + r.split * r.split_rows;
  const std::int64_t split_end = min(split_begin + r.split_rows, r.p + 1);
  const std::int64_t per_warp = r.split_rows / kAttendWarps;
  a = split_begin + warp * per_warp;
  b = min(a + per_warp, split_end);
}

struct RowPtr {
  const std::uint16_t* k;
  const std::uint16_t* v;
};

// The head row of logical position L: from the chunk when L >= chunk_start,
// else from the plane at the physical row the explicit origins give.
// Precondition: L is live in the ring or inside the chunk.
__device__ __forceinline__ RowPtr row_at(const AttendParams& P, std::int64_t L, int kv_head) {
  if (L >= P.chunk_start) {
    const std::int64_t off = (L - P.chunk_start) * P.kv_dim + kv_head * P.head_dim;
    return {P.chunk_k + off, P.chunk_v + off};
  }
  std::int64_t physical = P.origin_physical + (L - P.origin_logical);
  if (physical >= P.capacity) physical -= P.capacity;
  const std::uint64_t off = plane_head_row(
      P.token_major ? Layout::kTokenMajor : Layout::kHeadMajor, static_cast<std::uint64_t>(physical),
      static_cast<std::uint64_t>(kv_head), static_cast<std::uint64_t>(P.kv_dim),
      static_cast<std::uint64_t>(P.head_dim), static_cast<std::uint64_t>(P.capacity));
  return {P.plane_k + off, P.plane_v + off};
}

// Partials of the warps of one CTA, then of the splits of one item.
struct Shared {
  float m[kAttendWarps][kTensorHeads];  // running max (log2 units)
  float l[kAttendWarps][kTensorHeads];  // sum of weights
  float weight[kAttendWarps][kTensorHeads];
  float head_m[kTensorHeads];
  float head_l[kTensorHeads];
  // [warp][head * head_dim + dim]; heads * head_dim <= 8 * 128 = 256 * 4.
  float o[kAttendWarps][kTensorHeads * kTensorHeadDim];
  // [split * heads + head]: the splits' maxima, then their weights.
  float split_m[kAttendMaxSplits * kTensorHeads];
  float split_l[kAttendMaxSplits * kTensorHeads];
  int last;
};
static_assert(kGeneralMaxHeadDim <= kTensorHeads * kTensorHeadDim);
static_assert(kTensorHeads <= kAttendWarps, "one warp per head in the final combine");

__device__ __forceinline__ float weight_of(float m, float max) {
  return m == -INFINITY ? 0.0f : exp2f(m - max);
}

// Element i (head h) of the CTA's result: its warps combined in warp order.
__device__ __forceinline__ float cta_value(const Shared& sh, int i, int h) {
  float o = 0.0f;
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) o += sh.o[w][i] * sh.weight[w][h];
  return o;
}

// Combines the CTA's warp partials (in sh, after a barrier) for `heads`
// query heads head0.. of `heads_valid` real ones, and either writes the
// output (one split) or the split's partial; the last split of the item to
// arrive combines all partials in split order and writes the output.
__device__ void finish(const AttendParams& P, Shared& sh, const QueryRange& r, int heads,
                       int heads_valid, int head0) {
  const int hd = P.head_dim;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < heads) {
    float max = -INFINITY;
    for (int w = 0; w < kAttendWarps; ++w) max = fmaxf(max, sh.m[w][tid]);
    float sum = 0.0f;
    for (int w = 0; w < kAttendWarps; ++w) {
      const float wt = weight_of(sh.m[w][tid], max);
      sh.weight[w][tid] = wt;
      sum += sh.l[w][tid] * wt;
    }
    sh.head_m[tid] = max;
    sh.head_l[tid] = sum;
  }
  __syncthreads();
  const int total = heads * hd;
  float* out = P.out + (static_cast<std::int64_t>(r.qi) * P.n_heads + head0) * hd;
  if (r.n_splits == 1) {
    for (int i = tid; i < heads_valid * hd; i += blockDim.x) {
      const int h = i / hd;
      out[i] = cta_value(sh, i, h) / sh.head_l[h];
    }
    return;
  }

  const std::int64_t slot0 =
      (static_cast<std::int64_t>(r.qi) * gridDim.y + blockIdx.y) * P.max_splits;
  float* ws_o = P.ws_o + slot0 * total;          // [max_splits][heads * hd]
  float* ws_ml = P.ws_ml + slot0 * heads * 2;    // [max_splits][heads][m, l]
  for (int i = tid; i < total; i += blockDim.x)
    ws_o[static_cast<std::int64_t>(r.split) * total + i] = cta_value(sh, i, i / hd);
  if (tid < heads) {
    ws_ml[(r.split * heads + tid) * 2] = sh.head_m[tid];
    ws_ml[(r.split * heads + tid) * 2 + 1] = sh.head_l[tid];
  }
  // Publish the partial before counting this split in.
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    unsigned* counter = P.counters + static_cast<std::int64_t>(r.qi) * gridDim.y + blockIdx.y;
    const unsigned arrived = atomicAdd(counter, 1u);
    sh.last = arrived == static_cast<unsigned>(r.n_splits - 1);
    // Every other split has counted itself in: reset for the next launch.
    if (sh.last) *counter = 0;
  }
  __syncthreads();
  if (!sh.last) return;
  __threadfence();

  // Every split's (m, l) at once, then one warp per head: the maximum, each
  // split's weight (in place of its maximum) and the weighted sum, reduced
  // in a fixed lane order.
  const int n = r.n_splits;
  for (int i = tid; i < n * heads; i += blockDim.x) {
    sh.split_m[i] = __ldcg(ws_ml + 2 * i);
    sh.split_l[i] = __ldcg(ws_ml + 2 * i + 1);
  }
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < heads) {
    float max = -INFINITY;
    for (int s = lane; s < n; s += 32) max = fmaxf(max, sh.split_m[s * heads + warp]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) max = fmaxf(max, __shfl_xor_sync(kFullMask, max, off));
    float sum = 0.0f;
    for (int s = lane; s < n; s += 32) {
      const float wt = weight_of(sh.split_m[s * heads + warp], max);
      sh.split_m[s * heads + warp] = wt;
      sum += sh.split_l[s * heads + warp] * wt;
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
    if (lane == 0) sh.head_l[warp] = sum;
  }
  __syncthreads();
  // Each output element sums the splits in split order; the loads of
  // several splits are in flight at once.
  if ((hd & 3) == 0) {
    const int units = total / 4;
    const float4* src = reinterpret_cast<const float4*>(ws_o);
    for (int u = tid; u < heads_valid * hd / 4; u += blockDim.x) {
      const int h = 4 * u / hd;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
      for (int s = 0; s < n; ++s) {
        const float4 x = __ldcg(src + static_cast<std::int64_t>(s) * units + u);
        const float wt = sh.split_m[s * heads + h];
        acc.x += x.x * wt;
        acc.y += x.y * wt;
        acc.z += x.z * wt;
        acc.w += x.w * wt;
      }
      const float l = sh.head_l[h];
      reinterpret_cast<float4*>(out)[u] = make_float4(acc.x / l, acc.y / l, acc.z / l, acc.w / l);
    }
  } else {
    for (int i = tid; i < heads_valid * hd; i += blockDim.x) {
      const int h = i / hd;
      float acc = 0.0f;
#pragma unroll 8
      for (int s = 0; s < n; ++s)
        acc += __ldcg(ws_o + static_cast<std::int64_t>(s) * total + i) * sh.split_m[s * heads + h];
      out[i] = acc / sh.head_l[h];
    }
  }
}

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
//  - QK^T: A = query halves, k index <-> dims 32t + 4s + {0..3} in k-step s
//    (a permutation of the dims that both operands share), so the lane
//    loads dims [32t, 32t + 32) of its query and of key row g (8 + g) with
//    16-byte loads and needs no shuffles. Scores land as S[query g][keys
//    2t, 2t+1] (and 8 + ...).
//  - PV: A = the probabilities exactly where the scores landed; B = V with
//    n index <-> dim 16g + j in dim-tile j, so the lane loads dims
//    [16g, 16g + 16) of rows 2t, 2t+1, 2t+8, 2t+9 and pairs rows with one
//    byte permute per register. Output lands as O[query g][dims 16(2t) + j
//    and 16(2t+1) + j].
// A query's arithmetic is the same instruction sequence whatever else the
// warp holds: the other rows of an MMA never enter its dot products.

__device__ __forceinline__ void mma16816(float (&d)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
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

__global__ void __launch_bounds__(kAttendThreads, 1) attend_hd128_kernel(const AttendParams P) {
  constexpr int HD = kTensorHeadDim;
  __shared__ Shared sh;
  QueryRange r;
  if (!query_range(P, r)) return;
  const int group = P.n_heads / P.n_kv_heads;
  const int sets = (group + kTensorHeads - 1) / kTensorHeads;
  const int kv_head = static_cast<int>(blockIdx.y) / sets;
  const int set = static_cast<int>(blockIdx.y) - kv_head * sets;
  const int head0 = kv_head * group + set * kTensorHeads;
  const int heads_valid = min(kTensorHeads, group - set * kTensorHeads);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;

  // Query g's dims [32t, 32t + 32), scaled by a power of two (exact) so its
  // largest element lies in [2^14, 2^15): the lo halves then stay normal
  // f16 for every element that matters, whatever the query's magnitude.
  float qv[32];
  if (g < heads_valid) {
    const float4* src = reinterpret_cast<const float4*>(
        P.q + (static_cast<std::int64_t>(r.qi) * P.n_heads + head0 + g) * HD + 32 * t);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 x = src[i];
      qv[4 * i] = x.x;
      qv[4 * i + 1] = x.y;
      qv[4 * i + 2] = x.z;
      qv[4 * i + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) qv[i] = 0.0f;
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(qv[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
  int exponent = 0;
  frexpf(amax, &exponent);  // amax in [2^(exponent-1), 2^exponent)
  const int shift = 15 - exponent;
  std::uint32_t qa[8][4];
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const Halves a = split_f16(ldexpf(qv[4 * s], shift));
    const Halves b = split_f16(ldexpf(qv[4 * s + 1], shift));
    const Halves c = split_f16(ldexpf(qv[4 * s + 2], shift));
    const Halves d = split_f16(ldexpf(qv[4 * s + 3], shift));
    qa[s][0] = pack(a.hi, b.hi);  // row g,     k 2t, 2t+1   <- dims 32t + 4s + {0, 1}
    qa[s][1] = pack(a.lo, b.lo);  // row g + 8, k 2t, 2t+1
    qa[s][2] = pack(c.hi, d.hi);  // row g,     k 2t+8, 2t+9 <- dims 32t + 4s + {2, 3}
    qa[s][3] = pack(c.lo, d.lo);  // row g + 8, k 2t+8, 2t+9
  }
  const float score_scale = ldexpf(P.scale_log2, -shift);

  std::int64_t a, b;
  warp_rows(r, warp, a, b);
  float m = -INFINITY;  // uniform over the 4 lanes of query g
  float l = 0.0f;       // this lane's share of query g's weight sum
  float o[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

#pragma unroll 1
  for (std::int64_t base = a; base < b; base += kAttendTile) {
    // The rows of the tile after next into L2: more bytes in flight than
    // the registers of one tile hold.
    const std::int64_t ahead = base + 2 * kAttendTile;
    if (ahead < b) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const std::int64_t L = ahead + nt * 8 + g;
        if (L < b) prefetch_l2(row_at(P, L, kv_head).k + 32 * t);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t L = ahead + 2 * t + (j & 1) + (j >> 1) * 8;
        if (L < b) prefetch_l2(row_at(P, L, kv_head).v + 16 * g);
      }
    }
    // K rows g and 8 + g, dims [32t, 32t + 32).
    uint4 kr[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const std::int64_t L = base + nt * 8 + g;
      if (L < b) {
        const uint4* src = reinterpret_cast<const uint4*>(row_at(P, L, kv_head).k + 32 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) kr[nt][i] = __ldg(src + i);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) kr[nt][i] = make_uint4(0, 0, 0, 0);
      }
    }
    // V rows 2t, 2t+1, 2t+8, 2t+9, dims [16g, 16g + 16). Rows past the
    // range read as zero: their probability is 0, and 0 * V must not be
    // NaN from whatever the plane holds there.
    uint4 vr[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t L = base + 2 * t + (j & 1) + (j >> 1) * 8;
      if (L < b) {
        const uint4* src = reinterpret_cast<const uint4*>(row_at(P, L, kv_head).v + 16 * g);
        vr[j][0] = __ldg(src);
        vr[j][1] = __ldg(src + 1);
      } else {
        vr[j][0] = vr[j][1] = make_uint4(0, 0, 0, 0);
      }
    }

    float x[4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < 8; ++s) mma16816(c, qa[s], word(kr[nt], 2 * s), word(kr[nt], 2 * s + 1));
      x[2 * nt] = (c[0] + c[2]) * score_scale;      // key base + 8nt + 2t
      x[2 * nt + 1] = (c[1] + c[3]) * score_scale;  // key base + 8nt + 2t + 1
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (base + (i >> 1) * 8 + 2 * t + (i & 1) >= b) x[i] = -INFINITY;

    float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = weight_of(m, m_new);
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = weight_of(x[i], m_new);
    l = l * alpha + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
    m = m_new;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[j][0] *= alpha;
      o[j][1] *= alpha;
      o[j][2] *= alpha;
      o[j][3] *= alpha;
    }
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
    for (int j = 0; j < 16; ++j) {
      // Dim 16g + j of rows (2t, 2t+1) and (2t+8, 2t+9), paired.
      const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
      const std::uint32_t b0 = __byte_perm(word(vr[0], j >> 1), word(vr[1], j >> 1), sel);
      const std::uint32_t b1 = __byte_perm(word(vr[2], j >> 1), word(vr[3], j >> 1), sel);
      mma16816(o[j], pa, b0, b1);
    }
  }

  // Each lane summed its own keys; add the 4 lanes of query g in a fixed
  // butterfly (a + b == b + a, so all 4 lanes hold the same bits).
  l += __shfl_xor_sync(kFullMask, l, 1);
  l += __shfl_xor_sync(kFullMask, l, 2);
  if (t == 0) {
    sh.m[warp][g] = m;
    sh.l[warp][g] = l;
  }
  float* so = sh.o[warp] + g * HD;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    so[16 * (2 * t) + j] = o[j][0] + o[j][2];
    so[16 * (2 * t + 1) + j] = o[j][1] + o[j][3];
  }
  __syncthreads();
  finish(P, sh, r, kTensorHeads, heads_valid, head0);
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

__global__ void __launch_bounds__(kAttendThreads) attend_general_kernel(const AttendParams P) {
  __shared__ Shared sh;
  QueryRange r;
  if (!query_range(P, r)) return;
  const int hd = P.head_dim;
  const int head = static_cast<int>(blockIdx.y);
  const int kv_head = head / (P.n_heads / P.n_kv_heads);
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;

  float qv[kGeneralDimsPerLane];
  const float* q = P.q + (static_cast<std::int64_t>(r.qi) * P.n_heads + head) * hd;
#pragma unroll
  for (int i = 0; i < kGeneralDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < hd ? q[d] : 0.0f;
  }

  std::int64_t a, b;
  warp_rows(r, warp, a, b);
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
      if (live) row = row_at(P, base + u, kv_head);
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
    if (d < hd) sh.o[warp][d] = o[i];
  }
  __syncthreads();
  finish(P, sh, r, 1, 1, head);
}

}  // namespace

AttendGrid attend_grid(int n_heads, int n_kv_heads, int head_dim) {
  if (head_dim == kTensorHeadDim) {
    const int group = n_heads / n_kv_heads;
    return {n_kv_heads * ((group + kTensorHeads - 1) / kTensorHeads), kTensorHeads};
  }
  return {n_heads, 1};
}

std::int64_t attend_workspace_floats(int n_heads, int n_kv_heads, int head_dim, int max_splits) {
  const AttendGrid g = attend_grid(n_heads, n_kv_heads, head_dim);
  return static_cast<std::int64_t>(g.items) * max_splits * g.heads_per_item * (head_dim + 2);
}

cudaError_t launch_attend(const AttendParams& params, cudaStream_t stream) {
  if (params.n_queries <= 0) return cudaSuccess;
  const AttendGrid g = attend_grid(params.n_heads, params.n_kv_heads, params.head_dim);
  const dim3 grid(static_cast<unsigned>(params.max_splits), static_cast<unsigned>(g.items),
                  static_cast<unsigned>(params.n_queries));
  if (params.head_dim == kTensorHeadDim)
    attend_hd128_kernel<<<grid, kAttendThreads, 0, stream>>>(params);
  else
    attend_general_kernel<<<grid, kAttendThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace kvring::cuda
