// Ring arithmetic against an independent naive model.
#include "kvring/ring.h"

#include <gtest/gtest.h>

#include <deque>
#include <limits>
#include <random>
#include <vector>

namespace kvring {
namespace {

// The naive model: a deque of (logical, physical) pairs. It fills physical
// slots 0, 1, 2, ... in order and, once full, reuses the slot of the oldest
// live row. It never uses the explicit-origin formula.
struct NaiveRing {
  std::int64_t capacity;
  bool wraps;
  std::int64_t next = 0;
  std::deque<std::pair<std::int64_t, std::int64_t>> live;

  // Physical slot, or -1 for a capacity error.
  std::int64_t append() {
    std::int64_t slot;
    if (static_cast<std::int64_t>(live.size()) < capacity) {
      // Before the first wrap the slots fill in order.
      slot = static_cast<std::int64_t>(live.size());
    } else {
      if (!wraps) return -1;
      slot = live.front().second;
      live.pop_front();
    }
    live.emplace_back(next++, slot);
    return slot;
  }
};

void expect_same(const RingState& r, const NaiveRing& n) {
  ASSERT_EQ(r.len(), static_cast<std::int64_t>(n.live.size()));
  ASSERT_EQ(r.next_position(), n.next);
  if (n.live.empty()) return;
  ASSERT_EQ(r.origin_logical(), n.live.front().first);
  ASSERT_EQ(r.origin_physical(), n.live.front().second);
  for (auto [logical, physical] : n.live) {
    ASSERT_TRUE(r.holds(logical));
    ASSERT_EQ(r.physical(logical), physical) << "logical " << logical;
  }
  // The live spans enumerate the rows in logical order.
  LiveSpans s = r.live_spans();
  std::size_t k = 0;
  for (int i = 0; i < s.n_spans; ++i)
    for (std::int64_t j = 0; j < s.spans[i].rows; ++j, ++k) {
      ASSERT_LT(k, n.live.size());
      ASSERT_EQ(s.spans[i].physical_first + j, n.live[k].second);
      ASSERT_EQ(s.spans[i].source_first + j, static_cast<std::int64_t>(k));
    }
  ASSERT_EQ(k, n.live.size());
}

TEST(Ring, WalkthroughAtTheBoundary) {
  RingState r = RingState::sliding(2048);
  for (std::int64_t p = 0; p < 2048; ++p) ASSERT_EQ(*r.append(0, p), p);
  EXPECT_EQ(r.len(), 2048);
  EXPECT_EQ(r.origin_logical(), 0);
  EXPECT_EQ(r.origin_physical(), 0);
  EXPECT_EQ(*r.append(0, 2048), 0);  // first wrap overwrites slot 0
  EXPECT_EQ(r.origin_logical(), 1);
  EXPECT_EQ(r.origin_physical(), 1);
  EXPECT_EQ(*r.append(0, 2049), 1);
  EXPECT_EQ(r.origin_logical(), 2);
  EXPECT_EQ(r.origin_physical(), 2);
}

// holds_rows: the live positions [origin, origin + len) and no others, with
// no sum that overflows.
TEST(Ring, HoldsRowsIsTheLiveRange) {
  RingState r = RingState::sliding(8);
  ASSERT_TRUE(r.append_batch(0, 0, 11).ok());  // live: [3, 11)
  EXPECT_TRUE(r.holds_rows(3, 8));
  EXPECT_TRUE(r.holds_rows(10, 1));
  EXPECT_TRUE(r.holds_rows(5, 0));
  EXPECT_FALSE(r.holds_rows(2, 1));
  EXPECT_FALSE(r.holds_rows(4, 8));
  EXPECT_FALSE(r.holds_rows(3, 9));
  EXPECT_FALSE(r.holds_rows(3, -1));
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  EXPECT_FALSE(r.holds_rows(kMax, 1));
  EXPECT_FALSE(r.holds_rows(std::numeric_limits<std::int64_t>::min(), 1));
  EXPECT_FALSE(r.holds_rows(3, kMax));
}

TEST(Ring, SkippedAndReplayedPositionsFailClosed) {
  RingState r = RingState::sliding(32);
  for (std::int64_t p = 0; p < 40; ++p) ASSERT_TRUE(r.append(3, p).ok());
  const RingState before = r;
  for (std::int64_t bad : {41, 39, 0, 38, 1000, -1}) {
    auto res = r.append(3, bad);
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(res.error().layer, 3);
    EXPECT_EQ(res.error().expected, 40);
    EXPECT_EQ(res.error().got, bad);
    EXPECT_EQ(r, before);
    auto batch = r.append_batch(3, bad, 5);
    ASSERT_FALSE(batch.ok());
    EXPECT_EQ(batch.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(r, before);
  }
  EXPECT_FALSE(r.append_batch(3, 40, 0).ok());
  EXPECT_FALSE(r.append_batch(3, 40, -4).ok());
  EXPECT_FALSE(r.append_batch(3, 40, std::numeric_limits<std::int64_t>::max()).ok());
  EXPECT_EQ(r, before);
  EXPECT_EQ(*r.append(3, 40), 40 % 32);
}

TEST(Ring, FullPlaneRefusesToWrap) {
  RingState r = RingState::full(32);
  for (std::int64_t p = 0; p < 32; ++p) ASSERT_EQ(*r.append(0, p), p);
  const RingState before = r;
  auto res = r.append(7, 32);
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.error().code, ErrorCode::kCapacityExceeded);
  EXPECT_NE(res.error().message.find("layer 7"), std::string::npos);
  EXPECT_EQ(r, before);

  RingState g = RingState::full(100);
  ASSERT_TRUE(g.append_batch(0, 0, 60).ok());
  const RingState mid = g;
  auto big = g.append_batch(0, 60, 41);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().code, ErrorCode::kCapacityExceeded);
  EXPECT_EQ(g, mid);
  auto exact = g.append_batch(0, 60, 40);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->n_spans, 1);
  EXPECT_EQ(exact->spans[0].physical_first, 60);
  EXPECT_EQ(g.origin_logical(), 0);
  EXPECT_EQ(g.len(), 100);
}

TEST(Ring, BatchLongerThanCapacityKeepsTheTail) {
  RingState r = RingState::sliding(32);
  ASSERT_TRUE(r.append_batch(0, 0, 10).ok());
  auto p = r.append_batch(0, 10, 100);  // positions 10..109
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->first_live, 68);  // rows 78..109 stay
  EXPECT_EQ(p->live_rows, 32);
  EXPECT_EQ(r.origin_logical(), 78);
  EXPECT_EQ(r.len(), 32);
  std::int64_t rows = 0;
  for (int i = 0; i < p->n_spans; ++i) {
    for (std::int64_t j = 0; j < p->spans[i].rows; ++j)
      EXPECT_EQ(p->spans[i].physical_first + j, r.physical(10 + p->spans[i].source_first + j));
    rows += p->spans[i].rows;
  }
  EXPECT_EQ(rows, 32);
}

TEST(Ring, FromPartsChecksInvariants) {
  EXPECT_TRUE(RingState::from_parts(32, true, 32, 40, 8).ok());
  EXPECT_FALSE(RingState::from_parts(0, true, 0, 0, 0).ok());
  EXPECT_FALSE(RingState::from_parts(32, true, 33, 0, 0).ok());
  EXPECT_FALSE(RingState::from_parts(32, true, 31, 5, 5).ok());   // moved before full
  EXPECT_FALSE(RingState::from_parts(32, false, 32, 5, 5).ok());  // full planes never move
  EXPECT_FALSE(RingState::from_parts(32, true, 32, 5, 32).ok());
  EXPECT_FALSE(RingState::from_parts(32, true, 10, 0, 3).ok());
  EXPECT_FALSE(RingState::from_parts(32, true, -1, 0, 0).ok());
}

TEST(Ring, RollingBackChecksTheCount) {
  const RingState r = *RingState::sequential(32, true, 40);  // positions [8, 40)
  auto back = r.rolled_back(5);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->len(), 27);
  EXPECT_EQ(back->origin_logical(), 8);
  EXPECT_EQ(back->next_position(), 35);
  EXPECT_EQ(r.rolled_back(32)->len(), 0);
  EXPECT_EQ(r.rolled_back(0)->len(), 32);
  for (const std::int64_t count : {std::int64_t{-1}, std::int64_t{-100}, std::int64_t{33},
                                   std::numeric_limits<std::int64_t>::min(),
                                   std::numeric_limits<std::int64_t>::max()}) {
    const auto refused = r.rolled_back(count);
    ASSERT_FALSE(refused.ok()) << count;
    EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  }
  EXPECT_FALSE(RingState::sliding(32).rolled_back(-100).ok());
  EXPECT_FALSE(RingState::full(8).rolled_back(1).ok());
}

TEST(Ring, ABatchPastTheLastPositionSaysSo) {
  const std::int64_t end = std::int64_t{1} << 62;
  const RingState r = *RingState::sequential(32, true, end - 1);
  EXPECT_TRUE(r.plan_batch(0, end - 1, 1).ok());
  const auto past = r.plan_batch(3, end - 1, 2);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(past.error().message.find("layer 3: a batch of 2 rows from position 4611686018427387903 would pass "
                                      "position 2^62"),
            std::string::npos)
      << past.error().message;
}

// append holds positions below 2^62 as plan_batch does: a ring whose end
// is 2^62 takes no further row, and stays as it was.
TEST(Ring, AnAppendPastTheLastPositionIsRefused) {
  const std::int64_t end = std::int64_t{1} << 62;
  RingState r = *RingState::sequential(32, true, end - 1);
  ASSERT_TRUE(r.append(0, end - 1).ok());
  EXPECT_EQ(r.next_position(), end);
  const RingState at_end = r;
  const auto past = r.append(3, end);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(past.error().message.find("layer 3: a batch of 1 rows from position 4611686018427387904 would pass "
                                      "position 2^62"),
            std::string::npos)
      << past.error().message;
  EXPECT_EQ(r, at_end);
  EXPECT_FALSE(r.plan_batch(0, end, 1).ok());
}

// commit_batch applies only counts a plan accepts: one past position 2^62
// or past a full plane's capacity leaves the state as it was, so no state
// reaches a negative origin or a full plane whose origin moved.
TEST(Ring, CommitsNoPlanAcceptsChangeNothing) {
  const std::int64_t end = std::int64_t{1} << 62;
  RingState r = RingState::sliding(32);
  for (const std::int64_t count : {std::numeric_limits<std::int64_t>::max(), end + 1, std::int64_t{0}, std::int64_t{-3}})
    r.commit_batch(count);
  EXPECT_EQ(r.next_position(), 0);
  r.commit_batch(end);  // exactly to 2^62: accepted
  EXPECT_EQ(r.next_position(), end);
  EXPECT_EQ(r.len(), 32);
  const RingState at_end = r;
  r.commit_batch(1);
  EXPECT_EQ(r.next_position(), end);
  EXPECT_EQ(r.origin_physical(), at_end.origin_physical());
  EXPECT_TRUE(RingState::from_parts(r.capacity(), r.wraps(), r.len(), r.origin_logical(), r.origin_physical()).ok());
  RingState full = RingState::full(32);
  full.commit_batch(40);
  EXPECT_EQ(full.len(), 0);
  EXPECT_EQ(full.origin_logical(), 0);
  full.commit_batch(32);
  EXPECT_EQ(full.len(), 32);
  full.commit_batch(1);
  EXPECT_EQ(full.len(), 32);
  EXPECT_EQ(full.origin_logical(), 0);
}

TEST(Ring, SequentialMatchesAppends) {
  for (std::int64_t cap : {1, 7, 32, 33}) {
    RingState r = RingState::sliding(cap);
    for (std::int64_t p = 0; p < 5 * cap + 3; ++p) {
      ASSERT_EQ(*RingState::sequential(cap, true, p), r) << cap << " " << p;
      ASSERT_TRUE(r.append(0, p).ok());
    }
  }
  EXPECT_FALSE(RingState::sequential(32, false, 33).ok());
  EXPECT_FALSE(RingState::sequential(32, true, -1).ok());
  // Positions stay below 2^62, as from_parts requires of every ring.
  const std::int64_t end = std::int64_t{1} << 62;
  auto last = RingState::sequential(32, true, end);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->next_position(), end);
  EXPECT_TRUE(RingState::from_parts(32, true, 32, last->origin_logical(), last->origin_physical()).ok());
  EXPECT_FALSE(RingState::sequential(32, true, end + 1).ok());
  EXPECT_FALSE(RingState::sequential(32, true, std::numeric_limits<std::int64_t>::max()).ok());
}

// Long random sequences of appends and batches against the naive model.
void run_property(std::int64_t capacity, bool wraps, std::uint64_t seed, std::int64_t steps) {
  std::mt19937_64 rng(seed);
  RingState r = wraps ? RingState::sliding(capacity) : RingState::full(capacity);
  NaiveRing n{capacity, wraps, 0, {}};
  const std::int64_t sizes[] = {1, 7, 512, capacity, capacity + 1, 2 * capacity + 5};
  for (std::int64_t step = 0; step < steps; ++step) {
    const int op = static_cast<int>(rng() % 8);
    const std::int64_t start = r.next_position();
    if (op == 0) {  // a bad position, refused without change
      const RingState before = r;
      const std::int64_t bad = start + (rng() % 2 ? 1 + static_cast<std::int64_t>(rng() % 5)
                                                  : -1 - static_cast<std::int64_t>(rng() % 3));
      auto res = rng() % 2 ? r.append(1, bad).status() : r.append_batch(1, bad, 3).status();
      ASSERT_FALSE(res.ok());
      ASSERT_EQ(res.error().code, ErrorCode::kCacheDiscontinuity);
      ASSERT_EQ(res.error().expected, start);
      ASSERT_EQ(res.error().got, bad);
      ASSERT_EQ(r, before);
    } else if (op <= 3) {  // one token
      const std::int64_t want = n.append();
      auto got = r.append(0, start);
      if (want < 0) {
        ASSERT_FALSE(got.ok());
        ASSERT_EQ(got.error().code, ErrorCode::kCapacityExceeded);
        return;  // a full plane ends its session here
      }
      ASSERT_TRUE(got.ok());
      ASSERT_EQ(*got, want);
    } else {  // a batch
      const std::int64_t count =
          op == 4 ? 1 + static_cast<std::int64_t>(rng() % (3 * capacity)) : sizes[rng() % 6];
      if (!wraps && start + count > capacity) {
        const RingState before = r;
        auto res = r.append_batch(0, start, count);
        ASSERT_FALSE(res.ok());
        ASSERT_EQ(res.error().code, ErrorCode::kCapacityExceeded);
        ASSERT_EQ(r, before);
        continue;
      }
      std::vector<std::int64_t> slot(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) slot[static_cast<std::size_t>(i)] = n.append();
      auto p = r.append_batch(0, start, count);
      ASSERT_TRUE(p.ok());
      ASSERT_EQ(p->first_live, std::max<std::int64_t>(0, count - capacity));
      std::int64_t covered = 0;
      for (int s = 0; s < p->n_spans; ++s) {
        const PhysicalSpan& span = p->spans[s];
        ASSERT_EQ(span.source_first, p->first_live + covered);
        for (std::int64_t j = 0; j < span.rows; ++j)
          ASSERT_EQ(span.physical_first + j,
                    slot[static_cast<std::size_t>(span.source_first + j)]);
        covered += span.rows;
      }
      ASSERT_EQ(covered, p->live_rows);
      ASSERT_EQ(covered, count - p->first_live);
    }
    expect_same(r, n);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(RingProperty, SlidingRingsOfManyCapacities) {
  std::uint64_t seed = 1234;
  for (std::int64_t cap : {1, 2, 7, 31, 32, 33, 100, 2048})
    for (int rep = 0; rep < 3; ++rep) {
      SCOPED_TRACE("capacity " + std::to_string(cap) + " rep " + std::to_string(rep));
      run_property(cap, true, seed++, cap >= 2048 ? 400 : 2000);
      if (HasFatalFailure()) return;
    }
}

TEST(RingProperty, FullPlanesGrowThenRefuse) {
  std::uint64_t seed = 99;
  for (std::int64_t cap : {32, 33, 1000, 4096})
    for (int rep = 0; rep < 4; ++rep) {
      SCOPED_TRACE("capacity " + std::to_string(cap));
      run_property(cap, false, seed++, 3000);
      if (HasFatalFailure()) return;
    }
}

// The gate positions: the state around 0, 1, 31, 32, 33 and W-1, W, W+1
// matches the naive model for one-token and batched arrival alike.
TEST(RingProperty, GatePositionsUnderEveryChunking) {
  for (std::int64_t cap : {32, 2048}) {
    const std::vector<std::int64_t> gates = {0, 1, 31, 32, 33, cap - 1, cap, cap + 1};
    for (std::int64_t chunk : std::vector<std::int64_t>{1, 7, 512, cap + 3}) {
      RingState r = RingState::sliding(cap);
      NaiveRing n{cap, true, 0, {}};
      for (std::int64_t target : gates) {
        while (r.next_position() <= target) {
          const std::int64_t count = std::min(chunk, target + 1 - r.next_position());
          for (std::int64_t i = 0; i < count; ++i) n.append();
          ASSERT_TRUE(r.append_batch(0, r.next_position(), count).ok());
        }
        SCOPED_TRACE("cap " + std::to_string(cap) + " chunk " + std::to_string(chunk) +
                     " position " + std::to_string(target));
        expect_same(r, n);
        if (HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace
}  // namespace kvring
