// Model geometry: layer kinds, head shapes, window and context, validation
// with errors that name the field, and a stable fingerprint.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvring/status.h"

namespace kvring {

// The numeric values are part of the kvpack format; never reuse one. The
// names are those of the reference model's layers (RoPE on sliding layers,
// none on full ones); the store keeps K as a model gives it, rotated or not.
enum class LayerKind : std::uint8_t {
  kSlidingRope = 0,  // sliding-window attention: a fixed ring
  kFullNope = 1,     // full attention: a growing plane
};

const char* layer_kind_name(LayerKind kind);

// Bounds that keep every derived size far inside 64-bit arithmetic and stop
// absurd configs before they size an allocation.
inline constexpr std::int64_t kMaxLayers = 1024;
inline constexpr std::int64_t kMaxHeads = 1024;
inline constexpr std::int64_t kMaxHeadDim = 1024;
inline constexpr std::int64_t kMaxContext = std::int64_t{1} << 24;
// Positions stay below it (RingState::plan_batch's bound).
inline constexpr std::int64_t kNoPositionLimit = std::int64_t{1} << 62;
// n_kv_heads * head_dim: one row of K (or V) of one layer, 256 KiB in f32.
inline constexpr std::int64_t kMaxKvDim = 65536;
// Fields of a config.json that kvring reads but keeps no geometry for:
// hidden_size (for head_dim when absent) and vocab_size.
inline constexpr std::int64_t kMaxHiddenSize = 65536;
inline constexpr std::int64_t kMaxVocabSize = std::int64_t{1} << 20;
// query_pre_attn_scalar's range: a score scale from 2^-15 to 1 (below 1,
// scores past f16's range make the f16 numeric's weights overflow).
inline constexpr double kMinScoreScaleDim = 1.0;
inline constexpr double kMaxScoreScaleDim = 1073741824.0;
// Every plane holds at least this many rows (docs/DESIGN.md, "Memory").
inline constexpr std::int64_t kMinPlaneRows = 32;

struct ModelConfig {
  std::string name;
  std::int64_t n_layers = 0;
  std::int64_t n_heads = 0;     // query heads
  std::int64_t n_kv_heads = 0;  // key/value heads (GQA groups)
  std::int64_t head_dim = 0;
  std::int64_t sliding_window = 0;
  std::int64_t max_context = 0;
  std::vector<LayerKind> layer_kinds;  // one per layer
  double rope_theta = 10000.0;         // used by the reference model only
  // Attention scores are q . k / sqrt(query_pre_attn_scalar) (0: head_dim,
  // the usual scale; Gemma 3 27B: 168 with head_dim 128). The attention's,
  // not the cache's: no part of the fingerprint.
  double query_pre_attn_scalar = 0;
  double score_scale_dim() const {
    return query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim);
  }
  // The model has learned attention sinks (gpt-oss): a store of it attends
  // a layer only once that layer's sinks are set
  // (KvStore::set_attention_sinks), so that a model is never attended
  // without them. The attention's, not the cache's: no part of the
  // fingerprint.
  bool attention_sinks = false;

  std::int64_t kv_dim() const { return n_kv_heads * head_dim; }
  std::int64_t gqa_group() const { return n_heads / n_kv_heads; }
  std::int64_t count(LayerKind kind) const;
  LayerKind kind(std::int64_t layer) const { return layer_kinds[static_cast<std::size_t>(layer)]; }

  // Rows of the plane for `layer` in a cache sized for `context` tokens
  // (context <= max_context): sliding max(32, min(context, W)), full
  // max(32, context).
  std::int64_t plane_capacity(std::int64_t layer, std::int64_t context) const;
  std::int64_t plane_capacity(LayerKind kind, std::int64_t context) const;
  // Whether `layer` is sliding and its plane at `context` is shorter than
  // the window: its ring then stops at the context (a longer session would
  // evict rows a later query still sees), so no cache of that context holds
  // a position past it.
  bool ring_stops_at_context(std::int64_t layer, std::int64_t context) const;
  // The positions a sequence of a cache sized for `context` may reach on
  // every layer: a full plane's capacity, max(32, context); the context,
  // where a ring stops there; kNoPositionLimit where every layer is a ring
  // that holds its window (KvStore::position_limit, layer by layer).
  std::int64_t sequence_position_limit(std::int64_t context) const;

  // Checks every field; the error names the field.
  Status validate() const;

  // SHA-256 over a canonical encoding of the geometry (not the name,
  // rope_theta or query_pre_attn_scalar): equal fingerprints mean caches
  // are interchangeable.
  std::array<std::uint8_t, 32> fingerprint() const;
  std::string fingerprint_hex() const;
};

// First visible logical position for a query at `position` on `kind`.
std::int64_t visible_begin(const ModelConfig& config, LayerKind kind, std::int64_t position);

// Presets by name; "muse-glimmer" is the reference geometry.
Result<ModelConfig> preset_config(std::string_view name);
std::vector<std::string> preset_names();

// A hybrid geometry where layer l is full when l % full_every == full_every-1
// (every layer when full_every is 1, and then the window, which no layer
// uses, is 0, as parse_hf_config makes it; no layer when full_every <= 0).
// Fields outside their ranges are kept, so that validate() refuses them: a
// window outside [0, kMaxContext], and n_layers outside [1, kMaxLayers],
// for which no layer kinds are made (layer_kinds stays empty).
ModelConfig make_hybrid_config(std::string name, std::int64_t n_layers,
                               std::int64_t full_every, std::int64_t n_heads,
                               std::int64_t n_kv_heads, std::int64_t head_dim,
                               std::int64_t sliding_window,
                               std::int64_t max_context);

// Hugging Face style config.json (Gemma 3, Cohere 2, gpt-oss shapes). Host
// memory that runs out while the text is parsed (its tree takes up to
// about 30 bytes for each byte of text) is a kIOError, never an abort.
Result<ModelConfig> parse_hf_config(std::string_view json_text,
                                    std::string name = "config");
// The config is named by its path, non-printable bytes and invalid UTF-8
// escaped as \xHH.
Result<ModelConfig> load_hf_config(const std::string& path);

// `--model NAME` or `--config PATH`: at most one of them non-empty;
// neither gives the muse-glimmer preset.
Result<ModelConfig> resolve_config(const std::string& model_name,
                                   const std::string& config_path);

}  // namespace kvring
