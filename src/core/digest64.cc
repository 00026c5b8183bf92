#include "core/digest64.h"

#include <bit>
#include <cstring>

namespace kvring::digest64 {

static_assert(std::endian::native == std::endian::little, "words are read little-endian");

std::uint64_t words(const void* data, std::size_t bytes, std::uint32_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::size_t n = bytes / 8;
  // Four independent sums: the multiplies of neighbouring words overlap.
  std::uint64_t s[4] = {0, 0, 0, 0};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (std::size_t j = 0; j < 4; ++j) {
      std::uint64_t w;
      std::memcpy(&w, p + (i + j) * 8, 8);
      s[j] += term(w, seed, i + j);
    }
  for (; i < n; ++i) {
    std::uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    s[0] += term(w, seed, i);
  }
  if (const std::size_t tail = bytes - n * 8; tail > 0) {
    std::uint64_t w = 0;
    std::memcpy(&w, p + n * 8, tail);
    s[0] += term(w, seed, n);
  }
  return s[0] + s[1] + s[2] + s[3];
}

}  // namespace kvring::digest64
