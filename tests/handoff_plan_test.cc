// The handoff payload and the two send schedules' invariants.
#include <gtest/gtest.h>

#include "kvring/handoff.h"
#include "test_util.h"

namespace kvring::handoff {
namespace {

ModelConfig glimmer() { return *preset_config("muse-glimmer"); }

TEST(HandoffPayload, MuseGlimmerAt130815) {
  auto p = payload_for(glimmer(), 130815);
  ASSERT_TRUE(p.ok()) << p.error().to_string();
  EXPECT_EQ(p->payload_bytes, 1823184896);
  EXPECT_EQ(p->full_bytes, std::int64_t{130814} * 13312);
  EXPECT_EQ(p->sliding_bytes, std::int64_t{3} * 2048 * 13312);
  EXPECT_EQ(p->rows_tokens, 130814);
  for (const LayerPayload& l : p->layers) {
    EXPECT_EQ(l.rows, l.kind == LayerKind::kFullNope ? 130814 : 2048) << l.layer;
    EXPECT_EQ(l.ring.next_position(), 130814);
  }
}

TEST(HandoffPayload, ShortPromptsAndBounds) {
  const ModelConfig c = testing::small_config(32, 256);
  auto one = payload_for(c, 1);  // nothing but the token id travels
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->payload_bytes, 0);
  auto p = payload_for(c, 20);  // under the window: min(W, N-1) = 19 rows everywhere
  ASSERT_TRUE(p.ok());
  for (const LayerPayload& l : p->layers) EXPECT_EQ(l.rows, 19);
  EXPECT_FALSE(payload_for(c, 0).ok());
  EXPECT_FALSE(payload_for(c, 257).ok());
}

struct Case {
  ModelConfig config;
  std::int64_t tokens;
  PlanOptions options;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Schedule s : {Schedule::kSwaFirst, Schedule::kPaced}) {
    PlanOptions o;
    o.schedule = s;
    out.push_back({glimmer(), 130815, o});
    out.push_back({glimmer(), 32768, o});
    PlanOptions tight = o;  // credits of one message: every send waits for an ack
    tight.credit_bytes = tight.message_bytes;
    tight.ack_latency_s = 200e-6;
    out.push_back({glimmer(), 32768, tight});
    PlanOptions slow = o;  // a link slower than prefill: a backlog builds up
    slow.rate_bytes_per_s = 50e6;
    slow.message_bytes = 1 << 20;
    slow.credit_bytes = 3 << 20;
    out.push_back({glimmer(), 8192, slow});
    PlanOptions small = o;  // messages smaller than a chunk, odd chunk, tiny model
    small.chunk_tokens = 7;
    small.message_bytes = 3 * 256;
    small.credit_bytes = 4 * 256;
    out.push_back({testing::small_config(32, 256), 100, small});
    out.push_back({testing::small_config(32, 256), 2, small});
    out.push_back({testing::small_config(32, 256), 1, small});
  }
  return out;
}

TEST(HandoffSchedule, InvariantsHoldForBothSchedules) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(std::string(schedule_name(c.options.schedule)) + " " + c.config.name + " N=" + std::to_string(c.tokens));
    auto t = plan_handoff(c.config, c.tokens, c.options);
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    // The checker's own verdict, at the bound the configuration implies.
    ASSERT_TRUE(check_timeline(*t, c.options.ack_latency_s).ok());
    EXPECT_LE(t->max_in_flight, c.options.credit_bytes);
    EXPECT_LE(t->max_idle_while_ready_s, c.options.ack_latency_s + 1e-9);
    // Every byte exactly once, independently of the checker.
    std::vector<std::vector<int>> seen(t->payload.layers.size());
    for (const LayerPayload& l : t->payload.layers) seen[l.layer].assign(static_cast<std::size_t>(l.rows), 0);
    std::int64_t bytes = 0;
    for (const PlannedMessage& m : t->messages) {
      const auto& l = t->payload.layers[m.layer];
      for (std::int64_t r = m.first_row; r < m.first_row + m.rows; ++r) ++seen[m.layer][r - l.ring.origin_logical()];
      bytes += m.bytes;
      EXPECT_LE(m.bytes, c.options.message_bytes);
      EXPECT_GE(m.start_s, m.release_s);
      if (c.options.schedule == Schedule::kPaced) {
        EXPECT_EQ(m.release_step, m.final_step);  // streamed as soon as final
      } else if (m.kind == LayerKind::kFullNope) {
        EXPECT_EQ(m.release_step, t->n_steps - 1);  // the bulk after the last layer
        EXPECT_GE(m.start_s, t->prefill_end_s - 1e-12);
      }
      // A full row is final once its chunk passed its layer; a ring at the end.
      const std::int64_t chunk = m.final_step / c.config.n_layers;
      if (m.kind == LayerKind::kFullNope)
        EXPECT_EQ(chunk, (m.first_row + m.rows - 1) / c.options.chunk_tokens);
      else
        EXPECT_EQ(chunk, t->n_chunks - 1);
    }
    for (const auto& layer : seen)
      for (int n : layer) ASSERT_EQ(n, 1);
    EXPECT_EQ(bytes, t->payload.payload_bytes);
    // Send order is release order.
    for (std::size_t i = 1; i < t->messages.size(); ++i)
      EXPECT_LE(t->messages[i - 1].release_s, t->messages[i].release_s);
  }
}

TEST(HandoffSchedule, PacedKeepsTheLinkSteadyAndFinishesEarlier) {
  PlanOptions o;
  o.rate_bytes_per_s = 0.2e9;  // close to prefill's production rate
  auto paced = plan_handoff(glimmer(), 32768, o);
  o.schedule = Schedule::kSwaFirst;
  auto swa = plan_handoff(glimmer(), 32768, o);
  ASSERT_TRUE(paced.ok() && swa.ok());
  // swa-first sends the bulk after prefill; paced overlaps it with prefill.
  EXPECT_LT(paced->done_s - paced->prefill_end_s, swa->done_s - swa->prefill_end_s);
  EXPECT_GT(swa->done_s - swa->prefill_end_s, 0.9 * swa->payload.full_bytes / o.rate_bytes_per_s);
}

TEST(HandoffSchedule, CheckerCatchesBrokenTimelines) {
  PlanOptions o;
  o.message_bytes = 1 << 20;
  o.credit_bytes = 2 << 20;
  auto t = plan_handoff(glimmer(), 4096, o);
  ASSERT_TRUE(t.ok());
  {
    Timeline dup = *t;  // a message sent twice
    dup.messages.push_back(dup.messages.front());
    dup.messages.back().start_s = dup.messages.back().end_s = dup.messages.back().ack_s = 1e9;
    dup.messages.back().end_s += dup.messages.back().bytes / o.rate_bytes_per_s;
    dup.messages.back().ack_s = dup.messages.back().end_s;
    EXPECT_FALSE(check_timeline(dup, 1).ok());
  }
  {
    Timeline lost = *t;  // a message never sent
    lost.messages.erase(lost.messages.begin() + 3);
    EXPECT_FALSE(check_timeline(lost, 1).ok());
  }
  {
    Timeline flood = *t;  // credits ignored: acknowledgements arrive late
    for (auto& m : flood.messages) m.ack_s = 1e6;
    EXPECT_FALSE(check_timeline(flood, 1).ok());
  }
  {
    Timeline idle = *t;  // a gap of 10 ms with data ready
    const double gap = 0.01;
    for (std::size_t i = 5; i < idle.messages.size(); ++i) {
      idle.messages[i].start_s += gap;
      idle.messages[i].end_s += gap;
      idle.messages[i].ack_s += gap;
    }
    EXPECT_FALSE(check_timeline(idle, 0.001).ok());
    EXPECT_TRUE(check_timeline(idle, 0.02).ok());
  }
  {
    Timeline early = *t;  // sent before final
    early.messages.back().start_s = 0;
    EXPECT_FALSE(check_timeline(early, 1).ok());
  }
}

TEST(HandoffSchedule, RefusesImpossibleOptions) {
  PlanOptions o;
  o.credit_bytes = o.message_bytes - 1;
  EXPECT_FALSE(plan_handoff(glimmer(), 1000, o).ok());
  o = {};
  o.rate_bytes_per_s = 0;
  EXPECT_FALSE(plan_handoff(glimmer(), 1000, o).ok());
  o = {};
  o.message_bytes = 100;  // below one row
  EXPECT_FALSE(plan_handoff(glimmer(), 1000, o).ok());
  EXPECT_TRUE(parse_schedule("paced").ok());
  EXPECT_FALSE(parse_schedule("bursty").ok());
}

}  // namespace
}  // namespace kvring::handoff
