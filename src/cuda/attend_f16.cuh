// The f16 numeric's kernels (attend_f16.cu; docs/CUDA.md, "The f16
// numeric"): their shared memory and declarations, for launch.cu.
#pragma once

#include <cstddef>

#include "kernels.h"
#include "kvring/store.h"

namespace kvring::cuda {

inline constexpr int kF16Threads = 128;  // 4 warps
// Dynamic shared memory of a CTA: two stages of a K tile and a V tile.
KVRING_HD constexpr std::size_t f16_smem_bytes() {
  return static_cast<std::size_t>(2 * 2 * kF16AttendTile) * kTensorHeadDim * 2;
}

// A CTA a tile of kF16Rows (query, head) rows and a split.
__global__ void __launch_bounds__(kF16Threads, 3) attend_f16_kernel(const F16Params A);
// Each query's splits in split order, one CTA a tile.
__global__ void __launch_bounds__(kF16Threads) attend_f16_combine_kernel(const F16Params A);

}  // namespace kvring::cuda
