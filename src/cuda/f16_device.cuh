// The store path's f32 -> f16 conversion on the device.
//
// cvt.rn.f16.f32 rounds to nearest even, overflows to infinity and turns
// every NaN into 0x7fff: exactly f32_to_f16 of f16.h, which the tests check
// over all 2^32 inputs on the GPU (cuda_store_test). Keep every kernel that
// writes K/V on this one function.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels.h"

namespace kvring::cuda {

__device__ __forceinline__ std::uint16_t store_f16(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// Two values packed as f16x2: `lo` in bits 0-15, `hi` in bits 16-31.
__device__ __forceinline__ std::uint32_t store_f16x2(float lo, float hi) {
  return static_cast<std::uint32_t>(store_f16(lo)) |
         (static_cast<std::uint32_t>(store_f16(hi)) << 16);
}

// Every kernel that stores source rows (the store kernels, the prefill
// chunk's conversion, an attention launch's own rows) reads them here.
__device__ __forceinline__ float bf16_value(std::uint16_t bits) {
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}

// Element e of source row r as the f16 bits the store keeps: f16 as it
// is, f32 and bf16 (exact in f32) through store_f16.
__device__ __forceinline__ std::uint16_t source_f16(const SourceRows& s, std::int64_t r,
                                                    std::int64_t e) {
  const std::int64_t i = r * s.stride + e;
  switch (s.dtype) {
    case 0: return store_f16(static_cast<const float*>(s.data)[i]);
    case 1: return static_cast<const std::uint16_t*>(s.data)[i];
    default: return store_f16(bf16_value(static_cast<const std::uint16_t*>(s.data)[i]));
  }
}

// Eight elements from e on (16-byte aligned sources).
__device__ __forceinline__ uint4 source_f16x8(const SourceRows& s, std::int64_t r, std::int64_t e) {
  const std::int64_t i = r * s.stride + e;
  if (s.dtype == 1) return *reinterpret_cast<const uint4*>(static_cast<const std::uint16_t*>(s.data) + i);
  uint4 o;
  if (s.dtype == 0) {
    const float* src = static_cast<const float*>(s.data) + i;
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 b = *reinterpret_cast<const float4*>(src + 4);
    o.x = store_f16x2(a.x, a.y);
    o.y = store_f16x2(a.z, a.w);
    o.z = store_f16x2(b.x, b.y);
    o.w = store_f16x2(b.z, b.w);
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const std::uint16_t*>(s.data) + i);
    const unsigned x[4] = {w.x, w.y, w.z, w.w};
    unsigned y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      y[j] = store_f16x2(bf16_value(static_cast<std::uint16_t>(x[j] & 0xffffu)),
                         bf16_value(static_cast<std::uint16_t>(x[j] >> 16)));
    o = make_uint4(y[0], y[1], y[2], y[3]);
  }
  return o;
}

}  // namespace kvring::cuda
