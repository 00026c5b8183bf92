// A kernel launch whose status is its own: cudaLaunchKernelEx returns the
// launch's error, where `kernel<<<...>>>` followed by cudaGetLastError would
// also return an error an earlier runtime call of the caller's thread left
// pending (a failed cudaMalloc of the engine's, say) and fail a launch that
// ran. A failed launch's error is cleared, so it is reported here and not by
// a later call; a caller's pending error is left for the caller.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace kvring::cuda {

template <class... Params, class... Args>
cudaError_t launch_plain(void (*kernel)(Params...), dim3 grid, unsigned threads, std::size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

}  // namespace kvring::cuda
