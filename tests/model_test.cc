// The exactness gates on the CPU backend: the reference model's logits and
// stored K/V are the same bits whether tokens arrive one at a time or in
// prefill chunks, at the ring's edges; continuity violations are refused.
#include "kvring/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "kvring/cache.h"
#include "kvring/snapshot.h"
#include "test_util.h"

namespace kvring {
namespace {


// Feeds tokens[0, end) so that, when chunk > 1, the last chunk is a full
// chunk ending at `end` (a first feed takes the remainder), and returns the
// logits of every position fed in that last call.
struct ModelRun {
  std::vector<float> logits;  // [end, vocab]: logits of every position
  testing::CacheImage planes;
};

ModelRun run_model(std::shared_ptr<const ReferenceModel> model, const std::vector<std::int32_t>& tokens,
              std::int64_t end, std::int64_t chunk, std::int64_t context) {
  auto cache = make_cpu_cache(model->config(), {.context = context});
  EXPECT_TRUE(cache.ok());
  const std::int64_t vocab = model->options().vocab;
  ModelRun r;
  r.logits.assign(static_cast<std::size_t>(end * vocab), NAN);
  std::int64_t at = 0;
  const std::int64_t head = chunk > 1 ? end % chunk : 0;
  auto feed = [&](std::int64_t n) {
    EXPECT_TRUE(model->forward(**cache, at, tokens.data() + at, n, r.logits.data() + at * vocab).ok());
    at += n;
  };
  if (head > 0) feed(head);
  while (at < end) feed(std::min(chunk, end - at));
  r.planes = testing::image(**cache);
  return r;
}

using testing::same_bits;

void gate(const ModelConfig& config, const ModelOptions& options, std::int64_t context,
          const std::vector<std::int64_t>& positions) {
  auto model = ReferenceModel::create(config, options);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  const std::int64_t vocab = options.vocab;
  const std::int64_t last = positions.back();
  auto tokens = seeded_tokens(last + 1, vocab, 77);
  // One token at a time: the decode path. Its planes at each gate position.
  for (std::int64_t p : positions) {
    const ModelRun decode = run_model(*model, tokens, p + 1, 1, context);
    for (std::int64_t chunk : {7, 512}) {
      SCOPED_TRACE("position " + std::to_string(p) + " chunk " + std::to_string(chunk));
      const ModelRun prefill = run_model(*model, tokens, p + 1, chunk, context);
      // Full logits at every position, and every byte of every plane.
      for (std::int64_t q = 0; q <= p; ++q)
        ASSERT_TRUE(same_bits(prefill.logits.data() + q * vocab, decode.logits.data() + q * vocab,
                              static_cast<std::size_t>(vocab)))
            << "logits differ at position " << q;
      ASSERT_TRUE(prefill.planes == decode.planes) << "stored K/V differ";
    }
  }
}

TEST(ExactnessGate, Window32AtTheMinimumRing) {
  const ModelConfig c = testing::small_config(32, 1024, 4, 4, 2, 16);
  gate(c, {.hidden = 64, .vocab = 97, .mlp = 0, .seed = 5}, 1024, {1, 31, 32, 33});
}

TEST(ExactnessGate, MuseGlimmerWindowAt2048) {
  // muse-glimmer's window and layer pattern; fewer layers and heads to stay
  // fast on two CPU cores.
  const ModelConfig c = make_hybrid_config("glimmer-4", 4, 4, 4, 2, 32, 2048, 131072);
  gate(c, {.hidden = 64, .vocab = 97, .mlp = 0, .seed = 6}, 4096, {2047, 2048, 2049});
}

TEST(ExactnessGate, LongChunksAcrossManyWraps) {
  // 512-token chunks wrap a 32-row ring sixteen times each.
  const ModelConfig c = testing::small_config(32, 2048, 4, 4, 2, 16);
  auto model = ReferenceModel::create(c, {.hidden = 48, .vocab = 61, .mlp = 0, .seed = 9});
  ASSERT_TRUE(model.ok());
  auto tokens = seeded_tokens(1100, 61, 8);
  const ModelRun decode = run_model(*model, tokens, 1100, 1, 2048);
  const ModelRun prefill = run_model(*model, tokens, 1100, 512, 2048);
  EXPECT_TRUE(same_bits(prefill.logits.data(), decode.logits.data(), decode.logits.size()));
  EXPECT_TRUE(prefill.planes == decode.planes);
}

TEST(ExactnessGate, ContinuityViolationIsRefusedAndTheSessionContinues) {
  const ModelConfig c = testing::small_config(32, 512, 4, 4, 2, 16);
  auto model = ReferenceModel::create(c, {.hidden = 64, .vocab = 97, .mlp = 0, .seed = 3});
  ASSERT_TRUE(model.ok());
  auto tokens = seeded_tokens(80, 97, 4);
  const ModelRun straight = run_model(*model, tokens, 80, 1, 512);

  auto cache = make_cpu_cache(c, {.context = 512});
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits(static_cast<std::size_t>(80 * 97));
  ASSERT_TRUE((*model)->forward(**cache, 0, tokens.data(), 40, logits.data()).ok());
  const testing::CacheImage before = testing::image(**cache);
  for (std::int64_t bad : {41, 39, 0, 100}) {
    for (std::int64_t n : {1, 5}) {
      Status s = (*model)->forward(**cache, bad, tokens.data() + 40, n, logits.data());
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.error().code, ErrorCode::kCacheDiscontinuity);
      EXPECT_EQ(s.error().expected, 40);
      EXPECT_EQ(s.error().got, bad);
      ASSERT_TRUE(testing::image(**cache) == before);
    }
  }
  // A bad token id is refused before anything is stored.
  std::vector<std::int32_t> bad_ids = {1, 2, 97};
  EXPECT_EQ((*model)->forward(**cache, 40, bad_ids.data(), 3, logits.data()).error().code,
            ErrorCode::kInvalidArgument);
  ASSERT_TRUE(testing::image(**cache) == before);
  // Continue from the right position: the same bits as the run that never erred.
  for (std::int64_t p = 40; p < 80; ++p)
    ASSERT_TRUE((*model)->forward(**cache, p, tokens.data() + p, 1, logits.data() + p * 97).ok());
  EXPECT_TRUE(same_bits(logits.data() + 40 * 97, straight.logits.data() + 40 * 97, 40 * 97));
  EXPECT_TRUE(testing::image(**cache) == straight.planes);
}

// A cache sized for fewer positions than the window: its sliding rings are
// smaller than the window, so a position past the cache is refused before
// any layer stores anything.
TEST(ExactnessGate, PositionsPastTheCacheAreRefusedWhole) {
  const ModelConfig c = make_hybrid_config("all-sliding", 2, 0, 4, 2, 16, 128, 64);
  auto model = ReferenceModel::create(c, {.hidden = 32, .vocab = 50, .mlp = 0, .seed = 2});
  ASSERT_TRUE(model.ok());
  auto cache = make_cpu_cache(c);
  ASSERT_TRUE(cache.ok());
  Session s(*model, std::move(*cache));
  ASSERT_TRUE(s.feed(seeded_tokens(64, 50, 3), 9).ok());
  const testing::CacheImage before = testing::image(s.cache());
  auto t = s.step();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code, ErrorCode::kCapacityExceeded);
  EXPECT_TRUE(testing::image(s.cache()) == before);
  EXPECT_EQ(*s.cache().next_position(), 64);
  std::vector<float> logits(50);
  std::int32_t tok = 1;
  EXPECT_EQ((*model)->forward(s.cache(), 64, &tok, std::numeric_limits<std::int64_t>::max(),
                              logits.data()).error().code,
            ErrorCode::kCapacityExceeded);
}

// n seeded tokens fed in chunks of 7 on caches of contexts a and b: the
// same logits, bit for bit (and the same planes where both are the same
// size).
void expect_same_runs(const ModelConfig& c, const ModelOptions& options, std::int64_t n, std::int64_t a,
                      std::int64_t b, bool same_planes) {
  auto model = ReferenceModel::create(c, options);
  ASSERT_TRUE(model.ok());
  const auto tokens = seeded_tokens(n, options.vocab, 9);
  const ModelRun ra = run_model(*model, tokens, n, 7, a);
  const ModelRun rb = run_model(*model, tokens, n, 7, b);
  EXPECT_TRUE(same_bits(ra.logits.data(), rb.logits.data(), ra.logits.size()));
  if (same_planes) {
    EXPECT_TRUE(ra.planes == rb.planes);
  }
}

// A cache whose rings hold their window (32 rows of 32) and no full plane:
// its sequences go on past the context, and their bits are those of a
// cache sized for more positions (the rings are the same size).
TEST(ExactnessGate, RingsThatHoldTheirWindowRunPastTheContext) {
  const ModelConfig c = make_hybrid_config("all-sliding", 2, 0, 4, 2, 16, 32, 256);
  EXPECT_EQ(c.sequence_position_limit(40), kNoPositionLimit);
  const ModelOptions options{.hidden = 32, .vocab = 50, .mlp = 0, .seed = 4};
  gate(c, options, 40, {39, 40, 150});
  expect_same_runs(c, options, 151, 40, 256, true);
  // A count past any buffer is refused before a token id is read.
  auto model = ReferenceModel::create(c, options);
  ASSERT_TRUE(model.ok());
  auto cache = make_cpu_cache(c, {.context = 40});
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits(50);
  const std::int32_t one = 1;
  EXPECT_EQ((*model)->forward(**cache, 0, &one, std::int64_t{1} << 32, logits.data()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(*(*cache)->next_position(), 0);
}

// Below a context of 32 a full plane holds 32 positions (its least rows),
// and the model takes them all; a ring shorter than its window stops at
// the context.
TEST(ExactnessGate, ASequenceStopsWhereItsPlanesDo) {
  const ModelConfig c = make_hybrid_config("hybrid", 2, 2, 4, 2, 16, 16, 256);
  EXPECT_EQ(c.sequence_position_limit(8), 32);
  EXPECT_EQ(c.sequence_position_limit(256), 256);
  EXPECT_EQ(make_hybrid_config("short-ring", 2, 0, 4, 2, 16, 64, 256).sequence_position_limit(40), 40);
  const ModelOptions options{.hidden = 32, .vocab = 50, .mlp = 0, .seed = 5};
  expect_same_runs(c, options, 32, 8, 256, false);
  auto model = ReferenceModel::create(c, options);
  ASSERT_TRUE(model.ok());
  const auto tokens = seeded_tokens(32, 50, 10);
  auto cache = make_cpu_cache(c, {.context = 8});
  ASSERT_TRUE(cache.ok());
  Session s(*model, std::move(*cache));
  ASSERT_TRUE(s.feed(tokens, 7).ok());
  const testing::CacheImage before = testing::image(s.cache());
  auto t = s.step();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code, ErrorCode::kCapacityExceeded);
  EXPECT_TRUE(testing::image(s.cache()) == before);
}

// The index of the largest finite logit, the first of equals, written out
// independently of argmax.
std::int32_t first_max(const std::vector<float>& logits) {
  std::int32_t best = -1;
  for (std::size_t i = 0; i < logits.size(); ++i)
    if (!std::isnan(logits[i]) && (best < 0 || logits[i] > logits[static_cast<std::size_t>(best)]))
      best = static_cast<std::int32_t>(i);
  return best;
}

bool same_session(const Session& a, const Session& b) {
  return a.tokens() == b.tokens() &&
         same_bits(a.last_logits().data(), b.last_logits().data(), a.last_logits().size()) &&
         a.last_logits().size() == b.last_logits().size() && testing::image(a.cache()) == testing::image(b.cache());
}

// Greedy decoding picks the argmax of the last logits; a session saved
// part-way (snapshot, token ids, last logits), restored into a fresh cache
// and continued is bit for bit the session that never stopped.
TEST(Session, GreedyDecodeAndResume) {
  const ModelConfig c = testing::small_config(32, 256, 4, 4, 2, 16);
  auto model = ReferenceModel::create(c, {.hidden = 32, .vocab = 50, .mlp = 0, .seed = 1});
  ASSERT_TRUE(model.ok());
  auto prompt = seeded_tokens(20, 50, 2);
  auto a = make_cpu_cache(c, {.context = 256});
  Session s(*model, std::move(*a));
  EXPECT_FALSE(s.step().ok());  // nothing to decode from
  ASSERT_TRUE(s.feed(prompt, 7).ok());
  // Decoding 40 tokens wraps the 32-row sliding rings past the prompt.
  constexpr int kSteps = 40, kSaveAt = 17;
  std::vector<std::int32_t> generated;
  std::optional<Snapshot> saved;
  std::vector<std::int32_t> saved_tokens;
  std::vector<float> saved_logits;
  for (int i = 0; i < kSteps; ++i) {
    if (i == kSaveAt) {
      auto snap = take_snapshot(s.cache());
      ASSERT_TRUE(snap.ok()) << snap.error().to_string();
      saved = std::move(*snap);
      saved_tokens = s.tokens();
      saved_logits = s.last_logits();
    }
    const std::int32_t expect = first_max(s.last_logits());
    auto t = s.step();
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(*t, expect) << "step " << i << " did not decode the argmax of the last logits";
    generated.push_back(*t);
  }
  EXPECT_EQ(s.position(), 20 + kSteps);
  EXPECT_EQ(s.tokens().back(), generated.back());
  // Not a constant: greedy decoding of these weights moves between tokens.
  EXPECT_GT(std::set<std::int32_t>(generated.begin(), generated.end()).size(), 1u);

  // Resume the saved state in a fresh cache and continue to the same length.
  ASSERT_TRUE(saved.has_value());
  auto fresh = make_cpu_cache(c, {.context = 256});
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(restore(*saved, **fresh).ok());
  auto resumed = Session::resume(*model, std::move(*fresh), saved_tokens, saved_logits);
  ASSERT_TRUE(resumed.ok()) << resumed.error().to_string();
  EXPECT_EQ(resumed->position(), 20 + kSaveAt);
  for (int i = kSaveAt; i < kSteps; ++i) {
    auto t = resumed->step();
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(*t, generated[static_cast<std::size_t>(i)]) << "resumed step " << i;
  }
  EXPECT_TRUE(same_session(*resumed, s));
  // A resume whose logits belong to another point is still a session, but
  // not this one: the comparison above can fail.
  auto other = make_cpu_cache(c, {.context = 256});
  ASSERT_TRUE(restore(*saved, **other).ok());
  std::vector<float> shifted = saved_logits;
  std::rotate(shifted.begin(), shifted.begin() + 1, shifted.end());
  auto wrong = Session::resume(*model, std::move(*other), saved_tokens, shifted);
  ASSERT_TRUE(wrong.ok());
  for (int i = kSaveAt; i < kSteps; ++i) ASSERT_TRUE(wrong->step().ok());
  EXPECT_FALSE(same_session(*wrong, s));

  const float ties[] = {1.0f, 3.0f, NAN, 3.0f};
  EXPECT_EQ(argmax(ties, 4), 1);
  EXPECT_FALSE(s.feed(prompt, 0).ok());
  EXPECT_FALSE(ReferenceModel::create(c, {.hidden = 0}).ok());
  EXPECT_FALSE(ReferenceModel::create(c, {.hidden = 8, .vocab = 1}).ok());
}

// ReferenceModel::check refuses what create() refuses, with its message,
// and builds nothing.
TEST(Session, ModelCheckRefusesWhatCreateRefuses) {
  const ModelConfig c = testing::small_config(32, 256, 4, 4, 2, 16);
  ModelConfig odd = testing::small_config(32, 256, 4, 4, 2, 16);
  odd.head_dim = 15;
  // RoPE frequencies theta^(-2i / 16) must be finite floats: theta^(-7/8)
  // passes FLT_MAX below about 1.5e-44.
  auto theta = [&](double t) {
    ModelConfig x = c;
    x.rope_theta = t;
    return x;
  };
  const std::vector<std::pair<ModelConfig, ModelOptions>> cases = {
      {c, {.hidden = 32, .vocab = 50}},     {c, {.hidden = 0}},           {c, {.hidden = 16385}},
      {c, {.hidden = 8, .vocab = 1}},       {c, {.hidden = 8, .mlp = -1}}, {odd, {.hidden = 8}},
      {c, {.hidden = 16384, .vocab = 1 << 20}},
      {theta(1e-40), {.hidden = 8}},        {theta(1e300), {.hidden = 8}},
      {theta(1e-46), {.hidden = 8}},        {theta(1e-300), {.hidden = 8}}, {theta(0), {.hidden = 8}},
      {theta(-1), {.hidden = 8}},           {theta(std::nan("")), {.hidden = 8}},
      {theta(INFINITY), {.hidden = 8}}};
  int refused = 0;
  for (const auto& [config, options] : cases) {
    const Status checked = ReferenceModel::check(config, options);
    SCOPED_TRACE(checked.to_string());
    if (checked.ok()) {
      EXPECT_TRUE(ReferenceModel::create(config, options).ok());
      continue;
    }
    ++refused;
    EXPECT_EQ(checked.error().code, ErrorCode::kInvalidArgument);
    auto made = ReferenceModel::create(config, options);  // refuses before it allocates
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.error().message, checked.error().message);
  }
  EXPECT_EQ(refused, 12);
  EXPECT_NE(ReferenceModel::check(c, {.hidden = 16384, .vocab = 1 << 20}).error().message.find("weights would take"),
            std::string::npos);
  EXPECT_NE(ReferenceModel::check(theta(1e-300), {.hidden = 8}).error().message.find("rope_theta"), std::string::npos);
  // Without RoPE layers no frequency is used: any positive finite theta.
  ModelConfig nope = make_hybrid_config("nope", 2, 1, 4, 2, 16, 8, 256);
  ASSERT_EQ(nope.count(LayerKind::kSlidingRope), 0);
  nope.rope_theta = 1e-300;
  EXPECT_TRUE(ReferenceModel::check(nope, {.hidden = 8}).ok());
  nope.rope_theta = 0;
  EXPECT_FALSE(ReferenceModel::check(nope, {.hidden = 8}).ok());
}

}  // namespace
}  // namespace kvring
