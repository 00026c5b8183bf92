// Hostile arguments to the ring arithmetic, the one-sequence cache and the
// reference model's session: each is refused with an error (or gives
// nothing), and a refused call changes nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvring/cache.h"
#include "kvring/model.h"
#include "kvring/ring.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::small_config;

// A ring of no rows (a default state, which KvCache::ring gives for a layer
// out of range, or a factory given capacity < 1) divided by its capacity.
TEST(CacheHostile, RingOfNoRowsRefusesAppends) {
  auto cache = make_cpu_cache(small_config());
  ASSERT_TRUE(cache.ok());
  for (RingState r : {(*cache)->ring(99), (*cache)->ring(-1), RingState(), RingState::sliding(0),
                      RingState::sliding(-5), RingState::full(0)}) {
    const RingState before = r;
    EXPECT_FALSE(r.plan_batch(0, 0, 1).ok());
    EXPECT_FALSE(r.append_batch(0, 0, 3).ok());
    EXPECT_FALSE(r.append(0, 0).ok());
    r.commit_batch(1);
    EXPECT_EQ(r, before);
    EXPECT_EQ(r.spans(0, 1).n_spans, 0);
  }
}

// spans() of rows that are not all live never writes past its two spans.
TEST(CacheHostile, SpansOfRowsNotAllLiveAreEmpty) {
  RingState r = RingState::sliding(3);
  for (std::int64_t p = 0; p < 5; ++p) ASSERT_TRUE(r.append(0, p).ok());  // live [2, 5)
  EXPECT_EQ(r.spans(2, 3).n_spans, 2);
  EXPECT_EQ(r.spans(2, 10).n_spans, 0);
  EXPECT_EQ(r.spans(0, 3).n_spans, 0);
  EXPECT_EQ(r.spans(4, 2).n_spans, 0);
  EXPECT_EQ(r.spans(INT64_MIN, 3).n_spans, 0);
  EXPECT_EQ(r.spans(INT64_MAX, 1).n_spans, 0);
  EXPECT_EQ(r.spans(2, INT64_MAX).n_spans, 0);
}

TEST(CacheHostile, SeededTokensWithoutVocabulary) {
  EXPECT_TRUE(seeded_tokens(4, 0, 1).empty());
  EXPECT_TRUE(seeded_tokens(4, -3, 1).empty());
  for (std::int32_t t : seeded_tokens(64, 5, 1)) EXPECT_TRUE(t >= 0 && t < 5);
}

// A feed whose later chunk would be refused is refused whole: the session
// and its cache stay where they were.
TEST(CacheHostile, FeedRefusedInALaterChunkChangesNothing) {
  const ModelConfig c = small_config(32, 256);
  auto model = ReferenceModel::create(c, {.hidden = 32, .vocab = 50, .mlp = 0, .seed = 2});
  ASSERT_TRUE(model.ok());
  auto cache = make_cpu_cache(c, {.context = 40});
  ASSERT_TRUE(cache.ok());
  Session s(*model, std::move(*cache));
  ASSERT_TRUE(s.feed({1, 2, 3}, 2).ok());
  const std::vector<float> logits = s.last_logits();

  // A bad token id in the third chunk.
  Status bad_id = s.feed({4, 5, 6, 7, 50}, 2);
  EXPECT_FALSE(bad_id.ok());
  // Past the context in the last chunk (3 + 38 > 40).
  Status too_long = s.feed(std::vector<std::int32_t>(38, 1), 8);
  EXPECT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.error().code, ErrorCode::kCapacityExceeded);

  EXPECT_EQ(s.position(), 3);
  EXPECT_EQ(s.tokens(), (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(s.last_logits(), logits);
  auto next = s.cache().next_position();
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 3);
  // And the session goes on as before.
  EXPECT_TRUE(s.feed({4, 5}, 1).ok());
  EXPECT_EQ(s.position(), 5);
}

TEST(CacheHostile, ResumeWithoutAModelOrACacheIsRefused) {
  const ModelConfig c = small_config(32, 256);
  auto model = ReferenceModel::create(c, {.hidden = 32, .vocab = 50, .mlp = 0, .seed = 2});
  ASSERT_TRUE(model.ok());
  auto cache = make_cpu_cache(c, {.context = 40});
  ASSERT_TRUE(cache.ok());
  auto no_cache = Session::resume(*model, nullptr, {}, {});
  ASSERT_FALSE(no_cache.ok());
  EXPECT_NE(no_cache.error().message.find("no model or no cache"), std::string::npos);
  auto no_model = Session::resume(nullptr, std::move(*cache), {}, {});
  ASSERT_FALSE(no_model.ok());
  EXPECT_EQ(no_model.error().code, ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvring
