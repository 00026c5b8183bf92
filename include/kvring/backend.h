// Choosing a backend at run time.
#pragma once

#include <memory>
#include <string_view>

#include "kvring/cache.h"
#include "kvring/store.h"

namespace kvring {

// True when this build contains the CUDA backend.
bool cuda_compiled();
// True when the CUDA backend is compiled and a GPU is visible.
bool cuda_device_available();

// "cpu", "cuda" or "auto" (CUDA where a GPU is visible, else CPU).
Result<BackendKind> parse_backend(std::string_view name);

// A one-sequence cache on the chosen backend; kUnsupported for CUDA in a
// build or on a machine without it.
Result<std::unique_ptr<KvCache>> make_cache(BackendKind kind, const ModelConfig& config,
                                            CacheOptions options = {});

}  // namespace kvring
