#include "kvring/model.h"

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "cpu/parallel.h"
#include "kvring/footprint.h"

namespace kvring {

namespace {

inline constexpr std::int64_t kMaxHidden = 16384;
inline constexpr std::int64_t kMaxVocab = 1 << 20;
inline constexpr float kNormEps = 1e-6f;
// The reference model is a harness: refuse sizes whose weights or chunk
// activations could not sensibly live in host memory, before allocating.
inline constexpr double kMaxWeightBytes = 16.0 * (1 << 30);
inline constexpr double kMaxActivationBytes = 4.0 * (1 << 30);

// splitmix64: a small, portable, seeded generator.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-scale, scale).
  float uniform(float scale) {
    const double u = static_cast<double>(next() >> 11) * 0x1.0p-53;
    return static_cast<float>((2.0 * u - 1.0) * scale);
  }
};

std::vector<float> random_matrix(Rng& rng, std::int64_t rows, std::int64_t cols, float scale) {
  std::vector<float> w(static_cast<std::size_t>(rows * cols));
  for (auto& x : w) x = rng.uniform(scale);
  return w;
}

std::vector<float> norm_weight(Rng& rng, std::int64_t n) {
  std::vector<float> w(static_cast<std::size_t>(n));
  for (auto& x : w) x = 1.0f + rng.uniform(0.1f);
  return w;
}

// out[r, :] = x[r, :] . W for W [in, out] row-major. Each output element is
// summed over i in increasing order by one thread: the bits of a row do not
// depend on the other rows or on the thread count. Rows are processed in
// blocks so a block of W is read once per block of rows, not once per row.
void matmul(const float* x, std::int64_t rows, std::int64_t in, const std::vector<float>& w,
            std::int64_t out_dim, float* out) {
  constexpr std::int64_t kCols = 256, kRows = 16;
  const std::int64_t col_blocks = (out_dim + kCols - 1) / kCols;
  const std::int64_t row_blocks = (rows + kRows - 1) / kRows;
  cpu::parallel_for(row_blocks * col_blocks, rows * in * out_dim, [&](std::int64_t task) {
    const std::int64_t r0 = (task / col_blocks) * kRows;
    const std::int64_t r1 = std::min(rows, r0 + kRows);
    const std::int64_t j0 = (task % col_blocks) * kCols;
    const std::int64_t j1 = std::min(out_dim, j0 + kCols);
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t j = j0; j < j1; ++j) out[r * out_dim + j] = 0.0f;
    for (std::int64_t i = 0; i < in; ++i) {
      const float* wi = w.data() + i * out_dim;
      for (std::int64_t r = r0; r < r1; ++r) {
        const float xi = x[r * in + i];
        float* o = out + r * out_dim;
        for (std::int64_t j = j0; j < j1; ++j) o[j] += xi * wi[j];
      }
    }
  });
}

// y = x / sqrt(mean(x^2) + eps) * weight, over n elements.
void rms_norm(const float* x, const float* weight, std::int64_t n, float* y) {
  float ss = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + kNormEps);
  for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * weight[i];
}

float gelu(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + std::tanh(c * (x + 0.044715f * x * x * x)));
}

}  // namespace

std::vector<std::int32_t> seeded_tokens(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  // No vocabulary (or none an int32 id can name): no ids.
  if (vocab < 1 || vocab > (std::int64_t{1} << 31)) return {};
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(std::max<std::int64_t>(0, n)));
  for (auto& t : ids) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return ids;
}

std::int32_t argmax(const float* logits, std::int64_t n) {
  std::int32_t best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
  bool found = false;
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::isnan(logits[i])) continue;
    if (!found || logits[i] > best_value) {
      best = static_cast<std::int32_t>(i);
      best_value = logits[i];
      found = true;
    }
  }
  return best;
}

double ReferenceModel::weight_bytes(const ModelConfig& config, const ModelOptions& options) {
  const double hd = static_cast<double>(config.head_dim), hq = static_cast<double>(config.n_heads) * hd;
  const double kv = static_cast<double>(config.n_kv_heads) * hd, hidden = static_cast<double>(options.hidden);
  const double mlp = options.mlp == 0 ? 2 * hidden : static_cast<double>(options.mlp);
  return 4.0 * (2.0 * static_cast<double>(options.vocab) * hidden +
                static_cast<double>(config.n_layers) * (hidden * (2 * hq + 2 * kv + 2 * mlp) + (2 * hd + 2 * hidden)));
}

Status ReferenceModel::check(const ModelConfig& config, const ModelOptions& options) {
  KVRING_RETURN_IF_ERROR(config.validate());
  if (options.hidden < 1 || options.hidden > kMaxHidden)
    return invalid_argument("hidden size " + std::to_string(options.hidden) + " outside [1, " +
                            std::to_string(kMaxHidden) + "]");
  if (options.vocab < 2 || options.vocab > kMaxVocab)
    return invalid_argument("vocabulary " + std::to_string(options.vocab) + " outside [2, " +
                            std::to_string(kMaxVocab) + "]");
  if (options.mlp < 0 || options.mlp > 4 * kMaxHidden)
    return invalid_argument("mlp size " + std::to_string(options.mlp) + " outside [0, " +
                            std::to_string(4 * kMaxHidden) + "]");
  if (config.count(LayerKind::kSlidingRope) > 0 && config.head_dim % 2 != 0)
    return invalid_argument("RoPE needs an even head_dim, got " + std::to_string(config.head_dim));
  // Every RoPE frequency theta^(-2i / head_dim) must be a finite float:
  // the largest (theta < 1) at i = head_dim / 2 - 1. A model without RoPE
  // layers uses none, but theta must still be positive and finite.
  const bool rope = config.count(LayerKind::kSlidingRope) > 0;
  const double top = rope ? std::pow(config.rope_theta, -static_cast<double>(config.head_dim - 2) /
                                                            static_cast<double>(config.head_dim))
                          : 1.0;
  if (!(config.rope_theta > 0.0) || !std::isfinite(config.rope_theta) || !(top <= FLT_MAX)) {
    char theta[32];
    std::snprintf(theta, sizeof theta, "%.17g", config.rope_theta);
    return invalid_argument(std::string("rope_theta ") + theta +
                            " gives RoPE frequencies that are not finite floats at head_dim " +
                            std::to_string(config.head_dim) + " (it must be positive and finite, and " +
                            "theta^(-(head_dim - 2) / head_dim) at most the largest float)");
  }
  const double weights = weight_bytes(config, options);
  if (weights > kMaxWeightBytes)
    return invalid_argument("the reference model's weights would take " +
                            format_bytes(static_cast<std::int64_t>(weights)) + " (limit " +
                            format_bytes(static_cast<std::int64_t>(kMaxWeightBytes)) +
                            "): use a smaller hidden size or vocabulary");
  return Status::Ok();
}

Result<std::shared_ptr<const ReferenceModel>> ReferenceModel::create(const ModelConfig& config,
                                                                     const ModelOptions& options) {
  KVRING_RETURN_IF_ERROR(check(config, options));
  std::shared_ptr<ReferenceModel> m(new ReferenceModel(config, options));
  if (m->options_.mlp == 0) m->options_.mlp = 2 * options.hidden;
  const std::int64_t hd = config.head_dim, hq = config.n_heads * hd, kv = config.kv_dim();
  const std::int64_t hidden = options.hidden, mlp = m->options_.mlp;
  Rng rng{options.seed};
  auto scale = [](std::int64_t fan_in) { return 1.0f / std::sqrt(static_cast<float>(fan_in)); };
  m->embedding_ = random_matrix(rng, options.vocab, hidden, 1.0f);
  for (std::int64_t l = 0; l < config.n_layers; ++l) {
    Layer L;
    L.attn_norm = norm_weight(rng, hidden);
    L.wq = random_matrix(rng, hidden, hq, scale(hidden));
    L.wk = random_matrix(rng, hidden, kv, scale(hidden));
    L.wv = random_matrix(rng, hidden, kv, scale(hidden));
    L.q_norm = norm_weight(rng, hd);
    L.k_norm = norm_weight(rng, hd);
    L.wo = random_matrix(rng, hq, hidden, scale(hq));
    L.mlp_norm = norm_weight(rng, hidden);
    L.w1 = random_matrix(rng, hidden, mlp, scale(hidden));
    L.w2 = random_matrix(rng, mlp, hidden, scale(mlp));
    m->layers_.push_back(std::move(L));
  }
  m->final_norm_ = norm_weight(rng, hidden);
  m->unembed_ = random_matrix(rng, hidden, options.vocab, 4.0f * scale(hidden));
  // Sink logits of their own stream, so that the other weights are those of
  // the same geometry without sinks.
  Rng sink_rng{options.seed ^ 0x73696e6b73ULL};
  if (config.attention_sinks)
    for (Layer& L : m->layers_) L.sinks = random_matrix(sink_rng, 1, config.n_heads, 2.0f);
  for (std::int64_t i = 0; i < hd / 2; ++i)
    m->rope_inv_freq_.push_back(static_cast<float>(
        std::pow(config.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd))));
  return std::shared_ptr<const ReferenceModel>(std::move(m));
}

std::int64_t ReferenceModel::activation_floats_per_row() const {
  const std::int64_t hq = config_.n_heads * config_.head_dim;
  return options_.vocab + 4 * options_.hidden + 2 * hq + 2 * config_.kv_dim() + options_.mlp;
}

Status ReferenceModel::check_chunk(std::int64_t n) const {
  if (static_cast<double>(n) * static_cast<double>(activation_floats_per_row()) * 4.0 >
      kMaxActivationBytes)
    return invalid_argument("a chunk of " + std::to_string(n) + " tokens needs more than " +
                            format_bytes(static_cast<std::int64_t>(kMaxActivationBytes)) +
                            " of activations; use smaller chunks");
  return Status::Ok();
}

Status ReferenceModel::forward(KvCache& cache, std::int64_t start, const std::int32_t* tokens,
                               std::int64_t n, float* logits) const {
  if (n < 1) return invalid_argument("forward: " + std::to_string(n) + " tokens");
  const SeqSpan span{cache.seq(), start, n};
  return forward(cache.store(), {&span, 1}, tokens, logits);
}

Status ReferenceModel::check_tokens(const KvStore& store, std::span<const SeqSpan> spans,
                                    const std::int32_t* tokens) const {
  const ModelConfig& c = config_;
  if (store.config().fingerprint() != c.fingerprint())
    return make_error(ErrorCode::kMismatch, "the store was made for another geometry (" +
                                                store.config().name + ", not " + c.name + ")");
  if (spans.empty()) return invalid_argument("forward: no sequences");
  if (tokens == nullptr) return invalid_argument("forward: null buffer");
  // A store serves the positions its planes hold: a full plane's capacity,
  // the context where a sliding ring smaller than the window stops (past it
  // the ring would have lost rows a query needs); a store of rings that
  // hold their window goes on (ModelConfig::sequence_position_limit).
  const std::int64_t limit = c.sequence_position_limit(store.context());
  std::int64_t n = 0;
  for (const SeqSpan& sp : spans) {
    if (sp.count < 1) return invalid_argument("forward: " + std::to_string(sp.count) + " tokens");
    if (sp.start < 0 || sp.count > limit - sp.start)
      return make_error(ErrorCode::kCapacityExceeded,
                        std::to_string(sp.count) + " positions from " + std::to_string(sp.start) +
                            " exceed the store's " + std::to_string(limit) + " positions");
    // The rows' activations bound a call before its token ids are read (n
    // stays far below 2^62 before each span's count, at most 2^62, adds).
    n += sp.count;
    KVRING_RETURN_IF_ERROR(check_chunk(n));
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      auto ring = store.ring(sp.seq, l);
      if (!ring) return ring.error();
      auto plan = ring->plan_batch(l, sp.start, sp.count);
      if (!plan) return plan.error();
    }
  }
  auto blocks = store.blocks_to_store(spans);
  if (!blocks) return blocks.error();
  if (*blocks > store.free_blocks())
    return make_error(ErrorCode::kResourceExhausted,
                      "the block pool has " + std::to_string(store.free_blocks()) +
                          " free blocks; this step needs " + std::to_string(*blocks));
  for (std::int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= options_.vocab)
      return invalid_argument("token id " + std::to_string(tokens[i]) + " at index " +
                              std::to_string(i) + " outside [0, " +
                              std::to_string(options_.vocab) + ")");
  return Status::Ok();
}

Status ReferenceModel::forward(KvStore& store, std::span<const SeqSpan> spans,
                               const std::int32_t* tokens, float* logits) const {
  const ModelConfig& c = config_;
  // Everything is checked before anything is stored, so a refused call
  // leaves the store as it was.
  KVRING_RETURN_IF_ERROR(check_tokens(store, spans, tokens));
  if (logits == nullptr) return invalid_argument("forward: null buffer");
  std::int64_t n = 0;
  bool decode = true;
  for (const SeqSpan& sp : spans) {
    n += sp.count;
    decode = decode && sp.count == 1;
  }
  KVRING_RETURN_IF_ERROR(check_chunk(n));
  // The model's sinks go to a store that has none for a layer (weights, set
  // before anything is stored; a backend that computes none refuses them).
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    if (const Layer& L = layers_[static_cast<std::size_t>(l)]; !L.sinks.empty() && store.attention_sinks(l).empty())
      KVRING_RETURN_IF_ERROR(store.set_attention_sinks(l, L.sinks));
  // Row i's logical position.
  std::vector<std::int64_t> positions;
  std::vector<SeqQuery> queries;
  for (const SeqSpan& sp : spans)
    for (std::int64_t i = 0; i < sp.count; ++i) {
      positions.push_back(sp.start + i);
      queries.push_back(SeqQuery{sp.seq, sp.start + i});
    }

  const std::int64_t hidden = options_.hidden, hd = c.head_dim, H = c.n_heads;
  const std::int64_t hq = H * hd, kv = c.kv_dim(), mlp = options_.mlp;
  const auto sz = [](std::int64_t a) { return static_cast<std::size_t>(a); };
  std::vector<float> x(sz(n * hidden)), h(sz(n * hidden)), q(sz(n * hq)), k(sz(n * kv)),
      v(sz(n * kv)), attn(sz(n * hq)), o(sz(n * hidden)), u(sz(n * mlp));

  for (std::int64_t i = 0; i < n; ++i)
    std::copy_n(embedding_.data() + tokens[i] * hidden, hidden, x.data() + i * hidden);

  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[sz(l)];
    const bool sliding = c.kind(l) == LayerKind::kSlidingRope;
    for (std::int64_t i = 0; i < n; ++i)
      rms_norm(x.data() + i * hidden, L.attn_norm.data(), hidden, h.data() + i * hidden);
    matmul(h.data(), n, hidden, L.wq, hq, q.data());
    matmul(h.data(), n, hidden, L.wk, kv, k.data());
    matmul(h.data(), n, hidden, L.wv, kv, v.data());
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t pos = positions[sz(i)];
      auto qk_norm_rope = [&](float* head, const std::vector<float>& weight) {
        rms_norm(head, weight.data(), hd, head);
        if (!sliding) return;  // NoPE on full layers
        for (std::int64_t d = 0; d < hd / 2; ++d) {
          const double angle = static_cast<double>(pos) * rope_inv_freq_[sz(d)];
          const float cs = static_cast<float>(std::cos(angle));
          const float sn = static_cast<float>(std::sin(angle));
          const float a = head[d], b = head[d + hd / 2];
          head[d] = a * cs - b * sn;
          head[d + hd / 2] = a * sn + b * cs;
        }
      };
      for (std::int64_t hh = 0; hh < H; ++hh) qk_norm_rope(q.data() + i * hq + hh * hd, L.q_norm);
      for (std::int64_t g = 0; g < c.n_kv_heads; ++g)
        qk_norm_rope(k.data() + i * kv + g * hd, L.k_norm);
    }
    // One decode token per sequence is a store and a decode; anything else
    // a ragged prefill. The bits are the same either way.
    const ConstView kview = host_view(k.data(), n, kv), vview = host_view(v.data(), n, kv);
    const ConstView qview = host_view(q.data(), n, hq);
    const MutView out = host_view(attn.data(), n, hq);
    if (decode) {
      KVRING_RETURN_IF_ERROR(store.store(l, spans, kview, vview));
      KVRING_RETURN_IF_ERROR(store.attend_decode(l, queries, qview, out));
    } else {
      KVRING_RETURN_IF_ERROR(store.prefill(l, spans, kview, vview, qview, out));
    }
    matmul(attn.data(), n, hq, L.wo, hidden, o.data());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    for (std::int64_t i = 0; i < n; ++i)
      rms_norm(x.data() + i * hidden, L.mlp_norm.data(), hidden, h.data() + i * hidden);
    matmul(h.data(), n, hidden, L.w1, mlp, u.data());
    for (auto& e : u) e = gelu(e);
    matmul(u.data(), n, mlp, L.w2, hidden, o.data());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
  }
  for (std::int64_t i = 0; i < n; ++i)
    rms_norm(x.data() + i * hidden, final_norm_.data(), hidden, h.data() + i * hidden);
  matmul(h.data(), n, hidden, unembed_, options_.vocab, logits);
  return Status::Ok();
}

Session::Session(std::shared_ptr<const ReferenceModel> model, std::unique_ptr<KvCache> cache)
    : model_(std::move(model)), cache_(std::move(cache)) {}

Result<Session> Session::resume(std::shared_ptr<const ReferenceModel> model,
                                std::unique_ptr<KvCache> cache, std::vector<std::int32_t> tokens,
                                std::vector<float> last_logits) {
  if (model == nullptr || cache == nullptr) return invalid_argument("resume: no model or no cache");
  auto next = cache->next_position();
  if (!next) return next.error();
  if (*next != static_cast<std::int64_t>(tokens.size()))
    return invalid_argument("the cache holds " + std::to_string(*next) + " positions but " +
                            std::to_string(tokens.size()) + " token ids were given");
  if (!tokens.empty() && static_cast<std::int64_t>(last_logits.size()) != model->options().vocab)
    return invalid_argument("last logits have " + std::to_string(last_logits.size()) +
                            " entries, the vocabulary " + std::to_string(model->options().vocab));
  if (cache->config().fingerprint() != model->config().fingerprint())
    return make_error(ErrorCode::kMismatch, "the cache was made for another geometry");
  Session s(std::move(model), std::move(cache));
  s.tokens_ = std::move(tokens);
  s.last_logits_ = std::move(last_logits);
  return s;
}

Status Session::feed(const std::vector<std::int32_t>& tokens, std::int64_t chunk) {
  if (chunk < 1) return invalid_argument("chunk size " + std::to_string(chunk) + " < 1");
  const std::int64_t vocab = model_->options().vocab;
  // What forward() would refuse in a later chunk is refused here, before
  // the first: a failed feed leaves the session and its cache as they were.
  if (!tokens.empty()) {
    const SeqSpan all{cache_->seq(), position(), static_cast<std::int64_t>(tokens.size())};
    KVRING_RETURN_IF_ERROR(model_->check_tokens(cache_->store(), {&all, 1}, tokens.data()));
  }
  std::vector<float> logits;
  for (std::size_t at = 0; at < tokens.size();) {
    const std::int64_t n = std::min<std::int64_t>(chunk, static_cast<std::int64_t>(tokens.size() - at));
    // The chunk's activations, logits included, are checked before the
    // logits buffer is sized.
    KVRING_RETURN_IF_ERROR(model_->check_chunk(n));
    logits.resize(static_cast<std::size_t>(n * vocab));
    KVRING_RETURN_IF_ERROR(model_->forward(*cache_, position(), tokens.data() + at, n, logits.data()));
    tokens_.insert(tokens_.end(), tokens.begin() + static_cast<std::ptrdiff_t>(at),
                   tokens.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(n)));
    last_logits_.assign(logits.end() - vocab, logits.end());
    at += static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

Result<std::int32_t> Session::step() {
  if (last_logits_.empty()) return invalid_argument("decode needs a prompt first");
  const std::int32_t next = argmax(last_logits_.data(), static_cast<std::int64_t>(last_logits_.size()));
  KVRING_RETURN_IF_ERROR(feed({next}, 1));
  return next;
}

}  // namespace kvring
