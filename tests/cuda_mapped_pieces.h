// Device memory the driver reports piece by piece, for the tests of views
// past their allocations: n physical allocations of the driver's minimum
// granularity mapped back to back into a reserved virtual range of n + 1
// pieces (as a growing caching allocator maps its segments). The driver
// reports each piece alone, yet a view may run across a seam; the last
// piece of the range stays unmapped, so nothing the driver knows follows
// the n-th, and a kernel reading past it would fault.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/allocation.h"

namespace kvring::testing {

class MappedPieces {
 public:
  explicit MappedPieces(int n) : n_(n), handle_(static_cast<std::size_t>(n), 0), mapped_(static_cast<std::size_t>(n)) {}
  MappedPieces(const MappedPieces&) = delete;
  MappedPieces& operator=(const MappedPieces&) = delete;
  ~MappedPieces() {
    for (int i = 0; i < n_; ++i) {
      if (mapped_[static_cast<std::size_t>(i)]) (void)unmap_(base_ + i * piece_, piece_);
      if (handle_[static_cast<std::size_t>(i)] != 0) (void)release_(handle_[static_cast<std::size_t>(i)]);
    }
    if (base_ != 0) (void)free_(base_, (n_ + 1) * piece_);
  }

  // Reserves the range and maps the n pieces; a failure is the test's
  // (ASSERT), so a caller returns on HasFatalFailure().
  void map() {
    auto granularity = fn<CUresult (*)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags)>(
        "cuMemGetAllocationGranularity");
    auto create = fn<CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                                  unsigned long long)>("cuMemCreate");
    auto reserve = fn<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
        "cuMemAddressReserve");
    auto map_piece = fn<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)>(
        "cuMemMap");
    auto access = fn<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>("cuMemSetAccess");
    unmap_ = fn<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
    release_ = fn<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
    free_ = fn<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
    ASSERT_TRUE(granularity && create && reserve && map_piece && access && unmap_ && release_ && free_);
    ASSERT_GE(n_, 1);
    int device = 0;
    ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
    ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // the primary context, current
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    ASSERT_EQ(granularity(&piece_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
    ASSERT_EQ(reserve(&base_, (n_ + 1) * piece_, 0, 0, 0), CUDA_SUCCESS);
    for (int i = 0; i < n_; ++i) {
      const auto k = static_cast<std::size_t>(i);
      ASSERT_EQ(create(&handle_[k], piece_, &prop, 0), CUDA_SUCCESS);
      ASSERT_EQ(map_piece(base_ + i * piece_, piece_, 0, handle_[k], 0), CUDA_SUCCESS);
      mapped_[k] = true;
    }
    CUmemAccessDesc desc{};
    desc.location = prop.location;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_EQ(access(base_, n_ * piece_, &desc, 1), CUDA_SUCCESS);
  }

  // The first byte of piece i (i == n: the first byte past the last).
  char* at(int i) const { return reinterpret_cast<char*>(static_cast<std::uintptr_t>(base_ + i * piece_)); }
  char* end() const { return at(n_); }
  std::size_t piece_bytes() const { return piece_; }

 private:
  // A driver function (the tests link no driver library); the test fails
  // where the driver has none.
  template <class Fn>
  static Fn fn(const char* name) {
    const Fn f = cuda::driver_function<Fn>(name);
    EXPECT_NE(f, nullptr) << name;
    return f;
  }

  int n_;
  size_t piece_ = 0;
  CUdeviceptr base_ = 0;
  std::vector<CUmemGenericAllocationHandle> handle_;
  std::vector<bool> mapped_;
  CUresult (*unmap_)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*free_)(CUdeviceptr, size_t) = nullptr;
};

}  // namespace kvring::testing
