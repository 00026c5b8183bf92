// The device half of digest64 (src/core/digest64.h): a handoff's rows are
// checked on the GPU where they lie. Nothing here synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvring::cuda {

// Adds digest64::words(data, bytes, seed) to *sum (device memory, mod
// 2^64) on `stream`. `data` is device memory of any alignment (16-byte
// aligned data reads fastest).
cudaError_t launch_digest_words(const void* data, std::size_t bytes, std::uint32_t seed,
                                unsigned long long* sum, cudaStream_t stream);

}  // namespace kvring::cuda
