#include "kvring/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/file_read.h"
#include "core/json_tree.h"
#include "core/text.h"
#include "kvring/sha256.h"

namespace kvring {

const char* layer_kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::kSlidingRope: return "SlidingRope";
    case LayerKind::kFullNope: return "FullNope";
  }
  return "Unknown";
}

std::int64_t ModelConfig::count(LayerKind k) const {
  std::int64_t n = 0;
  for (LayerKind x : layer_kinds) n += (x == k);
  return n;
}

std::int64_t ModelConfig::plane_capacity(LayerKind k, std::int64_t context) const {
  if (k == LayerKind::kSlidingRope)
    return std::max(kMinPlaneRows, std::min(context, sliding_window));
  return std::max(kMinPlaneRows, context);
}

std::int64_t ModelConfig::plane_capacity(std::int64_t layer, std::int64_t context) const {
  return plane_capacity(kind(layer), context);
}

bool ModelConfig::ring_stops_at_context(std::int64_t layer, std::int64_t context) const {
  return kind(layer) == LayerKind::kSlidingRope && plane_capacity(layer, context) < sliding_window;
}

std::int64_t ModelConfig::sequence_position_limit(std::int64_t context) const {
  std::int64_t limit = kNoPositionLimit;
  for (LayerKind k : layer_kinds) {
    if (k == LayerKind::kFullNope) limit = std::min(limit, plane_capacity(k, context));
    else if (plane_capacity(k, context) < sliding_window) limit = std::min(limit, context);
  }
  return limit;
}

std::int64_t visible_begin(const ModelConfig& config, LayerKind kind, std::int64_t position) {
  if (kind == LayerKind::kFullNope || position < config.sliding_window) return 0;
  return position - config.sliding_window + 1;
}

namespace {

Status check_range(const char* field, std::int64_t value, std::int64_t lo,
                   std::int64_t hi) {
  if (value < lo || value > hi)
    return config_error(std::string(field) + " = " + std::to_string(value) +
                        " is out of range [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "]");
  return Status::Ok();
}

// The shortest decimal that reads back as v (5e-324, 1e+300, 168).
std::string shortest(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace

Status ModelConfig::validate() const {
  KVRING_RETURN_IF_ERROR(check_range("num_hidden_layers", n_layers, 1, kMaxLayers));
  KVRING_RETURN_IF_ERROR(check_range("num_attention_heads", n_heads, 1, kMaxHeads));
  KVRING_RETURN_IF_ERROR(check_range("num_key_value_heads", n_kv_heads, 1, kMaxHeads));
  KVRING_RETURN_IF_ERROR(check_range("head_dim", head_dim, 1, kMaxHeadDim));
  KVRING_RETURN_IF_ERROR(check_range("max_position_embeddings", max_context, 1, kMaxContext));
  KVRING_RETURN_IF_ERROR(check_range("num_key_value_heads * head_dim", kv_dim(), 1, kMaxKvDim));
  if (n_heads % n_kv_heads != 0)
    return config_error("num_attention_heads = " + std::to_string(n_heads) +
                        " is not a multiple of num_key_value_heads = " +
                        std::to_string(n_kv_heads));
  if (static_cast<std::int64_t>(layer_kinds.size()) != n_layers)
    return config_error("layer_types has " + std::to_string(layer_kinds.size()) +
                        " entries but num_hidden_layers = " + std::to_string(n_layers));
  for (std::size_t i = 0; i < layer_kinds.size(); ++i) {
    if (layer_kinds[i] != LayerKind::kSlidingRope && layer_kinds[i] != LayerKind::kFullNope)
      return config_error("layer_types[" + std::to_string(i) + "] is not a known layer kind");
  }
  if (count(LayerKind::kSlidingRope) > 0)
    KVRING_RETURN_IF_ERROR(check_range("sliding_window", sliding_window, 1, kMaxContext));
  else
    KVRING_RETURN_IF_ERROR(check_range("sliding_window", sliding_window, 0, kMaxContext));
  if (!(query_pre_attn_scalar == 0 ||
        (query_pre_attn_scalar >= kMinScoreScaleDim && query_pre_attn_scalar <= kMaxScoreScaleDim)))
    return config_error("query_pre_attn_scalar = " + shortest(query_pre_attn_scalar) + " outside [1, 2^30]");
  return Status::Ok();
}

std::array<std::uint8_t, 32> ModelConfig::fingerprint() const {
  // Canonical text: field order and spelling are frozen (version 1).
  std::ostringstream s;
  s << "kvring-geometry-v1;layers=" << n_layers << ";heads=" << n_heads
    << ";kv_heads=" << n_kv_heads << ";head_dim=" << head_dim
    << ";window=" << sliding_window << ";max_context=" << max_context << ";kinds=";
  for (LayerKind k : layer_kinds) s << static_cast<int>(k);
  const std::string text = s.str();
  return sha256(text.data(), text.size());
}

std::string ModelConfig::fingerprint_hex() const { return to_hex(fingerprint()); }

ModelConfig make_hybrid_config(std::string name, std::int64_t n_layers,
                               std::int64_t full_every, std::int64_t n_heads,
                               std::int64_t n_kv_heads, std::int64_t head_dim,
                               std::int64_t sliding_window,
                               std::int64_t max_context) {
  ModelConfig c;
  c.name = std::move(name);
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  c.sliding_window = sliding_window;
  c.max_context = max_context;
  // No kinds for a layer count validate() refuses: a count from a caller
  // must not size an allocation before it is checked.
  for (std::int64_t l = 0; n_layers <= kMaxLayers && l < n_layers; ++l)
    c.layer_kinds.push_back(full_every > 0 && l % full_every == full_every - 1
                                ? LayerKind::kFullNope
                                : LayerKind::kSlidingRope);
  // As parse_hf_config: a window no layer uses is no part of the geometry,
  // so the same shapes give one fingerprint however they were made. Only a
  // window that is a valid field is dropped: one outside [0, kMaxContext]
  // stays, so validate() refuses it as parse_hf_config refuses it in a file.
  if (n_layers > 0 && c.count(LayerKind::kSlidingRope) == 0 && sliding_window >= 0 &&
      sliding_window <= kMaxContext)
    c.sliding_window = 0;
  return c;
}

std::vector<std::string> preset_names() { return {"muse-glimmer"}; }

Result<ModelConfig> preset_config(std::string_view name) {
  if (name == "muse-glimmer")
    return make_hybrid_config("muse-glimmer", 52, 4, 16, 2, 128, 2048, 131072);
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  return invalid_argument("unknown model '" + std::string(name) +
                          "' (known presets: " + known + "; or pass --config FILE)");
}

namespace {

using nlohmann::json;

// A JSON value for an error message: scalars as written, containers by kind
// and size (dump() recurses once per level of nesting, and a nested array
// of a config file is deep enough to exhaust the stack).
std::string describe(const json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " elements";
  if (v.is_object()) return "an object of " + std::to_string(v.size()) + " fields";
  // Cut by bytes, then escaped: a character split by the cut shows as
  // escapes, never as invalid UTF-8.
  const std::string s = v.dump();
  return s.size() > 64 ? printable(std::string_view(s).substr(0, 64)) + "..." : printable(s);
}

// Reads an integer field; absent -> `fallback` (or an error when required).
Result<std::int64_t> int_field(const json& j, const char* field, bool required,
                               std::int64_t fallback = 0) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return config_error("missing field '" + std::string(field) + "'");
    return fallback;
  }
  // Unsigned first: is_number_integer holds for unsigned values too, and
  // one past int64's range would read back negative.
  if (it->is_number_unsigned()) {
    auto u = it->get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      return config_error("field '" + std::string(field) + "' is too large");
    return static_cast<std::int64_t>(u);
  }
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_number_float()) {
    // Range first: converting an out-of-range double is undefined.
    const double d = it->get<double>();
    if (d >= -1e15 && d <= 1e15 && d == std::floor(d)) return static_cast<std::int64_t>(d);
  }
  return config_error("field '" + std::string(field) + "' must be an integer, got " +
                      describe(*it));
}

std::string model_type(const json& root, const json& j) {
  for (const json* o : {&j, &root})
    if (auto it = o->find("model_type"); it != o->end() && it->is_string()) return it->get<std::string>();
  return "";
}

// What use_sliding_window says: absent (or null), true or false (another
// value is refused before this is asked).
enum class Sliding { kUnsaid, kOn, kOff };
Sliding uses_sliding_window(const json& j) {
  auto it = j.find("use_sliding_window");
  if (it == j.end() || !it->is_boolean()) return Sliding::kUnsaid;
  return it->get<bool>() ? Sliding::kOn : Sliding::kOff;
}

// Qwen's model types whose Hugging Face classes read use_sliding_window
// (false when absent) and max_window_layers, with that class's default
// when absent; 0 for other model types.
std::int64_t qwen_max_window_layers(const json& root, const json& j) {
  const std::string type = model_type(root, j);
  for (const char* t : {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
    if (type == t) return 28;
  for (const char* t : {"qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"})
    if (type == t) return 80;
  return 0;
}

// Models whose sliding_window, given alone, applies to every layer.
bool every_layer_slides(const json& root, const json& j) {
  const std::string type = model_type(root, j);
  return type == "mistral" || type == "mixtral" || type == "phi3" || type == "phimoe" || type == "starcoder2";
}

// The field is in the object with a value other than null.
bool given(const json& j, const char* field) {
  auto it = j.find(field);
  return it != j.end() && !it->is_null();
}

// Attention the store's kernels do not compute (they take softmax(q . k /
// sqrt(query_pre_attn_scalar)) over a row's visible positions, docs/DESIGN.md): a config
// that asks for it is refused, naming the field, rather than cached and
// attended as if it did not.
Status check_attention_features(const json& j, std::int64_t head_dim, std::int64_t n_kv_heads) {
  if (given(j, "attn_logit_softcapping") &&
      !(j["attn_logit_softcapping"].is_number() && j["attn_logit_softcapping"].get<double>() == 0.0))
    return config_error("attn_logit_softcapping = " + describe(j["attn_logit_softcapping"]) +
                        ": the store's attention has no logit soft-capping");
  if (given(j, "attention_chunk_size"))
    return config_error("attention_chunk_size = " + describe(j["attention_chunk_size"]) +
                        ": the store has no chunked local attention (its layers are sliding or full)");
  if (given(j, "kv_lora_rank"))
    return config_error("kv_lora_rank = " + describe(j["kv_lora_rank"]) +
                        ": multi-head latent attention caches a latent, not K and V heads");
  if (given(j, "v_head_dim") && !(j["v_head_dim"].is_number() && j["v_head_dim"].get<double>() ==
                                                                      static_cast<double>(head_dim)))
    return config_error("v_head_dim = " + describe(j["v_head_dim"]) + " is not head_dim = " +
                        std::to_string(head_dim) + ": the store's K and V heads are one width");
  // Gemma 4: full layers with heads of another width and count than the
  // sliding layers'; the store's layers share one head shape.
  if (given(j, "global_head_dim") &&
      !(j["global_head_dim"].is_number() && j["global_head_dim"].get<double>() == static_cast<double>(head_dim)))
    return config_error("global_head_dim = " + describe(j["global_head_dim"]) + " is not head_dim = " +
                        std::to_string(head_dim) + ": the store's layers share one head width");
  if (given(j, "num_global_key_value_heads") &&
      !(j["num_global_key_value_heads"].is_number() &&
        j["num_global_key_value_heads"].get<double>() == static_cast<double>(n_kv_heads)))
    return config_error("num_global_key_value_heads = " + describe(j["num_global_key_value_heads"]) +
                        " is not num_key_value_heads = " + std::to_string(n_kv_heads) +
                        ": the store's layers share one head count");
  // Gemma 3n, Gemma 4: the last layers attend over an earlier layer's K and V.
  if (given(j, "num_kv_shared_layers") &&
      !(j["num_kv_shared_layers"].is_number() && j["num_kv_shared_layers"].get<double>() == 0.0))
    return config_error("num_kv_shared_layers = " + describe(j["num_kv_shared_layers"]) +
                        ": layers that attend over another layer's K and V are not the store's planes");
  // EmbeddingGemma: attention over the whole sequence both ways.
  if (given(j, "use_bidirectional_attention") &&
      !(j["use_bidirectional_attention"].is_boolean() && !j["use_bidirectional_attention"].get<bool>()))
    return config_error("use_bidirectional_attention = " + describe(j["use_bidirectional_attention"]) +
                        ": the store's attention is causal");
  // ALiBi (Falcon's option): a bias by distance added to every score.
  if (given(j, "alibi") && !(j["alibi"].is_boolean() && !j["alibi"].get<bool>()))
    return config_error("alibi = " + describe(j["alibi"]) +
                        ": the store's attention adds no position bias to the scores");
  // Llama 3.2 Vision: layers that attend over the image's K and V.
  if (given(j, "cross_attention_layers") &&
      !(j["cross_attention_layers"].is_array() && j["cross_attention_layers"].empty()))
    return config_error("cross_attention_layers = " + describe(j["cross_attention_layers"]) +
                        ": layers that attend over an image's K and V are not the store's planes");
  // Nemotron-NAS (DeciLM): each layer its own head count, or no attention.
  for (const char* f : {"block_configs", "num_key_value_heads_per_layer"})
    if (given(j, f))
      return config_error(std::string(f) + " = " + describe(j[f]) +
                          ": layers of their own head counts are not the store's planes (its layers share one)");
  // ModernBERT: an encoder, its attention both ways.
  for (const char* f : {"global_attn_every_n_layers", "local_attention"})
    if (given(j, f))
      return config_error(std::string(f) + " = " + describe(j[f]) +
                          ": an encoder's attention sees the sequence both ways; the store's is causal");
  if (given(j, "is_encoder_decoder") &&
      !(j["is_encoder_decoder"].is_boolean() && !j["is_encoder_decoder"].get<bool>()))
    return config_error("is_encoder_decoder = " + describe(j["is_encoder_decoder"]) +
                        ": the store caches a decoder's self-attention, not an encoder's or cross-attention");
  // Phi-3-small: block-sparse attention on every other layer.
  for (const char* f : {"dense_attention_every_n_layers", "blocksparse_vert_stride", "blocksparse_num_local_blocks"})
    if (given(j, f))
      return config_error(std::string(f) + " = " + describe(j[f]) +
                          ": the store has no block-sparse attention (its layers are sliding or full)");
  // Hybrids whose other layers are linear attention, convolutions or
  // state-space mixers (Qwen3-Next, Jamba, MiniMax-01, Nemotron-H, Zamba,
  // Kimi Linear, RecurrentGemma, Bamba, LFM2): their configs name them by
  // these fields, not by layer_types, and the store would cache every layer
  // as attention.
  for (const char* f : {"full_attention_interval", "attn_layer_period", "attn_layer_offset", "attn_type_list",
                        "hybrid_override_pattern", "layers_block_type", "linear_attn_config", "block_types",
                        "attn_layer_indices", "full_attn_idxs"})
    if (given(j, f))
      return config_error(std::string(f) + " = " + describe(j[f]) +
                          ": the model has layers other than attention, which the store does not cache");
  return Status::Ok();
}

// A boolean field; absent or null -> `fallback`.
Result<bool> bool_field(const json& j, const char* field, bool fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return config_error("field '" + std::string(field) + "' must be true or false, got " + describe(*it));
  return it->get<bool>();
}

// The KV heads a layer caches. num_key_value_heads where given, else the
// query heads, but for Falcon, whose class counts them its own way (and
// reads no num_key_value_heads): one under multi_query without
// new_decoder_architecture (multi_query is its default when absent; null is
// false), else num_kv_heads (the query heads when absent). A Falcon file
// that names another count (num_key_value_heads, or the n_head_kv of
// older code) is refused rather than read one way here and another there,
// and so is another model that names its KV heads only by Falcon's fields
// or ChatGLM's. Where the count came from a field other than
// num_key_value_heads, its range and its fit with the query heads are
// checked here, naming that field.
Result<std::int64_t> kv_head_count(const json& root, const json& j, std::int64_t n_heads) {
  if (model_type(root, j) == "falcon") {
    for (const char* f : {"num_key_value_heads", "n_head_kv"})
      if (given(j, f))
        return config_error(std::string(f) + " = " + describe(j[f]) +
                            ": a falcon config counts its KV heads by multi_query, new_decoder_architecture "
                            "and num_kv_heads, and Hugging Face's class reads no " + f);
    auto new_arch = bool_field(j, "new_decoder_architecture", false);
    if (!new_arch.ok()) return new_arch.error();
    // Absent: the class's default, true; null: None, which tests false.
    auto multi_query = bool_field(j, "multi_query", !j.contains("multi_query"));
    if (!multi_query.ok()) return multi_query.error();
    if (!*new_arch && *multi_query) return std::int64_t{1};
    auto kv = int_field(j, "num_kv_heads", false, n_heads);
    if (!kv) return kv.error();
    KVRING_RETURN_IF_ERROR(check_range("num_kv_heads", *kv, 1, kMaxHeads));
    if (n_heads % *kv != 0)
      return config_error("num_attention_heads = " + std::to_string(n_heads) + " is not a multiple of num_kv_heads = " +
                          std::to_string(*kv));
    return *kv;
  }
  if (!given(j, "num_key_value_heads"))
    for (const char* f : {"num_kv_heads", "n_head_kv", "multi_query", "multi_query_attention", "multi_query_group_num"})
      if (given(j, f))
        return config_error(std::string(f) + " = " + describe(j[f]) + " without num_key_value_heads: the " +
                            "KV heads are counted by a field this reader takes only from a falcon config; " +
                            "give num_key_value_heads");
  return int_field(j, "num_key_value_heads", false, n_heads);
}

// Encoders: their attention sees the whole sequence both ways, and their
// configs look like a decoder's. Llama 3.2 Vision (mllama): its class gives
// a text config without cross_attention_layers eight of them.
Status check_decoder(const json& root, const json& j) {
  const std::string type = model_type(root, j);
  if (type == "mllama" || type == "mllama_text_model")
    return config_error("model_type = \"" + type +
                        "\": its cross-attention layers attend over an image's K and V, not the store's planes");
  for (const char* t : {"bert", "roberta", "xlm-roberta", "camembert", "albert", "electra", "deberta", "deberta-v2",
                        "mpnet", "ernie", "nomic_bert", "modernbert", "distilbert", "xlnet"})
    if (type == t)
      return config_error("model_type = \"" + type +
                          "\": an encoder's attention sees the sequence both ways; the store's is causal");
  return Status::Ok();
}

// Hugging Face's class defaults for the fields a model's own config.json may
// leave out: the multimodal Gemma 3 checkpoints (4B, 12B, 27B) name only a
// few fields of their text_config, and Gemma3TextConfig fills the rest;
// Mistral's and Qwen's classes give a window of 4096 to a file without
// one (Mistral slides every layer by it; Qwen only where use_sliding_window
// is true); Falcon's class holds 2048 positions where the file (Falcon-7B's,
// Falcon-40B's) does not say. Only absent fields take a default. A field
// given as null is the class's None: a window of None is no window, and an
// attn_logit_softcapping of None no capping; from any other None these
// classes cannot build a model (refused, by parse_hf_config).
// sliding_window_pattern stands for the class's layer pattern: every 6th
// layer full for Gemma 3, every 2nd for Gemma 2.
struct ClassDefaults {
  json values;
  std::vector<std::string> nullable;
};
const ClassDefaults* class_defaults(const json& root, const json& j) {
  static const ClassDefaults gemma3_text = {
      {{"num_hidden_layers", 26},         {"num_attention_heads", 8},       {"num_key_value_heads", 4},
       {"head_dim", 256},                 {"max_position_embeddings", 131072}, {"query_pre_attn_scalar", 256},
       {"sliding_window", 4096},          {"sliding_window_pattern", 6},    {"rope_theta", 1000000.0}},
      {"attn_logit_softcapping"}};
  static const ClassDefaults gemma2 = {
      {{"num_hidden_layers", 26},         {"num_attention_heads", 8},       {"num_key_value_heads", 4},
       {"head_dim", 256},                 {"max_position_embeddings", 8192}, {"query_pre_attn_scalar", 256},
       {"sliding_window", 4096},          {"sliding_window_pattern", 2},    {"rope_theta", 10000.0},
       {"attn_logit_softcapping", 50.0}},
      {"attn_logit_softcapping"}};
  static const ClassDefaults window_4096 = {{{"sliding_window", 4096}}, {"sliding_window"}};
  static const ClassDefaults falcon = {{{"max_position_embeddings", 2048}}, {}};
  const std::string type = model_type(root, j);
  if (type == "gemma3_text" || (type == "gemma3" && &j != &root)) return &gemma3_text;
  if (type == "gemma2") return &gemma2;
  if (type == "mistral" || qwen_max_window_layers(root, j) > 0) return &window_4096;
  if (type == "falcon") return &falcon;
  return nullptr;
}

// Gemma 3n and Gemma 4 attend with a score scale of 1 (q and k are
// RMS-normed; Hugging Face's attention takes scaling = 1.0 whatever the
// config says); so do Granite's models whose file leaves out
// attention_multiplier, its classes' default being 1.0 (one that gives it
// as null scales as attention does by default, 1/sqrt(head_dim)):
// query_pre_attn_scalar 1.
bool unit_score_scale(const json& root, const json& j) {
  const std::string type = model_type(root, j);
  if (type.starts_with("granite")) return !j.contains("attention_multiplier");
  return type.starts_with("gemma3n") || type.starts_with("gemma4");
}

// The geometry of a model's (text) config `j`, `root` the whole file.
Result<ModelConfig> parse_text_config(const json& root, const json& j, std::string name) {
  ModelConfig c;
  c.name = std::move(name);
  auto layers = int_field(j, "num_hidden_layers", true);
  if (!layers) return layers.error();
  c.n_layers = *layers;
  auto heads = int_field(j, "num_attention_heads", true);
  if (!heads) return heads.error();
  c.n_heads = *heads;
  KVRING_RETURN_IF_ERROR(check_range("num_hidden_layers", c.n_layers, 1, kMaxLayers));
  KVRING_RETURN_IF_ERROR(check_range("num_attention_heads", c.n_heads, 1, kMaxHeads));
  auto kv_heads = kv_head_count(root, j, c.n_heads);
  if (!kv_heads) return kv_heads.error();
  c.n_kv_heads = *kv_heads;

  auto head_dim = int_field(j, "head_dim", false, -1);
  if (!head_dim) return head_dim.error();
  if (*head_dim == -1 && !given(j, "head_dim")) {
    auto hidden = int_field(j, "hidden_size", false, -1);
    if (!hidden) return hidden.error();
    if (*hidden == -1)
      return config_error("missing field 'head_dim' (and no 'hidden_size' to derive it from)");
    // Gemma's heads are not hidden_size / num_attention_heads wide (Gemma 3
    // 12B: 3840 / 16 = 240, its head_dim 256); its configs may leave
    // head_dim to a library default, which is not this file's to guess.
    if (model_type(root, j).starts_with("gemma"))
      return config_error("missing field 'head_dim': a Gemma model's head_dim is not hidden_size / "
                          "num_attention_heads; give it (the model card's config.json has it)");
    KVRING_RETURN_IF_ERROR(check_range("hidden_size", *hidden, 1, kMaxHiddenSize));
    if (*hidden % c.n_heads != 0)
      return config_error("hidden_size = " + std::to_string(*hidden) +
                          " is not divisible by num_attention_heads = " +
                          std::to_string(c.n_heads) + " (set head_dim explicitly)");
    c.head_dim = *hidden / c.n_heads;
  } else {
    c.head_dim = *head_dim;
  }

  if (given(j, "hidden_size")) {
    auto hidden = int_field(j, "hidden_size", true);
    if (!hidden) return hidden.error();
    KVRING_RETURN_IF_ERROR(check_range("hidden_size", *hidden, 1, kMaxHiddenSize));
  }
  if (given(j, "vocab_size")) {
    auto vocab = int_field(j, "vocab_size", true);
    if (!vocab) return vocab.error();
    KVRING_RETURN_IF_ERROR(check_range("vocab_size", *vocab, 1, kMaxVocabSize));
  }

  KVRING_RETURN_IF_ERROR(check_range("num_key_value_heads", c.n_kv_heads, 1, kMaxHeads));
  KVRING_RETURN_IF_ERROR(check_decoder(root, j));
  KVRING_RETURN_IF_ERROR(check_attention_features(j, c.head_dim, c.n_kv_heads));
  if (given(j, "use_sliding_window") && !j["use_sliding_window"].is_boolean())
    return config_error("use_sliding_window = " + describe(j["use_sliding_window"]) + " must be true or false");
  if (given(j, "query_pre_attn_scalar")) {
    const json& q = j["query_pre_attn_scalar"];
    if (!q.is_number() || !(q.get<double>() >= kMinScoreScaleDim) || !(q.get<double>() <= kMaxScoreScaleDim))
      return config_error("query_pre_attn_scalar = " + describe(q) + " must be a number in [1, 2^30]");
    // Equal to head_dim: the usual scale, recorded as such.
    if (q.get<double>() != static_cast<double>(c.head_dim)) c.query_pre_attn_scalar = q.get<double>();
  }
  // Granite: scores are q . k * attention_multiplier, i.e. / sqrt(1 / m^2).
  if (given(j, "attention_multiplier")) {
    const json& m = j["attention_multiplier"];
    if (given(j, "query_pre_attn_scalar"))
      return config_error("attention_multiplier and query_pre_attn_scalar both set the score scale");
    const double v = m.is_number() ? m.get<double>() : 0.0;
    const double dim = v > 0 ? 1.0 / (v * v) : 0.0;
    if (!m.is_number() || !(v > 0) || !(dim >= kMinScoreScaleDim) || !(dim <= kMaxScoreScaleDim))
      return config_error("attention_multiplier = " + describe(m) + " must be a number in [2^-15, 1]");
    if (dim != static_cast<double>(c.head_dim)) c.query_pre_attn_scalar = dim;
  }
  if (unit_score_scale(root, j)) c.query_pre_attn_scalar = 1.0;
  // gpt-oss: a learned sink logit per head and layer, in the weights.
  c.attention_sinks = model_type(root, j) == "gpt_oss";

  auto max_pos = int_field(j, "max_position_embeddings", true);
  if (!max_pos) return max_pos.error();
  c.max_context = *max_pos;

  auto window = int_field(j, "sliding_window", false, 0);
  if (!window) return window.error();
  c.sliding_window = *window;

  if (given(j, "rope_theta")) {
    const json& theta = j["rope_theta"];
    if (!theta.is_number() || !(theta.get<double>() > 0.0) || !std::isfinite(theta.get<double>()))
      return config_error("rope_theta = " + describe(theta) + " must be a positive number");
    c.rope_theta = theta.get<double>();
  }

  const Sliding sliding = uses_sliding_window(j);
  const std::int64_t qwen_first = qwen_max_window_layers(root, j);
  if (given(j, "layer_types")) {
    const json& types = j["layer_types"];
    if (!types.is_array()) return config_error("field 'layer_types' must be an array");
    for (std::size_t i = 0; i < types.size(); ++i) {
      const json& t = types[i];
      std::string s = t.is_string() ? t.get<std::string>() : describe(t);
      if (s == "sliding_attention" || s == "sliding" || s == "local")
        c.layer_kinds.push_back(LayerKind::kSlidingRope);
      else if (s == "full_attention" || s == "full" || s == "global" || s == "attention")
        c.layer_kinds.push_back(LayerKind::kFullNope);
      else
        return config_error("layer_types[" + std::to_string(i) + "] = " + describe(t) +
                            " is not a known layer type (sliding_attention, full_attention)");
    }
  } else if (given(j, "sliding_window_pattern")) {
    auto pattern = int_field(j, "sliding_window_pattern", true);
    if (!pattern) return pattern.error();
    if (*pattern < 1 || *pattern > kMaxLayers)
      return config_error("sliding_window_pattern = " + std::to_string(*pattern) +
                          " must be in [1, " + std::to_string(kMaxLayers) + "]");
    // Every pattern-th layer is global (Gemma 3, Cohere 2): layer l is full
    // when (l + 1) % pattern == 0.
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      c.layer_kinds.push_back((l + 1) % *pattern == 0 ? LayerKind::kFullNope
                                                      : LayerKind::kSlidingRope);
  } else if (c.sliding_window > 0 &&
             (sliding == Sliding::kOff || (sliding == Sliding::kUnsaid && qwen_first > 0))) {
    // Qwen's configs name a window that no layer uses unless
    // use_sliding_window is true.
    c.layer_kinds.assign(static_cast<std::size_t>(c.n_layers), LayerKind::kFullNope);
  } else if (c.sliding_window > 0 &&
             (given(j, "max_window_layers") || (sliding == Sliding::kOn && qwen_first > 0))) {
    if (sliding != Sliding::kOn)
      return config_error("max_window_layers is set but 'use_sliding_window' is not true");
    // Qwen: layers from max_window_layers on slide, those before are full;
    // without the field, the model type's default. A model of no more
    // layers than that slides nowhere, as in Hugging Face's classes (the
    // Qwen2.5-VL 3B file names 70 of its 36).
    std::int64_t first = qwen_first;
    if (given(j, "max_window_layers")) {
      auto field = int_field(j, "max_window_layers", true);
      if (!field) return field.error();
      KVRING_RETURN_IF_ERROR(
          check_range("max_window_layers", *field, 0, std::numeric_limits<std::int32_t>::max()));
      first = *field;
    }
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      c.layer_kinds.push_back(l >= first ? LayerKind::kSlidingRope : LayerKind::kFullNope);
  } else if (c.sliding_window > 0 && (sliding == Sliding::kOn || every_layer_slides(root, j))) {
    // Mistral, Mixtral, Phi-3, Starcoder2: the window applies to every layer.
    c.layer_kinds.assign(static_cast<std::size_t>(c.n_layers), LayerKind::kSlidingRope);
  } else if (c.sliding_window > 0) {
    return config_error(
        "sliding_window is set but neither 'layer_types', 'sliding_window_pattern', "
        "'use_sliding_window' nor the model_type says which layers slide");
  } else {
    c.layer_kinds.assign(static_cast<std::size_t>(c.n_layers), LayerKind::kFullNope);
  }
  if (c.count(LayerKind::kSlidingRope) > 0 && !given(j, "sliding_window"))
    return config_error("missing field 'sliding_window' (the config has sliding layers)");
  KVRING_RETURN_IF_ERROR(c.validate());
  // A window no layer uses is no part of the geometry (once checked as a
  // field): two all-full configs of the same shapes give interchangeable
  // caches and one fingerprint.
  if (c.count(LayerKind::kSlidingRope) == 0) c.sliding_window = 0;
  return c;
}

// The geometry of a parsed config file `root`: its text config, with the
// class's defaults put in place for what it leaves out.
Result<ModelConfig> config_from_tree(json& root, std::string name) {
  if (!root.is_object()) return config_error("config is not a JSON object");
  // Multimodal Gemma 3 configs nest the language model under text_config.
  json& text = (root.contains("text_config") && root["text_config"].is_object()) ? root["text_config"] : root;
  // The class's defaults for what the file leaves out, put in place (a
  // copy of a hostile file's tree would double the parse's memory); a
  // refusal names the fields that took one.
  std::string defaulted;
  if (const ClassDefaults* d = class_defaults(root, text)) {
    const std::string type = model_type(root, text);
    for (const auto& [key, value] : d->values.items()) {
      if (!text.contains(key)) {
        text[key] = value;
        defaulted += (defaulted.empty() ? "" : ", ") + key;
      } else if (text[key].is_null() && std::find(d->nullable.begin(), d->nullable.end(), key) == d->nullable.end()) {
        return config_error("field '" + key + "' is null: a " + type +
                            " config gives it a value or leaves it out (Hugging Face's default: " + value.dump() +
                            ")");
      }
    }
  }
  auto r = parse_text_config(root, text, std::move(name));
  if (!r && !defaulted.empty()) {
    Error e = r.error();
    e.message += " (fields absent from the file took Hugging Face's " + model_type(root, text) +
                 " defaults: " + defaulted + ")";
    return e;
  }
  return r;
}

}  // namespace

// The deepest nesting a config.json may have (a model's configs nest a
// handful of levels: text_config, rope_scaling and their lists).
constexpr int kMaxConfigDepth = 32;

Result<ModelConfig> parse_hf_config(std::string_view json_text, std::string name) {
  // JSON text has no NUL byte; the parser would end the input at one and
  // take the text before it as the whole config.
  if (const auto nul = json_text.find('\0'); nul != std::string_view::npos)
    return config_error("a NUL byte at byte " + std::to_string(nul) + ": a config is JSON text");
  // Bounded before it is parsed: a parse of deeply nested text takes tens of
  // bytes of memory for each of its bytes.
  if (const int depth = json_depth(json_text); depth > kMaxConfigDepth)
    return config_error("arrays and objects nested " + std::to_string(depth) + " deep; a config nests at most " +
                        std::to_string(kMaxConfigDepth));
  // A 4 MiB file's tree takes about 30 bytes for each byte of its text, and
  // the memory may run out on the way: an error, with the tree freed
  // without allocating (core/json_tree.h).
  const auto out_of_memory = [&] {
    return make_error(ErrorCode::kIOError,
                      "out of host memory for a config of " + std::to_string(json_text.size()) + " bytes");
  };
  JsonTree tree;
  try {
    tree.parse(json_text);
  } catch (const json::parse_error& e) {
    // The parser's message quotes the input's last bytes as they are.
    return config_error("malformed JSON at byte " + std::to_string(e.byte) + ": " + printable(e.what()));
  } catch (const json::exception& e) {
    // The parser throws other errors too: a number too large for a double
    // (out_of_range 406) among them.
    return config_error("malformed JSON: " + printable(e.what()));
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
  try {
    return config_from_tree(tree.root(), std::move(name));
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

Result<ModelConfig> load_hf_config(const std::string& path) {
  auto text = file_internal::read_small_file(path, "config file", file_internal::kMaxConfigBytes);
  if (!text) {
    // A file that cannot be read is a config that is missing: kConfig, with
    // the reason (absent, not a regular file, too large) in the message.
    Error e = text.error();
    e.code = ErrorCode::kConfig;
    return e;
  }
  // The model's name is its path, escaped (core/text.h): it goes into
  // messages, JSON and packs, which need valid UTF-8 and no control bytes.
  auto r = parse_hf_config(*text, printable(path));
  if (!r) {
    Error e = r.error();
    e.message = printable(path) + ": " + e.message;
    return e;
  }
  return r;
}

Result<ModelConfig> resolve_config(const std::string& model_name,
                                   const std::string& config_path) {
  if (!model_name.empty() && !config_path.empty())
    return invalid_argument("give either --model or --config, not both");
  if (!config_path.empty()) return load_hf_config(config_path);
  return preset_config(model_name.empty() ? "muse-glimmer" : model_name);
}

}  // namespace kvring
