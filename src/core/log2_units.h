// The units both backends' attention computes in: scores and sinks times
// log2(e), so that exp2 of a difference is exp of the original difference
// (docs/DESIGN.md, "Attention numerics"). Each factor is rounded to f32
// once, here, so the CPU and CUDA backends start from the same bits.
#pragma once

#include <cfloat>
#include <cmath>

namespace kvring::detail {

inline constexpr double kLog2e = 1.4426950408889634;

// The factor every score takes: log2(e) / sqrt(scale_dim), rounded once.
inline float score_scale_log2(double scale_dim) {
  return static_cast<float>(kLog2e / std::sqrt(scale_dim));
}

// An attention sink in the scores' units: sink x log2(e) rounded to f32,
// capped at FLT_MAX (a finite sink past FLT_MAX / log2(e) would become inf).
inline float sink_log2(float sink) {
  return std::fmin(sink * static_cast<float>(kLog2e), FLT_MAX);
}

}  // namespace kvring::detail
