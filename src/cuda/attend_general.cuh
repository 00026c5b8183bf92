// The general attention kernel (any head_dim up to 256 but 128): its
// declaration (attend_general.cu; docs/CUDA.md, "Any other head_dim").
#pragma once

#include "attend_rows.cuh"
#include "kernels.h"

namespace kvring::cuda {

__global__ void __launch_bounds__(kAttendThreads, 2) attend_general_kernel(const KernelArgs A);
__global__ void __launch_bounds__(kAttendThreads, 2)
    attend_general_inline_kernel(const __grid_constant__ InlineArgs A);

}  // namespace kvring::cuda
