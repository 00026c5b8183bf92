// Saving a session of `kvring run` as a kvpack and resuming it, in this
// process or another, so that the resumed run continues bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvring/backend.h"
#include "kvring/chunk_store.h"
#include "kvring/model.h"
#include "kvring/pack.h"
#include "kvring/status.h"

namespace kvring::cli {

// What a resumed run needs beside the cache and the token ids: the model's
// name and weights, the run's parameters, and the last token's logits (the
// next greedy token comes from them). Kept as JSON in the pack's metadata.
// The reference model's bounds on a run's hidden size and vocabulary (the
// --hidden and --vocab ranges); a run record outside them is refused.
inline constexpr std::int64_t kMaxRunHidden = 16384;
inline constexpr std::int64_t kMaxRunVocab = std::int64_t{1} << 20;
// A run record's text: the last logits' hex (8 digits a vocabulary entry)
// and room for its other fields; nesting: the record and a field's value.
inline constexpr std::int64_t kMaxRunRecordBytes = 8 * kMaxRunVocab + (std::int64_t{1} << 16);
inline constexpr int kMaxRunRecordDepth = 4;

struct RunRecord {
  std::string model;  // the name the summary reports
  double rope_theta = 0;
  ModelOptions options;
  std::uint64_t seed = 0;  // the prompt's seed
  std::int64_t prompt_tokens = 0;
  std::int64_t chunk = 0;
  std::vector<float> last_logits;
  // The store's attention numeric (absent in records written before it
  // existed: f32).
  AttentionNumeric attention = AttentionNumeric::kF32;
  // ModelConfig::query_pre_attn_scalar of the run (absent: 0, the usual
  // 1/sqrt(head_dim)); like rope_theta, no part of a pack's geometry.
  double query_pre_attn_scalar = 0;
  // ModelConfig::attention_sinks of the run (absent: false): the reference
  // model's seeded sinks attend with it, resumed or handed off.
  bool attention_sinks = false;
};

// The reference model a run decodes with. A pack's run record or a config
// file chooses its size (hidden, vocabulary, mlp; the layers and heads), so
// a small file could have it take up to ReferenceModel's own limit; it is
// refused (kCapacityExceeded, naming the sizes) where its weights alone
// would take more than half the memory this process may use: its cgroup's
// or the machine's (as serve's --max-mib default), and its address-space
// limit (ulimit -v) where one is set.
Status check_run_model(const ModelConfig& config, const ModelOptions& options);
// check_run_model, then the model.
Result<std::shared_ptr<const ReferenceModel>> create_run_model(const ModelConfig& config,
                                                               const ModelOptions& options);

// A cache of `context` positions as messages about positions past its
// `limit` (ModelConfig::sequence_position_limit) name it: "the cache
// context C", and the positions its full planes hold where they hold more
// (below a context of 32).
std::string cache_context_text(std::int64_t limit, std::int64_t context);

std::string encode_run_record(const RunRecord& record);
// Errors name the pack and the field. Checks each field's type and bounds
// and the fields against one another (one last logit per vocabulary entry)
// before decoding the logits.
Result<RunRecord> decode_run_record(const std::string& metadata, const std::string& pack);

// Writes the session's cache, its token ids and `record` to `path`: a thin
// pack over the chunk store `store_spec` when it is set, else self-contained.
// Returns a line for the text summary.
Result<std::string> save_run(const Session& session, const RunRecord& record,
                             const std::string& path, const std::string& store_spec);

// The same for one sequence of a store holding `tokens`.
Result<std::string> save_sequence(const KvStore& store, SeqId seq,
                                  const std::vector<std::int32_t>& tokens, const RunRecord& record,
                                  const std::string& path, const std::string& store_spec);
// The chunk store a pack is read with (none for an empty spec), opened
// without being made (IoOptions::create false). Only a thin pack, whose
// chunks are in it, opens it; a self-contained pack never reads it and
// gets none, its spec only checked.
Result<std::unique_ptr<ChunkStore>> store_to_read(const std::string& store_spec, const PackSource& pack);
// The path of sequence i's pack: FILE.kvpack -> FILE.i.kvpack.
std::string indexed_path(const std::string& path, std::int64_t i);
// Fails where a save could not be written: a pack path check_pack_destination
// refuses (`sequences` 0: `save` itself; n: the n paths indexed_path gives),
// or a `store_spec` (if any) that cannot be opened or written. Called once
// the run's other inputs are checked and before it computes, so that
// nothing computed is lost and nothing is made for a run refused anyway.
Status check_save(const std::string& save, std::int64_t sequences, const std::string& store_spec);

// A pack written by save_run, its manifest and run record read and checked
// (token ids inside the vocabulary among them) and its rows backed
// (check_pack_backed), no row read yet. It holds no file or chunk store
// open, so a run may check thousands.
struct RunPack {
  std::string path;
  std::string store_spec;  // the chunk store of a thin pack's rows
  RunRecord record;
  // Of the manifest (not kept whole: its chunk table may be large): its
  // digest, the session's context and token ids.
  Digest digest{};
  std::int64_t context = 0;
  std::vector<std::int32_t> token_ids;
  // The pack's geometry with the record's name, RoPE base, score scale and
  // sinks, which the fingerprint does not cover.
  ModelConfig config;
  // `e` with the pack and its model named.
  Error named(const Error& e) const;
};
Result<RunPack> open_run_pack(const std::string& path, const std::string& store_spec);
// Reads the pack's rows into a new sequence of `store` (restore_pack: a
// group of planes at a time in host memory, not the session), opening the
// pack and its chunk store again. A pack whose manifest is no longer the
// one open_run_pack read is refused (kMismatch) and leaves no sequence.
Result<SeqId> restore_run_pack(const RunPack& pack, KvStore& store);

struct ResumedRun {
  RunRecord record;
  Session session;
};
// Reads a pack written by save_run and restores it into a new cache on
// `backend` (context: the pack's when 0). The manifest and the run record
// are checked before rows are read or the model is built; errors after the
// record is read name its model.
Result<ResumedRun> resume_run(const std::string& path, const std::string& store_spec,
                              BackendKind backend, std::int64_t context);

}  // namespace kvring::cli
