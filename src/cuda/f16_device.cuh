// The store path's f32 -> f16 conversion on the device.
//
// cvt.rn.f16.f32 rounds to nearest even, overflows to infinity and turns
// every NaN into 0x7fff: exactly f32_to_f16 of f16.h, which the tests check
// over all 2^32 inputs on the GPU (cuda_store_test). Keep every kernel that
// writes K/V on this one function.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace kvring::cuda {

__device__ __forceinline__ std::uint16_t store_f16(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// Two values packed as f16x2: `lo` in bits 0-15, `hi` in bits 16-31.
__device__ __forceinline__ std::uint32_t store_f16x2(float lo, float hi) {
  return static_cast<std::uint32_t>(store_f16(lo)) |
         (static_cast<std::uint32_t>(store_f16(hi)) << 16);
}

}  // namespace kvring::cuda
