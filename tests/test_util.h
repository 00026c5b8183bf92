// Helpers shared by the tests: seeded random data, small configs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kvring/cache.h"
#include "kvring/config.h"

namespace kvring::testing {

// Uniform in [-scale, scale), never all zeros.
inline std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// A small hybrid: layer % 4 == 3 full, the rest sliding.
inline ModelConfig small_config(std::int64_t window = 32, std::int64_t max_context = 256,
                                std::int64_t n_layers = 4, std::int64_t n_heads = 4,
                                std::int64_t n_kv_heads = 2, std::int64_t head_dim = 16) {
  return make_hybrid_config("test-hybrid", n_layers, 4, n_heads, n_kv_heads, head_dim, window,
                            max_context);
}

// The physical bytes of one plane as stored.
struct PlaneBytes {
  std::vector<std::uint16_t> k, v;
  bool operator==(const PlaneBytes&) const = default;
};

inline PlaneBytes plane_bytes(const KvCache& c, std::int64_t layer) {
  const auto n = static_cast<std::size_t>(c.ring(layer).capacity() * c.config().kv_dim());
  PlaneBytes b{std::vector<std::uint16_t>(n), std::vector<std::uint16_t>(n)};
  const Status s = c.read_plane(layer, b.k.data(), b.v.data());
  EXPECT_TRUE(s.ok()) << s.to_string();
  return b;
}

// Every ring state and every physical byte of a cache.
struct CacheImage {
  std::vector<RingState> rings;
  std::vector<PlaneBytes> planes;
  bool operator==(const CacheImage&) const = default;
};

inline CacheImage image(const KvCache& c) {
  CacheImage im;
  for (std::int64_t l = 0; l < c.n_layers(); ++l) {
    im.rings.push_back(c.ring(l));
    im.planes.push_back(plane_bytes(c, l));
  }
  return im;
}

}  // namespace kvring::testing
