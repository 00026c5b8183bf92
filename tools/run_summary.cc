#include "run_summary.h"

#include <cstdio>

namespace kvring::cli {

namespace {

nlohmann::json ring_json(const RingState& r, std::int64_t layer) {
  return {{"layer", layer},           {"capacity", r.capacity()},
          {"len", r.len()},           {"origin_logical", r.origin_logical()},
          {"origin_physical", r.origin_physical()}};
}

}  // namespace

PlaneUse plane_use(const KvStore& store, SeqId seq) {
  PlaneUse u;
  const ModelConfig& c = store.config();
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    auto r = store.ring(seq, l);
    if (!r) continue;
    const std::int64_t bytes = r->len() * c.kv_dim() * 4;
    if (c.kind(l) == LayerKind::kSlidingRope) {
      u.sliding_bytes += bytes;
      if (u.sliding_layer < 0) u.sliding_layer = l, u.sliding_ring = *r;
    } else {
      u.full_bytes += bytes;
      if (u.full_layer < 0) u.full_layer = l, u.full_ring = *r;
    }
  }
  return u;
}

nlohmann::json summary_json(const SummaryFields& f) {
  nlohmann::json j;
  j["model"] = f.model;
  j["fingerprint"] = f.fingerprint;
  j["backend"] = backend_name(f.backend);
  j["tokens"] = f.tokens;
  j["prompt_tokens"] = f.prompt_tokens;
  j["seed"] = f.seed;
  j["chunk"] = f.chunk;
  j["hidden"] = f.options.hidden;
  j["vocab"] = f.options.vocab;
  j["context"] = f.context;
  j["attention"] = attention_numeric_name(f.attention);
  j["generated"] = f.generated;
  j["logits_sha256"] = f.logits_sha256;
  j["cache"] = {{"sliding_bytes_in_use", f.use.sliding_bytes},
                {"full_bytes_in_use", f.use.full_bytes},
                {"allocated_bytes", f.allocated_bytes}};
  j["rings"] = nlohmann::json::object();
  if (f.use.sliding_layer >= 0) j["rings"]["sliding"] = ring_json(f.use.sliding_ring, f.use.sliding_layer);
  if (f.use.full_layer >= 0) j["rings"]["full"] = ring_json(f.use.full_ring, f.use.full_layer);
  j["timing"] = {{"prefill_s", f.prefill_s},
                 {"decode_s", f.decode_s},
                 {"prefill_tokens_per_s", f.prefill_s > 0 ? static_cast<double>(f.prefilled) / f.prefill_s : 0.0},
                 {"decode_tokens_per_s", f.decode_s > 0 ? static_cast<double>(f.decoded) / f.decode_s : 0.0}};
  return j;
}

void print_ring(const char* name, std::int64_t layer, const RingState& r) {
  if (layer < 0) return;
  std::printf("  ring %-7s layer %lld: capacity %lld, len %lld, origin logical %lld, physical %lld\n",
              name, static_cast<long long>(layer), static_cast<long long>(r.capacity()),
              static_cast<long long>(r.len()), static_cast<long long>(r.origin_logical()),
              static_cast<long long>(r.origin_physical()));
}

}  // namespace kvring::cli
