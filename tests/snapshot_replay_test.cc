// The replay gate in process: a session of the reference model saved as a
// kvpack (at, before and after its sliding rings wrap), restored through the
// detached path and continued, gives bitwise the same logits, tokens and K/V
// as the session that never stopped. tests/cli_pack_test.cmake runs the same
// gate across processes with `kvring run --save` / `--resume`.
#include <gtest/gtest.h>

#include <cstring>

#include "kvring/model.h"
#include "kvring/pack.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::image;
using testing::small_config;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Saves `live` into a pack (bytes, or a thin pack over `store`), reads it back
// and resumes it on a new cache.
Session save_and_resume(const Session& live, std::shared_ptr<const ReferenceModel> model,
                        ChunkStore* store, Encoding encoding) {
  auto snap = take_snapshot(live.cache());
  EXPECT_TRUE(snap.ok());
  snap->token_ids = live.tokens();
  auto bytes = encode_pack(*snap, {.encoding = encoding, .chunk_tokens = 16, .store = store});
  EXPECT_TRUE(bytes.ok()) << bytes.error().to_string();
  auto back = read_pack(*memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size())),
                        {.store = store});
  EXPECT_TRUE(back.ok()) << back.error().to_string();
  auto cache = restore_detached(*back);
  EXPECT_TRUE(cache.ok()) << cache.error().to_string();
  auto resumed = Session::resume(std::move(model), std::move(*cache), back->token_ids, live.last_logits());
  EXPECT_TRUE(resumed.ok()) << resumed.error().to_string();
  return std::move(*resumed);
}

TEST(ReplayGate, ResumedSessionContinuesBitwise) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto model = ReferenceModel::create(cfg, {.hidden = 32, .vocab = 64, .mlp = 0, .seed = 5});
  ASSERT_TRUE(model.ok());
  const std::string dir = testing::make_temp_dir("replay");
  auto store = open_dir_store(dir);
  ASSERT_TRUE(store.ok());
  const auto prompt = seeded_tokens(20, 64, 3);
  for (std::int64_t save_at : {20, 31, 32, 33, 70, 101}) {
    for (bool thin : {false, true}) {
      SCOPED_TRACE("saved at " + std::to_string(save_at) + (thin ? ", thin" : ""));
      auto cache = make_cpu_cache(cfg, {.context = 256});
      ASSERT_TRUE(cache.ok());
      Session live(*model, std::move(*cache));
      ASSERT_TRUE(live.feed(prompt, 7).ok());
      while (live.position() < save_at) ASSERT_TRUE(live.step().ok());
      Session resumed = save_and_resume(live, *model, thin ? store->get() : nullptr,
                                        thin ? Encoding::kF16Le : Encoding::kF32Le);
      ASSERT_TRUE(image(resumed.cache()) == image(live.cache()));
      for (int i = 0; i < 40; ++i) {
        auto a = live.step();
        auto b = resumed.step();
        ASSERT_TRUE(a.ok() && b.ok());
        ASSERT_EQ(*a, *b) << "step " << i;
        ASSERT_TRUE(same_bits(live.last_logits(), resumed.last_logits())) << "step " << i;
      }
      EXPECT_EQ(live.tokens(), resumed.tokens());
      EXPECT_TRUE(image(resumed.cache()) == image(live.cache()));
    }
  }
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace kvring
