// A shared object that embeds the store: the static libraries it links must
// be position-independent code.
#include <memory>

#include "kvring/backend.h"
#include "kvring/pack.h"

extern "C" long long engine_module_free_blocks() {
  using namespace kvring;
  auto store = make_store(BackendKind::kCpu, make_hybrid_config("module", 2, 2, 4, 2, 32, 16, 256),
                          {.max_sequences = 2});
  if (!store) return -1;
  auto seq = (*store)->add_sequence();
  auto snapshot = seq ? take_snapshot(**store, *seq) : Result<Snapshot>(seq.error());
  if (!snapshot || !encode_pack(*snapshot)) return -1;
  return (*store)->free_blocks();
}
