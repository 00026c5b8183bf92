// digest64 (src/core/digest64.h): the value is pinned, every single-bit
// change of a buffer changes it, and a segment's words add up the same
// whatever way the words are split (what the GPU's reduction relies on).
#include "core/digest64.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace kvring {
namespace {

std::vector<unsigned char> bytes(std::size_t n, unsigned seed) {
  std::vector<unsigned char> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>((i * 131 + seed * 7 + (i >> 3)) & 0xff);
  return b;
}

TEST(Digest64, ValuesArePinned) {
  // A change here changes what the handoff's wire carries. The values were
  // computed from the definition in digest64.h by a separate
  // implementation (Python integers), not by this one.
  EXPECT_EQ(digest64::fmix64(0), 0u);
  const auto b = bytes(1000, 1);
  EXPECT_EQ(digest64::words(b.data(), b.size(), 1), 0xe547360cf2e0fc57ULL);
  EXPECT_EQ(digest64::finish(digest64::segment(b.data(), 13, 0)), 0xd54ce7d849650406ULL);
}

TEST(Digest64, EveryFlippedBitChangesTheDigest) {
  for (std::size_t n : {1u, 7u, 8u, 9u, 64u, 77u}) {
    auto b = bytes(n, 2);
    const std::uint64_t base = digest64::segment(b.data(), n, 3);
    for (std::size_t bit = 0; bit < n * 8; ++bit) {
      b[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
      EXPECT_NE(digest64::segment(b.data(), n, 3), base) << n << " bytes, bit " << bit;
      b[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    }
  }
}

TEST(Digest64, SeedsLengthsAndOrderMatter) {
  const auto b = bytes(64, 4);
  EXPECT_NE(digest64::segment(b.data(), 64, 1), digest64::segment(b.data(), 64, 2));
  // A trailing zero byte is part of the length, not padding.
  auto z = bytes(63, 4);
  z.push_back(0);
  EXPECT_NE(digest64::segment(z.data(), 63, 1), digest64::segment(z.data(), 64, 1));
  // Two words swapped.
  auto s = b;
  std::swap_ranges(s.begin(), s.begin() + 8, s.begin() + 8);
  EXPECT_NE(digest64::words(s.data(), 64, 1), digest64::words(b.data(), 64, 1));
}

TEST(Digest64, WordsAreASumOfTerms) {
  const auto b = bytes(203, 5);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i * 8 < b.size(); ++i) {
    std::uint64_t w = 0;
    std::memcpy(&w, b.data() + i * 8, std::min<std::size_t>(8, b.size() - i * 8));
    sum += digest64::term(w, 9, i);
  }
  EXPECT_EQ(digest64::words(b.data(), b.size(), 9), sum);
}

}  // namespace
}  // namespace kvring
