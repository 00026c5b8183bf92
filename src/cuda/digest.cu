// digest64's word sum on the GPU: each thread adds the terms of its words,
// a block sums its threads' values, and one atomic per block adds that to
// the result. Addition mod 2^64 is exact and commutative, so the value is
// the host's (digest64::words) whatever order the blocks ran in.
#include <algorithm>

#include "core/digest64.h"
#include "digest.h"
#include "launch_plain.cuh"

namespace kvring::cuda {
namespace {

constexpr int kThreads = 256;
constexpr std::uint64_t kMaxBlocks = 2048;

// kUnit: bytes a thread reads at once (16: two words, 16-byte aligned; 8:
// one word, 8-byte aligned; 1: a word's bytes one by one, any alignment).
template <int kUnit>
__global__ void __launch_bounds__(kThreads)
    digest_kernel(const unsigned char* p, std::uint64_t bytes, std::uint32_t seed,
                  unsigned long long* sum) {
  const std::uint64_t n_words = bytes / 8;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  std::uint64_t local = 0;
  const std::uint64_t first = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kUnit == 16) {
    const std::uint64_t n_pairs = n_words / 2;
    const auto* pairs = reinterpret_cast<const ulonglong2*>(p);
    for (std::uint64_t i = first; i < n_pairs; i += stride) {
      const ulonglong2 w = pairs[i];
      local += digest64::term(w.x, seed, 2 * i) + digest64::term(w.y, seed, 2 * i + 1);
    }
    if (first == 0 && (n_words & 1))
      local += digest64::term(reinterpret_cast<const std::uint64_t*>(p)[n_words - 1], seed, n_words - 1);
  } else {
    for (std::uint64_t i = first; i < n_words; i += stride) {
      std::uint64_t w = 0;
      if constexpr (kUnit == 8) {
        w = reinterpret_cast<const std::uint64_t*>(p)[i];
      } else {
#pragma unroll
        for (int b = 0; b < 8; ++b) w |= static_cast<std::uint64_t>(p[i * 8 + b]) << (8 * b);
      }
      local += digest64::term(w, seed, i);
    }
  }
  if (first == 0 && bytes > n_words * 8) {
    std::uint64_t w = 0;
    for (std::uint64_t b = n_words * 8; b < bytes; ++b)
      w |= static_cast<std::uint64_t>(p[b]) << (8 * (b - n_words * 8));
    local += digest64::term(w, seed, n_words);
  }
  for (int off = 16; off > 0; off >>= 1) local += __shfl_down_sync(0xffffffffu, local, off);
  __shared__ std::uint64_t warps[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint64_t block = 0;
    for (int w = 0; w < kThreads / 32; ++w) block += warps[w];
    atomicAdd(sum, static_cast<unsigned long long>(block));
  }
}

}  // namespace

cudaError_t launch_digest_words(const void* data, std::size_t bytes, std::uint32_t seed,
                                unsigned long long* sum, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const auto* p = static_cast<const unsigned char*>(data);
  const auto addr = reinterpret_cast<std::uintptr_t>(data);
  const std::uint64_t unit = addr % 16 == 0 ? 16 : addr % 8 == 0 ? 8 : 1;
  const std::uint64_t units = std::max<std::uint64_t>(1, bytes / (unit == 16 ? 16 : 8));
  const auto blocks =
      static_cast<unsigned>(std::min<std::uint64_t>((units + kThreads - 1) / kThreads, kMaxBlocks));
  auto* kernel = unit == 16 ? digest_kernel<16> : unit == 8 ? digest_kernel<8> : digest_kernel<1>;
  return launch_plain(kernel, blocks, kThreads, 0, stream, p, bytes, seed, sum);
}

}  // namespace kvring::cuda
