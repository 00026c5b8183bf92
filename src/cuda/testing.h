// Hooks for the CUDA tests: device-side checks that have no place in the
// store's interface. They live in the kvring_cuda_testing library, which
// only the test binary links; the store's own library holds no test code
// (tests force attention's paths through a LaunchPolicy, launch_policy.h).
#pragma once

#include <cstdint>

#include "kvring/status.h"

namespace kvring::cuda::testing {

// Converts every one of the 2^32 f32 bit patterns on the GPU with the store
// kernels' conversion and with f32_to_f16 (f16.h, compiled for the device),
// in both halves of a packed pair.
struct F16Sweep {
  std::uint64_t checked = 0;
  std::uint64_t mismatches = 0;
  std::uint32_t first_input = 0;   // the first mismatching f32 bits
  std::uint16_t first_device = 0;  // what the store conversion gave
  std::uint16_t first_shared = 0;  // what f32_to_f16 gave
};
Result<F16Sweep> sweep_f16_conversion();

// The capability check of store creation for a device of compute
// capability major.minor on which this build's kernels do (or do not) run:
// ok, or kUnsupported naming the capability and the build's targets.
Status check_capability(int major, int minor, bool kernels_run);

// The f16 numeric's check of store creation for a device of compute
// capability major.minor and a build for `targets`.
Status check_f16_numeric(int major, int minor, const char* targets);

}  // namespace kvring::cuda::testing
