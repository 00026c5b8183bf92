#include "run_pack.h"

#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/file_read.h"
#include "core/json_tree.h"
#include "kvring/chunk_store.h"
#include "kvring/footprint.h"
#include "kvring/pack.h"
#include "kvring/sha256.h"
#include "core/text.h"

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
  if (hex.size() % 8 != 0) return invalid_argument("'last_logits_f32le' has " + std::to_string(hex.size()) + " hex digits");
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
      if (hi < 0 || lo < 0) return invalid_argument("'last_logits_f32le' is not lowercase hex");
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

Result<std::unique_ptr<ChunkStore>> store_to_read(const std::string& store_spec, const PackSource& pack) {
  if (store_spec.empty()) return std::unique_ptr<ChunkStore>();
  // A self-contained pack's reader never opens the store (an unreachable
  // Redis is no more its concern than an absent directory), though a spec
  // that names no store is refused; a pack whose manifest does not read is
  // left to the reader to report.
  KVRING_RETURN_IF_ERROR(check_chunk_store_spec(store_spec));
  auto m = read_manifest(pack);
  if (m && !m->thin) return std::unique_ptr<ChunkStore>();
  return open_chunk_store(store_spec, {.create = false});
}

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
  j["attention"] = attention_numeric_name(r.attention);
  if (r.query_pre_attn_scalar > 0) j["query_pre_attn_scalar"] = r.query_pre_attn_scalar;
  if (r.attention_sinks) j["attention_sinks"] = true;
  j["last_logits_f32le"] = logits_hex(r.last_logits);
  return j.dump();
}

namespace {

// The key of the last '"key":' that starts before byte `at` of `text`: the
// field a JSON syntax error at `at` falls in.
std::string field_before(const std::string& text, std::size_t at) {
  std::string field;
  for (std::size_t i = 0; i < text.size() && i < at; ++i) {
    if (text[i] != '"') continue;
    std::size_t j = i + 1;
    while (j < text.size() && j < at && text[j] != '"' && text[j] != '\\') ++j;
    if (j >= text.size() || j >= at || text[j] != '"') break;
    std::size_t k = j + 1;
    while (k < text.size() && (text[k] == ' ' || text[k] == '\t' || text[k] == '\n' || text[k] == '\r')) ++k;
    if (k < text.size() && text[k] == ':') field = text.substr(i + 1, j - i - 1);
    i = j;
  }
  return field;
}

}  // namespace

Result<RunRecord> decode_run_record(const std::string& metadata, const std::string& pack) {
  const std::string where = pack + ": metadata: ";
  const std::string not_ours = pack + " was not written by kvring run --save";
  if (metadata.empty()) return invalid_argument(not_ours + " (its metadata is empty)");
  // Bounded before it is parsed: a parse takes tens of bytes of memory for
  // each byte of deeply nested text. A run record is one flat object whose
  // largest field holds the last logits.
  if (static_cast<std::int64_t>(metadata.size()) > kMaxRunRecordBytes)
    return invalid_argument(where + std::to_string(metadata.size()) + " bytes, more than a run record's " +
                            std::to_string(kMaxRunRecordBytes) + " (the last logits of a " +
                            std::to_string(kMaxRunVocab) + "-entry vocabulary and its other fields)");
  // JSON text has no NUL byte; the parser would end the input at one and
  // take the record before it, whatever follows.
  if (const auto nul = metadata.find('\0'); nul != std::string::npos) {
    if (metadata.find("\"kvring_run\"") == std::string::npos)
      return invalid_argument(not_ours + " (its metadata is not a JSON run record)");
    return invalid_argument(where + "a NUL byte at byte " + std::to_string(nul) + ": a run record is JSON text");
  }
  if (const int depth = json_depth(metadata); depth > kMaxRunRecordDepth)
    return invalid_argument(where + "arrays and objects nested " + std::to_string(depth) +
                            " deep; a run record nests at most " + std::to_string(kMaxRunRecordDepth));
  // The tree comes down without allocating, should the memory run out
  // during the parse or after it (core/json_tree.h).
  JsonTree tree;
  nlohmann::json& j = tree.root();
  try {
    tree.parse(metadata);
  } catch (const nlohmann::json::parse_error& e) {
    // A record that starts like kvring's but does not parse is a damaged
    // record: name the field the error falls in, not the writer.
    if (metadata.find("\"kvring_run\"") == std::string::npos)
      return invalid_argument(not_ours + " (its metadata is not a JSON run record)");
    const std::size_t at = e.byte > 0 ? e.byte - 1 : 0;
    const std::string field = field_before(metadata, at);
    return invalid_argument(where + "the run record does not parse" +
                            (field.empty() ? "" : " in field '" + printable(field) + "'") + ": byte " +
                            std::to_string(at) + " is not valid JSON");
  } catch (const nlohmann::json::exception& e) {
    // Not a syntax error: a number too large for a double (out_of_range 406).
    return invalid_argument(where + "the run record does not parse: " + e.what());
  }
  if (!j.is_object() || !j.contains("kvring_run"))
    return invalid_argument(not_ours + " (no run record in its metadata)");
  auto shown = [](const nlohmann::json& v) {
    std::string d = v.dump(-1, ' ', /*ensure_ascii=*/true);
    return d.size() > 40 ? d.substr(0, 40) + "..." : d;
  };
  if (!j["kvring_run"].is_number_integer() || j["kvring_run"].get<std::int64_t>() != kRunRecordVersion)
    return make_error(ErrorCode::kUnsupported, where + "run record version " + shown(j["kvring_run"]) +
                                                   " (this build reads " + std::to_string(kRunRecordVersion) + ")");
  auto need = [&](const char* field, bool (nlohmann::json::*is)() const noexcept, const char* kind) -> Status {
    if (!j.contains(field)) return invalid_argument(where + "field '" + field + "' is missing");
    if (!(j[field].*is)())
      return invalid_argument(where + "field '" + field + "' must be " + kind + ", got " + shown(j[field]));
    return Status::Ok();
  };
  using J = nlohmann::json;
  KVRING_RETURN_IF_ERROR(need("model", &J::is_string, "a string"));
  KVRING_RETURN_IF_ERROR(need("rope_theta", &J::is_number, "a number"));
  for (const char* f : {"hidden", "vocab", "mlp", "prompt_tokens", "chunk"})
    KVRING_RETURN_IF_ERROR(need(f, &J::is_number_integer, "an integer"));
  for (const char* f : {"weights_seed", "seed"})
    KVRING_RETURN_IF_ERROR(need(f, &J::is_number_unsigned, "an unsigned integer"));
  KVRING_RETURN_IF_ERROR(need("last_logits_f32le", &J::is_string, "a string"));
  RunRecord r;
  r.model = j["model"].get<std::string>();
  if (r.model.empty()) return invalid_argument(where + "field 'model' is empty (a run names its model)");
  r.rope_theta = j["rope_theta"].get<double>();
  if (!(r.rope_theta > 0.0) || !std::isfinite(r.rope_theta))
    return invalid_argument(where + "field 'rope_theta' must be a positive finite number, got " +
                            shown(j["rope_theta"]));
  r.options.hidden = j["hidden"].get<std::int64_t>();
  r.options.vocab = j["vocab"].get<std::int64_t>();
  r.options.mlp = j["mlp"].get<std::int64_t>();
  r.options.seed = j["weights_seed"].get<std::uint64_t>();
  r.seed = j["seed"].get<std::uint64_t>();
  r.prompt_tokens = j["prompt_tokens"].get<std::int64_t>();
  r.chunk = j["chunk"].get<std::int64_t>();
  if (j.contains("attention")) {
    KVRING_RETURN_IF_ERROR(need("attention", &J::is_string, "a string"));
    auto numeric = parse_attention_numeric(j["attention"].get<std::string>());
    if (!numeric) return invalid_argument(where + "field 'attention': " + numeric.error().message);
    r.attention = *numeric;
  }
  if (j.contains("query_pre_attn_scalar")) {
    KVRING_RETURN_IF_ERROR(need("query_pre_attn_scalar", &J::is_number, "a number"));
    r.query_pre_attn_scalar = j["query_pre_attn_scalar"].get<double>();
    if (!(r.query_pre_attn_scalar >= kMinScoreScaleDim) || !(r.query_pre_attn_scalar <= kMaxScoreScaleDim))
      return invalid_argument(where + "field 'query_pre_attn_scalar' must be a number in [1, 2^30], got " +
                              shown(j["query_pre_attn_scalar"]));
  }
  if (j.contains("attention_sinks")) {
    KVRING_RETURN_IF_ERROR(need("attention_sinks", &J::is_boolean, "true or false"));
    r.attention_sinks = j["attention_sinks"].get<bool>();
  }
  // The reference model's bounds, checked here so that nothing is built for
  // a record that cannot be served.
  auto range = [&](const char* field, std::int64_t v, std::int64_t lo, std::int64_t hi) -> Status {
    if (v < lo || v > hi)
      return invalid_argument(where + "field '" + field + "' = " + std::to_string(v) + " outside [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return Status::Ok();
  };
  KVRING_RETURN_IF_ERROR(range("hidden", r.options.hidden, 1, kMaxRunHidden));
  KVRING_RETURN_IF_ERROR(range("vocab", r.options.vocab, 2, kMaxRunVocab));
  KVRING_RETURN_IF_ERROR(range("mlp", r.options.mlp, 0, 4 * kMaxRunHidden));
  // The last logits are one per vocabulary entry: compared by length before
  // anything is decoded.
  // None at all is a session whose receiver computes them (a handoff).
  const std::string& hex = j["last_logits_f32le"].get_ref<const std::string&>();
  if (!hex.empty() && hex.size() != static_cast<std::size_t>(r.options.vocab) * 8)
    return invalid_argument(where + "field 'last_logits_f32le' holds " + std::to_string(hex.size()) +
                            " hex digits; field 'vocab' = " + std::to_string(r.options.vocab) + " needs " +
                            std::to_string(r.options.vocab * 8) + " (8 per logit)");
  auto logits = logits_from_hex(hex);
  if (!logits) return invalid_argument(where + "field " + logits.error().message);
  r.last_logits = std::move(*logits);
  return r;
}

std::string indexed_path(const std::string& path, std::int64_t i) {
  const std::size_t slash = path.find_last_of('/');
  const std::size_t dot = path.find_last_of('.');
  std::string index = std::to_string(i);
  index.insert(index.begin(), '.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) ||
      dot == (slash == std::string::npos ? 0 : slash + 1))
    return path + index;
  return path.substr(0, dot) + index + path.substr(dot);
}

Status check_save(const std::string& save, std::int64_t sequences, const std::string& store_spec) {
  for (std::int64_t i = 0; i < std::max<std::int64_t>(1, sequences); ++i) {
    const std::string path = sequences > 0 ? indexed_path(save, i) : save;
    if (Status s = check_pack_destination(path); !s.ok())
      return make_error(s.error().code, "--save: " + s.error().message);
  }
  if (store_spec.empty()) return Status::Ok();
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
  KVRING_RETURN_IF_ERROR(write_pack(kv, seq, path, tokens, encode_run_record(record), {.store = store->get()}));
  auto src = open_pack_file(path);
  if (!src) return src.error();
  auto m = read_manifest(**src);
  if (!m) return m.error();
  std::string line = printable(path) + ": " + format_bytes((*src)->size()) + ", " + std::to_string(m->chunks.size()) + " chunks";
  if (*store) line += " (" + format_bytes(m->payload_bytes) + ") in " + printable((*store)->spec());
  return line;
}

Error RunPack::named(const Error& e) const {
  Error out = e;
  out.message = path + ": model '" + printable(record.model, false) + "': " + e.message;
  return out;
}

Result<RunPack> open_run_pack(const std::string& path, const std::string& store_spec) {
  auto src = open_pack_file(path);
  if (!src) return src.error();
  auto m = read_manifest(**src);
  if (!m) return m.error();
  // Everything the manifest and the run record can show is checked before
  // any rows are read or any model is built.
  auto record = decode_run_record(m->header.metadata, path);
  if (!record) return record.error();
  const std::string model_name = "model '" + printable(record->model, false) + "'";
  if (static_cast<std::int64_t>(m->header.token_ids.size()) != m->header.token_count || m->header.token_count == 0)
    return invalid_argument(path + ": a run's pack must hold the token ids of its " +
                            std::to_string(m->header.token_count) + " tokens");
  // The run record is as untrusted as any other field of the pack.
  if (record->prompt_tokens < 1 || record->prompt_tokens > m->header.token_count)
    return invalid_argument(path + ": metadata: prompt_tokens = " + std::to_string(record->prompt_tokens) +
                            " outside [1, " + std::to_string(m->header.token_count) + "] (the tokens it holds)");
  if (record->chunk < 1)
    return invalid_argument(path + ": metadata: chunk = " + std::to_string(record->chunk) + " < 1");
  if (record->last_logits.empty())
    return invalid_argument(path + ": metadata: field 'last_logits_f32le' is empty; a saved run "
                            "holds the logits of its last token");
  const auto& ids = m->header.token_ids;
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= record->options.vocab)
      return invalid_argument(path + ": tokens: token id " + std::to_string(ids[i]) + " at position " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(record->options.vocab) + ") of " + model_name);
  // The rows the header claims are backed (a thin pack's chunks in their
  // store) before the run sizes a store by it.
  auto chunks = store_to_read(store_spec, **src);
  if (!chunks) return chunks.error();
  KVRING_RETURN_IF_ERROR(check_pack_backed(**src, {.store = chunks->get()}));
  // The geometry comes from the pack; the name, RoPE base, score scale and
  // sinks from the run record.
  ModelConfig config = m->header.config;
  config.name = record->model;
  config.rope_theta = record->rope_theta;
  config.query_pre_attn_scalar = record->query_pre_attn_scalar;
  config.attention_sinks = record->attention_sinks;
  return RunPack{path, store_spec, std::move(*record), m->digest, m->header.context,
                 std::move(m->header.token_ids), std::move(config)};
}

Result<SeqId> restore_run_pack(const RunPack& pack, KvStore& store) {
  const Error changed{ErrorCode::kMismatch, pack.path + ": the pack changed after its run record was read"};
  auto src = open_pack_file(pack.path);
  if (!src) return src.error();
  // Compared before any row is read, and again on the manifest the restore
  // itself read (the file may be replaced between the two reads).
  auto m = read_manifest(**src);
  if (!m) return m.error();
  if (m->digest != pack.digest) return changed;
  auto chunks = store_to_read(pack.store_spec, **src);
  if (!chunks) return chunks.error();
  // restore_pack's errors name the pack.
  Manifest read;
  auto seq = restore_pack(**src, {.store = chunks->get()}, store, &read);
  if (!seq) return seq.error();
  if (read.digest != pack.digest) {
    (void)store.remove_sequence(*seq);
    return changed;
  }
  return *seq;
}

std::string cache_context_text(std::int64_t limit, std::int64_t context) {
  return "the cache context " + std::to_string(context) +
         (limit > context && limit < kNoPositionLimit
              ? " (" + std::to_string(limit) + " positions on its full planes)"
              : "");
}

Status check_run_model(const ModelConfig& config, const ModelOptions& options) {
  KVRING_RETURN_IF_ERROR(ReferenceModel::check(config, options));
  std::int64_t limit = file_internal::memory_limit_bytes();
  struct rlimit as {};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY &&
      as.rlim_cur < static_cast<rlim_t>(limit))
    limit = static_cast<std::int64_t>(as.rlim_cur);
  const double weights = ReferenceModel::weight_bytes(config, options);
  if (weights > static_cast<double>(limit / 2))
    return make_error(ErrorCode::kCapacityExceeded,
                      "the reference model (hidden " + std::to_string(options.hidden) + ", vocab " +
                          std::to_string(options.vocab) + ", " + std::to_string(config.n_layers) +
                          " layers) would take " + format_bytes(static_cast<std::int64_t>(weights)) +
                          ", more than half the " + format_bytes(limit) +
                          " this process may use (a smaller hidden size or vocabulary, or fewer layers or heads, would fit)");
  return Status::Ok();
}

Result<std::shared_ptr<const ReferenceModel>> create_run_model(const ModelConfig& config,
                                                               const ModelOptions& options) {
  KVRING_RETURN_IF_ERROR(check_run_model(config, options));
  return ReferenceModel::create(config, options);
}

Result<ResumedRun> resume_run(const std::string& path, const std::string& store_spec, BackendKind backend,
                              std::int64_t context) {
  auto pack = open_run_pack(path, store_spec);
  if (!pack) return pack.error();
  auto model = create_run_model(pack->config, pack->record.options);
  if (!model) return pack->named(model.error());
  // A store of one slot with the run's config (what the restore says of the
  // model names it; the cache attends with its score scale). The restore's
  // install writes or clears every row a reader sees, so the store is not
  // zero-filled first.
  auto store = make_store(backend, pack->config,
                          {.max_sequences = 1, .context = context == 0 ? pack->context : context,
                           .zero_fill = false, .attention = pack->record.attention});
  if (!store) return pack->named(store.error());
  auto seq = restore_run_pack(*pack, **store);
  if (!seq) return seq.error();
  auto cache = KvCache::adopt(std::move(*store), *seq);
  if (!cache) return pack->named(cache.error());
  auto session = Session::resume(*model, std::move(*cache), pack->token_ids, pack->record.last_logits);
  if (!session) return pack->named(session.error());
  return ResumedRun{std::move(pack->record), std::move(*session)};
}

}  // namespace kvring::cli
