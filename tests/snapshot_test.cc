// Snapshot and restore: restored planes are byte-identical to the live ones
// (also after sliding rings wrapped, and through the detached path), and a
// restore that cannot succeed leaves the target exactly as it was.
#include "kvring/snapshot.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <type_traits>

#include "kvring/backend.h"

#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::filled_cache;
using testing::image;
using testing::small_config;

std::unique_ptr<KvCache> fresh(const ModelConfig& cfg, std::int64_t context) {
  auto c = make_cpu_cache(cfg, {.context = context});
  EXPECT_TRUE(c.ok());
  return std::move(*c);
}

// Positions around the 32-row minimum ring and a 48-row window, and far past
// several wraps.
TEST(Snapshot, RestoreIsByteIdenticalAtEveryBoundary) {
  for (std::int64_t window : {32, 48}) {
    const ModelConfig cfg = small_config(window, 256, 8);
    for (std::int64_t tokens : {0, 1, 31, 32, 33, 47, 48, 49, 64, 65, 100, 256}) {
      SCOPED_TRACE("window " + std::to_string(window) + ", tokens " + std::to_string(tokens));
      auto live = filled_cache(cfg, 256, tokens, 11);
      auto snap = take_snapshot(*live);
      ASSERT_TRUE(snap.ok()) << snap.error().to_string();
      EXPECT_EQ(snap->token_count, tokens);
      ASSERT_TRUE(validate_snapshot(*snap).ok());

      auto target = fresh(cfg, 256);
      ASSERT_TRUE(restore(*snap, *target).ok());
      EXPECT_TRUE(image(*target) == image(*live));

      auto detached = restore_detached(*snap);
      ASSERT_TRUE(detached.ok()) << detached.error().to_string();
      EXPECT_TRUE(image(**detached) == image(*live));
    }
  }
}

// A wrapped ring's rotation is reproduced: the restored origin_physical is the
// live one, not 0.
TEST(Snapshot, WrappedRingKeepsItsRotation) {
  const ModelConfig cfg = small_config(48, 256, 4);
  auto live = filled_cache(cfg, 256, 100, 3);
  ASSERT_EQ(live->ring(0).origin_logical(), 52);
  ASSERT_EQ(live->ring(0).origin_physical(), 4);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto target = fresh(cfg, 256);
  ASSERT_TRUE(restore(*snap, *target).ok());
  EXPECT_EQ(target->ring(0), live->ring(0));
  EXPECT_EQ(target->ring(3), live->ring(3));
}

// A ring state whose bytes were set by hand, its length or origin near
// INT64_MAX (no RingState constructor makes one), is refused as out of
// range, before its end position is computed (which would overflow).
TEST(Snapshot, RingPartsOutOfRangeAreRefusedBeforeTheirSum) {
  static_assert(std::is_trivially_copyable_v<RingState>);
  const ModelConfig cfg = small_config(48, 256, 4);
  auto live = filled_cache(cfg, 256, 100, 3);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  // RingState's fields in order: capacity, len, origin_logical, ... (the
  // assertions below catch another order).
  for (const std::size_t field : {std::size_t{1}, std::size_t{2}}) {
    Snapshot s = *snap;
    RingState& r = s.planes[0].ring;
    const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
    std::memcpy(reinterpret_cast<char*>(&r) + field * sizeof(std::int64_t), &huge, sizeof huge);
    ASSERT_EQ(field == 1 ? r.len() : r.origin_logical(), huge);
    const Status st = validate_snapshot(s);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("out of range"), std::string::npos) << st.error().message;
  }
}

// Restore replaces a target that holds another session, rows and zero tail.
TEST(Snapshot, RestoreReplacesAnOccupiedTarget) {
  const ModelConfig cfg = small_config(32, 128, 4);
  auto live = filled_cache(cfg, 128, 20, 5);
  auto target = filled_cache(cfg, 128, 120, 6);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  ASSERT_TRUE(restore(*snap, *target).ok());
  EXPECT_TRUE(image(*target) == image(*live));
}

// The restored cache continues like the live one.
TEST(Snapshot, RestoredCacheContinuesIdentically) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 77, 8);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto target = fresh(cfg, 256);
  ASSERT_TRUE(restore(*snap, *target).ok());
  testing::fill(*live, 77, 150, 8, 5);
  testing::fill(*target, 77, 150, 8, 11);
  EXPECT_TRUE(image(*target) == image(*live));
}

// A target with a larger context: full planes keep every row, sliding planes
// of the same capacity keep theirs.
TEST(Snapshot, RestoresIntoALargerContext) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 64, 60, 9);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto target = fresh(cfg, 256);
  ASSERT_TRUE(restore(*snap, *target).ok());
  auto back = take_snapshot(*target);
  ASSERT_TRUE(back.ok());
  for (std::int64_t l = 0; l < 4; ++l) {
    EXPECT_EQ(back->planes[static_cast<std::size_t>(l)].k, snap->planes[static_cast<std::size_t>(l)].k);
    EXPECT_EQ(back->planes[static_cast<std::size_t>(l)].v, snap->planes[static_cast<std::size_t>(l)].v);
  }
  EXPECT_EQ(target->ring(3).capacity(), 256);
  EXPECT_EQ(target->ring(3).len(), 60);
}

class RestoreRefusal : public ::testing::Test {
 protected:
  // The target holds a session of its own; every refusal must leave it so.
  void expect_refused(const Snapshot& snap, KvCache& target, ErrorCode code, const std::string& words) {
    const testing::CacheImage before = image(target);
    const Status s = restore(snap, target);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, code) << s.to_string();
    EXPECT_NE(s.error().message.find(words), std::string::npos) << s.to_string();
    EXPECT_TRUE(image(target) == before);
  }
};

TEST_F(RestoreRefusal, AnotherGeometry) {
  auto live = filled_cache(small_config(32, 256, 8), 256, 50, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto fewer_layers = filled_cache(small_config(32, 256, 4), 256, 10, 2);
  expect_refused(*snap, *fewer_layers, ErrorCode::kMismatch, "num_hidden_layers 8 in the snapshot, 4");
  auto other_window = filled_cache(small_config(64, 256, 8), 256, 10, 2);
  expect_refused(*snap, *other_window, ErrorCode::kMismatch, "sliding_window 32 in the snapshot, 64");
  auto other_heads = filled_cache(small_config(32, 256, 8, 4, 1, 32), 256, 10, 2);
  expect_refused(*snap, *other_heads, ErrorCode::kMismatch, "num_key_value_heads");
}

TEST_F(RestoreRefusal, TargetTooSmall) {
  const ModelConfig cfg = small_config(64, 256, 4);
  // Full planes: 100 positions do not fit a 64-position cache.
  auto live = filled_cache(cfg, 256, 100, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto small = filled_cache(cfg, 64, 10, 2);
  expect_refused(*snap, *small, ErrorCode::kCapacityExceeded, "layer 3: the snapshot holds 100 positions");
}

TEST_F(RestoreRefusal, PoolTooSmallForTheFullPlanes) {
  // Layer 3 is full: 100 positions take 7 blocks of 16 rows. The target's
  // own 48 positions hold 3 blocks of its pool.
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 100, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  const std::int64_t rows = 48, kv = cfg.kv_dim();
  const auto k = testing::random_floats(static_cast<std::size_t>(cfg.n_layers * rows * kv), 2);
  for (const std::int64_t pool : {5, 7}) {
    auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = 1, .context = 256, .block_rows = 16, .pool_blocks = pool});
    ASSERT_TRUE(made.ok());
    KvStore& target = **made;
    const SeqId seq = *target.add_sequence();
    const SeqSpan span{seq, 0, rows};
    ASSERT_TRUE(target.store_all_layers({&span, 1}, host_view(k.data(), cfg.n_layers * rows, kv),
                                        host_view(k.data(), cfg.n_layers * rows, kv)).ok());
    ASSERT_EQ(*target.blocks_held(seq), 3);
    const Snapshot before = *take_snapshot(target, seq);
    const Status s = restore(*snap, target, seq);
    if (pool == 5) {
      // Its own 3 are reused; 2 free can never make the other 4: refused
      // before anything changes.
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.error().code, ErrorCode::kResourceExhausted) << s.to_string();
      EXPECT_NE(s.error().message.find("need 4 new blocks of 16 rows; the target's pool has 2 free and"),
                std::string::npos) << s.to_string();
      EXPECT_EQ(target.free_blocks(), 2);
      EXPECT_TRUE(testing::same_rows(*take_snapshot(target, seq), before));
    } else {
      // 4 free and its own 3, which it shares with no other sequence.
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(target.free_blocks(), 0);
      EXPECT_TRUE(testing::same_rows(*take_snapshot(target, seq), *snap));
    }
  }
}

// A sequence that shares blocks with a fork: its shared blocks are replaced,
// not reused. Layers 3 and 7 are full. Source and fork share 40 rows (3
// blocks of 16 a plane); the fork then writes 60 rows into layer 7 alone,
// which copies the block it writes into and takes 4 more. Restoring 32 rows
// takes 2 new blocks a plane; layer 7 gives back the 5 it holds alone, layer
// 3 gives back none. With 2 free blocks that works only with layer 7 first;
// with 1 free, in no order.
TEST_F(RestoreRefusal, ForkedPlanesGetTheirBlocksInAnOrderThatFits) {
  const ModelConfig cfg = small_config(32, 256, 8);
  const std::int64_t kv = cfg.kv_dim();
  auto live = filled_cache(cfg, 256, 32, 4);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  const auto x = testing::random_floats(static_cast<std::size_t>(cfg.n_layers * 60 * kv), 9);
  for (const std::int64_t pool : {13, 12}) {
    SCOPED_TRACE("pool " + std::to_string(pool));
    auto made = make_store(BackendKind::kCpu, cfg,
                           {.max_sequences = 2, .context = 256, .block_rows = 16, .pool_blocks = pool});
    ASSERT_TRUE(made.ok());
    KvStore& target = **made;
    const SeqId source = *target.add_sequence();
    const SeqSpan first{source, 0, 40};
    ASSERT_TRUE(target.store_all_layers({&first, 1}, host_view(x.data(), cfg.n_layers * 40, kv),
                                        host_view(x.data(), cfg.n_layers * 40, kv)).ok());
    auto fork = target.fork_sequence(source);
    ASSERT_TRUE(fork.ok()) << fork.error().to_string();
    const SeqSpan more{*fork, 40, 60};
    ASSERT_TRUE(target.store(7, {&more, 1}, host_view(x.data(), 60, kv), host_view(x.data(), 60, kv)).ok());
    ASSERT_EQ(target.free_blocks(), pool - 11);
    const auto layer3 = target.blocks_to_install(*fork, 3, 32);
    const auto layer7 = target.blocks_to_install(*fork, 7, 32);
    ASSERT_TRUE(layer3.ok() && layer7.ok());
    EXPECT_EQ(layer3->take, 2);
    EXPECT_EQ(layer3->give, 0);
    EXPECT_EQ(layer7->take, 2);
    EXPECT_EQ(layer7->give, 5);
    EXPECT_EQ(layer3->shared, 2);
    EXPECT_EQ(layer7->shared, 2);
    const Snapshot source_before = *take_snapshot(target, source);
    // Every plane's ring and physical image: the fork's layers stand at
    // different positions, which a snapshot refuses.
    auto image_of = [&](SeqId seq) {
      std::vector<std::pair<RingState, std::vector<std::uint16_t>>> planes;
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        std::vector<std::uint16_t> k(static_cast<std::size_t>(target.capacity(l) * kv)), v(k.size());
        EXPECT_TRUE(target.read_plane(seq, l, k.data(), v.data()).ok());
        k.insert(k.end(), v.begin(), v.end());
        planes.emplace_back(*target.ring(seq, l), std::move(k));
      }
      return planes;
    };
    const auto fork_before = image_of(*fork);
    const Status s = restore(*snap, target, *fork);
    if (pool == 13) {
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(testing::same_rows(*take_snapshot(target, *fork), *snap));
      // 11 - 5 given back + 4 taken; the source keeps its 6.
      EXPECT_EQ(target.free_blocks(), 3);
    } else {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.error().code, ErrorCode::kResourceExhausted) << s.to_string();
      const std::string name = seq_name(*fork);
      EXPECT_NE(s.error().message.find("need 4 new blocks of 16 rows (4 for blocks " + name +
                                       " shares with a fork); the target's pool has 1 free and " + name +
                                       "'s planes give back 5 once in; no order of the planes fits: layer 7 "
                                       "needs 2 with at most 1 free before it"),
                std::string::npos) << s.to_string();
      EXPECT_EQ(target.free_blocks(), 1);
      EXPECT_TRUE(image_of(*fork) == fork_before);
    }
    EXPECT_TRUE(testing::same_rows(*take_snapshot(target, source), source_before));
  }
}

// A new sequence whose full planes the free pool cannot hold is refused
// before it is added: the next add_sequence gets the handle it would have.
TEST_F(RestoreRefusal, NewSequenceBeyondThePoolLeavesTheNextHandle) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 100, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = 2, .context = 256, .block_rows = 16, .pool_blocks = 6});
  auto twin = make_store(BackendKind::kCpu, cfg, {.max_sequences = 2, .context = 256, .block_rows = 16, .pool_blocks = 6});
  ASSERT_TRUE(made.ok() && twin.ok());
  auto s = restore_new_sequence(*snap, **made);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kResourceExhausted) << s.error().to_string();
  EXPECT_NE(s.error().message.find("need 7 new blocks of 16 rows; the target's pool has 6 free"), std::string::npos)
      << s.error().to_string();
  EXPECT_EQ((*made)->sequence_count(), 0);
  EXPECT_EQ((*made)->free_blocks(), 6);
  EXPECT_EQ(seq_name(*(*made)->add_sequence()), seq_name(*(*twin)->add_sequence()));
}

// A store with no free slot refuses a new sequence with add_sequence's own
// refusal, before the pool's blocks are asked (a pool too small as well),
// and as check_restorable_as_new says from the header alone.
TEST_F(RestoreRefusal, NewSequenceWithoutASlotIsAddSequencesRefusal) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 100, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  for (const std::int64_t pool : {0, 6}) {
    SCOPED_TRACE("pool " + std::to_string(pool));
    auto made = make_store(BackendKind::kCpu, cfg,
                           {.max_sequences = 1, .context = 256, .block_rows = 16, .pool_blocks = pool});
    ASSERT_TRUE(made.ok());
    KvStore& full = **made;
    const SeqId held = *full.add_sequence();
    const std::int64_t free_blocks = full.free_blocks();
    auto refused = full.add_sequence();
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(full.check_free_slot().error().message, refused.error().message);
    auto s = restore_new_sequence(*snap, full);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kResourceExhausted);
    EXPECT_EQ(s.error().message, refused.error().message);
    const Status header_only = check_restorable_as_new(*snap, full);
    ASSERT_FALSE(header_only.ok());
    EXPECT_EQ(header_only.error().message, refused.error().message);
    EXPECT_EQ(full.sequences(), std::vector<SeqId>{held});
    EXPECT_EQ(full.free_blocks(), free_blocks);
  }
}

// blocks_to_restore is what restore_new_sequence takes from the pool.
TEST_F(RestoreRefusal, BlocksToRestoreIsWhatARestoreTakes) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 100, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = 2, .context = 256, .block_rows = 16, .pool_blocks = 9});
  ASSERT_TRUE(made.ok());
  auto price = blocks_to_restore(*snap, **made);
  ASSERT_TRUE(price.ok()) << price.error().to_string();
  EXPECT_EQ(*price, 7);  // 100 rows of the one full layer, blocks of 16
  ASSERT_TRUE(restore_new_sequence(*snap, **made).ok());
  EXPECT_EQ((*made)->free_blocks(), 9 - *price);
  auto other = make_store(BackendKind::kCpu, small_config(64, 256, 4), {.max_sequences = 1});
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(blocks_to_restore(*snap, **other).error().code, ErrorCode::kMismatch);
}

TEST_F(RestoreRefusal, ShortRingsPastTheTargetContext) {
  // Window 64, layer 3 full. At context 20 every ring is 32 rows, shorter
  // than the window: such a store stops at its context, so a session of 20
  // positions does not fit a store of context 16, whose rings also stop
  // short of the window.
  const ModelConfig cfg = small_config(64, 256, 4);
  auto live = filled_cache(cfg, 20, 20, 1);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  auto target = filled_cache(cfg, 16, 10, 2);
  EXPECT_FALSE(check_restorable(*snap, *target).ok());
  expect_refused(*snap, *target, ErrorCode::kCapacityExceeded,
                 "layer 0: the snapshot holds 20 positions; the target's sliding ring, shorter than the window, "
                 "stops at its context 16");
  // A target whose rings hold the window takes it.
  auto wide = filled_cache(cfg, 256, 10, 3);
  EXPECT_TRUE(restore(*snap, *wide).ok());
}

// A session that ends within a target's rollback slack of the 2^62
// position bound: the target's ring would have to have been built past the
// bound, so it refuses, saying so; a store without slack takes it.
TEST(Snapshot, PositionsNearTheBoundNeedATargetWithoutSlack) {
  const ModelConfig c = make_hybrid_config("edge", 2, 0, 2, 1, 4, 40, 64);  // sliding layers only
  Snapshot s;
  s.config = c;
  s.context = 64;
  s.token_count = (std::int64_t{1} << 62) - 1;
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    PlaneSnapshot p;
    p.kind = LayerKind::kSlidingRope;
    p.layout = layout_for(p.kind);
    p.ring = *RingState::sequential(c.plane_capacity(l, 64), true, s.token_count);
    p.k.assign(static_cast<std::size_t>(p.ring.len() * c.kv_dim()), 0x3c00);
    p.v = p.k;
    s.planes.push_back(p);
  }
  ASSERT_TRUE(validate_snapshot(s).ok());
  auto slack = make_store(BackendKind::kCpu, c, {.max_sequences = 2, .context = 64, .slack = 8});
  ASSERT_TRUE(slack.ok());
  auto refused = restore_new_sequence(s, **slack);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kCapacityExceeded) << refused.error().to_string();
  EXPECT_NE(refused.error().message.find("rollback slack of 8 rows of the 2^62 position bound"), std::string::npos)
      << refused.error().to_string();
  EXPECT_EQ((*slack)->free_slots(), 2);
  auto plain = make_store(BackendKind::kCpu, c, {.max_sequences = 2, .context = 64});
  ASSERT_TRUE(plain.ok());
  auto taken = restore_new_sequence(s, **plain);
  ASSERT_TRUE(taken.ok()) << taken.error().to_string();
  EXPECT_EQ(*(*plain)->next_position(*taken), s.token_count);
}

TEST_F(RestoreRefusal, SlidingRingLacksRows) {
  // A store whose rings are shorter than the window stops at its context,
  // so only an edited snapshot holds such rings past it: the 64-row rings
  // of an all-sliding store at position 90, cut to the 40-row rings of a
  // store of context 40. No cache could hold it: it is invalid, and a
  // restore refuses it as such rather than for the rows it lacks.
  ModelConfig cfg = small_config(64, 256, 4);
  cfg.layer_kinds.assign(4, LayerKind::kSlidingRope);
  auto live = filled_cache(cfg, 256, 90, 3);  // rings of 64 rows, wrapped
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  Snapshot s = *snap;
  s.context = 40;
  for (PlaneSnapshot& p : s.planes) {
    const std::int64_t kept = 40, drop = p.ring.len() - kept;
    const auto cut = static_cast<std::ptrdiff_t>(drop * cfg.kv_dim());
    auto ring = RingState::from_parts(kept, true, kept, p.ring.origin_logical() + drop,
                                      (p.ring.origin_logical() + drop) % kept);
    ASSERT_TRUE(ring.ok());
    p.ring = *ring;
    p.k.erase(p.k.begin(), p.k.begin() + cut);
    p.v.erase(p.v.begin(), p.v.begin() + cut);
  }
  const std::string words = "layer 0: a ring of 40 rows, shorter than the window of 64, stops at the context, 40; "
                            "the snapshot is at 90";
  const Status invalid = validate_snapshot(s, false);
  ASSERT_FALSE(invalid.ok());
  EXPECT_NE(invalid.error().message.find(words), std::string::npos) << invalid.to_string();
  auto wide = filled_cache(cfg, 256, 5, 4);  // rings of 64 rows
  expect_refused(s, *wide, ErrorCode::kInvalidArgument, words);
  // The same rings at the context are whole: valid, and restored.
  auto at_context = filled_cache(cfg, 40, 40, 5);
  auto short_snap = take_snapshot(*at_context);
  ASSERT_TRUE(short_snap.ok());
  EXPECT_TRUE(validate_snapshot(*short_snap, false).ok());
  EXPECT_TRUE(restore(*short_snap, *wide).ok());
}

TEST_F(RestoreRefusal, InconsistentSnapshot) {
  const ModelConfig cfg = small_config(32, 256, 4);
  auto live = filled_cache(cfg, 256, 50, 1);
  auto target = filled_cache(cfg, 256, 7, 2);
  auto snap = take_snapshot(*live);
  ASSERT_TRUE(snap.ok());
  {
    Snapshot s = *snap;
    s.planes[2].k.pop_back();
    expect_refused(s, *target, ErrorCode::kInvalidArgument, "layer 2: row buffers hold");
  }
  {
    Snapshot s = *snap;
    s.token_ids = {1, 2, 3};
    expect_refused(s, *target, ErrorCode::kInvalidArgument, "3 token ids for 50 tokens");
  }
  {
    Snapshot s = *snap;
    s.planes.pop_back();
    expect_refused(s, *target, ErrorCode::kInvalidArgument, "3 planes for 4 layers");
  }
  {
    Snapshot s = *snap;
    auto rotated = RingState::from_parts(32, true, 32, 18, 5);  // sequential would be slot 18
    ASSERT_TRUE(rotated.ok());
    s.planes[0].ring = *rotated;
    expect_refused(s, *target, ErrorCode::kInvalidArgument, "layer 0: ring origin_physical 5");
  }
  {
    Snapshot s = *snap;
    s.token_count = 49;
    expect_refused(s, *target, ErrorCode::kInvalidArgument, "ring ends at position 50");
  }
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

// Snapshots taken into a reused Snapshot equal fresh ones, whatever it held.
TEST(Snapshot, ReusedBuffersGiveTheSameSnapshot) {
  const ModelConfig cfg = testing::small_config(32, 256, 4);
  Snapshot reused;
  for (std::int64_t tokens : {100, 7, 256, 0, 40}) {
    auto live = testing::filled_cache(cfg, 256, tokens, static_cast<std::uint64_t>(tokens));
    auto fresh = take_snapshot(*live);
    ASSERT_TRUE(fresh.ok());
    reused.metadata = "stale";
    ASSERT_TRUE(take_snapshot(*live, reused).ok());
    EXPECT_TRUE(testing::same_rows(reused, *fresh)) << tokens;
  }
}

}  // namespace
}  // namespace kvring
