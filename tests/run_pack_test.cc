// kvring run's saved sessions: a run record is untrusted input like every
// other field of a pack, and out-of-range values are refused on resume.
#include "../tools/run_pack.h"

#include <gtest/gtest.h>

#include "kvring/cache.h"
#include "test_util.h"

namespace kvring::cli {
namespace {

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

}  // namespace
}  // namespace kvring::cli
