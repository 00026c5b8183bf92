// IEEE binary16 conversion with round-to-nearest-even, bit-identical to
// CUDA's __float2half_rn, so stored K/V bytes match across backends.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvring/layout.h"  // KVRING_HD

namespace kvring {

KVRING_HD std::uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

KVRING_HD float f32_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// f32 -> f16 bits, round to nearest, ties to even. Overflow goes to
// infinity; every NaN becomes the canonical quiet NaN 0x7fff, which is what
// the GPU's cvt.rn.f16.f32 produces.
KVRING_HD std::uint16_t f32_to_f16(float value) {
  const std::uint32_t x = f32_bits(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN
    if (abs == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    return 0x7fffu;
  }
  if (abs >= 0x477ff000u)  // rounds to >= 65520: infinity
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {  // below 2^-14: f16 subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // < 2^-25: to zero
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // 14..24
    std::uint32_t h = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  // Normal: rebias exponent (127 -> 15), round 13 dropped mantissa bits.
  std::uint32_t h = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into exponent
  return static_cast<std::uint16_t>(sign | h);
}

// f16 bits -> f32 (exact).
KVRING_HD float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // Subnormal: normalise.
    std::uint32_t e = 113;  // 127 - 14
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    return f32_from_bits(sign | (e << 23) | ((mant & 0x3ffu) << 13));
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace kvring
