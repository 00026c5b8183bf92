// The CUDA backend's kernels as the host code sees them: parameter structs,
// the split rule of attention, and launch functions that return the launch's
// cudaError_t. Nothing here synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvring/layout.h"

namespace kvring::cuda {

// One plane's device storage.
struct PlaneDev {
  std::uint16_t* k = nullptr;  // f16 bits, [capacity * kv_dim], layout-indexed
  std::uint16_t* v = nullptr;
  std::int64_t capacity = 0;
  Layout layout = Layout::kTokenMajor;
};

struct Shape {
  std::int32_t kv_dim = 0;
  std::int32_t head_dim = 0;
};

// ---- Stores (f32 -> f16, round to nearest even) -----------------------------

// Source rows [0, rows) (f32 [rows, kv_dim]) to physical rows
// [physical_first, physical_first + rows) of one plane; the caller splits a
// placement into spans, so no row wraps inside one launch. With v and
// plane.v null, only K is stored (host uploads move one buffer at a time).
cudaError_t launch_store_rows(const PlaneDev& plane, Shape shape, std::int64_t physical_first,
                              std::int64_t rows, const float* k, const float* v,
                              cudaStream_t stream);

// One token into up to kMaxLayersPerStore planes: layer i gets row i of
// k and v (f32 [n, kv_dim]) at its physical row.
inline constexpr int kMaxLayersPerStore = 64;
struct LayerRows {
  int n = 0;
  PlaneDev plane[kMaxLayersPerStore];
  std::int64_t physical[kMaxLayersPerStore];
};
cudaError_t launch_store_token_layers(const LayerRows& rows, Shape shape, const float* k,
                                      const float* v, cudaStream_t stream);

// Row spans of several planes in one launch: span i stores source rows
// [0, rows[i]) of k[i] and v[i] (f32 [rows, kv_dim]) at physical rows
// [physical[i], physical[i] + rows[i]) of plane[i]; no span wraps. At most
// kMaxSpansPerStore spans a launch, so that its parameters stay under the
// 4 KB that every toolkit takes.
inline constexpr int kMaxSpansPerStore = 48;
struct SpanRows {
  int n = 0;
  PlaneDev plane[kMaxSpansPerStore];
  std::int64_t physical[kMaxSpansPerStore];
  std::int64_t rows[kMaxSpansPerStore];
  const float* k[kMaxSpansPerStore];
  const float* v[kMaxSpansPerStore];
};
static_assert(sizeof(SpanRows) + sizeof(Shape) <= 4000, "kernel parameters over 4 KB");
cudaError_t launch_store_spans(const SpanRows& spans, Shape shape, cudaStream_t stream);

// f32 [n] -> f16 bits [n] with the store's conversion (the prefill chunk).
cudaError_t launch_convert_f16(const float* src, std::uint16_t* dst, std::int64_t n,
                               cudaStream_t stream);

// ---- Snapshot copies ----------------------------------------------------------

// Logical rows of a ring as (at most) two physical spans: row j of the
// sequence sits at physical[0] + j for j < rows0, else physical[1] + j - rows0.
struct SpanMap {
  std::int64_t physical[2] = {0, 0};
  std::int64_t rows0 = 0;
};

// Rows [first, first + rows) of the sequence of one buffer of a plane
// (`plane_buf` is the plane's K or V) to/from token-major f16 [rows, kv_dim].
cudaError_t launch_gather_rows(const std::uint16_t* plane_buf, std::int64_t capacity,
                               Layout layout, Shape shape, SpanMap map, std::int64_t first,
                               std::int64_t rows, std::uint16_t* out, cudaStream_t stream);
cudaError_t launch_scatter_rows(std::uint16_t* plane_buf, std::int64_t capacity, Layout layout,
                                Shape shape, SpanMap map, std::int64_t first, std::int64_t rows,
                                const std::uint16_t* in, cudaStream_t stream);

// ---- Attention ---------------------------------------------------------------

// A query at logical position p sees rows [lo, p] (n = p - lo + 1 rows).
// The rows are cut into splits of attend_split_rows(n) rows starting at lo,
// each split into tiles of kAttendTile rows, which its kAttendWarps warps
// take in turn (head_dim 128: warp w takes tiles w, w + 8, ...) or in
// ranges of split_rows / kAttendWarps rows (other head_dims); every
// boundary is lo plus a function of n. The splits' partial results are
// combined in a fixed tree of n alone (in split order up to
// kAttendSingleLevel splits, else in groups, below). So the
// arithmetic for a query depends only on n and the values of its rows in
// logical order: not on the ring's rotation, the chunk the query came in,
// the order CTAs ran in, or which path the splits met on (a resident grid's
// tagged partials, a cluster's shared memory or the global workspace).
// At most 64 splits of a KV head: at 131072 rows the 2 x 64 CTAs of 8 warps
// (one per SM) fill one wave of an H200's 132 SMs. At least 128 rows a
// split (one tile a warp): a 2048-row window spreads over 32 CTAs, since at
// that size every warp's chain of dependent steps, not bandwidth, sets the
// time.
inline constexpr int kAttendWarps = 8;
inline constexpr int kAttendThreads = 32 * kAttendWarps;
inline constexpr int kAttendTile = 16;
inline constexpr int kAttendMaxSplits = 64;
inline constexpr std::int64_t kAttendMinSplitRows = 128;

KVRING_HD constexpr std::int64_t attend_split_rows(std::int64_t n) {
  constexpr std::int64_t unit = kAttendWarps * kAttendTile;
  const std::int64_t per = (n + kAttendMaxSplits - 1) / kAttendMaxSplits;
  const std::int64_t rounded = (per + unit - 1) / unit * unit;
  return rounded > kAttendMinSplitRows ? rounded : kAttendMinSplitRows;
}
KVRING_HD constexpr std::int64_t attend_splits(std::int64_t n) {
  return (n + attend_split_rows(n) - 1) / attend_split_rows(n);
}

// A query with more than kAttendSingleLevel splits combines them in two
// levels: each group of kAttendGroup consecutive splits, then the groups in
// group order (so one CTA never reads more than a few partials). The tree
// is a function of the split count alone.
inline constexpr int kAttendSingleLevel = 16;
inline constexpr int kAttendGroup = 8;
KVRING_HD constexpr int attend_groups(int n_splits) {
  return n_splits > kAttendSingleLevel ? (n_splits + kAttendGroup - 1) / kAttendGroup : 0;
}
// Partial slots per (query, item) of a launch: one per split, one per group.
KVRING_HD constexpr int attend_slots(int max_splits) {
  return max_splits + attend_groups(max_splits);
}
// Arrival counters per (query, item): the item's, then one per group.
KVRING_HD constexpr int attend_counters(int max_splits) { return 1 + attend_groups(max_splits); }

// head_dim 128 runs on tensor cores (a warp takes 8 query heads of one KV
// head); every other head_dim up to 256 on a general kernel.
inline constexpr int kTensorHeadDim = 128;
inline constexpr int kTensorHeads = 8;
inline constexpr int kGeneralMaxHeadDim = 256;

struct AttendParams {
  // The plane, read through its ring state as it was before the chunk.
  const std::uint16_t* plane_k = nullptr;
  const std::uint16_t* plane_v = nullptr;
  std::int64_t capacity = 0;
  std::int32_t token_major = 1;
  std::int64_t origin_logical = 0;
  std::int64_t origin_physical = 0;
  // Rows from chunk_start on: f16 [rows, kv_dim] (null when none are read).
  const std::uint16_t* chunk_k = nullptr;
  const std::uint16_t* chunk_v = nullptr;
  std::int64_t chunk_start = 0;
  // Queries at first_position + i, i < n_queries: q, out [n_queries, n_heads, head_dim].
  const float* q = nullptr;
  float* out = nullptr;
  std::int64_t first_position = 0;
  std::int32_t n_queries = 0;
  std::int32_t n_heads = 0;
  std::int32_t n_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t kv_dim = 0;
  std::int64_t window = 0;  // 0: full attention
  float scale_log2 = 0;     // log2(e) / sqrt(head_dim)
  // Split and group partials ([query][item][attend_slots]) and arrival
  // counters ([query][item][attend_counters]). Counters are zero between
  // launches: the last CTA to arrive at one resets it.
  float* ws_o = nullptr;
  float* ws_ml = nullptr;
  unsigned* counters = nullptr;
  std::int32_t max_splits = 0;  // grid.x; the workspace's split stride
  // Set by launch_attend: the splits of an item form one thread-block
  // cluster (grid.x of at most kAttendSingleLevel CTAs) and combine through
  // its shared memory; the workspace is then unused.
  std::int32_t cluster = 0;
  // Tagged partials for resident grids: attend_tagged_words() words per
  // CTA for up to tagged_ctas CTAs (null: no resident grids), and this
  // launch's epoch, nonzero and different from every earlier launch's since
  // the words were last zeroed.
  std::uint64_t* tagged = nullptr;
  std::int32_t tagged_ctas = 0;
  std::uint32_t epoch = 0;
  // Set by launch_attend: every CTA of the grid is resident at once (a
  // cooperative launch), so each split stores its partial as tagged words,
  // waits for the other splits' words to carry the epoch and combines a
  // share of the output; the workspace is then unused.
  std::int32_t resident = 0;
};

// Work items per query (grid.y) and query heads per item for a geometry.
struct AttendGrid {
  int items = 0;
  int heads_per_item = 0;
};
AttendGrid attend_grid(int n_heads, int n_kv_heads, int head_dim);

// Workspace floats for one query of a launch whose grid.x is max_splits:
// partials [items][attend_slots][heads * head_dim], then their
// [items][attend_slots][heads][m, l].
std::int64_t attend_workspace_floats(int n_heads, int n_kv_heads, int head_dim, int max_splits);

// 64-bit words of one CTA's tagged partial: [heads * head_dim] values, then
// [heads][m, l].
inline std::int64_t attend_tagged_words(int n_heads, int n_kv_heads, int head_dim) {
  return static_cast<std::int64_t>(attend_grid(n_heads, n_kv_heads, head_dim).heads_per_item) *
         (head_dim + 2);
}
// The most CTAs of a resident grid for head_dim on the current device (0:
// attention with that head_dim never runs as one).
int attend_resident_ctas(int head_dim);

cudaError_t launch_attend(const AttendParams& params, cudaStream_t stream);

// The epoch a test set for the next launch (testing.h), once; 0: none.
std::uint32_t testing_next_epoch();

}  // namespace kvring::cuda
