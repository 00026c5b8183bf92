#include "kvring/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <limits>

namespace kvring {
namespace {

TEST(Config, MuseGlimmerPreset) {
  auto c = preset_config("muse-glimmer");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->n_layers, 52);
  EXPECT_EQ(c->n_heads, 16);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->kv_dim(), 256);
  EXPECT_EQ(c->sliding_window, 2048);
  EXPECT_EQ(c->max_context, 131072);
  EXPECT_EQ(c->count(LayerKind::kFullNope), 13);
  EXPECT_EQ(c->count(LayerKind::kSlidingRope), 39);
  for (std::int64_t l = 0; l < 52; ++l)
    EXPECT_EQ(c->kind(l), l % 4 == 3 ? LayerKind::kFullNope : LayerKind::kSlidingRope);
  EXPECT_TRUE(c->validate().ok());
  EXPECT_EQ(preset_config("nope").error().code, ErrorCode::kInvalidArgument);
}

TEST(Config, FingerprintIsStableAndSensitive) {
  const ModelConfig c = *preset_config("muse-glimmer");
  // Pinned: a change here breaks every stored pack of this geometry.
  EXPECT_EQ(c.fingerprint_hex(), c.fingerprint_hex());
  EXPECT_EQ(c.fingerprint_hex(),
            "dda7e3c27b75c5cde043119aac207390b9613d6694af5f9e66d0b415a0096b45");
  ModelConfig renamed = c;
  renamed.name = "other";
  EXPECT_EQ(renamed.fingerprint(), c.fingerprint());
  auto differs = [&](auto mutate) {
    ModelConfig d = c;
    mutate(d);
    return d.fingerprint() != c.fingerprint();
  };
  EXPECT_TRUE(differs([](ModelConfig& d) { d.n_layers = 51; d.layer_kinds.pop_back(); }));
  EXPECT_TRUE(differs([](ModelConfig& d) { d.n_heads = 8; }));
  EXPECT_TRUE(differs([](ModelConfig& d) { d.n_kv_heads = 4; }));
  EXPECT_TRUE(differs([](ModelConfig& d) { d.head_dim = 64; }));
  EXPECT_TRUE(differs([](ModelConfig& d) { d.sliding_window = 4096; }));
  EXPECT_TRUE(differs([](ModelConfig& d) { d.max_context = 65536; }));
  EXPECT_TRUE(differs([](ModelConfig& d) { d.layer_kinds[0] = LayerKind::kFullNope; }));
}

TEST(HfConfig, Gemma3WithPattern) {
  // Gemma 3 27B's text config: 5 local : 1 global.
  auto c = parse_hf_config(R"({
    "model_type": "gemma3", "text_config": {
      "hidden_size": 5376, "num_hidden_layers": 62, "num_attention_heads": 32,
      "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
      "sliding_window_pattern": 6, "max_position_embeddings": 131072,
      "rope_theta": 1000000.0}})");
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->n_layers, 62);
  EXPECT_EQ(c->kv_dim(), 2048);
  EXPECT_EQ(c->sliding_window, 1024);
  EXPECT_EQ(c->count(LayerKind::kFullNope), 10);  // layers 5, 11, ..., 59
  EXPECT_EQ(c->kind(5), LayerKind::kFullNope);
  EXPECT_EQ(c->kind(4), LayerKind::kSlidingRope);
  EXPECT_EQ(c->rope_theta, 1000000.0);
}

TEST(HfConfig, Gemma3WithLayerTypes) {
  auto c = parse_hf_config(R"({"hidden_size": 1152, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "sliding_window": 512, "max_position_embeddings": 32768,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]})");
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->kind(3), LayerKind::kFullNope);
  EXPECT_EQ(c->count(LayerKind::kSlidingRope), 3);
}

TEST(HfConfig, Cohere2) {
  auto c = parse_hf_config(R"({"model_type": "cohere2", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "sliding_window": 4096, "sliding_window_pattern": 4, "max_position_embeddings": 8192})");
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->head_dim, 128);  // hidden_size / num_attention_heads
  EXPECT_EQ(c->count(LayerKind::kFullNope), 8);
  EXPECT_EQ(c->kind(3), LayerKind::kFullNope);
}

TEST(HfConfig, GptOss) {
  std::string types;
  for (int i = 0; i < 24; ++i)
    types += std::string(i ? "," : "") + (i % 2 ? "\"full_attention\"" : "\"sliding_attention\"");
  auto c = parse_hf_config(R"({"model_type": "gpt_oss", "hidden_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072,
    "layer_types": [)" + types + "]}");
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->count(LayerKind::kFullNope), 12);
  EXPECT_EQ(c->kind(0), LayerKind::kSlidingRope);
  EXPECT_EQ(c->kind(1), LayerKind::kFullNope);
  EXPECT_EQ(c->kv_dim(), 512);
  // Its sinks are weights; the config says the model has them, and the
  // fingerprint does not.
  EXPECT_TRUE(c->attention_sinks);
  ModelConfig without = *c;
  without.attention_sinks = false;
  EXPECT_EQ(without.fingerprint(), c->fingerprint());
  auto other = parse_hf_config(R"({"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096, "sliding_window": 512})");
  ASSERT_TRUE(other.ok()) << other.error().to_string();
  EXPECT_FALSE(other->attention_sinks);
}

void expect_error(const std::string& json, const std::string& names);

// Attention the store's kernels do not compute is refused, naming the field;
// the same fields at values that change nothing are accepted.
TEST(HfConfig, AttentionTheStoreDoesNotComputeIsRefused) {
  const std::string base = R"({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "sliding_window": 512, "sliding_window_pattern": 2, )";
  expect_error(base + R"("head_dim": 128, "attn_logit_softcapping": 50.0})", "attn_logit_softcapping = 50.0");
  expect_error(base + R"("head_dim": 128, "attention_chunk_size": 8192})", "attention_chunk_size = 8192");
  expect_error(base + R"("head_dim": 192, "kv_lora_rank": 512})", "kv_lora_rank = 512");
  expect_error(base + R"("head_dim": 192, "v_head_dim": 128})", "v_head_dim = 128");
  for (const char* fine : {R"("head_dim": 256, "query_pre_attn_scalar": 256, "attn_logit_softcapping": null})",
                           R"("head_dim": 128, "attention_chunk_size": null, "v_head_dim": 128})"}) {
    auto c = parse_hf_config(base + fine);
    EXPECT_TRUE(c.ok()) << fine << ": " << c.error().to_string();
  }
}

// query_pre_attn_scalar sets the score scale (Gemma 3 27B: 168 at head_dim
// 128), which is no part of the geometry; equal to head_dim it is the usual
// scale, recorded as 0.
TEST(HfConfig, QueryPreAttnScalarSetsTheScoreScale) {
  const std::string base = R"({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "sliding_window": 512, "sliding_window_pattern": 2, "head_dim": 128)";
  auto plain = parse_hf_config(base + "}");
  auto scaled = parse_hf_config(base + R"(, "query_pre_attn_scalar": 168})");
  auto same = parse_hf_config(base + R"(, "query_pre_attn_scalar": 128.0})");
  ASSERT_TRUE(plain.ok() && scaled.ok() && same.ok());
  EXPECT_EQ(plain->score_scale_dim(), 128.0);
  EXPECT_EQ(scaled->query_pre_attn_scalar, 168.0);
  EXPECT_EQ(scaled->score_scale_dim(), 168.0);
  EXPECT_EQ(same->query_pre_attn_scalar, 0.0);
  EXPECT_EQ(scaled->fingerprint(), plain->fingerprint());
  for (const char* bad : {"0", "-4", "0.5", "1e-300", "\"168\"", "2e9", "true"})
    expect_error(base + R"(, "query_pre_attn_scalar": )" + bad + "}", "query_pre_attn_scalar");
  ModelConfig c = *plain;
  c.query_pre_attn_scalar = -1;
  EXPECT_FALSE(c.validate().ok());
  // The refused value as it is, not rounded to six decimals.
  for (const auto& [v, text] : {std::pair{5e-324, "= 5e-324 outside"}, std::pair{1e300, "= 1e+300 outside"},
                                std::pair{0.5, "= 0.5 outside"}}) {
    c.query_pre_attn_scalar = v;
    const Status s = c.validate();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.error().message.find(text), std::string::npos) << s.error().to_string();
  }
}

// Which layers a window covers, as Hugging Face's configs say it: not at all
// (use_sliding_window false), from max_window_layers on (Qwen2), or every
// layer (Mistral's bare window). A window no layer uses leaves the
// geometry: the fingerprint is that of the same config without it.
TEST(HfConfig, TheWindowCoversTheLayersTheConfigSays) {
  const std::string base = R"({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 32768, )";
  auto none = parse_hf_config(base + R"("model_type": "qwen2"})");
  ASSERT_TRUE(none.ok()) << none.error().to_string();
  auto off = parse_hf_config(base + R"("model_type": "qwen2", "sliding_window": 32768,
    "use_sliding_window": false, "max_window_layers": 2})");
  ASSERT_TRUE(off.ok()) << off.error().to_string();
  EXPECT_EQ(off->count(LayerKind::kFullNope), 4);
  EXPECT_EQ(off->sliding_window, 0);
  EXPECT_EQ(off->fingerprint(), none->fingerprint());
  auto listed = parse_hf_config(base + R"("sliding_window": 512, "layer_types": ["full_attention",
    "full_attention", "full_attention", "full_attention"]})");
  ASSERT_TRUE(listed.ok()) << listed.error().to_string();
  EXPECT_EQ(listed->fingerprint(), none->fingerprint());
  // The same shapes made in code: every layer full, the window dropped.
  const ModelConfig made = make_hybrid_config("made", 4, 1, 8, 2, 64, 512, 32768);
  EXPECT_EQ(made.sliding_window, 0);
  EXPECT_EQ(made.fingerprint(), none->fingerprint());
  EXPECT_EQ(make_hybrid_config("made", 4, 2, 8, 2, 64, 512, 32768).sliding_window, 512);
  // A window that is no valid field is refused in code as in a file, used
  // by a layer or not.
  for (const std::int64_t bad : {std::int64_t{-1}, kMaxContext + 1}) {
    const std::string field = "\"sliding_window\": " + std::to_string(bad);
    EXPECT_FALSE(parse_hf_config(base + field + R"(, "layer_types": ["full_attention", "full_attention",
      "full_attention", "full_attention"]})").ok()) << bad;
    EXPECT_FALSE(make_hybrid_config("made", 4, 1, 8, 2, 64, bad, 32768).validate().ok()) << bad;
    EXPECT_FALSE(make_hybrid_config("made", 4, 2, 8, 2, 64, bad, 32768).validate().ok()) << bad;
  }
  // A layer count past kMaxLayers makes no layer kinds (none allocated for
  // it) and is refused by validate(); full_every <= 0 makes no full layer.
  for (const std::int64_t layers : {kMaxLayers + 1, 4 * kMaxLayers}) {
    const ModelConfig huge = make_hybrid_config("made", layers, 2, 8, 2, 64, 512, 32768);
    EXPECT_TRUE(huge.layer_kinds.empty()) << layers;
    const Status refused = huge.validate();
    ASSERT_FALSE(refused.ok()) << layers;
    EXPECT_NE(refused.to_string().find("num_hidden_layers"), std::string::npos) << refused.to_string();
  }
  EXPECT_EQ(make_hybrid_config("made", kMaxLayers, 2, 8, 2, 64, 512, 32768).layer_kinds.size(),
            static_cast<std::size_t>(kMaxLayers));
  for (const std::int64_t every : {std::int64_t{0}, std::int64_t{-3}})
    EXPECT_EQ(make_hybrid_config("made", 4, every, 8, 2, 64, 512, 32768).count(LayerKind::kFullNope), 0) << every;

  auto upper = parse_hf_config(base + R"("sliding_window": 512, "use_sliding_window": true,
    "max_window_layers": 2})");
  ASSERT_TRUE(upper.ok()) << upper.error().to_string();
  EXPECT_EQ(upper->kind(1), LayerKind::kFullNope);
  EXPECT_EQ(upper->kind(2), LayerKind::kSlidingRope);
  EXPECT_EQ(upper->count(LayerKind::kSlidingRope), 2);
  EXPECT_EQ(upper->sliding_window, 512);
  expect_error(base + R"("sliding_window": 512, "max_window_layers": 2})", "use_sliding_window");
  // Past the last layer (the Qwen2.5-VL 3B file names 70 of its 36): no
  // layer slides, as in Hugging Face's classes.
  auto past = parse_hf_config(base + R"("sliding_window": 512, "use_sliding_window": true, "max_window_layers": 9})");
  ASSERT_TRUE(past.ok()) << past.error().to_string();
  EXPECT_EQ(past->count(LayerKind::kFullNope), 4);
  expect_error(base + R"("sliding_window": 512, "use_sliding_window": true, "max_window_layers": -1})",
               "max_window_layers");

  // Qwen's classes take use_sliding_window = false when it is absent, and
  // max_window_layers = 28 (80 for the VL models' text configs).
  const std::string deep = R"({"num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 32768, "sliding_window": 4096, "use_sliding_window": true, )";
  auto qwen = parse_hf_config(deep + R"("model_type": "qwen2"})");
  ASSERT_TRUE(qwen.ok()) << qwen.error().to_string();
  EXPECT_EQ(qwen->kind(27), LayerKind::kFullNope);
  EXPECT_EQ(qwen->kind(28), LayerKind::kSlidingRope);
  EXPECT_EQ(qwen->count(LayerKind::kSlidingRope), 2);
  auto shallow = parse_hf_config(base + R"("model_type": "qwen3", "sliding_window": 512, "use_sliding_window": true})");
  ASSERT_TRUE(shallow.ok()) << shallow.error().to_string();
  EXPECT_EQ(shallow->count(LayerKind::kFullNope), 4);
  EXPECT_EQ(shallow->sliding_window, 0);
  auto vl = parse_hf_config(deep + R"("model_type": "qwen2_5_vl"})");
  ASSERT_TRUE(vl.ok()) << vl.error().to_string();
  EXPECT_EQ(vl->count(LayerKind::kFullNope), 30);
  auto unsaid = parse_hf_config(base + R"("model_type": "qwen2", "sliding_window": 512, "max_window_layers": 2})");
  ASSERT_TRUE(unsaid.ok()) << unsaid.error().to_string();
  EXPECT_EQ(unsaid->count(LayerKind::kFullNope), 4);

  for (const char* every : {R"("model_type": "mistral", "sliding_window": 4096})",
                            R"("sliding_window": 4096, "use_sliding_window": true})"}) {
    auto c = parse_hf_config(base + every);
    ASSERT_TRUE(c.ok()) << every << ": " << c.error().to_string();
    EXPECT_EQ(c->count(LayerKind::kSlidingRope), 4) << every;
  }
  auto phimoe = parse_hf_config(base + R"("model_type": "phimoe", "sliding_window": 2048})");
  ASSERT_TRUE(phimoe.ok()) << phimoe.error().to_string();
  EXPECT_EQ(phimoe->count(LayerKind::kSlidingRope), 4);
  expect_error(base + R"("model_type": "llama", "sliding_window": 4096})", "which layers slide");
  expect_error(base + R"("sliding_window": 4096, "use_sliding_window": "yes"})", "use_sliding_window = \"yes\"");
}

// Mistral's and Qwen's classes give a file without a window one of 4096:
// Mistral slides every layer by it, Qwen the layers from max_window_layers
// on where use_sliding_window is true. A window given as null is none.
TEST(HfConfig, MistralAndQwenTakeTheirClassesWindow) {
  const std::string base = R"({"num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 32768, )";
  auto mistral = parse_hf_config(base + R"("model_type": "mistral"})");
  ASSERT_TRUE(mistral.ok()) << mistral.error().to_string();
  EXPECT_EQ(mistral->count(LayerKind::kSlidingRope), 30);
  EXPECT_EQ(mistral->sliding_window, 4096);
  auto no_window = parse_hf_config(base + R"("model_type": "mistral", "sliding_window": null})");
  ASSERT_TRUE(no_window.ok()) << no_window.error().to_string();
  EXPECT_EQ(no_window->count(LayerKind::kFullNope), 30);
  EXPECT_EQ(no_window->sliding_window, 0);
  for (const char* type : {"qwen2", "qwen3", "qwen2_moe"}) {
    auto on = parse_hf_config(base + R"("model_type": ")" + type + R"(", "use_sliding_window": true})");
    ASSERT_TRUE(on.ok()) << type << ": " << on.error().to_string();
    EXPECT_EQ(on->kind(27), LayerKind::kFullNope) << type;
    EXPECT_EQ(on->kind(28), LayerKind::kSlidingRope) << type;
    EXPECT_EQ(on->sliding_window, 4096) << type;
    auto off = parse_hf_config(base + R"("model_type": ")" + type + R"("})");
    ASSERT_TRUE(off.ok()) << type << ": " << off.error().to_string();
    EXPECT_EQ(off->count(LayerKind::kFullNope), 30) << type;
    auto null_on = parse_hf_config(base + R"("model_type": ")" + type +
                                   R"(", "use_sliding_window": true, "sliding_window": null})");
    ASSERT_TRUE(null_on.ok()) << type << ": " << null_on.error().to_string();
    EXPECT_EQ(null_on->count(LayerKind::kFullNope), 30) << type;
  }
  // A refusal says which fields took the class's default.
  auto bad = parse_hf_config(base + R"("model_type": "mistral", "num_key_value_heads": 3})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("defaults: sliding_window"), std::string::npos) << bad.error().message;
}

// Falcon counts its KV heads its own way: one under multi_query (the
// class's default when absent; null is false), else num_kv_heads (the query
// heads when absent) under the new decoder architecture or without
// multi_query; a count its class does not read is refused, and so is
// another model naming its KV heads only by those fields. Its class holds
// 2048 positions where the file does not say.
TEST(HfConfig, FalconCountsItsKvHeadsItsOwnWay) {
  const std::string base = R"({"model_type": "falcon", "num_hidden_layers": 4, "num_attention_heads": 32,
    "hidden_size": 4096, "max_position_embeddings": 8192, )";
  struct Case {
    const char* fields;
    std::int64_t kv_heads;
  };
  for (const Case& c : {Case{R"("new_decoder_architecture": true, "num_kv_heads": 8})", 8},
                        Case{R"("new_decoder_architecture": true})", 32},
                        Case{R"("multi_query": true, "num_kv_heads": 8})", 1},
                        Case{R"("alibi": false})", 1},
                        Case{R"("multi_query": null, "num_kv_heads": 4})", 4},
                        Case{R"("multi_query": false})", 32},
                        Case{R"("multi_query": false, "num_kv_heads": 16})", 16}}) {
    auto f = parse_hf_config(base + c.fields);
    ASSERT_TRUE(f.ok()) << c.fields << ": " << f.error().to_string();
    EXPECT_EQ(f->n_kv_heads, c.kv_heads) << c.fields;
    EXPECT_EQ(f->head_dim, 128) << c.fields;
  }
  expect_error(base + R"("alibi": true})", "alibi = true");
  expect_error(base + R"("new_decoder_architecture": "yes"})", "new_decoder_architecture");
  expect_error(base + R"("new_decoder_architecture": true, "num_kv_heads": 5})", "num_kv_heads = 5");
  expect_error(base + R"("new_decoder_architecture": true, "num_kv_heads": 0})", "num_kv_heads");
  expect_error(base + R"("new_decoder_architecture": true, "n_head_kv": 4})", "n_head_kv = 4");
  expect_error(base + R"("num_key_value_heads": 1})", "num_key_value_heads = 1");
  auto seven_b = parse_hf_config(R"({"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71,
    "hidden_size": 4544, "multi_query": true})");
  ASSERT_TRUE(seven_b.ok()) << seven_b.error().to_string();
  EXPECT_EQ(seven_b->max_context, 2048);
  EXPECT_EQ(seven_b->n_kv_heads, 1);
  const std::string other = R"({"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 32,
    "head_dim": 128, "max_position_embeddings": 8192, )";
  for (const char* field : {"num_kv_heads", "n_head_kv", "multi_query_group_num"})
    expect_error(other + "\"" + field + R"(": 8})", field);
  auto plain = parse_hf_config(other + R"("num_key_value_heads": 8, "num_kv_heads": 8})");
  ASSERT_TRUE(plain.ok()) << plain.error().to_string();
  EXPECT_EQ(plain->n_kv_heads, 8);
}

// Gemma's head_dim is never derived from hidden_size (Gemma 3 12B's would
// come out 240, not 256): Gemma 2 and 3 take their class's default, other
// Gemma configs must give it.
TEST(HfConfig, GemmaHeadDimIsNeverDerived) {
  auto c = parse_hf_config(R"({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 3840,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
    "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072}})");
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->head_dim, 256);
  expect_error(R"({"model_type": "gemma", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "max_position_embeddings": 8192})", "missing field 'head_dim': a Gemma model's head_dim is not hidden_size");
}

// The multimodal Gemma 3 checkpoints' config.json as published (transformers
// 4.50): text_config names a few fields and Gemma3TextConfig's defaults give
// the rest (8 heads over 4 KV heads of 256, 131072 positions,
// query_pre_attn_scalar 256, every 6th layer full).
TEST(HfConfig, Gemma3MultimodalAsPublished) {
  const std::string head = R"({"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
    "mm_tokens_per_image": 256, "model_type": "gemma3", "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "vision_config": {"hidden_size": 1152, "image_size": 896,
    "intermediate_size": 4304, "model_type": "siglip_vision_model", "num_attention_heads": 16,
    "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": false}, "text_config": )";
  auto b4 = parse_hf_config(head + R"({"hidden_size": 2560, "intermediate_size": 10240,
    "model_type": "gemma3_text", "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024}})");
  ASSERT_TRUE(b4.ok()) << b4.error().to_string();
  EXPECT_EQ(b4->n_heads, 8);
  EXPECT_EQ(b4->n_kv_heads, 4);
  EXPECT_EQ(b4->head_dim, 256);
  EXPECT_EQ(b4->max_context, 131072);
  EXPECT_EQ(b4->sliding_window, 1024);
  EXPECT_EQ(b4->score_scale_dim(), 256.0);
  for (std::int64_t l = 0; l < 34; ++l)
    EXPECT_EQ(b4->kind(l), l % 6 == 5 ? LayerKind::kFullNope : LayerKind::kSlidingRope) << l;
  auto b27 = parse_hf_config(head + R"({"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
    "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024}})");
  ASSERT_TRUE(b27.ok()) << b27.error().to_string();
  EXPECT_EQ(b27->kv_dim(), 2048);
  EXPECT_EQ(b27->score_scale_dim(), 168.0);
  EXPECT_EQ(b27->count(LayerKind::kFullNope), 10);
  // A Gemma 3 text config without query_pre_attn_scalar scales by the
  // class's 256, not by head_dim.
  auto plain = parse_hf_config(R"({"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 4096, "sliding_window": 512})");
  ASSERT_TRUE(plain.ok()) << plain.error().to_string();
  EXPECT_EQ(plain->score_scale_dim(), 256.0);
  EXPECT_EQ(plain->kind(5), LayerKind::kFullNope);
}

// Gemma 2: layers alternate, sliding first; soft-capping is the class's
// default when the file leaves it out, so such a file is refused.
TEST(HfConfig, Gemma2) {
  const std::string base = R"({"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 4096)";
  expect_error(base + R"(, "attn_logit_softcapping": 50.0})", "attn_logit_softcapping = 50.0");
  expect_error(base + "}", "attn_logit_softcapping");
  auto c = parse_hf_config(base + R"(, "attn_logit_softcapping": null, "query_pre_attn_scalar": 144})");
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  // Another defaulted field given as null is the class's None, from which
  // it builds no model.
  expect_error(base + R"(, "attn_logit_softcapping": null, "num_key_value_heads": null})",
               "field 'num_key_value_heads' is null");
  expect_error(base + R"(, "attn_logit_softcapping": null, "query_pre_attn_scalar": null})",
               "field 'query_pre_attn_scalar' is null");
  EXPECT_EQ(c->kind(0), LayerKind::kSlidingRope);
  EXPECT_EQ(c->kind(1), LayerKind::kFullNope);
  EXPECT_EQ(c->count(LayerKind::kFullNope), 2);
  EXPECT_EQ(c->score_scale_dim(), 144.0);
}

// Configs whose attention or layers the store does not have are refused,
// naming the field: Gemma 4's wider full-layer heads, Gemma 3n's shared KV
// layers, Phi-3-small's block-sparse layers, Qwen3-Next's and Jamba's
// non-attention layers. Granite's attention_multiplier sets the scale; Gemma
// 3n and 4 score with scale 1.
TEST(HfConfig, AttentionOfOtherModels) {
  const std::string base = R"({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "max_position_embeddings": 4096, )";
  struct Refused {
    const char* fields;
    const char* names;
  };
  for (const Refused& r : {Refused{R"("global_head_dim": 512)", "global_head_dim = 512"},
                           Refused{R"("num_global_key_value_heads": 1)", "num_global_key_value_heads = 1"},
                           Refused{R"("num_kv_shared_layers": 2)", "num_kv_shared_layers = 2"},
                           Refused{R"("dense_attention_every_n_layers": 2)", "dense_attention_every_n_layers = 2"},
                           Refused{R"("full_attention_interval": 4)", "full_attention_interval = 4"},
                           Refused{R"("attn_layer_period": 8, "attn_layer_offset": 4)", "attn_layer_period = 8"},
                           Refused{R"("use_bidirectional_attention": true)", "use_bidirectional_attention = true"},
                           Refused{R"("cross_attention_layers": [3, 8])", "cross_attention_layers"},
                           Refused{R"("block_configs": [{}, {}, {}, {}])", "block_configs"},
                           Refused{R"("attn_layer_indices": [1, 3])", "attn_layer_indices"},
                           Refused{R"("full_attn_idxs": [2])", "full_attn_idxs"},
                           Refused{R"("global_attn_every_n_layers": 3, "local_attention": 128)",
                                   "global_attn_every_n_layers"},
                           Refused{R"("is_encoder_decoder": true)", "is_encoder_decoder"}})
    expect_error(base + r.fields + "}", r.names);
  for (const char* encoder : {"bert", "roberta", "modernbert"})
    expect_error(base + R"("model_type": ")" + encoder + R"("})", "an encoder's attention");
  // Llama 3.2 Vision's class gives a text config without the field its
  // cross-attention layers.
  expect_error(base + R"("model_type": "mllama_text_model"})", "cross-attention layers");
  // Granite 4's layer_types name an attention layer "attention".
  auto attention = parse_hf_config(base + R"("layer_types": ["attention", "attention", "attention", "attention"]})");
  ASSERT_TRUE(attention.ok()) << attention.error().to_string();
  EXPECT_EQ(attention->count(LayerKind::kFullNope), 4);
  expect_error(base + R"("layer_types": ["attention", "mamba", "attention", "attention"]})", "layer_types[1]");
  for (const char* fine : {R"("global_head_dim": 128, "num_global_key_value_heads": 2, "num_kv_shared_layers": 0,
                             "use_bidirectional_attention": false})",
                           R"("attention_multiplier": 0.0078125})",
                           R"("cross_attention_layers": [], "alibi": false, "is_encoder_decoder": false})"}) {
    auto c = parse_hf_config(base + fine);
    EXPECT_TRUE(c.ok()) << fine << ": " << c.error().to_string();
  }
  auto granite = parse_hf_config(base + R"("model_type": "granite", "attention_multiplier": 0.0078125})");
  ASSERT_TRUE(granite.ok());
  EXPECT_EQ(granite->score_scale_dim(), 16384.0);
  // Granite's classes default attention_multiplier to 1.0, not
  // 1/sqrt(head_dim); a file that leaves it out scores with scale 1.
  for (const char* type : {"granite", "granitemoe", "granitemoeshared"}) {
    auto defaulted = parse_hf_config(base + R"("model_type": ")" + type + R"("})");
    ASSERT_TRUE(defaulted.ok()) << type << ": " << defaulted.error().to_string();
    EXPECT_EQ(defaulted->score_scale_dim(), 1.0) << type;
  }
  // Given as null (the classes' None), attention scales by its default.
  auto null_multiplier = parse_hf_config(base + R"("model_type": "granite", "attention_multiplier": null})");
  ASSERT_TRUE(null_multiplier.ok()) << null_multiplier.error().to_string();
  EXPECT_EQ(null_multiplier->score_scale_dim(), 128.0);
  expect_error(base + R"("attention_multiplier": 0})", "attention_multiplier");
  expect_error(base + R"("attention_multiplier": 0.01, "query_pre_attn_scalar": 64})", "attention_multiplier");
  auto unit = parse_hf_config(R"({"model_type": "gemma3n", "text_config": {"model_type": "gemma3n_text",
    "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "max_position_embeddings": 32768, "sliding_window": 512, "num_kv_shared_layers": 0, "layer_types":
    ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}})");
  ASSERT_TRUE(unit.ok()) << unit.error().to_string();
  EXPECT_EQ(unit->score_scale_dim(), 1.0);
}

void expect_error(const std::string& json, const std::string& names) {
  auto c = parse_hf_config(json);
  ASSERT_FALSE(c.ok()) << json;
  EXPECT_EQ(c.error().code, ErrorCode::kConfig);
  EXPECT_NE(c.error().message.find(names), std::string::npos)
      << "message '" << c.error().message << "' does not name '" << names << "'";
}

// The parser's message quotes the bytes it last read; they reach the
// error escaped, as every other piece of config text does.
TEST(HfConfig, MalformedJsonIsQuotedEscaped) {
  for (const std::string& json : {std::string("{\"\xff\": 1}"), std::string("{\"a\": 1,\x1b[2J")}) {
    auto c = parse_hf_config(json);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.error().message.find("malformed JSON"), std::string::npos) << c.error().message;
    for (const char ch : c.error().message) {
      const auto u = static_cast<unsigned char>(ch);
      EXPECT_TRUE(u >= 0x20 && u < 0x7f) << "raw byte " << static_cast<int>(u) << " in " << c.error().message;
    }
  }
  auto bad = parse_hf_config("{\"\xff\": 1}");
  EXPECT_NE(bad.error().message.find("\\xff"), std::string::npos) << bad.error().message;
  // Text after a NUL byte is not dropped: the whole text is refused.
  const std::string good = R"({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9})";
  ASSERT_TRUE(parse_hf_config(good).ok());
  const std::string nul = good + std::string(1, '\0') + R"( {"num_hidden_layers": 999)";
  auto after = parse_hf_config(nul);
  ASSERT_FALSE(after.ok());
  EXPECT_NE(after.error().message.find("NUL byte at byte " + std::to_string(good.size())), std::string::npos)
      << after.error().message;
}

TEST(HfConfig, ErrorsNameTheField) {
  const std::string base = R"("num_hidden_layers": 4, "num_attention_heads": 8,
    "head_dim": 64, "max_position_embeddings": 4096, "sliding_window_pattern": 2)";
  expect_error("{" + base + R"(, "num_key_value_heads": 3, "sliding_window": 128})",
               "num_key_value_heads");
  expect_error("{" + base + R"(, "sliding_window": 0})", "sliding_window");
  expect_error("{" + base + R"(, "sliding_window": -5})", "sliding_window");
  expect_error("{" + base + "}", "sliding_window");
  expect_error(R"({"num_hidden_layers": -4, "num_attention_heads": 8, "head_dim": 64})",
               "num_hidden_layers");
  expect_error(R"({"num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": -64,
    "max_position_embeddings": 4096})", "head_dim");
  expect_error(R"({"num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64,
    "max_position_embeddings": 0})", "max_position_embeddings");
  expect_error(R"({"num_attention_heads": 8, "head_dim": 64, "max_position_embeddings": 9})",
               "num_hidden_layers");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 100,
    "max_position_embeddings": 9})", "hidden_size");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": 8,
    "max_position_embeddings": 9})", "head_dim");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": "8", "head_dim": 4,
    "max_position_embeddings": 9})", "num_attention_heads");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9, "sliding_window": 4,
    "layer_types": ["sliding_attention", "chunked_attention"]})", "layer_types[1]");
  expect_error(R"({"num_hidden_layers": 3, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"]})", "layer_types");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 4,)", "malformed JSON");
  expect_error("[1, 2]", "not a JSON object");
  expect_error(R"({"num_hidden_layers": 1e300, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9})", "num_hidden_layers");
  // Past int64: "too large", not read back as a negative number.
  expect_error(R"({"num_hidden_layers": 18446744073709551615, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9})", "'num_hidden_layers' is too large");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9, "rope_theta": 0})", "rope_theta");
  expect_error(R"({"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 4,
    "max_position_embeddings": 9, "rope_theta": "big"})", "rope_theta");
}

TEST(HfConfig, LoadFromFile) {
  const std::string path = ::testing::TempDir() + "/kvring_config_test.json";
  {
    std::ofstream f(path);
    f << R"({"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
      "head_dim": 128, "sliding_window": 2048, "sliding_window_pattern": 4,
      "max_position_embeddings": 131072})";
  }
  auto c = load_hf_config(path);
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->kind(3), LayerKind::kFullNope);
  auto missing = load_hf_config(path + ".absent");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("cannot read"), std::string::npos);
  EXPECT_FALSE(resolve_config("muse-glimmer", path).ok());
  auto dir = load_hf_config(::testing::TempDir());
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.error().message.find("is a directory"), std::string::npos);
  EXPECT_EQ(resolve_config("", "")->name, "muse-glimmer");
}

}  // namespace
}  // namespace kvring
