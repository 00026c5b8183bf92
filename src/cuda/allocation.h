// The extent of a device allocation, from the driver: what a view or a
// mapped buffer may be read or written through, whatever its caller claims.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace kvring::cuda {

// A driver function by name, in CUDA 12.0's form, through the runtime's
// driver entry point, so that nothing links the driver library; null where
// the driver has none.
template <class Fn>
Fn driver_function(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    f = nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

namespace detail {

// cuMemGetAddressRange (the 64-bit form); null where the driver has none.
using GetRange = int (*)(unsigned long long* base, std::size_t* bytes, unsigned long long p);
inline GetRange get_range() {
  static const GetRange fn = driver_function<GetRange>("cuMemGetAddressRange");
  return fn;
}

// The driver's answer for `at`: 0 and the bytes from `at` to the end of
// the allocation that holds it, or the driver's error
// (CUDA_ERROR_NOT_FOUND, 500: no allocation of the current context holds
// it).
inline int range_from(std::uintptr_t at, std::uint64_t& bytes) {
  unsigned long long base = 0;
  std::size_t size = 0;
  const int e = get_range()(&base, &size, static_cast<unsigned long long>(at));
  if (e != 0) return e;
  if (at < base || at - base >= size) return -1;
  bytes = static_cast<std::uint64_t>(size - (at - base));
  return 0;
}

constexpr int kNotFound = 500;

}  // namespace detail

// The bytes from `p` to the end of the device allocation that holds it;
// nullopt where the driver cannot say: no such entry point, or no
// allocation it knows holds `p`. The calling thread's current device must
// be the allocation's.
inline std::optional<std::uint64_t> allocation_bytes(const void* p) {
  std::uint64_t bytes = 0;
  if (detail::get_range() == nullptr || detail::range_from(reinterpret_cast<std::uintptr_t>(p), bytes) != 0)
    return std::nullopt;
  return bytes;
}

// The bytes from `p` on, up to `want`, that device allocations mapped back
// to back hold. A view may run from one allocation into the next that
// starts where it ends: the physical pieces of one virtual range (as a
// growing caching allocator maps them; the driver reports each alone), or
// two allocations that happen to lie side by side, which a kernel may
// equally read without a fault. Fewer than `want` where a byte before it
// lies in no allocation of the current device (the runtime's pointer
// attributes name another device's memory, host memory or none there);
// nullopt where the runtime or the driver cannot say (for `p` itself, on
// any error but "not found", a failed attribute or device query, or past
// kMostRanges ranges).
inline std::optional<std::uint64_t> mapped_bytes(const void* p, std::uint64_t want) {
  constexpr int kMostRanges = 4096;
  const std::optional<std::uint64_t> first = allocation_bytes(p);
  if (!first) return std::nullopt;
  std::uint64_t have = *first;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  int device = -1;
  if (have < want && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  for (int ranges = 1; have < want; ++ranges) {
    if (ranges == kMostRanges || have > UINTPTR_MAX - at) return std::nullopt;
    // Only an address that the runtime knows as this device's memory goes
    // to the driver's range query: past the last allocation the query would
    // fail, and fail loudly under compute-sanitizer, for a refusal that the
    // pointer's attributes already give.
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(at + have)) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    if (a.type != cudaMemoryTypeDevice || a.device != device) break;
    std::uint64_t next = 0;
    const int e = detail::range_from(at + have, next);
    if (e == detail::kNotFound) break;
    if (e != 0) return std::nullopt;
    have += next;
  }
  return have;
}

}  // namespace kvring::cuda
