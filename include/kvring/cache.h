// One sequence's KV cache: a thin view of a one-sequence KvStore, for code
// that serves a single sequence from host memory (the reference model's
// session, snapshots, the tool). Every call goes through the store's one
// checked path; `store()` and `seq()` reach the store itself.
#pragma once

#include <cstdint>
#include <memory>

#include "kvring/config.h"
#include "kvring/layout.h"
#include "kvring/ring.h"
#include "kvring/status.h"
#include "kvring/store.h"

namespace kvring {

struct CacheOptions {
  // Positions this cache is sized for (0: the model's max_context).
  std::int64_t context = 0;
  // Zero-fill planes at allocation. Only a detached install, which
  // overwrites every row before anything reads it, may turn this off.
  bool zero_fill = true;
  // StoreOptions::slack and StoreOptions::block_rows.
  std::int64_t slack = 0;
  std::int64_t block_rows = 0;
  // StoreOptions::attention.
  AttentionNumeric attention = AttentionNumeric::kF32;
};

class KvCache {
 public:
  // A store of one sequence on `kind`, with that sequence added.
  static Result<std::unique_ptr<KvCache>> create(BackendKind kind, const ModelConfig& config,
                                                 CacheOptions options = {});
  // A cache over a store of one slot and its live sequence `seq` (say, one
  // a handoff installed into). It takes the store only when it accepts: on a
  // refusal (kInvalidArgument) `store` still holds it, unchanged.
  static Result<std::unique_ptr<KvCache>> adopt(std::unique_ptr<KvStore>&& store, SeqId seq);

  BackendKind backend() const { return store_->backend(); }
  const ModelConfig& config() const { return store_->config(); }
  std::int64_t context() const { return store_->context(); }
  std::int64_t n_layers() const { return store_->n_layers(); }
  // The ring state of a layer (a default state for a layer out of range).
  RingState ring(std::int64_t layer) const;
  Layout layout(std::int64_t layer) const { return store_->layout(layer); }
  // Bytes of K and V storage of one plane's image (capacity rows).
  std::int64_t plane_bytes(std::int64_t layer) const;
  std::int64_t allocated_bytes() const { return store_->allocated_bytes(); }

  // Store the K and V rows of the token at `position`.
  // k, v: host f32 [kv_dim]; stored as f16 (round to nearest even).
  Status store_token(std::int64_t layer, std::int64_t position, const float* k, const float* v);
  // Store `count` tokens at positions [start, start + count).
  // k, v: host f32 [count, kv_dim]. A batch longer than a sliding ring
  // writes only the rows that stay live.
  Status store_batch(std::int64_t layer, std::int64_t start, std::int64_t count, const float* k,
                     const float* v);
  // Live rows [first, first + count) in logical order as f16 bits.
  Status read_rows(std::int64_t layer, std::int64_t first, std::int64_t count, std::uint16_t* k,
                   std::uint16_t* v) const;
  // The physical image of a plane (KvStore::read_plane).
  Status read_plane(std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const;
  // Decode attention for the query at `position`, whose K/V is stored.
  // q, out: host f32 [n_heads, head_dim].
  Status attend_decode(std::int64_t layer, std::int64_t position, const float* q, float* out);
  // Chunked prefill (KvStore::prefill). k, v: host f32 [count, kv_dim];
  // q, out: host f32 [count, n_heads, head_dim].
  Status prefill(std::int64_t layer, std::int64_t start, std::int64_t count, const float* k,
                 const float* v, const float* q, float* out);
  // KvStore::install.
  Status install(std::int64_t layer, const RingState& ring, const std::uint16_t* k,
                 const std::uint16_t* v);
  // Empty every plane.
  Status reset() { return store_->reset_sequence(seq_); }
  Result<std::int64_t> next_position() const { return store_->next_position(seq_); }

  KvStore& store() { return *store_; }
  const KvStore& store() const { return *store_; }
  SeqId seq() const { return seq_; }

 private:
  KvCache(std::unique_ptr<KvStore> store, SeqId seq) : store_(std::move(store)), seq_(seq) {}
  std::unique_ptr<KvStore> store_;
  SeqId seq_;
};

// `context` 0 means the model's max_context; otherwise it must lie in
// [1, max_context].
Result<std::int64_t> resolve_context(const ModelConfig& config, std::int64_t context);

// A cache on the CPU backend (host memory).
Result<std::unique_ptr<KvCache>> make_cpu_cache(const ModelConfig& config,
                                                CacheOptions options = {});

}  // namespace kvring
