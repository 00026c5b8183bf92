#include "testing.h"

#include <cuda_runtime_api.h>

#include <string>

#include "f16_device.cuh"
#include "kernels.h"
#include "kvring/f16.h"

namespace kvring::cuda::testing {
namespace {

struct SweepResult {
  unsigned long long mismatches;
  unsigned long long checked;
  unsigned int first;  // smallest mismatching input (atomicMin)
};

// Each thread walks a strided share of the 2^32 inputs; x goes in the low
// half of the pair and -x in the high half.
__global__ void sweep_kernel(SweepResult* out) {
  unsigned long long bad = 0, seen = 0;
  unsigned int first = 0xffffffffu;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
       i < (1ull << 32); i += stride) {
    const unsigned int bits = static_cast<unsigned int>(i);
    const float x = __uint_as_float(bits);
    const std::uint32_t pair = store_f16x2(x, -x);
    const std::uint16_t want_lo = f32_to_f16(x);
    const std::uint16_t want_hi = f32_to_f16(-x);
    ++seen;
    if ((pair & 0xffffu) != want_lo || (pair >> 16) != want_hi) {
      ++bad;
      if (bits < first) first = bits;
    }
  }
  atomicAdd(&out->mismatches, bad);
  atomicAdd(&out->checked, seen);
  if (bad) atomicMin(&out->first, first);
}

Error cuda_failure(const char* what, cudaError_t e) {
  return make_error(ErrorCode::kCuda, std::string(what) + ": " + cudaGetErrorName(e) + " (" +
                                          cudaGetErrorString(e) + ")");
}

}  // namespace

Result<F16Sweep> sweep_f16_conversion() {
  SweepResult* dev = nullptr;
  cudaError_t e = cudaMalloc(&dev, sizeof(SweepResult));
  if (e != cudaSuccess) return cuda_failure("cudaMalloc", e);
  SweepResult host{0, 0, 0xffffffffu};
  e = cudaMemcpy(dev, &host, sizeof host, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    sweep_kernel<<<1024, 256>>>(dev);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(&host, dev, sizeof host, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  if (e != cudaSuccess) return cuda_failure("f16 sweep", e);
  F16Sweep s;
  s.checked = host.checked;
  s.mismatches = host.mismatches;
  if (s.mismatches) {
    s.first_input = host.first;
    const float x = f32_from_bits(host.first);
    s.first_shared = f32_to_f16(x);
    // The device's answer for that input, for the report.
    std::uint16_t* d16 = nullptr;
    float* dx = nullptr;
    if (cudaMalloc(&d16, 2 * sizeof(std::uint16_t)) == cudaSuccess &&
        cudaMalloc(&dx, sizeof(float)) == cudaSuccess &&
        cudaMemcpy(dx, &x, sizeof x, cudaMemcpyHostToDevice) == cudaSuccess &&
        launch_convert_kv(SourceRows{dx, 1, 0}, SourceRows{dx, 1, 0}, 1, 1, false, d16, nullptr) ==
            cudaSuccess)
      cudaMemcpy(&s.first_device, d16, sizeof(std::uint16_t), cudaMemcpyDeviceToHost);
    cudaFree(d16);
    cudaFree(dx);
  }
  return s;
}

Status check_capability(int major, int minor, bool kernels_run) {
  return capability_status(0, "test", major, minor, kernels_run);
}

Status check_f16_numeric(int major, int minor, const char* targets) {
  return f16_numeric_status(major, minor, targets);
}

}  // namespace kvring::cuda::testing
