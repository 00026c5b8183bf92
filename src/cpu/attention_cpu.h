// CPU attention over a plane and an optional chunk, in logical order.
#pragma once

#include <cstdint>

#include "kvring/layout.h"
#include "kvring/ring.h"

namespace kvring::cpu {

// Rows of one plane as the attention reads them.
struct PlaneView {
  const std::uint16_t* k;  // f16 bits, layout-indexed, [capacity * kv_dim]
  const std::uint16_t* v;
  Layout layout;
  std::int64_t capacity;
  std::int64_t kv_dim;
  std::int64_t head_dim;
};

struct AttentionShape {
  std::int64_t n_heads;
  std::int64_t n_kv_heads;
  std::int64_t head_dim;
  std::int64_t window;  // 0: full attention
};

// For each query i (logical position first_position + i) and head h:
// softmax(scale * q . K[lo..p]) . V[lo..p] with rows before chunk_start read
// from `plane` through `ring` and rows from chunk_start on from the chunk.
// The reduction runs over logical positions in increasing order with one
// fixed arithmetic sequence, so the bits depend only on the query and the
// visible rows' values, not on rotation, chunking or threads.
void attend(const PlaneView& plane, const RingState& ring, const AttentionShape& shape,
            std::int64_t first_position, std::int64_t n_queries, std::int64_t chunk_start,
            const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, const float* q,
            float* out);

}  // namespace kvring::cpu
