// Reading rows of a host view in any input dtype: K/V become the f16 bits
// the store keeps (f16 inputs as they are, f32 and bf16 by round to nearest
// even), queries become f32 (exact for every input dtype).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/f16_rows.h"
#include "kvring/f16.h"
#include "kvring/store.h"

namespace kvring::detail {

inline float bf16_to_f32(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Element c of 16-bit data at any address: 16-bit views may sit at odd
// addresses (store.h).
inline std::uint16_t load16(const unsigned char* base, std::int64_t c) {
  std::uint16_t bits;
  std::memcpy(&bits, base + c * 2, 2);
  return bits;
}

// Row `row` of a host view: cols values as f16 bits.
inline void row_to_f16(const ConstView& v, std::int64_t row, std::uint16_t* dst) {
  const auto* base = static_cast<const unsigned char*>(v.data) +
                     row * v.row_stride * dtype_bytes(v.dtype);
  switch (v.dtype) {
    case DType::kF32:
      f32_to_f16_row(reinterpret_cast<const float*>(base), dst, v.cols);
      break;
    case DType::kF16:
      std::memcpy(dst, base, static_cast<std::size_t>(v.cols) * 2);
      break;
    case DType::kBF16:
      for (std::int64_t c = 0; c < v.cols; ++c) dst[c] = f32_to_f16(bf16_to_f32(load16(base, c)));
      break;
  }
}

// Row `row` of a host view as f32.
inline void row_to_f32(const ConstView& v, std::int64_t row, float* dst) {
  const auto* base = static_cast<const unsigned char*>(v.data) +
                     row * v.row_stride * dtype_bytes(v.dtype);
  switch (v.dtype) {
    case DType::kF32:
      std::memcpy(dst, base, static_cast<std::size_t>(v.cols) * 4);
      break;
    case DType::kF16:
      for (std::int64_t c = 0; c < v.cols; ++c) dst[c] = f16_to_f32(load16(base, c));
      break;
    case DType::kBF16:
      for (std::int64_t c = 0; c < v.cols; ++c) dst[c] = bf16_to_f32(load16(base, c));
      break;
  }
}

}  // namespace kvring::detail
