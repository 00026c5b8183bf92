// Batched decode and prefill attention: every query of a batch of
// sequences in one launch, each over its own plane (a slot's sliding ring
// or a block table into the shared pool) read in place through its ring
// state, plus the rows of its prefill chunk. Each query finds its item
// (AttendQueryItem, in the launch's parameters or in device memory:
// InlineArgs): item qi in a decode, else by binary search on its index.
//
// This header: what a CTA of either kernel works on, the launch's
// arguments, its query and split, and where the rows of its KV head lie
// (docs/CUDA.md, "Attention"). The kernels are attend_hd128.cu and
// attend_general.cu, their combine combine.cuh, their launch launch.cu.
//
// Grid: x = split of the query's visible rows (a run of F.split_run
// splits), y = work item (query heads that share a KV head), z = query (x
// and z swapped in query-major launches, FirstTiles). Each warp of a CTA reduces its own rows of the
// split (kernels.h) in logical order with an online softmax. Every
// boundary is a function of the query's logical range alone (kernels.h).
//
// Numerics: f32 scores, softmax and accumulation, exp2 with the scale
// log2(e)/sqrt(score_scale_dim) folded into the scores.
#pragma once

#include <cmath>
#include <cstdint>

#include "f16_device.cuh"
#include "kernels.h"

namespace kvring::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// The launch-wide part of what a CTA needs to address its rows, computed
// once on the host from AttendParams; the per-query part comes from the
// query's item (QueryRange).
struct FirstTiles {
  std::int64_t reach;        // a query at p sees rows from max(0, p - reach)
  std::int32_t group;        // query heads per KV head
  std::int32_t sets;         // work items per KV head
  std::int32_t n_heads;
  std::int32_t read_once;    // every row is read by one CTA
  // grid.x = query and grid.z = split (else grid.x = split, grid.z =
  // query): set for last-arrival launches of several queries whose rows
  // outgrow the L2, so that the CTAs that run at once are one split's of
  // many queries, which read the same rows, and those rows come from L2
  // for all but the first. Where the L2 holds the rows, the split-major
  // order is the faster, hence the size rule (LaunchPolicy::query_major;
  // docs/PERFORMANCE.md).
  std::int32_t query_major;
  // Consecutive splits of one query each CTA takes (1 but in last-arrival
  // launches of the tensor-core kernel): CTA c takes splits [c * run,
  // c * run + run). Each split still yields its own partial, by the same
  // arithmetic, and combines in the same tree (launch.cu gives the rule).
  std::int32_t split_run;
};
// A launch's arguments: its items in device memory at P.items, or its one
// item in P.single.
struct KernelArgs {
  FirstTiles F;
  AttendParams P;
};
static_assert(sizeof(KernelArgs) <= 4000, "kernel parameters over 4 KB");
// The arguments of a launch of several items that carries them (at most
// kAttendInlineItems) in its parameters: the kernel reads them where the
// launch put them, so no upload precedes it (P.items is unused). The
// kernels take these as a __grid_constant__ parameter, whose address is a
// generic one.
struct InlineArgs {
  FirstTiles F;
  AttendParams P;
  AttendQueryItem items[kAttendInlineItems];
};
static_assert(sizeof(InlineArgs) <= kMaxKernelParamBytes, "kernel parameters over the launch's limit");

// The items a CTA searches: null for a launch of one item in P.single.
__device__ __forceinline__ const AttendQueryItem* launch_items(const KernelArgs& A) { return A.P.items; }
__device__ __forceinline__ const AttendQueryItem* launch_items(const InlineArgs& A) { return A.items; }
// Whether the launch's items are in its parameters (read before the
// programmatic wait), not in uploaded memory.
__device__ __forceinline__ bool items_in_params(const KernelArgs& A) { return A.P.items == nullptr; }
__device__ __forceinline__ bool items_in_params(const InlineArgs&) { return true; }

struct QueryRange {
  int qi;                  // query index in the launch (its row of q and out)
  std::int64_t p;          // its logical position
  std::int64_t lo;         // first visible row
  std::int64_t split_rows;
  int n_splits;
  int split;               // this CTA's split (its first, with F.split_run > 1)
  // Its plane and chunk (AttendQueryItem).
  const std::uint16_t* plane_k;
  const std::uint16_t* plane_v;
  const std::int32_t* table;
  std::int64_t shift, capacity, chunk_start, chunk_row;
  // Its workspace: slots of item_splits splits from ws_slot on, counters
  // from ws_counter on.
  int item_splits;
  std::int64_t ws_slot, ws_counter;
};

// A query's plane and chunk, from its item.
__device__ __forceinline__ void take_plane(QueryRange& r, const AttendQueryItem& it) {
  r.plane_k = it.k;
  r.plane_v = it.v;
  r.table = it.table;
  r.shift = it.shift;
  r.capacity = it.capacity;
  r.chunk_start = it.chunk_start;
  r.chunk_row = it.chunk_row;
}

// This CTA's query and split, but the split count; false when the split
// does not exist for its query (the grid is sized for the query with the
// most splits): a split exists when its first row is visible.
// `items`: launch_items.
__device__ __forceinline__ bool query_range(const FirstTiles& F, const AttendParams& P,
                                            const AttendQueryItem* items, QueryRange& r) {
  r.qi = static_cast<int>(F.query_major ? blockIdx.x : blockIdx.z);
  // Items hold their queries in order, each at least one; as many items as
  // queries (a decode) is one query an item, item qi.
  int lo = 0, hi = P.n_items - 1;
  if (P.n_items == P.n_queries) lo = hi = r.qi;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (items[mid].q_first <= r.qi) lo = mid; else hi = mid - 1;
  }
  // The one item of a launch without descriptors is read by value from the
  // parameters.
  const AttendQueryItem it = items != nullptr ? items[lo] : P.single;
  const int i = r.qi - it.q_first;
  r.p = it.first_position + i;
  r.lo = max(std::int64_t{0}, r.p - F.reach);
  r.split_rows = attend_split_rows(r.p - r.lo + 1);
  r.split = static_cast<int>(F.query_major ? blockIdx.z : blockIdx.x) * F.split_run;
  take_plane(r, it);
  r.item_splits = it.max_splits;
  r.ws_slot = it.ws_slot + static_cast<std::int64_t>(i) * attend_slots(it.max_splits);
  r.ws_counter = it.ws_counter + static_cast<std::int64_t>(i) * attend_counters(it.max_splits);
  return r.lo + r.split * r.split_rows <= r.p;
}
// The query's split count: a division, which the tensor-core kernel does
// with the rest of its setup (before its programmatic wait where its items
// are in its parameters).
__device__ __forceinline__ int split_count(const QueryRange& r) {
  return static_cast<int>((r.p - r.lo + r.split_rows) / r.split_rows);
}

// Rows [a, b) of the CTA's split.
__device__ __forceinline__ void split_rows_of(const QueryRange& r, std::int64_t& a,
                                              std::int64_t& b) {
  a = r.lo + r.split * r.split_rows;
  b = min(a + r.split_rows, r.p + 1);
}

// The general kernel's warps: rows [a, b) of warp `warp` (possibly empty),
// a multiple of kAttendTile rows from lo.
__device__ __forceinline__ void warp_rows(const QueryRange& r, int warp, std::int64_t& a,
                                          std::int64_t& b) {
  std::int64_t split_end;
  split_rows_of(r, a, split_end);
  const std::int64_t per_warp = r.split_rows / kAttendWarps;
  a += warp * per_warp;
  b = min(a + per_warp, split_end);
}

struct RowPtr {
  const std::uint16_t* k;
  const std::uint16_t* v;
};

// Where the head rows of one KV head of one query's plane lie (layout.h's
// formulas, factored): a ring's row `physical` at physical * kv_dim +
// head_offset; a full plane's in block table[physical >> block_shift] at
// (physical & block_mask) * head_dim + head_offset inside it; chunk row i at
// (chunk_row + i) * kv_dim + chunk_offset.
struct HeadRows {
  const std::uint16_t* k;
  const std::uint16_t* v;
  const std::int32_t* table;  // null: a ring
  std::int64_t shift, capacity, chunk_start;
  std::int64_t row_stride, head_offset, chunk_offset;
  std::int64_t block_elems, block_mask;
  int block_shift;
  // A block whose entry the launch carries: block index known_index is block known_block.
  std::int64_t known_index = -1;
  std::int32_t known_block = 0;
  __device__ HeadRows(const AttendParams& P, const QueryRange& r, int head_dim, int kv_head)
      : k(r.plane_k),
        v(r.plane_v),
        table(P.full ? r.table : nullptr),
        shift(r.shift),
        capacity(r.capacity),
        chunk_start(r.chunk_start),
        row_stride(P.full ? head_dim : P.kv_dim),
        head_offset(P.full ? (static_cast<std::int64_t>(kv_head) << P.pool.block_shift) * head_dim
                           : static_cast<std::int64_t>(kv_head) * head_dim),
        chunk_offset(r.chunk_row * P.kv_dim + static_cast<std::int64_t>(kv_head) * head_dim -
                     r.chunk_start * P.kv_dim),
        block_elems(P.pool.block_elems),
        block_mask((std::int64_t{1} << P.pool.block_shift) - 1),
        block_shift(P.pool.block_shift) {}
  // Offset of plane row `physical` of the head, in k and v.
  __device__ __forceinline__ std::int64_t plane_offset(std::int64_t physical) const {
    if (table == nullptr) return physical * row_stride + head_offset;
    const std::int64_t index = physical >> block_shift;
    const std::int32_t block = index == known_index ? known_block : table[index];
    return static_cast<std::int64_t>(block) * block_elems + head_offset + (physical & block_mask) * row_stride;
  }
};

// The head row of logical position L: from the chunk when L >= chunk_start,
// else from the plane at the physical row the explicit origins give.
// Precondition: L is live in the ring or inside the chunk.
__device__ __forceinline__ RowPtr row_at(const AttendParams& P, const HeadRows& h,
                                         std::int64_t L) {
  if (L >= h.chunk_start) {
    const std::int64_t off = L * P.kv_dim + h.chunk_offset;
    return {P.chunk_k + off, P.chunk_v + off};
  }
  std::int64_t physical = L + h.shift;
  if (physical >= h.capacity) physical -= h.capacity;
  const std::int64_t off = h.plane_offset(physical);
  return {h.k + off, h.v + off};
}

// A one-token prefill's own row (AttendParams::own_rows): query r's
// position p, for KV head kv_head, from the sources to where row_at finds
// it once the chunk is stored: the ring slot p takes (the ring as before
// the chunk, so the oldest row's once the ring is full) or its place in the
// block the mirrored table names (the prefill mirrors a new block's entry
// before it launches). The lanes of the one warp that reads row p call it;
// the __syncwarp orders every lane's stores before any lane's later read.
// Where several CTAs read row p (query heads beyond one CTA's share of a KV
// head), each stores the same bits before it reads.
__device__ __forceinline__ void store_own_row(const AttendParams& P, const QueryRange& r,
                                              const HeadRows& h, int kv_head, int head_dim,
                                              int lane) {
  std::int64_t physical = r.p + h.shift;
  if (physical >= h.capacity) physical -= h.capacity;
  const std::int64_t off = h.plane_offset(physical);
  // The item's plane pointers are const for the readers; this launch owns
  // row p's bytes.
  std::uint16_t* k = const_cast<std::uint16_t*>(h.k) + off;
  std::uint16_t* v = const_cast<std::uint16_t*>(h.v) + off;
  const std::int64_t e0 = static_cast<std::int64_t>(kv_head) * head_dim;
  // Both sources are read before either store: a store may alias a source
  // as far as the compiler knows, so a load after it would wait for it.
  if (P.own_vec) {
    for (int d = lane * 8; d < head_dim; d += 32 * 8) {
      const uint4 kx = source_f16x8(P.own_k, r.chunk_row, e0 + d);
      const uint4 vx = source_f16x8(P.own_v, r.chunk_row, e0 + d);
      *reinterpret_cast<uint4*>(k + d) = kx;
      *reinterpret_cast<uint4*>(v + d) = vx;
    }
  } else {
    for (int d = lane; d < head_dim; d += 32) {
      const std::uint16_t kx = source_f16(P.own_k, r.chunk_row, e0 + d);
      const std::uint16_t vx = source_f16(P.own_v, r.chunk_row, e0 + d);
      k[d] = kx;
      v[d] = vx;
    }
  }
  __syncwarp();
}

// A query head's power-of-two scale 2^k (returned; 2^-k in `down`) for its
// largest magnitude amax: amax 2^k lies in [2^14, 2^15), k in [-126, 126],
// so both factors are normal and scaling and unscaling are exact.
__device__ __forceinline__ float query_scale(float amax, float& down) {
  // amax in [2^(e-1), 2^e) for e = biased exponent - 126.
  const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 126;
  const int shift = min(max(15 - e, -126), 126);
  down = __uint_as_float(static_cast<unsigned>(127 - shift) << 23);
  return __uint_as_float(static_cast<unsigned>(127 + shift) << 23);
}

// The softmax weight exp2(m - max) of a score or partial maximum m under
// the running maximum `max`; 0 for an empty partial (m = -inf), so no
// -inf - -inf is ever taken.
__device__ __forceinline__ float weight_of(float m, float max) {
  return m == -INFINITY ? 0.0f : exp2f(m - max);
}

// The divisor of query head h's outputs: its weight sum `sum` at the
// maximum `max` (log2 units), plus its attention sink's weight
// 2^(sinks[h] - max) where the layer has sinks (AttendParams::sinks, log2
// units; null: none, and the divisor is `sum` itself). A sink more than
// 128 log2 units above the maximum makes the divisor inf and the outputs
// 0; a sink of -inf adds exactly 0.
__device__ __forceinline__ float sink_divisor(float sum, float max, const float* sinks, int h) {
  return sinks == nullptr ? sum : sum + exp2f(sinks[h] - max);
}
// The launch's sinks from query head head0 on (null: none). Taken where
// an output is written, not held through a kernel's row loop.
__device__ __forceinline__ const float* sinks_from(const AttendParams& P, int head0) {
  return P.sinks != nullptr ? P.sinks + head0 : nullptr;
}
__device__ __forceinline__ float4 divided(float4 a, float d) {
  return make_float4(a.x / d, a.y / d, a.z / d, a.w / d);
}

}  // namespace kvring::cuda
