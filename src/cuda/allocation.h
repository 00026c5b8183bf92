// The extent of a device allocation, from the driver: what a view or a
// mapped buffer may be read or written through, whatever its caller claims.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace kvring::cuda {

// The bytes from `p` to the end of the device allocation that holds it
// (cuMemGetAddressRange, reached through the runtime's driver entry point,
// so nothing links the driver library); nullopt where the driver cannot
// say: no such entry point, or no allocation it knows holds `p`. The
// calling thread's current device must be the allocation's.
inline std::optional<std::uint64_t> allocation_bytes(const void* p) {
  using GetRange = int (*)(unsigned long long*, std::size_t*, unsigned long long);
  static const GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return std::nullopt;
  unsigned long long base = 0;
  std::size_t bytes = 0;
  const auto at = static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p));
  if (get_range(&base, &bytes, at) != 0 || at < base || at - base > bytes) return std::nullopt;
  return static_cast<std::uint64_t>(bytes - (at - base));
}

// The bytes from `p` on, up to `want`, that device allocations mapped back
// to back hold: a view may run from one allocation into the next that
// starts where it ends (a virtual range over several physical ones, as a
// growing caching allocator maps them; the driver reports each one alone).
// Fewer than `want` where a byte before it lies in no allocation; nullopt
// where the driver cannot say for `p`, or the view crosses more than
// kMostRanges of them.
inline std::optional<std::uint64_t> mapped_bytes(const void* p, std::uint64_t want) {
  constexpr int kMostRanges = 4096;
  const std::optional<std::uint64_t> first = allocation_bytes(p);
  if (!first) return std::nullopt;
  std::uint64_t have = *first;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  for (int i = 0; have < want; ++i) {
    if (i == kMostRanges || have > UINTPTR_MAX - at) return std::nullopt;
    const std::optional<std::uint64_t> next = allocation_bytes(reinterpret_cast<const void*>(at + have));
    if (!next || *next == 0) break;
    have += *next;
  }
  return have;
}

}  // namespace kvring::cuda
