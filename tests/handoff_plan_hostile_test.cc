// Hostile plan and session options: refused with an error, never undefined
// arithmetic, a plan without bound or a check that runs for hours.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kvring/handoff.h"
#include "test_util.h"

namespace kvring::handoff {
namespace {

TEST(HandoffPlanHostile, HugeChunkIsOneChunk) {
  PlanOptions o;
  o.chunk_tokens = std::numeric_limits<std::int64_t>::max();
  auto t = plan_handoff(testing::small_config(32, 256), 200, o);
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_EQ(t->n_chunks, 1);
}

TEST(HandoffPlanHostile, NonFiniteTimesAreRefused) {
  const ModelConfig c = testing::small_config(32, 256);
  PlanOptions inf_ack;
  inf_ack.ack_latency_s = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(plan_handoff(c, 200, inf_ack).ok());
  PlanOptions slow_link;
  slow_link.rate_bytes_per_s = 1e-310;  // positive and finite; every send takes forever
  EXPECT_FALSE(plan_handoff(c, 200, slow_link).ok());
  PlanOptions slow_prefill;
  slow_prefill.prefill_tokens_per_s = 1e-310;
  EXPECT_FALSE(plan_handoff(c, 200, slow_prefill).ok());
  // Finite times past the bound a plan may take: refused, naming it.
  for (double rate : {1e-300, 1e-9}) {
    PlanOptions o;
    o.rate_bytes_per_s = rate;
    auto t = plan_handoff(c, 200, o);
    ASSERT_FALSE(t.ok()) << rate;
    EXPECT_EQ(t.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(t.error().message.find("past the 1e+12 s a plan may take"), std::string::npos) << t.error().message;
  }
}

// A timeline whose rate is not a positive finite number, or an idle bound
// that is not a number of at least 0, is refused: every comparison with a
// NaN is false, so neither would measure anything.
TEST(HandoffPlanHostile, ATimelinesRateAndIdleBoundAreNumbers) {
  const ModelConfig c = testing::small_config(32, 256);
  auto t = plan_handoff(c, 200, {});
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(check_timeline(*t, 1.0).ok());
  for (const double rate : {nan, 0.0, -1.0, std::numeric_limits<double>::infinity()}) {
    Timeline bad = *t;
    bad.options.rate_bytes_per_s = rate;
    const Status s = check_timeline(bad, 1.0);
    EXPECT_FALSE(s.ok()) << rate;
    if (!s.ok()) {
      EXPECT_NE(s.error().message.find("rate"), std::string::npos) << s.to_string();
    }
  }
  for (const double idle : {nan, -1.0}) {
    Timeline bad = *t;
    EXPECT_FALSE(check_timeline(bad, idle).ok()) << idle;
  }
}

// A timeline's sums are checked, not wrapped: messages whose bytes add up
// to 2^64 plus the payload's, or whose rows run a plane's positions past
// 2^63, do not send every payload byte exactly once.
TEST(HandoffPlanHostile, TimelineSumsPastInt64AreRefused) {
  constexpr std::int64_t kQuarter = std::int64_t{1} << 62, kPayload = 1000;
  auto timeline = [](const std::vector<std::pair<RingState, std::int64_t>>& layers, std::int64_t payload) {
    Timeline t;
    t.options.rate_bytes_per_s = 1e18;
    t.options.credit_bytes = std::numeric_limits<std::int64_t>::max();
    t.payload.row_bytes = 1;
    t.payload.payload_bytes = payload;
    double at = 0;
    for (const auto& [ring, rows] : layers) {
      LayerPayload lp;
      lp.layer = static_cast<std::int64_t>(t.payload.layers.size());
      lp.kind = LayerKind::kFullNope;
      lp.ring = ring;
      lp.rows = rows;
      lp.bytes = rows;
      t.payload.layers.push_back(lp);
      PlannedMessage m;  // one message a layer, one after another on the link
      m.index = lp.layer;
      m.layer = lp.layer;
      m.kind = lp.kind;
      m.first_row = ring.origin_logical();
      m.rows = rows;
      m.bytes = rows;
      m.start_s = at;
      m.end_s = m.ack_s = at + static_cast<double>(rows) / 1e18;
      at = m.end_s;
      t.messages.push_back(m);
    }
    return t;
  };
  // Four layers of 2^62, 2^62, 2^62 and 2^62 + 1000 rows: 2^64 + 1000 B.
  Timeline bytes = timeline({{RingState::full(1), kQuarter}, {RingState::full(1), kQuarter},
                             {RingState::full(1), kQuarter}, {RingState::full(1), kQuarter + kPayload}},
                            kPayload);
  Status s = check_timeline(bytes, 1e9);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("2^63"), std::string::npos) << s.error().message;
  // A ring that ends at 2^62 and a message of 2^62 + 4 rows from its origin.
  const RingState high = *RingState::from_parts(4, true, 4, kQuarter - 4, 0);
  Timeline rows = timeline({{high, kQuarter + 4}}, kQuarter + 4);
  s = check_timeline(rows, 1e9);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("2^63"), std::string::npos) << s.error().message;
}

// Slow rates, slow prefills and long answer times put a plan's times far
// past 1000 s; the plan's own check compares them within rounding there,
// so every such plan is made, none refused as an internal error.
TEST(HandoffPlanHostile, SlowPlansAreMadeNotRefusedAsInternal) {
  const ModelConfig c = testing::small_config(32, 256);
  int made = 0;
  for (double rate : {1.0, 1e3, 1e-3, 7.3e-6})
    for (double tps : {1e-6, 0.01, 3.7, 1e9})
      for (double ack : {0.0, 1e-6, 1e6, 3.3e8})
        for (Schedule sched : {Schedule::kPaced, Schedule::kSwaFirst}) {
          PlanOptions o;
          o.schedule = sched;
          o.rate_bytes_per_s = rate;
          o.prefill_tokens_per_s = tps;
          o.ack_latency_s = ack;
          o.message_bytes = c.kv_dim() * 4 * 3;
          o.chunk_tokens = 7;
          auto t = plan_handoff(c, 200, o);
          ASSERT_TRUE(t.ok()) << rate << " " << tps << " " << ack << ": " << t.error().to_string();
          ++made;
        }
  EXPECT_EQ(made, 128);
}

// Messages of one row at muse-glimmer's whole context: 1.8M messages,
// planned and checked in seconds (the idle measure was quadratic).
TEST(HandoffPlanHostile, ManySmallMessagesPlanQuickly) {
  const ModelConfig c = *preset_config("muse-glimmer");
  PlanOptions o;
  o.schedule = Schedule::kSwaFirst;
  o.message_bytes = c.kv_dim() * 4;
  const auto t0 = std::chrono::steady_clock::now();
  auto t = plan_handoff(c, c.max_context, o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_GT(t->messages.size(), 1'700'000u);
  EXPECT_LT(s, 60.0);
}

// A plan of more messages than any session sends is refused before it is built.
TEST(HandoffPlanHostile, TooManyMessagesAreRefused) {
  ModelConfig c = make_hybrid_config("wide", 64, 64, 64, 64, 1024, 4096, std::int64_t{1} << 24);
  PlanOptions o;
  o.message_bytes = c.kv_dim() * 4;  // one row each: 2^24 rows on each full layer
  auto t = plan_handoff(c, std::int64_t{1} << 24, o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("messages"), std::string::npos) << t.error().message;
}

TEST(HandoffPlanHostile, DeadlinesOfAnyDoubleStayInRange) {
  const auto now = Clock::now();
  EXPECT_GT(deadline_in(1e10), now + std::chrono::hours(24 * 365));
  EXPECT_GT(deadline_in(1e300), now + std::chrono::hours(24 * 365));
  EXPECT_GT(deadline_in(std::numeric_limits<double>::infinity()), now + std::chrono::hours(24 * 365));
  const Deadline nan_at = deadline_in(std::nan("")), negative_at = deadline_in(-5);
  const auto later = Clock::now();
  EXPECT_LE(nan_at, later);
  EXPECT_LE(negative_at, later);
}

TEST(HandoffPlanHostile, ReceiveOptionsOfNoSizeAreRefused) {
  auto pair = local_pair();
  DetachedCacheTarget target({});
  auto r = receive_session(*pair.second, target, {.timeout_s = 0.1, .max_message_bytes = -1});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("max_message_bytes"), std::string::npos) << r.error().message;
  r = receive_session(*pair.second, target, {.timeout_s = 0.1, .credit_bytes = 0});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("credit_bytes"), std::string::npos) << r.error().message;
  for (const double rate : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    r = receive_session(*pair.second, target, {.timeout_s = 0.1, .min_bytes_per_s = rate});
    ASSERT_FALSE(r.ok()) << rate;
    EXPECT_NE(r.error().message.find("min_bytes_per_s"), std::string::npos) << r.error().message;
  }
}

}  // namespace
}  // namespace kvring::handoff
