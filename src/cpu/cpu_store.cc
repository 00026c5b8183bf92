// The CPU backend: rings and the block pool in host memory.
#include "cpu_store.h"

#include <memory>

namespace kvring {

Result<std::unique_ptr<KvStore>> make_cpu_store(const ModelConfig& config, StoreOptions options) {
  auto o = resolve_store_options(config, options);
  if (!o) return o.error();
  auto store = std::make_unique<CpuStore>(config, *o);
  KVRING_RETURN_IF_ERROR(store->allocate());
  return std::unique_ptr<KvStore>(std::move(store));
}

}  // namespace kvring
