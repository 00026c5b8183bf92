// Helpers shared by the CUDA tests: skipping without a GPU, device buffers,
// plane bytes, and K/V streams with the f16 special cases mixed in.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kvring/cache.h"
#include "kvring/cuda_cache.h"
#include "kvring/f16.h"
#include "test_util.h"

namespace kvring::testing {

#define KVRING_SKIP_WITHOUT_GPU() \
  if (::kvring::cuda_device_count() == 0) GTEST_SKIP() << "no GPU visible"

// Smaller problems for runs under compute-sanitizer (KVRING_TEST_QUICK=1).
inline bool quick() {
  const char* q = std::getenv("KVRING_TEST_QUICK");
  return q != nullptr && q[0] == '1';
}

// A device allocation for a test; aborts the test on failure.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  // Every byte 0xff: as f32 a NaN, so an element nothing writes shows.
  void poison() { EXPECT_EQ(cudaMemset(p_, 0xff, n_ * sizeof(T)), cudaSuccess); }
  T* get() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

// Every plane and ring of two caches agree.
inline void expect_same_planes(const KvCache& a, const KvCache& b) {
  ASSERT_EQ(a.n_layers(), b.n_layers());
  for (std::int64_t l = 0; l < a.n_layers(); ++l) {
    EXPECT_EQ(a.ring(l), b.ring(l)) << "layer " << l;
    EXPECT_TRUE(plane_bytes(a, l) == plane_bytes(b, l)) << "layer " << l;
  }
}

// f32 values whose f16 conversion is delicate: ties of both parities,
// subnormals and their ties, the overflow threshold, infinities, NaNs with
// several payloads and signs, f32 subnormals, signed zeros.
inline std::vector<float> f16_special_values() {
  auto b = [](std::uint32_t u) { return f32_from_bits(u); };
  return {1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11), 2047.5f, -2047.5f,
          std::ldexp(1.0f, -25), std::ldexp(3.0f, -25), std::ldexp(5.0f, -25),
          -std::ldexp(3.0f, -25), std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25),
          std::ldexp(1023.0f, -24), std::ldexp(1.0f, -30), 65504.0f, 65519.0f, 65520.0f,
          -65520.0f, 1e10f, -1e10f, INFINITY, -INFINITY, NAN, b(0xffc00001u), b(0x7f800001u),
          b(0x7fbfffffu), -0.0f, b(1u), b(0x807fffffu)};
}

// Row p of a long K/V stream (p in [0, n)): random values in [-4, 4) with,
// when `specials`, about one element in five a special value or a random
// f32 bit pattern.
struct KvStream {
  std::int64_t kv_dim;
  std::vector<float> k, v;
  KvStream(std::int64_t kv, std::int64_t n, std::uint64_t seed, bool specials = false)
      : kv_dim(kv),
        k(random_floats(static_cast<std::size_t>(kv * n), seed, 4.0f)),
        v(random_floats(static_cast<std::size_t>(kv * n), seed + 1, 4.0f)) {
    if (!specials) return;
    const std::vector<float> sp = f16_special_values();
    std::mt19937_64 rng(seed ^ 0x5bd1e995u);
    for (auto* buf : {&k, &v})
      for (float& x : *buf) {
        const std::uint64_t r = rng();
        if (r % 5 != 0) continue;
        x = (r >> 8) % 3 == 0 ? f32_from_bits(static_cast<std::uint32_t>(r >> 32))
                              : sp[(r >> 16) % sp.size()];
      }
  }
  const float* krow(std::int64_t p) const { return k.data() + p * kv_dim; }
  const float* vrow(std::int64_t p) const { return v.data() + p * kv_dim; }
};

}  // namespace kvring::testing
