// CPU attention over a plane and an optional chunk, in logical order.
#pragma once

#include <cstdint>

#include "kvring/layout.h"
#include "kvring/ring.h"

namespace kvring::cpu {

// Rows of one plane as the attention reads them: a token-major ring
// (k, v [capacity * kv_dim]), or head-major blocks of block_rows rows from a
// pool (k, v the pool; physical row r in block blocks[r / block_rows], at
// (kv_head * block_rows + r % block_rows) * head_dim inside it).
struct PlaneView {
  const std::uint16_t* k;
  const std::uint16_t* v;
  Layout layout;
  std::int64_t capacity;
  std::int64_t kv_dim;
  std::int64_t head_dim;
  const std::int32_t* blocks = nullptr;  // head-major planes
  std::int64_t block_rows = 0;
};

// Offset of the head row (physical row, kv_head) in a plane's buffers.
inline std::int64_t head_row_offset(const PlaneView& p, std::int64_t physical,
                                    std::int64_t kv_head) {
  if (p.layout == Layout::kTokenMajor) return physical * p.kv_dim + kv_head * p.head_dim;
  const std::int64_t block = p.blocks[physical / p.block_rows];
  return block * p.block_rows * p.kv_dim +
         (kv_head * p.block_rows + physical % p.block_rows) * p.head_dim;
}

struct AttentionShape {
  std::int64_t n_heads;
  std::int64_t n_kv_heads;
  std::int64_t head_dim;
  std::int64_t window;  // 0: full attention
  double scale_dim;     // scores are q . k / sqrt(scale_dim) (ModelConfig::score_scale_dim)
  // Attention sinks: one finite logit per query head, in the units of the
  // scaled scores, added to each softmax's denominator only (null: none).
  const float* sinks = nullptr;
};

// Rows of one split of a query's visible range of `rows` rows: a function
// of the row count alone, never of threads, batch or chunking, so that a
// query's bits depend only on its own rows. Split s covers the visible rows
// [s * split_rows, (s + 1) * split_rows) (counted from the first visible
// row); the splits' partials combine in split order.
std::int64_t attend_split_rows(std::int64_t rows);

// The arithmetic a machine runs: the scalar path, AVX2 with FMA and F16C,
// or AVX-512 (F), the widest this CPU has, chosen once at start-up. A
// head_dim that is not a multiple of the vector width takes the next
// narrower path (not a multiple of 8: scalar). The paths differ in the last
// bits, so one machine always uses the same one.
enum class AttentionIsa { kScalar, kAvx2, kAvx512 };
AttentionIsa attention_isa();
// For tests: runs `isa` from now on; false (nothing changes) when this CPU
// lacks it.
bool set_attention_isa(AttentionIsa isa);

// For each query i (logical position first_position + i) and head h:
// softmax(q . K[lo..p] / sqrt(scale_dim)) . V[lo..p] with rows before chunk_start read
// from `plane` through `ring` and rows from chunk_start on from the chunk.
// Each task reads one split of one KV head's rows once for all the query
// heads of its group; each split reduces its rows in increasing logical
// order, and the splits combine in split order with one fixed arithmetic
// sequence, so the bits depend only on the query and the visible rows'
// values, not on rotation, chunking, blocks, batch or threads.
// q and out rows (one query's [n_heads, head_dim]) are q_stride and
// out_stride floats apart.
void attend(const PlaneView& plane, const RingState& ring, const AttentionShape& shape,
            std::int64_t first_position, std::int64_t n_queries, std::int64_t chunk_start,
            const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, const float* q,
            std::int64_t q_stride, float* out, std::int64_t out_stride);

// The f16 numeric (AttentionNumeric::kF16), same arguments as attend: per
// query head, the query scaled by 2^k (its largest magnitude into
// [2^14, 2^15)) and rounded to f16; s the f32 dot products with the f16
// rows and c = 2^-k log2(e) / sqrt(scale_dim); rows in splits of
// kF16AttendSplitRows and tiles of kF16AttendTile at multiples of those
// positions, each tile one step of the online softmax: m the running
// maximum of s, weights exp2(fma(s, c, -m c)) rounded to f16, their f32
// sum; splits combined in order; a zero output is +0. The GPU kernel takes
// the same steps (docs/DESIGN.md, "Attention numerics").
void attend_f16(const PlaneView& plane, const RingState& ring, const AttentionShape& shape,
                std::int64_t first_position, std::int64_t n_queries, std::int64_t chunk_start,
                const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, const float* q,
                std::int64_t q_stride, float* out, std::int64_t out_stride);

}  // namespace kvring::cpu
