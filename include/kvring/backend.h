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

// The CPU backend's threads: its calls use at most `threads` (the calling
// thread included; 1: only the caller's; 0, the default: one a hardware
// thread, at most 64), process-wide, from the next call on. The workers it
// leaves out are not woken, so an engine's own thread pool keeps those
// cores. The workers serve one call at a time; a call from another thread
// that finds them busy runs on its own thread instead of waiting. The bits
// of every result are the same at any setting.
void set_cpu_threads(unsigned threads);
unsigned cpu_threads();

// "cpu", "cuda" or "auto" (CUDA where a GPU is visible, else CPU).
Result<BackendKind> parse_backend(std::string_view name);

// A one-sequence cache on the chosen backend; kUnsupported for CUDA in a
// build or on a machine without it.
Result<std::unique_ptr<KvCache>> make_cache(BackendKind kind, const ModelConfig& config,
                                            CacheOptions options = {});

}  // namespace kvring
