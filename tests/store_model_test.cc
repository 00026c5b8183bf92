// The store model harness (store_model.h) on the CPU backend, and focused
// cases it led to.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvring/config.h"
#include "kvring/snapshot.h"
#include "kvring/store.h"
#include "store_model.h"
#include "test_util.h"

namespace kvring {
namespace {

// The fixed small hybrid: 8 layers (3 and 7 full), window 32 or 48.
TEST(StoreModel, RandomOperationsMatchTheModel) {
  store_model::run_seeds(BackendKind::kCpu, store_model::Geometry::kFixed, 80, 500);
}

// A geometry drawn per seed: 1 to 6 layers, sliding and full in any pattern
// (all sliding, all full), GQA groups 1 to 8, odd head dims, windows 1 to
// 40 around the 32-row minimum plane, small contexts and pools.
TEST(StoreModel, RandomGeometriesMatchTheModel) {
  store_model::run_seeds(BackendKind::kCpu, store_model::Geometry::kRandom, 80, 300);
}

// A snapshot taken between W and W + slack positions restores into a store
// with rollback slack (its sliding rings then hold the snapshot's W rows
// without being full), and the restored sequence equals the source.
TEST(StoreModel, RestoreIntoSlackPastTheWindow) {
  const ModelConfig cfg = testing::small_config(32, 256, 4);
  StoreOptions o;
  o.max_sequences = 2;
  o.slack = 8;
  auto store = make_store(BackendKind::kCpu, cfg, o);
  ASSERT_TRUE(store.ok());
  KvStore& s = **store;
  auto seq = s.add_sequence();
  ASSERT_TRUE(seq.ok());
  const std::int64_t n = 36;
  const auto k = testing::random_floats(static_cast<std::size_t>(n * cfg.n_layers * cfg.kv_dim()), 1);
  const auto v = testing::random_floats(k.size(), 2);
  const SeqSpan span{*seq, 0, n};
  ASSERT_TRUE(s.store_all_layers({&span, 1}, host_view(k.data(), n * cfg.n_layers, cfg.kv_dim()),
                                 host_view(v.data(), n * cfg.n_layers, cfg.kv_dim()))
                  .ok());
  auto snap = take_snapshot(s, *seq);
  ASSERT_TRUE(snap.ok()) << snap.error().to_string();
  EXPECT_TRUE(check_restorable(*snap, s).ok());
  const Status st = restore(*snap, s, *seq);
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto copy = restore_new_sequence(*snap, s);
  ASSERT_TRUE(copy.ok()) << copy.error().to_string();
  for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
    auto r = s.ring(*copy, l);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->next_position(), n);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(r->len() * cfg.kv_dim())), b(a.size()),
        c(a.size()), d(a.size());
    ASSERT_TRUE(s.read_rows(*seq, l, r->origin_logical(), r->len(), a.data(), b.data()).ok());
    ASSERT_TRUE(s.read_rows(*copy, l, r->origin_logical(), r->len(), c.data(), d.data()).ok());
    EXPECT_EQ(a, c);
    EXPECT_EQ(b, d);
  }
}

}  // namespace
}  // namespace kvring
