// Makes a GPU the thread's current one for a scope and gives the thread's
// own back at its end, so a caller that drives several GPUs from one thread
// keeps its current device (the CUDA store's calls, the handoff's GPU side).
#pragma once

#include <cuda_runtime_api.h>

namespace kvring::cuda {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaError_t e = cudaGetDevice(&previous_);
    if (e == cudaSuccess && previous_ != device) {
      e = cudaSetDevice(device);
      switched_ = e == cudaSuccess;
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      error_ = e;
    }
  }
  ~DeviceScope() {
    if (switched_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  // cudaSuccess where `device` is current for the scope.
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace kvring::cuda
