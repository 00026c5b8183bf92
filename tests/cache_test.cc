// CPU planes: store one token and store a batch, both layouts, read back by
// logical position across wraps; failures leave the cache unchanged.
#include "kvring/cache.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvring/backend.h"
#include "kvring/f16.h"
#include "kvring/store.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::random_floats;
using testing::small_config;

using testing::PlaneBytes;
using testing::plane_bytes;

// Data for logical position p: row p of a long random stream.
struct Stream {
  std::int64_t kv_dim;
  std::vector<float> k, v;
  Stream(std::int64_t kv, std::int64_t n, std::uint64_t seed)
      : kv_dim(kv),
        k(random_floats(static_cast<std::size_t>(kv * n), seed, 4.0f)),
        v(random_floats(static_cast<std::size_t>(kv * n), seed + 1, 4.0f)) {}
  const float* krow(std::int64_t p) const { return k.data() + p * kv_dim; }
  const float* vrow(std::int64_t p) const { return v.data() + p * kv_dim; }
};

// Every live row, read by logical position, equals what was written; and the
// raw plane holds it where the layout formula (written out here) says.
void check_live_rows(const KvCache& c, std::int64_t layer, const Stream& s) {
  const RingState& r = c.ring(layer);
  const std::int64_t kv = c.config().kv_dim(), hd = c.config().head_dim;
  std::vector<std::uint16_t> k(static_cast<std::size_t>(r.len() * kv)), v(k.size());
  ASSERT_TRUE(c.read_rows(layer, r.origin_logical(), r.len(), k.data(), v.data()).ok());
  const PlaneBytes plane = plane_bytes(c, layer);
  for (std::int64_t i = 0; i < r.len(); ++i) {
    const std::int64_t p = r.origin_logical() + i;
    const std::int64_t phys = r.physical(p);
    for (std::int64_t e = 0; e < kv; ++e) {
      const std::uint16_t want_k = f32_to_f16(s.krow(p)[e]);
      const std::uint16_t want_v = f32_to_f16(s.vrow(p)[e]);
      ASSERT_EQ(k[static_cast<std::size_t>(i * kv + e)], want_k) << "layer " << layer << " pos " << p;
      ASSERT_EQ(v[static_cast<std::size_t>(i * kv + e)], want_v);
      const std::int64_t at = c.layout(layer) == Layout::kTokenMajor
                                  ? phys * kv + e
                                  : ((e / hd) * r.capacity() + phys) * hd + e % hd;
      ASSERT_EQ(plane.k[static_cast<std::size_t>(at)], want_k);
      ASSERT_EQ(plane.v[static_cast<std::size_t>(at)], want_v);
    }
  }
}

TEST(CpuCache, PlanesHaveTheDesignedShapes) {
  auto c = make_cpu_cache(*preset_config("muse-glimmer"), {.context = 4096});
  ASSERT_TRUE(c.ok());
  for (std::int64_t l = 0; l < 52; ++l) {
    const bool full = l % 4 == 3;
    EXPECT_EQ((*c)->layout(l), full ? Layout::kHeadMajor : Layout::kTokenMajor);
    EXPECT_EQ((*c)->ring(l).capacity(), full ? 4096 : 2048);
    EXPECT_EQ((*c)->ring(l).wraps(), !full);
  }
  auto tiny = make_cpu_cache(small_config(8, 20));
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ((*tiny)->ring(0).capacity(), 32);  // max(32, min(20, 8))
  EXPECT_EQ((*tiny)->ring(3).capacity(), 32);  // max(32, 20)
}

// Leaves the allocator holding freed blocks of each size, filled with a
// pattern: the next allocations of those sizes reuse them, so memory that
// is handed out without being cleared shows the pattern.
void poison_heap(const std::vector<std::size_t>& sizes) {
  std::vector<void*> blocks;
  for (int rep = 0; rep < 16; ++rep)
    for (std::size_t n : sizes) {
      void* p = std::malloc(n);
      ASSERT_NE(p, nullptr);
      std::memset(p, 0xA5, n);
      blocks.push_back(p);
    }
  for (void* p : blocks) std::free(p);
}

bool any_nonzero(const KvCache& c) {
  for (std::int64_t l = 0; l < c.n_layers(); ++l) {
    const PlaneBytes b = plane_bytes(c, l);
    for (auto x : b.k)
      if (x != 0) return true;
    for (auto x : b.v)
      if (x != 0) return true;
  }
  return false;
}

// The planes are zero even where the allocator holds dirty memory of their
// sizes, with the zero fill and without it: the CPU backend maps fresh
// pages, zero until written, rather than taking the heap's. A plane taken
// from the heap without clearing would show the dirt.
TEST(CpuCache, ZeroFilledAtAllocation) {
  const ModelConfig cfg = small_config();
  std::vector<std::size_t> sizes;
  {
    auto probe = make_cpu_cache(cfg);
    ASSERT_TRUE(probe.ok());
    for (std::int64_t l = 0; l < cfg.n_layers; ++l) sizes.push_back(plane_bytes(**probe, l).k.size() * sizeof(std::uint16_t));
  }
  for (bool zero_fill : {false, true}) {
    SCOPED_TRACE(zero_fill ? "zero-filled" : "not zero-filled");
    poison_heap(sizes);
    auto c = make_cpu_cache(cfg, {.zero_fill = zero_fill});
    ASSERT_TRUE(c.ok());
    EXPECT_FALSE(any_nonzero(**c));
  }
}

// A pool no address space can hold (2^30 blocks of 32 MiB a plane, 32 PiB,
// past the 128 TiB a process maps without asking for more) is refused with
// an error, not a crash, and at once: the pool's bookkeeping is made as
// blocks are taken, so nothing of the pool's size is built before the
// planes' mapping fails.
TEST(CpuCache, APoolPastTheAddressSpaceIsAnError) {
  auto store = make_store(BackendKind::kCpu, *preset_config("muse-glimmer"),
                          {.context = 4096, .block_rows = 65536, .pool_blocks = std::int64_t{1} << 30});
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.error().code, ErrorCode::kIOError);
  EXPECT_NE(store.error().message.find("out of host memory"), std::string::npos) << store.error().message;
  // It names the plane and its size: 2^30 blocks of 32 MiB, 2^55 bytes.
  EXPECT_NE(store.error().message.find("block pool: the host refused a mapping of 36028797018963968 bytes"),
            std::string::npos)
      << store.error().message;
}

// One token at a time and batches of many sizes, across several wraps; the
// two store paths leave identical plane bytes.
TEST(CpuCache, StorePathsAgreeAndReadBackAcrossWraps) {
  const ModelConfig cfg = small_config(32, 200, 4, 4, 2, 16);
  const std::int64_t n = 200;
  Stream s(cfg.kv_dim(), n, 42);
  auto one = make_cpu_cache(cfg);
  ASSERT_TRUE(one.ok());
  for (std::int64_t chunk : {1, 3, 7, 32, 33, 64, 199}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    auto batched = make_cpu_cache(cfg);
    ASSERT_TRUE(batched.ok());
    for (std::int64_t p = 0; p < n;) {
      const std::int64_t count = std::min(chunk, n - p);
      for (std::int64_t l = 0; l < cfg.n_layers; ++l)
        ASSERT_TRUE((*batched)->store_batch(l, p, count, s.krow(p), s.vrow(p)).ok());
      if (chunk == 1) {
        for (std::int64_t l = 0; l < cfg.n_layers; ++l)
          ASSERT_TRUE((*one)->store_token(l, p, s.krow(p), s.vrow(p)).ok());
      }
      p += count;
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        check_live_rows(**batched, l, s);
        if (HasFatalFailure()) return;
      }
    }
    for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
      EXPECT_EQ((*batched)->ring(l), (*one)->ring(l));
      EXPECT_TRUE(plane_bytes(**batched, l) == plane_bytes(**one, l)) << "layer " << l;
    }
  }
}

TEST(CpuCache, FailuresLeaveTheCacheUnchanged) {
  const ModelConfig cfg = small_config(32, 64);
  Stream s(cfg.kv_dim(), 128, 7);
  auto c = make_cpu_cache(cfg);
  ASSERT_TRUE(c.ok());
  KvCache& cache = **c;
  for (std::int64_t l = 0; l < 4; ++l)
    ASSERT_TRUE(cache.store_batch(l, 0, 40, s.krow(0), s.vrow(0)).ok());
  std::vector<PlaneBytes> before;
  for (std::int64_t l = 0; l < 4; ++l) before.push_back(plane_bytes(cache, l));
  auto unchanged = [&] {
    for (std::int64_t l = 0; l < 4; ++l) {
      EXPECT_EQ(cache.ring(l).next_position(), 40);
      EXPECT_TRUE(plane_bytes(cache, l) == before[static_cast<std::size_t>(l)]);
    }
  };
  // Skipped and replayed positions.
  for (std::int64_t bad : {41, 39, 0}) {
    Status st = cache.store_token(1, bad, s.krow(0), s.vrow(0));
    ASSERT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(st.error().layer, 1);
    EXPECT_EQ(st.error().expected, 40);
    EXPECT_EQ(st.error().got, bad);
    EXPECT_EQ(cache.store_batch(2, bad, 5, s.krow(0), s.vrow(0)).error().code,
              ErrorCode::kCacheDiscontinuity);
  }
  unchanged();
  // A full plane asked past its capacity (64 positions).
  EXPECT_EQ(cache.store_batch(3, 40, 25, s.krow(40), s.vrow(40)).error().code,
            ErrorCode::kCapacityExceeded);
  // Bad layers, null buffers, empty batches, rows that are not live.
  EXPECT_EQ(cache.store_token(4, 40, s.krow(0), s.vrow(0)).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_token(-1, 40, s.krow(0), s.vrow(0)).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_token(0, 40, nullptr, s.vrow(0)).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_batch(0, 40, 0, s.krow(0), s.vrow(0)).error().code, ErrorCode::kInvalidArgument);
  std::vector<std::uint16_t> k(64 * 64), v(64 * 64);
  EXPECT_FALSE(cache.read_rows(0, 0, 1, k.data(), v.data()).ok());   // overwritten (ring of 32)
  EXPECT_FALSE(cache.read_rows(0, 39, 2, k.data(), v.data()).ok());  // not yet written
  EXPECT_TRUE(cache.read_rows(3, 0, 40, k.data(), v.data()).ok());
  unchanged();
}

TEST(CpuCache, AdoptTakesTheStoreOnlyWhenItAccepts) {
  const ModelConfig cfg = small_config(32, 64);
  std::unique_ptr<KvStore> none;
  EXPECT_EQ(KvCache::adopt(std::move(none), SeqId{1}).error().code, ErrorCode::kInvalidArgument);

  // A store of `slots` slots with one sequence added.
  auto store_of = [&](std::int64_t slots) -> std::pair<std::unique_ptr<KvStore>, SeqId> {
    auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = slots, .context = 64});
    if (!made.ok()) return {};
    auto seq = (*made)->add_sequence();
    return {std::move(*made), seq.ok() ? *seq : SeqId{}};
  };

  // A store of two slots: refused, and the caller still holds it.
  auto [two, a] = store_of(2);
  ASSERT_NE(two, nullptr);
  ASSERT_TRUE(two->contains(a));
  EXPECT_EQ(KvCache::adopt(std::move(two), a).error().code, ErrorCode::kInvalidArgument);
  ASSERT_NE(two, nullptr);
  EXPECT_TRUE(two->contains(a));

  // A store of one slot and a handle it does not hold: refused, kept; then
  // its live sequence: taken, with the rows stored before.
  auto [one, b] = store_of(1);
  ASSERT_NE(one, nullptr);
  ASSERT_TRUE(one->contains(b));
  EXPECT_EQ(KvCache::adopt(std::move(one), a).error().code, ErrorCode::kInvalidArgument);
  ASSERT_NE(one, nullptr);
  Stream s(cfg.kv_dim(), 8, 3);
  const SeqSpan span{b, 0, 5};
  for (std::int64_t l = 0; l < cfg.n_layers; ++l)
    ASSERT_TRUE(
        one->store(l, {&span, 1}, host_view(s.krow(0), 5, cfg.kv_dim()), host_view(s.vrow(0), 5, cfg.kv_dim())).ok());
  auto cache = KvCache::adopt(std::move(one), b);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(one, nullptr);
  for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
    EXPECT_EQ((*cache)->ring(l).next_position(), 5);
    check_live_rows(**cache, l, s);
  }
}

TEST(CpuCache, ResetEmptiesAndZeroFills) {
  const ModelConfig cfg = small_config();
  Stream s(cfg.kv_dim(), 50, 3);
  auto c = make_cpu_cache(cfg);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->store_batch(0, 0, 50, s.krow(0), s.vrow(0)).ok());
  ASSERT_TRUE((*c)->reset().ok());
  EXPECT_EQ((*c)->ring(0).len(), 0);
  EXPECT_EQ((*c)->ring(0).next_position(), 0);
  for (auto x : plane_bytes(**c, 0).k) ASSERT_EQ(x, 0);
}

TEST(CpuCache, ContextOutsideTheModelIsRefused) {
  const ModelConfig cfg = small_config(32, 256);
  EXPECT_FALSE(make_cpu_cache(cfg, {.context = 257}).ok());
  EXPECT_FALSE(make_cpu_cache(cfg, {.context = -1}).ok());
  ModelConfig broken = cfg;
  broken.n_kv_heads = 3;
  EXPECT_EQ(make_cpu_cache(broken).error().code, ErrorCode::kConfig);
}

}  // namespace
}  // namespace kvring
