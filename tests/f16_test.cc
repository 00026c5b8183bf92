#include "kvring/f16.h"
#include "core/f16_rows.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvring {
namespace {

float bits(std::uint32_t u) { return f32_from_bits(u); }

TEST(F16, ExactValues) {
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
}

TEST(F16, TiesRoundToEven) {
  // Halfway between 1 and 1 + 2^-10: stays at the even 1.
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // Halfway between 1 + 2^-10 (odd) and 1 + 2^-9: up to the even one.
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above a tie rounds up, just below rounds down.
  EXPECT_EQ(f32_to_f16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  EXPECT_EQ(f32_to_f16(std::nextafter(1.0f + 3 * std::ldexp(1.0f, -11), 0.0f)), 0x3c01);
  // A tie that carries into the exponent: 2047.5 + ... -> 2048.
  EXPECT_EQ(f32_to_f16(2047.5f), 0x6800);
}

TEST(F16, Subnormals) {
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);      // tie to even 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);      // 1.5 ulp: tie to even 2
  EXPECT_EQ(f32_to_f16(std::ldexp(5.0f, -25)), 0x0002);      // 2.5 ulp: tie to even 2
  EXPECT_EQ(f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -30)), 0x0000);      // underflow to zero
  EXPECT_EQ(f32_to_f16(-std::ldexp(1.0f, -30)), 0x8000);     // keeps its sign
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400);  // to normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.0f, -24)), 0x03ff);   // largest subnormal
  EXPECT_EQ(f32_to_f16(bits(1)), 0x0000);                    // f32 subnormal
}

TEST(F16, OverflowInfinityAndNaN) {
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // the tie goes to infinity (even)
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e10f), 0xfc00);
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(f32_to_f16(-INFINITY), 0xfc00);
  EXPECT_EQ(f32_to_f16(NAN), 0x7fff);
  EXPECT_EQ(f32_to_f16(bits(0xffc00001u)), 0x7fff);
  EXPECT_EQ(f32_to_f16(bits(0x7f800001u)), 0x7fff);  // signalling NaN stays a NaN
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7fff)));
  EXPECT_TRUE(std::isinf(f16_to_f32(0xfc00)));
}

TEST(F16, EveryHalfRoundTrips) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
}

// Against a reference that picks the nearest finite half by exact double
// arithmetic (ties to the even bit pattern), on random f32 bit patterns.
TEST(F16, MatchesNearestHalfReference) {
  std::vector<double> pos;  // all finite non-negative halves, ascending
  for (std::uint32_t h = 0; h < 0x7c00; ++h) pos.push_back(f16_to_f32(static_cast<std::uint16_t>(h)));
  auto reference = [&](float x) -> std::uint16_t {
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= 65520.0) return sign | 0x7c00;
    auto it = std::lower_bound(pos.begin(), pos.end(), a);
    std::size_t hi = static_cast<std::size_t>(it - pos.begin());
    if (hi < pos.size() && pos[hi] == a) return sign | static_cast<std::uint16_t>(hi);
    const std::size_t lo = hi - 1;
    const double dlo = a - pos[lo], dhi = pos[hi] - a;
    std::size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | static_cast<std::uint16_t>(pick);
  };
  std::mt19937 rng(20261129);
  for (int i = 0; i < 2000000; ++i) {
    std::uint32_t u = rng();
    if (i % 2) u = (u & 0x8fffffffu) | 0x30000000u;  // half the draws near the f16 range
    const float x = bits(u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_f16(x), reference(x)) << std::hex << u;
  }
}

}  // namespace
// The row conversion the CPU store uses (F16C where the processor has it)
// equals f32_to_f16 on every one of the 2^32 inputs, NaNs included.
TEST(F16, RowConversionMatchesTheScalarOnEveryInput) {
  constexpr std::int64_t kBlock = 1 << 20;
  std::vector<float> in(kBlock);
  std::vector<std::uint16_t> fast(kBlock), slow(kBlock);
  for (std::uint64_t base = 0; base < (std::uint64_t{1} << 32); base += kBlock) {
    for (std::int64_t i = 0; i < kBlock; ++i) {
      const auto bits = static_cast<std::uint32_t>(base + static_cast<std::uint64_t>(i));
      std::memcpy(&in[static_cast<std::size_t>(i)], &bits, 4);
    }
    // An odd length: the vector loop and its scalar tail both run.
    detail::f32_to_f16_row(in.data(), fast.data(), kBlock - 3);
    detail::f32_to_f16_row(in.data() + kBlock - 3, fast.data() + kBlock - 3, 3);
    detail::f32_to_f16_row_scalar(in.data(), slow.data(), kBlock);
    ASSERT_EQ(fast, slow) << "inputs from " << base;
  }
}

// The streamed row writes (non-temporal where the row is whole 64-byte
// lines) give the bits of the plain ones, at line starts and off them, for
// lengths of whole lines and not; every NaN still becomes 0x7fff.
TEST(F16, StreamedRowsEqualThePlainOnes) {
  constexpr std::size_t kMax = 4096;
  std::vector<float> in(kMax);
  std::mt19937 rng(20261207);
  for (float& x : in) {
    const std::uint32_t u = rng();
    std::memcpy(&x, &u, 4);
  }
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            65504.0f, 65520.0f, -0.0f, 5.96e-8f};
  for (std::size_t i = 0; i < kMax; i += 61) in[i] = specials[(i / 61) % 6];
  std::vector<std::uint16_t> src16(kMax);
  detail::f32_to_f16_row_scalar(in.data(), src16.data(), kMax);
  // 64-byte aligned storage with room for an offset.
  std::vector<std::uint16_t> store(kMax + 64), want(kMax);
  auto* line = reinterpret_cast<std::uint16_t*>((reinterpret_cast<std::uintptr_t>(store.data()) + 63) & ~std::uintptr_t{63});
  for (const std::int64_t n : {32, 64, 128, 4064, 24, 100}) {
    for (const std::int64_t offset : {0, 8, 1}) {
      SCOPED_TRACE(std::to_string(n) + " values at +" + std::to_string(offset));
      std::uint16_t* dst = line + offset;
      std::fill(store.begin(), store.end(), 0x1234);
      detail::f32_to_f16_row_stream(in.data(), dst, n);
      detail::stream_fence();
      detail::f32_to_f16_row_scalar(in.data(), want.data(), n);
      EXPECT_EQ(std::memcmp(dst, want.data(), static_cast<std::size_t>(n) * 2), 0);
      EXPECT_EQ(dst[n], 0x1234) << "written past the row";
      std::fill(store.begin(), store.end(), 0x1234);
      detail::copy_f16_row_stream(src16.data() + 3, dst, n);
      detail::stream_fence();
      EXPECT_EQ(std::memcmp(dst, src16.data() + 3, static_cast<std::size_t>(n) * 2), 0);
      EXPECT_EQ(dst[n], 0x1234) << "written past the row";
      if (offset > 0) {
        EXPECT_EQ(dst[-1], 0x1234) << "written before the row";
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The F16C check reads CPUID itself (clang 14 has no name for it); GCC's
// builtin answers the same question.
TEST(F16, F16cCheckAgreesWithTheCompilersBuiltin) {
  EXPECT_EQ(detail::cpu_has_f16c(), __builtin_cpu_supports("f16c") != 0);
}
#endif

}  // namespace kvring
