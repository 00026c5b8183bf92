#include "kvring/backend.h"

#include <string>

#include "cpu/cpu_store.h"
#include "cpu/parallel.h"

#if KVRING_HAVE_CUDA
#include "kvring/cuda_store.h"
#endif

namespace kvring {

bool cuda_compiled() { return KVRING_HAVE_CUDA != 0; }

void set_cpu_threads(unsigned threads) { cpu::set_thread_limit(threads); }

unsigned cpu_threads() {
  const unsigned limit = cpu::thread_limit();
  return limit == 0 ? cpu::worker_count() : std::min(limit, cpu::worker_count());
}

bool cuda_device_available() {
#if KVRING_HAVE_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

Result<BackendKind> parse_backend(std::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  if (name == "auto" || name.empty())
    return cuda_device_available() ? BackendKind::kCuda : BackendKind::kCpu;
  return invalid_argument("unknown backend '" + std::string(name) + "' (cpu, cuda or auto)");
}

Result<std::unique_ptr<KvStore>> make_store(BackendKind kind, const ModelConfig& config,
                                            StoreOptions options) {
  if (kind == BackendKind::kCpu) return make_cpu_store(config, options);
#if KVRING_HAVE_CUDA
  if (!cuda_device_available())
    return make_error(ErrorCode::kUnsupported, "the CUDA backend needs a GPU; none is visible");
  return make_cuda_store(config, options);
#else
  return make_error(ErrorCode::kUnsupported, "this build has no CUDA backend (nvcc was not found)");
#endif
}

Result<std::unique_ptr<KvCache>> make_cache(BackendKind kind, const ModelConfig& config,
                                            CacheOptions options) {
  return KvCache::create(kind, config, options);
}

}  // namespace kvring
