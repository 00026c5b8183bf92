#include "attention_cpu.h"

#include <cmath>
#include <vector>

#include "kvring/f16.h"
#include "parallel.h"

namespace kvring::cpu {

namespace {

// Exact f16 -> f32 for every bit pattern.
const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (std::uint32_t i = 0; i < 65536; ++i) t[i] = f16_to_f32(static_cast<std::uint16_t>(i));
    return t;
  }();
  return table.data();
}

float dot_f32(const float* a, const float* b, std::int64_t n) {
  // Eight interleaved partial sums combined in a fixed tree: a fixed order
  // that the compiler can keep in vector registers.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[d + u] * b[d + u];
  for (int u = 0; d < n; ++d, ++u) acc[u] += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

void attend(const PlaneView& plane, const RingState& ring, const AttentionShape& shape,
            std::int64_t first_position, std::int64_t n_queries, std::int64_t chunk_start,
            const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, const float* q,
            std::int64_t q_stride, float* out, std::int64_t out_stride) {
  const float* table = f16_table();
  const std::int64_t hd = shape.head_dim;
  const std::int64_t group = shape.n_heads / shape.n_kv_heads;
  const std::int64_t kv_dim = shape.n_kv_heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const std::int64_t max_rows =
      shape.window > 0 ? std::min(shape.window, first_position + n_queries)
                       : first_position + n_queries;
  const std::int64_t tasks = n_queries * shape.n_heads;

  parallel_for(tasks, tasks * max_rows * hd, [&](std::int64_t task) {
    const std::int64_t i = task / shape.n_heads;
    const std::int64_t h = task % shape.n_heads;
    const std::int64_t g = h / group;
    const std::int64_t p = first_position + i;
    const std::int64_t lo = shape.window > 0 ? std::max<std::int64_t>(0, p - shape.window + 1) : 0;
    const std::int64_t rows = p - lo + 1;
    const float* qh = q + i * q_stride + h * hd;
    float* oh = out + i * out_stride + h * hd;

    thread_local std::vector<float> scores, krow, acc;
    scores.resize(static_cast<std::size_t>(rows));
    krow.resize(static_cast<std::size_t>(hd));
    acc.assign(static_cast<std::size_t>(hd), 0.0f);

    // Row j of the visible range (logical lo + j) as an f16 head row.
    auto row_ptr = [&](const std::uint16_t* plane_buf, const std::uint16_t* chunk_buf,
                       std::int64_t logical) -> const std::uint16_t* {
      if (logical >= chunk_start)
        return chunk_buf + (logical - chunk_start) * kv_dim + g * hd;
      return plane_buf + head_row_offset(plane, ring.physical(logical), g);
    };

    float m = -INFINITY;
    for (std::int64_t j = 0; j < rows; ++j) {
      const std::uint16_t* kr = row_ptr(plane.k, chunk_k, lo + j);
      for (std::int64_t d = 0; d < hd; ++d) krow[static_cast<std::size_t>(d)] = table[kr[d]];
      const float s = dot_f32(qh, krow.data(), hd) * scale;
      scores[static_cast<std::size_t>(j)] = s;
      m = std::max(m, s);
    }
    float sum = 0.0f;
    for (std::int64_t j = 0; j < rows; ++j) {
      const float w = std::exp(scores[static_cast<std::size_t>(j)] - m);
      sum += w;
      const std::uint16_t* vr = row_ptr(plane.v, chunk_v, lo + j);
      for (std::int64_t d = 0; d < hd; ++d) acc[static_cast<std::size_t>(d)] += w * table[vr[d]];
    }
    const float inv = 1.0f / sum;
    for (std::int64_t d = 0; d < hd; ++d) oh[d] = acc[static_cast<std::size_t>(d)] * inv;
  });
}

}  // namespace kvring::cpu
