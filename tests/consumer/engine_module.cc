// A shared object that embeds the store: the static libraries it links must
// be position-independent code. It is compiled with hidden visibility, as a
// Python extension is (pybind11 and nanobind build so), and exports its entry
// point by name; the template code of kvring's headers that this file
// instantiates follows this file's visibility, kvring's libraries their own.
#include <memory>

#include "kvring/backend.h"
#include "kvring/pack.h"

extern "C" __attribute__((visibility("default"))) long long engine_module_free_blocks() {
  using namespace kvring;
  auto store = make_store(BackendKind::kCpu, make_hybrid_config("module", 2, 2, 4, 2, 32, 16, 256),
                          {.max_sequences = 2});
  if (!store) return -1;
  auto seq = (*store)->add_sequence();
  auto snapshot = seq ? take_snapshot(**store, *seq) : Result<Snapshot>(seq.error());
  if (!snapshot || !encode_pack(*snapshot)) return -1;
  return (*store)->free_blocks();
}
