// The two plane layouts and their index formulas: the one source of truth
// shared by the CPU backend, the CUDA kernels and the pack codec.
//
//   token-major (sliding rings):  index = physical * kv_dim + element
//   head-major  (full planes):    index = (kv_head * capacity + physical) * head_dim + dim
//
// where element = kv_head * head_dim + dim indexes one token's K (or V) row.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVRING_HD __host__ __device__ __forceinline__
#else
#define KVRING_HD inline
#endif

namespace kvring {

// The numeric values are part of the kvpack format; never reuse one.
enum class Layout : std::uint8_t {
  kTokenMajor = 0,
  kHeadMajor = 1,
};

KVRING_HD constexpr std::uint64_t token_major_index(std::uint64_t physical,
                                                    std::uint64_t element,
                                                    std::uint64_t kv_dim) {
  return physical * kv_dim + element;
}

KVRING_HD constexpr std::uint64_t head_major_index(std::uint64_t kv_head, std::uint64_t physical,
                                                   std::uint64_t dim, std::uint64_t capacity,
                                                   std::uint64_t head_dim) {
  return (kv_head * capacity + physical) * head_dim + dim;
}

// Index of (physical row, element of the token's row) in a plane buffer.
KVRING_HD constexpr std::uint64_t plane_index(Layout layout, std::uint64_t physical,
                                              std::uint64_t element, std::uint64_t kv_dim,
                                              std::uint64_t head_dim, std::uint64_t capacity) {
  return layout == Layout::kTokenMajor
             ? token_major_index(physical, element, kv_dim)
             : head_major_index(element / head_dim, physical, element % head_dim, capacity,
                                head_dim);
}

// Index of (physical row, kv_head, dim): the start of one head's row is
// contiguous over dim in both layouts.
KVRING_HD constexpr std::uint64_t plane_head_row(Layout layout, std::uint64_t physical,
                                                 std::uint64_t kv_head, std::uint64_t kv_dim,
                                                 std::uint64_t head_dim, std::uint64_t capacity) {
  return layout == Layout::kTokenMajor
             ? token_major_index(physical, kv_head * head_dim, kv_dim)
             : head_major_index(kv_head, physical, 0, capacity, head_dim);
}

// Distance between consecutive physical rows of one head.
KVRING_HD constexpr std::uint64_t plane_row_stride(Layout layout, std::uint64_t kv_dim,
                                                   std::uint64_t head_dim) {
  return layout == Layout::kTokenMajor ? kv_dim : head_dim;
}

}  // namespace kvring
