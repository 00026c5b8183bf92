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

// Where the head rows of one KV head lie: plane row `physical` at
// physical * row_stride + head_offset (layout.h's formulas, factored), chunk
// row i at i * kv_dim + chunk_offset.
struct HeadRows {
  std::int64_t row_stride, head_offset, chunk_offset;
  __device__ HeadRows(const AttendParams& P, int kv_head) {
    const Layout layout = P.token_major ? Layout::kTokenMajor : Layout::kHeadMajor;
    row_stride = static_cast<std::int64_t>(plane_row_stride(
        layout, static_cast<std::uint64_t>(P.kv_dim), static_cast<std::uint64_t>(P.head_dim)));
    head_offset = static_cast<std::int64_t>(plane_head_row(
        layout, 0, static_cast<std::uint64_t>(kv_head), static_cast<std::uint64_t>(P.kv_dim),
        static_cast<std::uint64_t>(P.head_dim), static_cast<std::uint64_t>(P.capacity)));
    chunk_offset = static_cast<std::int64_t>(kv_head) * P.head_dim;
  }
};

// The head row of logical position L: from the chunk when L >= chunk_start,
// else from the plane at the physical row the explicit origins give.
// Precondition: L is live in the ring or inside the chunk.
__device__ __forceinline__ RowPtr row_at(const AttendParams& P, const HeadRows& h, std::int64_t L) {
  if (L >= P.chunk_start) {
    const std::int64_t off = (L - P.chunk_start) * P.kv_dim + h.chunk_offset;
    return {P.chunk_k + off, P.chunk_v + off};
  }
  std::int64_t physical = P.origin_physical + (L - P.origin_logical);
  if (physical >= P.capacity) physical -= P.capacity;
  const std::int64_t off = physical * h.row_stride + h.head_offset;
  return {P.plane_k + off, P.plane_v + off};
}

// Partials of the warps of one CTA, then of the splits of one item.
struct Shared {
  float m[kAttendWarps][kTensorHeads];  // running max (log2 units)
  float l[kAttendWarps][kTensorHeads];  // sum of weights
  float weight[kAttendWarps][kTensorHeads];
  float head_m[kTensorHeads];
  float head_l[kTensorHeads];
  // [split * heads + head]: the splits' maxima, then their weights.
  float split_m[kAttendMaxSplits * kTensorHeads];
  float split_l[kAttendMaxSplits * kTensorHeads];
  int last;
};
// Each warp's unnormalised output, [head * head_dim + dim], lies at
// o + warp * stride (floats) in shared memory.
struct WarpOutputs {
  const float* o;
  int stride;
};
static_assert(kTensorHeads <= kAttendWarps, "one warp per head in the final combine");

__device__ __forceinline__ float weight_of(float m, float max) {
  return m == -INFINITY ? 0.0f : exp2f(m - max);
}

// Element i (head h) of the CTA's result: its warps combined in warp order.
__device__ __forceinline__ float cta_value(const Shared& sh, WarpOutputs wo, int i, int h) {
  float o = 0.0f;
#pragma unroll
  for (int w = 0; w < kAttendWarps; ++w) o += wo.o[w * wo.stride + i] * sh.weight[w][h];
  return o;
}

// Combines the CTA's warp partials (in sh, after a barrier) for `heads`
// query heads head0.. of `heads_valid` real ones, and either writes the
// output (one split) or the split's partial; the last split of the item to
// arrive combines all partials in split order and writes the output.
__device__ void finish(const AttendParams& P, Shared& sh, WarpOutputs wo, const QueryRange& r,
                       int heads, int heads_valid, int head0) {
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
      out[i] = cta_value(sh, wo, i, h) / sh.head_l[h];
    }
    return;
  }

  const std::int64_t slot0 =
      (static_cast<std::int64_t>(r.qi) * gridDim.y + blockIdx.y) * P.max_splits;
  float* ws_o = P.ws_o + slot0 * total;          // [max_splits][heads * hd]
  float* ws_ml = P.ws_ml + slot0 * heads * 2;    // [max_splits][heads][m, l]
  for (int i = tid; i < total; i += blockDim.x)
    ws_o[static_cast<std::int64_t>(r.split) * total + i] = cta_value(sh, wo, i, i / hd);
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
//  - QK^T: A = query halves; in k-step s = 2i + e the k index <-> dims
//    32i + 8t + 4e + {0..3} (a permutation of the dims that both operands
//    share), so the lane holds dims {32i + 8t + [0, 8)} of its query and of
//    key rows g and 8 + g: four 16-byte pieces a row, which the 4 lanes of a
//    row fetch as 64 contiguous bytes. No shuffles. Scores land as
//    S[query g][keys 2t, 2t+1] (and 8 + ...).
//  - PV: A = the probabilities exactly where the scores landed; B = V with
//    n index <-> dim 64h + 8g + e in dim-tile j = 8h + e, so the lane holds
//    dims {64h + 8g + [0, 8)} of rows 2t, 2t+1, 2t+8, 2t+9 (the 8 lanes of
//    a row fetch 128 contiguous bytes per h) and pairs rows with one byte
//    permute per register. Output lands as O[query g][dims 64h + 8(2t) + e
//    and 64h + 8(2t+1) + e].
// A query's arithmetic is the same instruction sequence whatever else the
// warp holds: the other rows of an MMA never enter its dot products.

__device__ __forceinline__ void mma16816(float (&d)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// cp.async: 16 bytes global -> shared without registers; a source size of 0
// writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
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
// 170 registers a lane) could not keep in flight alone. A lane copies exactly
// the 16-byte pieces it later reads (16 per tile: 8 of K, 8 of V), so
// cp.async.wait_group alone orders them; slot (stage, piece, lane) keeps the
// lanes of a warp on consecutive 16-byte words.
constexpr int kStages = 3;
constexpr int kPieces = 16;
constexpr int kWarpArea = kStages * kPieces * 32;  // uint4 per warp

struct TensorSmem {
  Shared sh;
  uint4 area[kAttendWarps][kWarpArea];  // per warp; its output partial after the loop
};
static_assert(kTensorHeads * kTensorHeadDim * sizeof(float) <= kWarpArea * sizeof(uint4));

// Enqueues the tile at `base` (rows < b) into stage `stage` of a lane's slots.
__device__ __forceinline__ void issue_tile(const AttendParams& P, const HeadRows& rows,
                                           std::int64_t base, std::int64_t b, uint4* area,
                                           int stage, int lane, int g, int t) {
  uint4* slots = area + stage * kPieces * 32 + lane;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {  // K rows g and 8 + g, dims 32i + 8t + [0, 8)
    const std::int64_t L = base + nt * 8 + g;
    const bool ok = L < b;
    const std::uint16_t* src = ok ? row_at(P, rows, L).k + 8 * t : P.plane_k;
#pragma unroll
    for (int i = 0; i < 4; ++i) cp_async16(slots + (nt * 4 + i) * 32, src + (ok ? 32 * i : 0), ok);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // V rows 2t, 2t+1, 2t+8, 2t+9, dims 64h + 8g + [0, 8)
    const std::int64_t L = base + 2 * t + (j & 1) + (j >> 1) * 8;
    const bool ok = L < b;
    const std::uint16_t* src = ok ? row_at(P, rows, L).v + 8 * g : P.plane_k;
#pragma unroll
    for (int h = 0; h < 2; ++h) cp_async16(slots + (8 + 2 * j + h) * 32, src + (ok ? 64 * h : 0), ok);
  }
}

__global__ void __launch_bounds__(kAttendThreads, 1) attend_hd128_kernel(const AttendParams P) {
  constexpr int HD = kTensorHeadDim;
  extern __shared__ uint4 smem_raw[];
  TensorSmem& S = *reinterpret_cast<TensorSmem*>(smem_raw);
  Shared& sh = S.sh;
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

  // The first tiles go out before the query comes in.
  std::int64_t a, b;
  warp_rows(r, warp, a, b);
  const HeadRows rows(P, kv_head);
  uint4* area = S.area[warp];
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (a + st * kAttendTile < b) issue_tile(P, rows, a + st * kAttendTile, b, area, st, lane, g, t);
    cp_async_commit();
  }

  // Query g's dims 32i + 8t + [0, 8) as qv[8i + ...], scaled by a power of two (exact) so its
  // largest element lies in [2^14, 2^15): the lo halves then stay normal
  // f16 for every element that matters, whatever the query's magnitude.
  float qv[32];
  if (g < heads_valid) {
    const float4* src = reinterpret_cast<const float4*>(
        P.q + (static_cast<std::int64_t>(r.qi) * P.n_heads + head0 + g) * HD + 8 * t);
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
  for (std::int64_t base = a; base < b; base += kAttendTile) {
    {
      // Refill the stage the previous tile was read from.
      const std::int64_t ahead = base + (kStages - 1) * kAttendTile;
      const int st = stage == 0 ? kStages - 1 : stage - 1;
      if (ahead < b) issue_tile(P, rows, ahead, b, area, st, lane, g, t);
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();  // this tile's group is complete
    const uint4* slots = area + stage * kPieces * 32 + lane;
    uint4 kr[2][4];
    uint4 vr[4][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) kr[i >> 2][i & 3] = slots[i * 32];
#pragma unroll
    for (int i = 0; i < 8; ++i) vr[i >> 1][i & 1] = slots[(8 + i) * 32];
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
      // Dim 64(j/8) + 8g + j%8 of rows (2t, 2t+1) and (2t+8, 2t+9), paired.
      const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
      const std::uint32_t b0 = __byte_perm(word(vr[0], j >> 1), word(vr[1], j >> 1), sel);
      const std::uint32_t b1 = __byte_perm(word(vr[2], j >> 1), word(vr[3], j >> 1), sel);
      mma16816(o[j], pa, b0, b1);
    }
  }
  cp_async_wait<0>();  // nothing may still land in the area the partial reuses

  // Each lane summed its own keys; add the 4 lanes of query g in a fixed
  // butterfly (a + b == b + a, so all 4 lanes hold the same bits).
  l += __shfl_xor_sync(kFullMask, l, 1);
  l += __shfl_xor_sync(kFullMask, l, 2);
  if (t == 0) {
    sh.m[warp][g] = m;
    sh.l[warp][g] = l;
  }
  float* so = reinterpret_cast<float*>(area) + g * HD;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int d = 64 * (j >> 3) + (j & 7);
    so[d + 8 * (2 * t)] = o[j][0] + o[j][2];
    so[d + 8 * (2 * t + 1)] = o[j][1] + o[j][3];
  }
  __syncthreads();
  finish(P, sh, WarpOutputs{reinterpret_cast<const float*>(S.area[0]), kWarpArea * 4}, r,
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

__global__ void __launch_bounds__(kAttendThreads) attend_general_kernel(const AttendParams P) {
  __shared__ Shared sh;
  __shared__ float warp_o[kAttendWarps][kGeneralMaxHeadDim];
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
  const HeadRows rows(P, kv_head);
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
  finish(P, sh, WarpOutputs{warp_o[0], kGeneralMaxHeadDim}, r, 1, 1, head);
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
  if (params.head_dim == kTensorHeadDim) {
    // Beyond the 48 KB default: opt in once per process.
    static const cudaError_t opted_in = cudaFuncSetAttribute(
        attend_hd128_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(TensorSmem));
    if (opted_in != cudaSuccess) return opted_in;
    attend_hd128_kernel<<<grid, kAttendThreads, sizeof(TensorSmem), stream>>>(params);
  } else {
    attend_general_kernel<<<grid, kAttendThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

}  // namespace kvring::cuda
