// The CPU backend of KvStore (host memory); make_store picks it.
#pragma once

#include <memory>

#include "kvring/store.h"

namespace kvring {

Result<std::unique_ptr<KvStore>> make_cpu_store(const ModelConfig& config, StoreOptions options);

}  // namespace kvring
