// The f16 numeric's kernels (attend_f16.cu; docs/CUDA.md, "The f16
// numeric"): their shared memory and declarations, for launch.cu.
#pragma once

#include <cstddef>

#include "kernels.h"
#include "kvring/store.h"

namespace kvring::cuda {

inline constexpr int kF16Threads = 128;  // 4 warps
// Dynamic shared memory of a CTA: `stages` stages of a K tile and a V
// tile.
KVRING_HD constexpr std::size_t f16_smem_bytes(int stages) {
  return static_cast<std::size_t>(stages * 2 * kF16AttendTile) * kTensorHeadDim * 2;
}

// A CTA a tile of kF16Rows (query, head) rows and a split, its copies one
// tile ahead of its MMAs (three CTAs an SM), or two tiles ahead (the deep
// kernel, two CTAs an SM). Both give the same bits: the copies' schedule
// is all they differ in.
__global__ void __launch_bounds__(kF16Threads, 3) attend_f16_kernel(const F16Params A);
__global__ void __launch_bounds__(kF16Threads, 2) attend_f16_deep_kernel(const F16Params A);
// The splits of each query of more than one in split order, where the
// kernel did not combine them: grid.x the tile, a warp per (query, head)
// of it.
__global__ void __launch_bounds__(kF16Threads) attend_f16_combine_kernel(const F16Params A);

}  // namespace kvring::cuda
