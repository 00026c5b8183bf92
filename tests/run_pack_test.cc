// kvring run's saved sessions: a run record is untrusted input like every
// other field of a pack, and out-of-range values are refused on resume.
#include "../tools/run_pack.h"

#include <gtest/gtest.h>

#include <limits>

#include <nlohmann/json.hpp>

#include "../tools/handoff_cli.h"
#include "core/file_read.h"
#include "kvring/cache.h"
#include "test_util.h"

namespace kvring::cli {
namespace {

// serve's default bound on what a sender may make it hold (its store and
// the reference model its run names): half the memory the process may
// use, within [1 MiB, 64 GiB]; 64 GiB where that is unknown.
TEST(HandoffServe, TheDefaultLimitIsHalfTheHostsMemory) {
  constexpr std::int64_t kGiB = std::int64_t{1} << 30;
  EXPECT_EQ(serve_default_max_mib(24 * kGiB), 12 * 1024);
  EXPECT_EQ(serve_default_max_mib(23 * kGiB + 123456789), (23 * kGiB + 123456789) / 2 / (1 << 20));
  EXPECT_EQ(serve_default_max_mib(256 * kGiB), 64 * 1024);
  EXPECT_EQ(serve_default_max_mib(std::int64_t{1} << 20), 1);
  EXPECT_EQ(serve_default_max_mib(0), 64 * 1024);
  EXPECT_EQ(serve_default_max_mib(-1), 64 * 1024);
  EXPECT_EQ(serve_default_max_mib(std::numeric_limits<std::int64_t>::max()), 64 * 1024);
  // This process's own bound is at most its host's memory.
  const std::int64_t here = file_internal::memory_limit_bytes();
  EXPECT_GT(here, 0);
  EXPECT_LE(serve_default_max_mib(here), 64 * 1024);
}

TEST(RunPack, ResumeRefusesRunRecordsOutOfRange) {
  const ModelConfig c = testing::small_config(32, 256, 4, 4, 2, 16);
  const ModelOptions options{.hidden = 32, .vocab = 50, .mlp = 0, .seed = 4};
  auto model = ReferenceModel::create(c, options);
  ASSERT_TRUE(model.ok());
  auto cache = make_cpu_cache(c);
  ASSERT_TRUE(cache.ok());
  Session s(*model, std::move(*cache));
  ASSERT_TRUE(s.feed(seeded_tokens(40, 50, 1), 7).ok());
  const std::string dir = ::testing::TempDir();
  auto save = [&](std::int64_t prompt_tokens, std::int64_t chunk, double theta) {
    const std::string path = dir + "/run_pack_" + std::to_string(prompt_tokens) + "_" +
                             std::to_string(chunk) + ".kvpack";
    RunRecord r{c.name, theta, options, 1, prompt_tokens, chunk, s.last_logits()};
    EXPECT_TRUE(save_run(s, r, path, "").ok());
    return path;
  };
  EXPECT_TRUE(resume_run(save(40, 7, c.rope_theta), "", BackendKind::kCpu, 0).ok());
  struct Bad { std::int64_t prompt, chunk; double theta; const char* names; };
  for (const Bad& b : {Bad{-1000000, 7, c.rope_theta, "prompt_tokens"},
                       Bad{0, 7, c.rope_theta, "prompt_tokens"},
                       Bad{41, 7, c.rope_theta, "prompt_tokens"},
                       Bad{40, 0, c.rope_theta, "chunk"},
                       Bad{40, 7, -1.0, "rope_theta"}}) {
    auto r = resume_run(save(b.prompt, b.chunk, b.theta), "", BackendKind::kCpu, 0);
    ASSERT_FALSE(r.ok()) << b.names;
    EXPECT_NE(r.error().message.find(b.names), std::string::npos) << r.error().message;
  }
}

// A resumed run reads its pack's rows straight into the run's store; the
// rows are the saved session's. A pack replaced after its record was read
// (another session at the same path) is refused and leaves no sequence.
TEST(RunPack, APackIsRestoredAsItsRecordWasRead) {
  const ModelConfig c = testing::small_config(32, 256, 4, 4, 2, 16);
  const ModelOptions options{.hidden = 32, .vocab = 50, .mlp = 0, .seed = 4};
  auto model = ReferenceModel::create(c, options);
  ASSERT_TRUE(model.ok());
  auto session = [&](std::int64_t tokens) {
    auto cache = make_cpu_cache(c);
    EXPECT_TRUE(cache.ok());
    Session s(*model, std::move(*cache));
    EXPECT_TRUE(s.feed(seeded_tokens(tokens, 50, 1), 7).ok());
    return s;
  };
  const Session a = session(40), b = session(45);
  const std::string path = ::testing::TempDir() + "/run_pack_replaced.kvpack";
  RunRecord r{c.name, c.rope_theta, options, 1, 40, 7, a.last_logits()};
  ASSERT_TRUE(save_run(a, r, path, "").ok());
  auto pack = open_run_pack(path, "");
  ASSERT_TRUE(pack.ok()) << pack.error().to_string();
  auto store = make_store(BackendKind::kCpu, c, {.max_sequences = 2});
  ASSERT_TRUE(store.ok());
  auto seq = restore_run_pack(*pack, **store);
  ASSERT_TRUE(seq.ok()) << seq.error().to_string();
  const std::int64_t kv = c.kv_dim();
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const RingState ring = a.cache().ring(l);
    const std::int64_t n = ring.len();
    std::vector<std::uint16_t> want_k(n * kv), want_v(n * kv), got_k(n * kv), got_v(n * kv);
    ASSERT_TRUE(a.cache().store().read_rows(a.cache().seq(), l, ring.origin_logical(), n, want_k.data(),
                                            want_v.data()).ok());
    ASSERT_TRUE((*store)->read_rows(*seq, l, ring.origin_logical(), n, got_k.data(), got_v.data()).ok());
    EXPECT_EQ(got_k, want_k) << "layer " << l;
    EXPECT_EQ(got_v, want_v) << "layer " << l;
  }
  ASSERT_TRUE((*store)->remove_sequence(*seq).ok());
  const std::int64_t free_blocks = (*store)->free_blocks();

  r.last_logits = b.last_logits();
  ASSERT_TRUE(save_run(b, r, path, "").ok());
  auto replaced = restore_run_pack(*pack, **store);
  ASSERT_FALSE(replaced.ok());
  EXPECT_EQ(replaced.error().code, ErrorCode::kMismatch);
  EXPECT_NE(replaced.error().message.find("changed after its run record was read"), std::string::npos)
      << replaced.error().message;
  EXPECT_EQ((*store)->sequence_count(), 0);
  EXPECT_EQ((*store)->free_blocks(), free_blocks);
}

// The attention numeric travels in the record: absent (records written
// before it existed) it is f32, and a name this build does not know is
// refused with the field named.
TEST(RunPack, RunRecordsCarryTheAttentionNumeric) {
  RunRecord r{"m", 10000.0, {.hidden = 8, .vocab = 4, .mlp = 0, .seed = 1}, 1, 3, 2, {0.5f, -1.0f, 2.0f, 0.0f},
              AttentionNumeric::kF16};
  const std::string text = encode_run_record(r);
  auto back = decode_run_record(text, "p.kvpack");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back->attention, AttentionNumeric::kF16);
  nlohmann::json j = nlohmann::json::parse(text);
  j.erase("attention");
  auto old = decode_run_record(j.dump(), "p.kvpack");
  ASSERT_TRUE(old.ok()) << old.error().message;
  EXPECT_EQ(old->attention, AttentionNumeric::kF32);
  j["attention"] = "fp8";
  auto bad = decode_run_record(j.dump(), "p.kvpack");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("field 'attention'"), std::string::npos) << bad.error().message;
  j["attention"] = 16;
  bad = decode_run_record(j.dump(), "p.kvpack");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("'attention' must be a string"), std::string::npos) << bad.error().message;
}

constexpr ModelOptions kRunOptions{.hidden = 32, .vocab = 50, .mlp = 0, .seed = 4};
const std::vector<std::int32_t> kRunTokens = seeded_tokens(45, 50, 1);

// A session of the reference model of `c` on a CPU cache, fed the first 40
// of kRunTokens in chunks of 7.
Session fed_session(const ModelConfig& c) {
  auto model = ReferenceModel::create(c, kRunOptions);
  EXPECT_TRUE(model.ok());
  auto cache = make_cpu_cache(c);
  EXPECT_TRUE(cache.ok());
  Session s(*model, std::move(*cache));
  EXPECT_TRUE(s.feed({kRunTokens.begin(), kRunTokens.begin() + 40}, 7).ok());
  return s;
}

// `s` saved with `r` and resumed; both go on over the rest of kRunTokens to
// the same logits. The resumed session.
Result<ResumedRun> resumed_alike(Session& s, const RunRecord& r, const std::string& name) {
  const std::string path = ::testing::TempDir() + "/" + name + ".kvpack";
  EXPECT_TRUE(save_run(s, r, path, "").ok());
  auto resumed = resume_run(path, "", BackendKind::kCpu, 0);
  if (!resumed) return resumed.error();
  const std::vector<std::int32_t> rest(kRunTokens.begin() + 40, kRunTokens.end());
  EXPECT_TRUE(s.feed(rest, 7).ok());
  EXPECT_TRUE(resumed->session.feed(rest, 7).ok());
  EXPECT_EQ(resumed->session.last_logits(), s.last_logits());
  return resumed;
}

// The score scale travels in the record (absent: the usual scale): a
// resumed session of a scaled config attends as the session that never
// stopped.
TEST(RunPack, RunRecordsCarryTheScoreScale) {
  ModelConfig c = testing::small_config(32, 256, 4, 4, 2, 16);
  c.query_pre_attn_scalar = 37;
  Session s = fed_session(c);
  RunRecord r{c.name, c.rope_theta, kRunOptions, 1, 40, 7, s.last_logits()};
  r.query_pre_attn_scalar = c.query_pre_attn_scalar;
  auto resumed = resumed_alike(s, r, "run_pack_scaled");
  ASSERT_TRUE(resumed.ok()) << resumed.error().to_string();
  EXPECT_EQ(resumed->session.model().config().query_pre_attn_scalar, 37.0);

  nlohmann::json j = nlohmann::json::parse(encode_run_record(r));
  EXPECT_EQ(j["query_pre_attn_scalar"], 37.0);
  j.erase("query_pre_attn_scalar");
  auto plain = decode_run_record(j.dump(), "p.kvpack");
  ASSERT_TRUE(plain.ok()) << plain.error().message;
  EXPECT_EQ(plain->query_pre_attn_scalar, 0.0);
  for (const nlohmann::json& bad : {nlohmann::json(0), nlohmann::json(-3.0), nlohmann::json(1e-300), nlohmann::json("37"),
                                    nlohmann::json(4e9)}) {
    j["query_pre_attn_scalar"] = bad;
    auto refused = decode_run_record(j.dump(), "p.kvpack");
    ASSERT_FALSE(refused.ok()) << bad.dump();
    EXPECT_NE(refused.error().message.find("query_pre_attn_scalar"), std::string::npos) << refused.error().message;
  }
}

// A model with attention sinks: the reference model sets its own on the
// store, the record says so, and a resumed session attends with them as
// the session that never stopped (and not as the same weights without).
TEST(RunPack, RunRecordsCarryAttentionSinks) {
  ModelConfig c = testing::small_config(32, 256, 4, 4, 2, 16);
  c.attention_sinks = true;
  Session s = fed_session(c);
  ModelConfig plain_config = c;
  plain_config.attention_sinks = false;
  EXPECT_NE(fed_session(plain_config).last_logits(), s.last_logits());
  RunRecord r{c.name, c.rope_theta, kRunOptions, 1, 40, 7, s.last_logits()};
  r.attention_sinks = true;
  auto resumed = resumed_alike(s, r, "run_pack_sinks");
  ASSERT_TRUE(resumed.ok()) << resumed.error().to_string();
  EXPECT_TRUE(resumed->session.model().config().attention_sinks);

  nlohmann::json j = nlohmann::json::parse(encode_run_record(r));
  EXPECT_EQ(j["attention_sinks"], true);
  j.erase("attention_sinks");
  auto without = decode_run_record(j.dump(), "p.kvpack");
  ASSERT_TRUE(without.ok()) << without.error().message;
  EXPECT_FALSE(without->attention_sinks);
  j["attention_sinks"] = 1;
  auto refused = decode_run_record(j.dump(), "p.kvpack");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("attention_sinks"), std::string::npos) << refused.error().message;
}

// A record that could only be served wrongly (a RoPE base of 0 or less),
// or whose text would cost far more to parse than a record can hold, is
// refused by decode_run_record itself, for resume and handoff alike.
TEST(RunPack, RunRecordsRefusedBeforeUse) {
  RunRecord r{"m[[[[[[", 10000.0, {.hidden = 8, .vocab = 4, .mlp = 0, .seed = 1}, 1, 3, 2, {0.5f, -1.0f, 2.0f, 0.0f}};
  const nlohmann::json good = nlohmann::json::parse(encode_run_record(r));
  ASSERT_TRUE(decode_run_record(good.dump(), "p").ok());  // brackets in strings are not nesting
  for (double theta : {0.0, -5.0, -0.0, 1e-320 * -1}) {
    nlohmann::json j = good;
    j["rope_theta"] = theta;
    auto bad = decode_run_record(j.dump(), "p");
    ASSERT_FALSE(bad.ok()) << theta;
    EXPECT_NE(bad.error().message.find("field 'rope_theta' must be a positive finite number"), std::string::npos)
        << bad.error().message;
  }
  nlohmann::json deep = good;
  deep["x"] = nlohmann::json::parse("[[[[{\"a\":[1]}]]]]");
  auto nested = decode_run_record(deep.dump(), "p");
  ASSERT_FALSE(nested.ok());
  EXPECT_NE(nested.error().message.find("nested 7 deep"), std::string::npos) << nested.error().message;
  std::string big = good.dump();
  big.insert(1, static_cast<std::size_t>(kMaxRunRecordBytes), ' ');
  auto huge = decode_run_record(big, "p");
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().message.find("more than a run record's"), std::string::npos) << huge.error().message;
}

}  // namespace
}  // namespace kvring::cli
