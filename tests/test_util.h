// Helpers shared by the tests: seeded random data, small configs.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

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

}  // namespace kvring::testing
