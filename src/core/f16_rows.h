// f32 -> f16 over a row, bit for bit equal to f32_to_f16 (f16.h) on every
// input: IEEE round to nearest even, overflow to infinity, every NaN to the
// canonical 0x7fff. Uses the F16C instruction where the processor has it.
#pragma once

#include <cstdint>

namespace kvring::detail {

void f32_to_f16_row(const float* src, std::uint16_t* dst, std::int64_t n);

// The same, without the F16C path (for tests that compare the two).
void f32_to_f16_row_scalar(const float* src, std::uint16_t* dst, std::int64_t n);

// Row writes for calls that write more rows than stay in cache: where dst
// starts a 64-byte line and the row fills whole lines, each line is written
// by non-temporal stores, whole, without the host first reading it (as a
// plain store does); elsewhere the plain path. The bits are those of
// f32_to_f16_row and of a copy. stream_fence() orders a thread's streamed
// stores before its later ones (before it tells another thread it is done).
void f32_to_f16_row_stream(const float* src, std::uint16_t* dst, std::int64_t n);
void copy_f16_row_stream(const std::uint16_t* src, std::uint16_t* dst, std::int64_t n);
void stream_fence();

// Whether the processor has F16C (CPUID leaf 1, ECX bit 29), asked of the
// processor itself: not every compiler's __builtin_cpu_supports knows the
// name (clang 14 rejects it). False off x86-64.
bool cpu_has_f16c();

}  // namespace kvring::detail
