// Helpers shared by the tests: seeded random data, small configs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvring/cache.h"
#include "kvring/config.h"
#include "kvring/model.h"
#include "kvring/store.h"

namespace kvring::testing {

// Uniform in [-scale, scale), never all zeros.
inline std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// An unsigned integer from the environment variable `name`, or `fallback`
// when it is not set (seed counts and the like of the randomized tests).
inline std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* s = std::getenv(name);
  return s != nullptr ? std::strtoull(s, nullptr, 10) : fallback;
}

// The same bits in n floats (NaNs compare by their bits).
inline bool same_bits(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// A figure of /proc/self/status in bytes: key "VmSize" (the address space)
// or "VmRSS" (resident memory); -1 where absent.
inline std::int64_t proc_status_bytes(std::string_view key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 && line[key.size()] == ':')
      return std::stoll(line.substr(key.size() + 1)) * 1024;  // "VmSize:  N kB"
  return -1;
}

// Decodes sequence `seq` of `store`, which holds the K/V of `tokens`,
// greedily until it holds `until` tokens: `next` first, then the argmax of
// each step's logits. Returns the tokens and the last step's logits.
inline std::pair<std::vector<std::int32_t>, std::vector<float>> greedy_decode(
    const ReferenceModel& model, KvStore& store, SeqId seq, std::vector<std::int32_t> tokens,
    std::int32_t next, std::int64_t until) {
  const std::int64_t vocab = model.options().vocab;
  std::vector<float> last(static_cast<std::size_t>(vocab));
  while (static_cast<std::int64_t>(tokens.size()) < until) {
    const SeqSpan step{seq, static_cast<std::int64_t>(tokens.size()), 1};
    const Status st = model.forward(store, {&step, 1}, &next, last.data());
    EXPECT_TRUE(st.ok()) << st.to_string();
    if (!st.ok()) break;
    tokens.push_back(next);
    next = argmax(last.data(), vocab);
  }
  return {std::move(tokens), std::move(last)};
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

inline PlaneBytes plane_bytes(const KvStore& store, SeqId seq, std::int64_t layer) {
  const auto n = static_cast<std::size_t>(store.capacity(layer) * store.config().kv_dim());
  PlaneBytes b{std::vector<std::uint16_t>(n), std::vector<std::uint16_t>(n)};
  const Status s = store.read_plane(seq, layer, b.k.data(), b.v.data());
  EXPECT_TRUE(s.ok()) << s.to_string();
  return b;
}

inline PlaneBytes plane_bytes(const KvCache& c, std::int64_t layer) {
  return plane_bytes(c.store(), c.seq(), layer);
}

// Every ring state and every physical byte of a cache.
struct CacheImage {
  std::vector<RingState> rings;
  std::vector<PlaneBytes> planes;
  bool operator==(const CacheImage&) const = default;
};

// The image of one sequence of a store.
inline CacheImage image(const KvStore& store, SeqId seq) {
  CacheImage im;
  for (std::int64_t l = 0; l < store.n_layers(); ++l) {
    auto ring = store.ring(seq, l);
    EXPECT_TRUE(ring.ok()) << ring.error().to_string();
    im.rings.push_back(ring.ok() ? *ring : RingState{});
    im.planes.push_back(plane_bytes(store, seq, l));
  }
  return im;
}

inline CacheImage image(const KvCache& c) { return image(c.store(), c.seq()); }

}  // namespace kvring::testing
