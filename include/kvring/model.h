// The reference model: a small deterministic hybrid transformer that drives
// the store end to end (a test and demo harness, not the product).
//
// token embedding; per layer: RMSNorm, Q/K/V projections, per-head RMS
// QK-norm, RoPE on sliding layers only (NoPE on full layers), attention
// through a KvCache, output projection, residual, RMSNorm, a small MLP,
// residual; final RMSNorm; logits over a small vocabulary. Weights come from
// a seeded generator. Every projection handles each row on its own with a
// fixed reduction order, so a token's bits do not depend on the chunk it
// arrives in.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvring/cache.h"
#include "kvring/config.h"
#include "kvring/store.h"
#include "kvring/status.h"

namespace kvring {

struct ModelOptions {
  std::int64_t hidden = 256;
  std::int64_t vocab = 512;
  std::int64_t mlp = 0;  // 0: 2 * hidden
  std::uint64_t seed = 0x6b7672696e67ULL;  // weights
};

class ReferenceModel {
 public:
  // Errors: an invalid geometry, hidden/vocab/mlp outside sane bounds.
  static Result<std::shared_ptr<const ReferenceModel>> create(const ModelConfig& config,
                                                              const ModelOptions& options);
  // What create() refuses, without building anything: for a caller that
  // checks a model someone else chose before it builds it.
  static Status check(const ModelConfig& config, const ModelOptions& options);
  // The bytes create() allocates for the weights of `options` on `config`
  // (an mlp of 0 counts as 2 * hidden, as create() makes it).
  static double weight_bytes(const ModelConfig& config, const ModelOptions& options);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }

  // Runs the tokens at positions [start, start + n) through every layer,
  // storing their K/V in `cache`, and writes logits [n, vocab]. n == 1 is a
  // decode step (store_token + attend_decode), n > 1 a prefill chunk
  // (prefill); the logits and stored K/V are the same bits either way.
  // A failure (a discontinuity, a bad token id) leaves the cache unchanged.
  // Where the config has attention sinks, the model's own (seeded) sinks
  // are set on each layer of the store that has none, before anything is
  // stored (both backends compute them; set_attention_sinks's error, if
  // any, is returned).
  Status forward(KvCache& cache, std::int64_t start, const std::int32_t* tokens, std::int64_t n,
                 float* logits) const;
  // A chunk of `n` tokens whose activations (logits included) stay under
  // the model's bound; forward() checks it before anything is stored.
  Status check_chunk(std::int64_t n) const;
  // Everything else forward() checks before it stores anything: the
  // store's geometry, each span's continuity and capacity in every layer,
  // the block pool, and every token id. A span that passes passes forward()
  // in chunks of any size check_chunk allows.
  Status check_tokens(const KvStore& store, std::span<const SeqSpan> spans,
                      const std::int32_t* tokens) const;

  // The same as forward(cache, ...) for a batch of sequences of one store:
  // span i's tokens are the next `count` of `tokens`, and its logits the
  // next `count` rows of logits [rows, vocab]. Every span of one token is a
  // decode step (one batched store and decode a layer), otherwise a ragged
  // prefill; a sequence's bits do not depend on the batch it runs in. A
  // sequence appears at most once.
  Status forward(KvStore& store, std::span<const SeqSpan> spans, const std::int32_t* tokens,
                 float* logits) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, q_norm, k_norm, wo, mlp_norm, w1, w2;
    std::vector<float> sinks;  // [n_heads] where the config has attention sinks
  };
  // Floats of activations (and logits) one row of a chunk needs.
  std::int64_t activation_floats_per_row() const;
  ReferenceModel(ModelConfig config, ModelOptions options) : config_(std::move(config)), options_(options) {}

  ModelConfig config_;
  ModelOptions options_;
  std::vector<float> embedding_;  // [vocab, hidden]
  std::vector<float> final_norm_;
  std::vector<float> unembed_;    // [hidden, vocab]
  std::vector<Layer> layers_;
  std::vector<float> rope_inv_freq_;  // [head_dim / 2]
};

// `n` token ids in [0, vocab) drawn from `seed` (std::mt19937_64).
std::vector<std::int32_t> seeded_tokens(std::int64_t n, std::int64_t vocab, std::uint64_t seed);

// Index of the largest logit (the lowest index among equals; NaN never wins).
std::int32_t argmax(const float* logits, std::int64_t n);

// One sequence: a model, a cache and the tokens whose K/V it holds.
class Session {
 public:
  Session(std::shared_ptr<const ReferenceModel> model, std::unique_ptr<KvCache> cache);

  // A session over a restored cache: `tokens` are the ids whose K/V it holds
  // (cache next position == tokens.size()), `last_logits` the logits of the
  // last of them.
  static Result<Session> resume(std::shared_ptr<const ReferenceModel> model,
                                std::unique_ptr<KvCache> cache, std::vector<std::int32_t> tokens,
                                std::vector<float> last_logits);

  // Prefills `tokens` in chunks of `chunk` tokens (chunk >= 1).
  Status feed(const std::vector<std::int32_t>& tokens, std::int64_t chunk);
  // Decodes one token: feeds argmax(last logits) and returns it.
  Result<std::int32_t> step();

  std::int64_t position() const { return static_cast<std::int64_t>(tokens_.size()); }
  const std::vector<std::int32_t>& tokens() const { return tokens_; }
  const std::vector<float>& last_logits() const { return last_logits_; }
  const ReferenceModel& model() const { return *model_; }
  KvCache& cache() { return *cache_; }
  const KvCache& cache() const { return *cache_; }

 private:
  std::shared_ptr<const ReferenceModel> model_;
  std::unique_ptr<KvCache> cache_;
  std::vector<std::int32_t> tokens_;
  std::vector<float> last_logits_;
};

}  // namespace kvring
