// What `kvring run` prints about a session: the options of a run, the
// summary object of one sequence (the same for a solo run and for each
// sequence of a batched run), and the batched run itself.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvring/model.h"
#include "kvring/store.h"

namespace kvring::cli {

// The most sequences `kvring run --sequences` runs at once.
inline constexpr std::int64_t kMaxRunSequences = 4096;

struct RunOptions {
  std::string model_name, config_path, backend = "auto";
  std::string save, resume, store;  // kvpack files and the chunk store
  std::string handoff_to, handoff_schedule = "paced";  // --handoff-to: send instead of decoding
  double handoff_rate_gb_s = 0, handoff_timeout_s = 10, handoff_min_rate_gb_s = 64.0 * 1024 / 1e9;
  std::int64_t handoff_message_kib = 4096;
  bool tokens_given = false;
  std::int64_t tokens = 320, prompt_tokens = -1, chunk = 128, context = 0;
  std::int64_t sequences = 0;  // 0: one session, not a batch
  AttentionNumeric attention = AttentionNumeric::kF32;
  std::uint64_t seed = 1;
  ModelOptions model;
  bool json = false, progress = true;
};

// Live bytes per plane class and the rings of the first sliding and the
// first full layer of one sequence.
struct PlaneUse {
  std::int64_t sliding_bytes = 0, full_bytes = 0;
  std::int64_t sliding_layer = -1, full_layer = -1;
  RingState sliding_ring, full_ring;
};
PlaneUse plane_use(const KvStore& store, SeqId seq);

struct SummaryFields {
  std::string model, fingerprint;
  BackendKind backend;
  std::int64_t tokens, prompt_tokens;
  std::uint64_t seed;
  std::int64_t chunk;
  ModelOptions options;
  std::int64_t context;
  std::vector<std::int32_t> generated;
  std::string logits_sha256;
  PlaneUse use;
  std::int64_t allocated_bytes;
  double prefill_s, decode_s;
  std::int64_t prefilled, decoded;
  AttentionNumeric attention;
};
// Everything outside "timing" is deterministic.
nlohmann::json summary_json(const SummaryFields& f);

void print_ring(const char* name, std::int64_t layer, const RingState& r);

// `kvring run --sequences N` (o.sequences >= 1).
int run_many(const RunOptions& o, BackendKind backend);

}  // namespace kvring::cli
