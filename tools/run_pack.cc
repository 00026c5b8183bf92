#include "run_pack.h"

#include <cmath>

#include <cstring>
#include <nlohmann/json.hpp>

#include "kvring/chunk_store.h"
#include "kvring/footprint.h"
#include "kvring/pack.h"
#include "kvring/sha256.h"

namespace kvring::cli {

namespace {

// The record's layout version inside the metadata blob.
constexpr int kRunRecordVersion = 1;

std::string logits_hex(const std::vector<float>& logits) {
  std::vector<std::uint8_t> bytes(logits.size() * 4);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    std::uint32_t u;
    std::memcpy(&u, &logits[i], 4);
    for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<std::uint8_t>(u >> (8 * b));
  }
  return to_hex(bytes.data(), bytes.size());
}

Result<std::vector<float>> logits_from_hex(const std::string& hex) {
  if (hex.size() % 8 != 0) return invalid_argument("last_logits_f32le has " + std::to_string(hex.size()) + " hex digits");
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::vector<float> out(hex.size() / 8);
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint32_t u = 0;
    for (int b = 0; b < 4; ++b) {
      const int hi = digit(hex[8 * i + 2 * b]), lo = digit(hex[8 * i + 2 * b + 1]);
      if (hi < 0 || lo < 0) return invalid_argument("last_logits_f32le is not lowercase hex");
      u |= static_cast<std::uint32_t>(hi * 16 + lo) << (8 * b);
    }
    std::memcpy(&out[i], &u, 4);
  }
  return out;
}

Result<std::unique_ptr<ChunkStore>> maybe_store(const std::string& spec) {
  if (spec.empty()) return std::unique_ptr<ChunkStore>();
  return open_chunk_store(spec);
}

}  // namespace

std::string encode_run_record(const RunRecord& r) {
  nlohmann::json j;
  j["kvring_run"] = kRunRecordVersion;
  j["model"] = r.model;
  j["rope_theta"] = r.rope_theta;
  j["hidden"] = r.options.hidden;
  j["vocab"] = r.options.vocab;
  j["mlp"] = r.options.mlp;
  j["weights_seed"] = r.options.seed;
  j["seed"] = r.seed;
  j["prompt_tokens"] = r.prompt_tokens;
  j["chunk"] = r.chunk;
  j["last_logits_f32le"] = logits_hex(r.last_logits);
  return j.dump();
}

Result<RunRecord> decode_run_record(const std::string& metadata, const std::string& pack) {
  const std::string where = pack + ": metadata: ";
  nlohmann::json j = nlohmann::json::parse(metadata, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("kvring_run"))
    return invalid_argument(pack + " was not written by kvring run --save (no run record in its metadata)");
  if (!j["kvring_run"].is_number_integer() || j["kvring_run"].get<int>() != kRunRecordVersion)
    return make_error(ErrorCode::kUnsupported, where + "run record version " + j["kvring_run"].dump() +
                                                   " (this build reads " + std::to_string(kRunRecordVersion) + ")");
  RunRecord r;
  auto need = [&](const char* field, bool ok) -> Status {
    if (!j.contains(field) || !ok) return invalid_argument(where + "field '" + field + "' is missing or malformed");
    return Status::Ok();
  };
  KVRING_RETURN_IF_ERROR(need("model", j.contains("model") && j["model"].is_string()));
  KVRING_RETURN_IF_ERROR(need("rope_theta", j.contains("rope_theta") && j["rope_theta"].is_number()));
  for (const char* f : {"hidden", "vocab", "mlp", "prompt_tokens", "chunk"})
    KVRING_RETURN_IF_ERROR(need(f, j.contains(f) && j[f].is_number_integer()));
  for (const char* f : {"weights_seed", "seed"})
    KVRING_RETURN_IF_ERROR(need(f, j.contains(f) && j[f].is_number_unsigned()));
  KVRING_RETURN_IF_ERROR(need("last_logits_f32le", j.contains("last_logits_f32le") && j["last_logits_f32le"].is_string()));
  r.model = j["model"].get<std::string>();
  r.rope_theta = j["rope_theta"].get<double>();
  r.options.hidden = j["hidden"].get<std::int64_t>();
  r.options.vocab = j["vocab"].get<std::int64_t>();
  r.options.mlp = j["mlp"].get<std::int64_t>();
  r.options.seed = j["weights_seed"].get<std::uint64_t>();
  r.seed = j["seed"].get<std::uint64_t>();
  r.prompt_tokens = j["prompt_tokens"].get<std::int64_t>();
  r.chunk = j["chunk"].get<std::int64_t>();
  auto logits = logits_from_hex(j["last_logits_f32le"].get<std::string>());
  if (!logits) return invalid_argument(where + logits.error().message);
  r.last_logits = std::move(*logits);
  return r;
}

Status check_save_store(const std::string& store_spec) {
  auto store = open_chunk_store(store_spec);
  if (!store) return store.error();
  return (*store)->check_writable();
}

Result<std::string> save_run(const Session& session, const RunRecord& record, const std::string& path,
                             const std::string& store_spec) {
  return save_sequence(session.cache().store(), session.cache().seq(), session.tokens(), record,
                       path, store_spec);
}

Result<std::string> save_sequence(const KvStore& kv, SeqId seq, const std::vector<std::int32_t>& tokens,
                                  const RunRecord& record, const std::string& path,
                                  const std::string& store_spec) {
  auto store = maybe_store(store_spec);
  if (!store) return store.error();
  auto snapshot = take_snapshot(kv, seq);
  if (!snapshot) return snapshot.error();
  snapshot->token_ids = tokens;
  snapshot->metadata = encode_run_record(record);
  KVRING_RETURN_IF_ERROR(write_pack(*snapshot, path, {.store = store->get()}));
  auto src = open_pack_file(path);
  if (!src) return src.error();
  auto m = read_manifest(**src);
  if (!m) return m.error();
  std::string line = path + ": " + format_bytes((*src)->size()) + ", " + std::to_string(m->chunks.size()) + " chunks";
  if (*store) line += " (" + format_bytes(m->payload_bytes) + ") in " + (*store)->spec();
  return line;
}

Result<ResumedRun> resume_run(const std::string& path, const std::string& store_spec, BackendKind backend,
                              std::int64_t context) {
  auto src = open_pack_file(path);
  if (!src) return src.error();
  auto m = read_manifest(**src);
  if (!m) return m.error();
  auto record = decode_run_record(m->header.metadata, path);
  if (!record) return record.error();
  if (static_cast<std::int64_t>(m->header.token_ids.size()) != m->header.token_count || m->header.token_count == 0)
    return invalid_argument(path + ": a run's pack must hold the token ids of its " +
                            std::to_string(m->header.token_count) + " tokens");
  // The run record is as untrusted as any other field of the pack.
  if (record->prompt_tokens < 1 || record->prompt_tokens > m->header.token_count)
    return invalid_argument(path + ": metadata: prompt_tokens = " + std::to_string(record->prompt_tokens) +
                            " outside [1, " + std::to_string(m->header.token_count) + "] (the tokens it holds)");
  if (record->chunk < 1)
    return invalid_argument(path + ": metadata: chunk = " + std::to_string(record->chunk) + " < 1");
  if (!(record->rope_theta > 0.0) || !std::isfinite(record->rope_theta))
    return invalid_argument(path + ": metadata: rope_theta must be a positive finite number");
  // The geometry comes from the pack; the name and RoPE base, which the
  // fingerprint does not cover, from the run record.
  ModelConfig config = m->header.config;
  config.name = record->model;
  config.rope_theta = record->rope_theta;
  auto model = ReferenceModel::create(config, record->options);
  if (!model) return model.error();
  auto store = maybe_store(store_spec);
  if (!store) return store.error();
  auto snapshot = read_pack(**src, {.store = store->get()});
  if (!snapshot) return snapshot.error();
  auto cache = restore_detached(*snapshot, backend, context);
  if (!cache) return cache.error();
  auto session = Session::resume(*model, std::move(*cache), snapshot->token_ids, record->last_logits);
  if (!session) return session.error();
  return ResumedRun{std::move(*record), std::move(*session)};
}

}  // namespace kvring::cli
