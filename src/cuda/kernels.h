// The CUDA backend's kernels as the host code sees them: parameter structs,
// the split rule of attention, and launch functions that return the launch's
// cudaError_t. Nothing here synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvring/layout.h"
#include "kvring/status.h"
#include "launch_policy.h"

namespace kvring::cuda {

// Marks a launch a programmatic dependent of the work before it on its
// stream (LaunchPolicy::programmatic; such kernels begin with
// enter_dependent, ptx.cuh).
inline void programmatic_attribute(cudaLaunchAttribute& a) {
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
}

struct Shape {
  std::int32_t kv_dim = 0;
  std::int32_t head_dim = 0;
};

// Where a plane's rows lie, for one launch's layer. A sliding ring is
// token-major at `k`/`v` (the slot's ring) with `capacity` rows; a full
// plane is a block table (`table`, device memory) into a pool of blocks of
// 2^block_shift rows, head-major inside a block:
//   row r, kv_head h -> pool + table[r >> block_shift] * block_elems
//                            + (h << block_shift | r & mask) * head_dim
struct PoolGeometry {
  std::int32_t block_shift = 0;
  std::int64_t block_elems = 0;  // kv_dim << block_shift
};

// Element offset of (row, kv_head) of a full plane in its pool (layout.h's
// head-major formula inside one block).
KVRING_HD std::int64_t block_row_offset(const std::int32_t* table, PoolGeometry g,
                                        std::int32_t head_dim, std::int64_t row,
                                        std::int64_t kv_head) {
  const std::int64_t mask = (std::int64_t{1} << g.block_shift) - 1;
  return static_cast<std::int64_t>(table[row >> g.block_shift]) * g.block_elems +
         ((kv_head << g.block_shift) + (row & mask)) * head_dim;
}

// ---- Stores (f32, f16 or bf16 -> f16, round to nearest even) ------------------

// A source of rows in caller memory (device): row r at data + r * stride
// elements of dtype (0 f32, 1 f16, 2 bf16).
struct SourceRows {
  const void* data = nullptr;
  std::int64_t stride = 0;
  std::int32_t dtype = 0;
};

// One entry of the device's block-table mirror: tables[at] = block.
struct TableWrite {
  std::int64_t at = 0;
  std::int32_t block = 0;
  std::int32_t unused = 0;
};

// One span of a batched store: source rows [src_row, src_row + rows) go to
// plane rows [physical_first, ...). `k`/`v` are the slot's ring (table
// null) or the pool, row r in block table[r >> block_shift]: the plane's
// block table, or where first_id >= 0 the launch's block list from
// block_ids + first_id (the blocks from the span's first on;
// physical_first then counts from that block). first_row is the span's
// first row in the launch's concatenation of all spans (ascending).
struct StoreSpan {
  std::uint16_t* k = nullptr;
  std::uint16_t* v = nullptr;
  const std::int32_t* table = nullptr;
  std::int64_t physical_first = 0;
  std::int64_t src_row = 0;
  std::int64_t first_row = 0;
  std::int64_t first_id = -1;
};

// Every span of one batch in one launch: `spans` (device memory, n_spans
// entries, ascending first_row), or the one span `single` when spans is
// null (a launch with nothing to upload). total_rows is the sum of their
// rows. Each warp stores a contiguous range of rows, finding its first
// row's span by binary search and walking forward. `vector` selects
// 8-element units (head_dim % 8 == 0 and 16-byte aligned sources and
// strides).
struct StoreLaunch {
  const StoreSpan* spans = nullptr;
  StoreSpan single{};
  std::int32_t n_spans = 0;
  std::int64_t total_rows = 0;
  SourceRows k, v;
  Shape shape;
  PoolGeometry pool;
  bool vector = false;
  // Table writes [0, n_table_writes) into the mirror `tables`, applied by
  // the same launch: no span reads the mirror when there are any.
  const TableWrite* table_writes = nullptr;
  std::int64_t n_table_writes = 0;
  std::int32_t* tables = nullptr;
  const std::int32_t* block_ids = nullptr;
};
// `programmatic`: launched as a programmatic dependent of the work before
// it (LaunchPolicy::programmatic).
cudaError_t launch_store_spans(const StoreLaunch& launch, bool programmatic, cudaStream_t stream);

// The most bytes of parameters a launch takes (CUDA 12.1 on Volta and
// later).
inline constexpr std::size_t kMaxKernelParamBytes = 32764;

// A store launch whose descriptors travel in its parameters, with nothing
// to upload: `bytes` holds the spans (a.n_spans, from offset 0), the table
// writes (from writes_at) and the block lists (from ids_at); a.spans,
// a.table_writes and a.block_ids are set by the kernel.
constexpr std::size_t kStoreInlineBytes = 30 * 1024;

// The store's descriptor buffers: made at creation, each of at least
// kDescriptorChunkBytes; more are made while all are busy.
inline constexpr int kInitialDescriptorChunks = 4;
inline constexpr std::size_t kDescriptorChunkBytes = std::size_t{64} << 10;
struct StoreInline {
  StoreLaunch a;
  std::int64_t writes_at = 0;
  std::int64_t ids_at = 0;
  alignas(16) unsigned char bytes[kStoreInlineBytes];
};
static_assert(sizeof(StoreInline) <= kMaxKernelParamBytes, "a launch's parameters take at most 32764 bytes");
cudaError_t launch_store_inline(const StoreInline& launch, bool programmatic, cudaStream_t stream);

// Source rows [0, rows) of K and of V -> f16 [rows, cols] packed, K's at
// dst and V's after them (the prefill chunk), with the store's conversion;
// one launch. `vector`: cols % 8 == 0 and 16-byte aligned sources and
// strides.
cudaError_t launch_convert_kv(SourceRows k, SourceRows v, std::int64_t rows, std::int32_t cols,
                              bool vector, std::uint16_t* dst, cudaStream_t stream);

// ---- Block tables ------------------------------------------------------------

// Applies writes [0, n), all of one batched operation's table changes in
// one launch.
cudaError_t launch_table_writes(const TableWrite* writes, std::int64_t n, std::int32_t* tables,
                                cudaStream_t stream);

// ---- Ring rows -----------------------------------------------------------------

// `elems` f16 elements at `dst`: zeros when `src` is null, else those at
// `src` (which do not overlap them).
struct FillSegment {
  std::uint16_t* dst = nullptr;
  const std::uint16_t* src = nullptr;
  std::int64_t elems = 0;
};
inline constexpr int kFillSegments = 1024;
struct FillLaunch {
  std::int32_t n = 0;
  FillSegment segments[kFillSegments];
};
static_assert(sizeof(FillLaunch) <= kMaxKernelParamBytes, "a launch's parameters take at most 32764 bytes");
// Segments [0, launch.n) in one launch: each block moves 16 bytes a thread
// where the segment's addresses and length allow, else 2.
cudaError_t launch_fill_segments(const FillLaunch& launch, cudaStream_t stream);

// ---- Snapshot copies ----------------------------------------------------------

// Logical rows of a plane as (at most) two physical spans: row j of the
// sequence sits at physical[0] + j for j < rows0, else physical[1] + j - rows0.
struct SpanMap {
  std::int64_t physical[2] = {0, 0};
  std::int64_t rows0 = 0;
};

// One buffer (K or V) of a plane: a ring (table null) or the pool.
struct PlaneBuf {
  std::uint16_t* base = nullptr;
  const std::int32_t* table = nullptr;
};

// Rows [first, first + rows) of a plane to/from token-major f16 [rows, kv_dim].
cudaError_t launch_gather_rows(PlaneBuf plane, Shape shape, PoolGeometry pool, SpanMap map,
                               std::int64_t first, std::int64_t rows, std::uint16_t* out,
                               cudaStream_t stream);
cudaError_t launch_scatter_rows(PlaneBuf plane, Shape shape, PoolGeometry pool, SpanMap map,
                                std::int64_t first, std::int64_t rows, const std::uint16_t* in,
                                cudaStream_t stream);

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
// logical order: not on the ring's rotation, the block its rows lie in,
// the chunk the query came in, the other queries of the launch, the order
// CTAs ran in, or which path the splits met on (a resident grid's tagged
// partials, a cluster's shared memory or the global workspace).
// At most kAttendMaxSplits splits of a KV head and at least
// kAttendMinSplitRows rows a split (one tile a warp); docs/CUDA.md, "The
// split rule", gives the reasons.
inline constexpr int kAttendWarps = 8;
inline constexpr int kAttendThreads = 32 * kAttendWarps;
// The warp-split kernel's CTAs are of kWarpSplitWarps warps, two an SM, so
// that one CTA's start (the query, its first tiles) and end (the arrival,
// a combine) overlap the other's stream (attend_hd128.cuh).
inline constexpr int kWarpSplitWarps = 4;
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

// The split count is not monotonic in n. Split rows are kAttendMinSplitRows
// x m for n in (B (m - 1), B m], B = kAttendMaxSplits x kAttendMinSplitRows:
// within each such band the count grows with n, up to kAttendMaxSplits at
// n = B m, and it drops just past (8193 rows: 33 splits of 256). So the
// most splits of a range of n reach kAttendMaxSplits wherever the range
// holds a multiple of B, and the fewest are at its start or just past its
// first multiple of B (the counts just past B m, m = 1, 2, ..., grow with
// m). A launch sizes grids and workspaces by these, not by its ends.
static_assert(kAttendMinSplitRows == kAttendWarps * kAttendTile,
              "split rows are whole multiples of the minimum: the bands below");
inline constexpr std::int64_t kAttendSplitBand = kAttendMaxSplits * kAttendMinSplitRows;
// The most splits of any n in [n0, n1] (1 <= n0 <= n1).
constexpr std::int64_t attend_splits_most(std::int64_t n0, std::int64_t n1) {
  const std::int64_t top = n1 / kAttendSplitBand * kAttendSplitBand;
  return top >= n0 && top > 0 ? attend_splits(top) : attend_splits(n1);
}
// The fewest splits of any n in [n0, n1] (1 <= n0 <= n1).
constexpr std::int64_t attend_splits_least(std::int64_t n0, std::int64_t n1) {
  const std::int64_t band_end = (n0 + kAttendSplitBand - 1) / kAttendSplitBand * kAttendSplitBand;
  const std::int64_t at_start = attend_splits(n0);
  if (band_end + 1 > n1) return at_start;
  const std::int64_t past = attend_splits(band_end + 1);
  return past < at_start ? past : at_start;
}
static_assert(attend_splits(8192) == 64 && attend_splits(8193) == 33 && attend_splits_most(8000, 8300) == 64 &&
              attend_splits_least(8000, 8300) == 33);

// A query with more than kAttendSingleLevel splits combines them in two
// levels: each group of kAttendGroup consecutive splits, then the groups in
// group order (so one CTA never reads more than a few partials). The tree
// is a function of the split count alone.
inline constexpr int kAttendSingleLevel = 16;
inline constexpr int kAttendGroup = 8;
KVRING_HD constexpr int attend_groups(int n_splits) {
  return n_splits > kAttendSingleLevel ? (n_splits + kAttendGroup - 1) / kAttendGroup : 0;
}
// Partial slots per (query, work item): one per split, one per group.
KVRING_HD constexpr int attend_slots(int max_splits) {
  return max_splits + attend_groups(max_splits);
}
// Arrival counters per (query, work item): the item's, then one per group.
KVRING_HD constexpr int attend_counters(int max_splits) { return 1 + attend_groups(max_splits); }

// head_dim 128 runs on tensor cores (a warp takes 8 query heads of one KV
// head); every other head_dim up to 256 on a general kernel.
inline constexpr int kTensorHeadDim = 128;
inline constexpr int kTensorHeads = 8;
inline constexpr int kGeneralMaxHeadDim = 256;

// One item of a batched attention launch (device memory): queries
// q_first .. q_first + n_queries - 1 of the launch (rows of q and out) at
// logical positions first_position + i, of one sequence's plane read
// through its ring state as before the chunk. Items are in ascending
// q_first and cover the launch's queries without gaps.
struct AttendQueryItem {
  // A sliding ring: the slot's ring (token-major, `capacity` rows, logical
  // L at L + shift, less capacity past the end). A full plane: the pool and
  // the plane's block table (device mirror); shift 0.
  const std::uint16_t* k;
  const std::uint16_t* v;
  const std::int32_t* table;
  std::int64_t shift;
  std::int64_t capacity;
  std::int64_t first_position;
  // Rows from chunk_start on come from the chunk (f16 [rows, kv_dim]), row
  // L at chunk_row + L - chunk_start.
  std::int64_t chunk_start;
  std::int64_t chunk_row;
  std::int32_t q_first;
  std::int32_t n_queries;
  // The item's split bound (the most splits of any of its queries,
  // attend_splits_most): its queries' workspace slots and counters are that many
  // apart, from ws_slot (in units of one (query, slot) of every work item)
  // and ws_counter (one (query) of every work item's counters) on.
  std::int32_t max_splits;
  std::int64_t ws_slot;
  std::int64_t ws_counter;
};
// The most items a launch of the f32 numeric carries in its parameters
// (InlineArgs, attend_rows.cuh); a launch of more reads them from a
// descriptor upload.
inline constexpr int kAttendInlineItems = 128;

// The clock of resident grids, in device memory after their tagged words
// (docs/CUDA.md, "The resident clock"). The low 32 bits of `count` are the
// epoch of the next resident launch (never 0), bit 32 the half of the
// tagged words it uses. Every CTA of a resident launch reads `count` first
// and counts itself in at `readers`; the last to do so sets `readers` back
// to 0 and advances `count` for the next launch. So the epoch lives on the
// device, and a launch captured into a CUDA graph takes a new one at every
// replay.
struct ResidentClock {
  unsigned long long count;
  unsigned readers;
  unsigned unused;
};
static_assert(sizeof(ResidentClock) == 16, "two 64-bit words after the tagged words");

struct AttendParams {
  // The launch's items (device memory), or its one item `single` when
  // items is null (a launch with nothing to upload; n_items is then 1).
  const AttendQueryItem* items = nullptr;
  AttendQueryItem single{};
  std::int32_t n_items = 0;
  // The block of the first row of each of the first first_blocks_n splits
  // of the launch's one query, as its table held it when the launch was
  // enqueued (0: none).
  std::int32_t first_blocks_n = 0;
  std::int32_t first_blocks[kAttendMaxSplits] = {};
  std::int32_t full = 0;  // the layer's planes are block tables
  PoolGeometry pool;
  // The chunk's rows, f16 [rows, kv_dim] (null in decode).
  const std::uint16_t* chunk_k = nullptr;
  const std::uint16_t* chunk_v = nullptr;
  // A launch of one-token prefills (own_rows = 1; f32 numeric only): each
  // item is one query whose chunk is its own row p, at row chunk_row of the
  // sources own_k, own_v. The warp that reads row p stores it to the plane
  // first (store_own_row, attend_rows.cuh), so the launch is the prefill's
  // store as well as its attention, and every row is read from the plane.
  // own_vec: the sources take 16-byte loads (head_dim % 8 == 0, aligned).
  SourceRows own_k{};
  SourceRows own_v{};
  std::int32_t own_rows = 0;
  std::int32_t own_vec = 0;
  // q, out: query i's [n_heads, head_dim] at i * stride floats (16-byte
  // aligned rows).
  const float* q = nullptr;
  float* out = nullptr;
  std::int64_t q_stride = 0;
  std::int64_t out_stride = 0;
  std::int32_t n_queries = 0;
  std::int32_t n_heads = 0;
  std::int32_t n_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t kv_dim = 0;
  std::int64_t window = 0;  // 0: full attention
  float scale_log2 = 0;     // log2(e) / sqrt(ModelConfig::score_scale_dim())
  // The layer's attention sinks in log2 units (each sink times log2(e),
  // rounded to f32), one per query head (device memory), or null: a query
  // head's outputs are then divided by its weight sum plus 2^(sink - max),
  // at the one step that writes them (sink_divisor, attend_rows.cuh).
  const float* sinks = nullptr;
  // Split and group partials and arrival counters (AttendQueryItem's
  // ws_slot, ws_counter). Counters are zero between launches: the last CTA
  // to arrive at one resets it.
  float* ws_o = nullptr;
  float* ws_ml = nullptr;
  unsigned* counters = nullptr;
  std::int32_t max_splits = 0;  // grid.x (split count bound of the launch)
  // Set by launch_attend: the splits of an item form one thread-block
  // cluster (grid.x of at most kAttendSingleLevel CTAs) and combine through
  // its shared memory; the workspace is then unused.
  std::int32_t cluster = 0;
  // Tagged partials for resident grids (null: no resident grids): two
  // halves of tagged_half words each (attend_tagged_words() per CTA for up
  // to tagged_ctas CTAs), then their clock, which gives each resident
  // launch its epoch and half (ResidentClock).
  std::uint64_t* tagged = nullptr;
  std::int64_t tagged_half = 0;
  std::int32_t tagged_ctas = 0;
  ResidentClock* clock = nullptr;
  // Set by launch_attend: every CTA of the grid is resident at once (a
  // cooperative launch), so each split stores its partial as tagged words,
  // waits for the other splits' words to carry the epoch and combines a
  // share of the output; the workspace is then unused.
  std::int32_t resident = 0;
  // The most rows one query of the launch sees (for the query-major rule),
  // and the fewest splits of any of its queries (for the rule of runs of
  // splits): host-side facts about the launch.
  std::int64_t most_rows = 0;
  std::int32_t least_splits = 0;
};

// ---- The f16 numeric ---------------------------------------------------------

// (query, head) rows of one CTA of the f16 kernel: a tile holds up to
// kF16Rows / group consecutive queries of one item, all heads of one KV
// head each.
inline constexpr int kF16Rows = 64;
KVRING_HD constexpr int f16_tile_queries(int group) { return kF16Rows / group; }
// Floats of one (query, split, head) partial in the f16 workspace: m, l,
// two unused, then the head_dim (128) unnormalized outputs.
inline constexpr int kF16PartFloats = 4 + kTensorHeadDim;

struct F16Tile {
  std::int64_t position;     // of the tile's first query
  std::int32_t item;         // its item in AttendParams
  std::int32_t q_first;      // its first query's row of q and out
  std::int32_t n_queries;
  std::int32_t first_split;  // the split of its first query's first visible row
};
struct F16Params {
  // The launch's items, planes, chunk, queries, outputs and geometry (the
  // split-path fields are unused).
  AttendParams P;
  // The launch's tiles in device memory; or, when null, the tiles of the
  // one item P.single from its tile first_tile on (P.single.q_first is
  // then the item's first query row relative to the launch's).
  const F16Tile* tiles = nullptr;
  std::int32_t first_tile = 0;
  std::int32_t n_tiles = 0;
  // CTAs with rows to read: over tiles, the splits a tile's queries see,
  // times the KV heads (host-side, for the launch rule).
  std::int64_t ctas = 0;
  std::int32_t max_splits = 0;     // grid.z: the most splits of any tile
  // Partials [query][split of the query][head][kF16PartFloats], split
  // counted from the query's first; query_splits of them a query. Unused
  // by queries of one split, whose CTAs write their outputs themselves
  // (null when every query has one).
  float* ws = nullptr;
  std::int32_t query_splits = 0;
};
// The f16 kernel over every tile, the kernel by `policy`
// (launch_policy.h), then where a query has more than one split the
// combine (two launches on `stream`).
cudaError_t launch_attend_f16(const F16Params& params, const LaunchPolicy& policy, cudaStream_t stream);

// Work items per query (grid.y) and query heads per item for a geometry.
struct AttendGrid {
  int items = 0;
  int heads_per_item = 0;
};
AttendGrid attend_grid(int n_heads, int n_kv_heads, int head_dim);

// Workspace floats of one (query, slot) over every work item: partials
// [items][heads * head_dim] and [items][heads][m, l].
std::int64_t attend_slot_floats(int n_heads, int n_kv_heads, int head_dim);

// 64-bit words of one CTA's tagged partial: [heads * head_dim] values, then
// [heads][m, l].
inline std::int64_t attend_tagged_words(int n_heads, int n_kv_heads, int head_dim) {
  return static_cast<std::int64_t>(attend_grid(n_heads, n_kv_heads, head_dim).heads_per_item) *
         (head_dim + 2);
}
// Launches attention on the current device, on the combine path and in
// the grid order `policy` gives (launch_policy.h), which counts the launch
// in policy.stats. `inline_items`: null, or the launch's params.n_items
// items (host memory, at most kAttendInlineItems), which then travel in the
// launch's parameters and params.items is not read.
cudaError_t launch_attend(const AttendParams& params, const LaunchPolicy& policy, cudaStream_t stream,
                          const AttendQueryItem* inline_items = nullptr);

// A kernel of this build runs on the current device (its image was built
// for the device's architecture); false with the error cleared otherwise.
bool kernels_run_here();

// The capability check of store creation for GPU `device` (`name`, compute
// capability major.minor) on which this build's kernels do or do not run:
// ok, or kUnsupported naming the capability and the build's targets
// (cuda_store.cc).
Status capability_status(int device, const char* name, int major, int minor, bool kernels_run);

// Whether the f16 numeric's kernels (wgmma, which only sm_90a code has)
// run on a device of compute capability major.minor with a build for
// `targets` (KVRING_CUDA_GENCODE): ok on a 9.0 device where the targets
// include 90a; else kUnsupported naming both (cuda_store.cc).
Status f16_numeric_status(int major, int minor, const char* targets);

}  // namespace kvring::cuda
