#include "f16_rows.h"

#include <cstring>

#include "kvring/f16.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvring::detail {

void f32_to_f16_row_scalar(const float* src, std::uint16_t* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

#if defined(__x86_64__)
namespace {

// vcvtps2ph rounds to nearest even with overflow to infinity, as
// f32_to_f16 does; only NaNs differ (it keeps payload and sign), so NaN
// lanes are replaced by 0x7fff. kStream: each 16 bytes of dst written by a
// non-temporal store (dst 16-byte aligned).
template <bool kStream>
__attribute__((target("avx2,f16c"))) void row_f16c(const float* src, std::uint16_t* dst,
                                                   std::int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m128i qnan = _mm_set1_epi16(0x7fff);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i abs = _mm256_and_si256(_mm256_castps_si256(x), abs_mask);
    const __m256i nan32 = _mm256_cmpgt_epi32(abs, inf);
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32),
                                          _mm256_extracti128_si256(nan32, 1));
    h = _mm_blendv_epi8(h, qnan, nan16);
    if constexpr (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    }
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

// Whether n f16 values at dst are whole 64-byte lines.
bool whole_lines(const std::uint16_t* dst, std::int64_t n) {
  return n % 32 == 0 && reinterpret_cast<std::uintptr_t>(dst) % 64 == 0;
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && cpu_has_f16c();
  return yes;
}

}  // namespace
#endif

bool cpu_has_f16c() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
#else
  return false;
#endif
}

void f32_to_f16_row(const float* src, std::uint16_t* dst, std::int64_t n) {
#if defined(__x86_64__)
  if (has_f16c()) return row_f16c<false>(src, dst, n);
#endif
  f32_to_f16_row_scalar(src, dst, n);
}

void f32_to_f16_row_stream(const float* src, std::uint16_t* dst, std::int64_t n) {
#if defined(__x86_64__)
  if (has_f16c() && whole_lines(dst, n)) return row_f16c<true>(src, dst, n);
#endif
  f32_to_f16_row(src, dst, n);
}

void copy_f16_row_stream(const std::uint16_t* src, std::uint16_t* dst, std::int64_t n) {
#if defined(__x86_64__)
  if (whole_lines(dst, n)) {
    for (std::int64_t i = 0; i < n; i += 8)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<std::size_t>(n) * 2);
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace kvring::detail
