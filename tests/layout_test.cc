#include "kvring/layout.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvring {
namespace {

TEST(Layout, FormulasAsDocumented) {
  // token-major: physical * kv_dim + element
  static_assert(token_major_index(3, 5, 256) == 3 * 256 + 5);
  // head-major: (kv_head * capacity + physical) * head_dim + dim
  static_assert(head_major_index(1, 7, 9, 2048, 128) == (1 * 2048 + 7) * 128 + 9);
  static_assert(plane_index(Layout::kHeadMajor, 7, 128 + 9, 256, 128, 2048) ==
                (1 * 2048 + 7) * 128 + 9);
  static_assert(plane_index(Layout::kTokenMajor, 7, 128 + 9, 256, 128, 2048) == 7 * 256 + 137);
  EXPECT_EQ(plane_row_stride(Layout::kTokenMajor, 256, 128), 256u);
  EXPECT_EQ(plane_row_stride(Layout::kHeadMajor, 256, 128), 128u);
}

// Both layouts are bijections of (physical, element) onto [0, capacity * kv_dim),
// and a head's row is contiguous with the documented row stride.
TEST(Layout, BijectiveAtAwkwardSizes) {
  for (Layout layout : {Layout::kTokenMajor, Layout::kHeadMajor})
    for (std::uint64_t heads : {1u, 2u, 3u})
      for (std::uint64_t hd : {1u, 7u, 16u})
        for (std::uint64_t cap : {1u, 5u, 33u}) {
          const std::uint64_t kv = heads * hd;
          std::vector<int> seen(cap * kv, 0);
          for (std::uint64_t p = 0; p < cap; ++p)
            for (std::uint64_t e = 0; e < kv; ++e) {
              const std::uint64_t i = plane_index(layout, p, e, kv, hd, cap);
              ASSERT_LT(i, cap * kv);
              ++seen[i];
              const std::uint64_t h = e / hd, d = e % hd;
              ASSERT_EQ(i, plane_head_row(layout, p, h, kv, hd, cap) + d);
              if (p + 1 < cap) {
                ASSERT_EQ(plane_index(layout, p + 1, e, kv, hd, cap),
                          i + plane_row_stride(layout, kv, hd));
              }
            }
          for (int s : seen) ASSERT_EQ(s, 1);
        }
}

}  // namespace
}  // namespace kvring
