#include "kvring/footprint.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include "kvring/cache.h"
#include "test_util.h"

namespace kvring {
namespace {

TEST(Footprint, MuseGlimmerAtFullContext) {
  auto f = compute_footprint(*preset_config("muse-glimmer"), 131072, 4);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->bytes_per_token, 53248);
  EXPECT_EQ(f->sliding_bytes, 81788928);
  EXPECT_EQ(f->full_bytes, 1744830464);
  EXPECT_EQ(f->slot_bytes, 1826619392);
  EXPECT_EQ(f->total_bytes, 7306477568);
  EXPECT_EQ(f->n_sliding, 39);
  EXPECT_EQ(f->n_full, 13);
}

TEST(Footprint, SmallContextsUseTheMinimumRing) {
  const ModelConfig c = testing::small_config(64, 1000);
  auto f = compute_footprint(c, 10, 1);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->sliding_rows, 32);
  EXPECT_EQ(f->full_rows, 32);
  auto g = compute_footprint(c, 500, 1);
  EXPECT_EQ(g->sliding_rows, 64);
  EXPECT_EQ(g->full_rows, 500);
}

TEST(Footprint, BadArguments) {
  const ModelConfig c = *preset_config("muse-glimmer");
  EXPECT_FALSE(compute_footprint(c, 0, 1).ok());
  EXPECT_FALSE(compute_footprint(c, 131073, 1).ok());
  EXPECT_FALSE(compute_footprint(c, 2048, 0).ok());
  EXPECT_FALSE(compute_footprint(c, 2048, -3).ok());
  // The largest geometry the config bounds allow: one slot fits, a million
  // slots overflow 64 bits and are refused instead of wrapping.
  ModelConfig huge = make_hybrid_config("huge", kMaxLayers, 1, kMaxHeads, kMaxKvDim / kMaxHeadDim,
                                        kMaxHeadDim, 0, kMaxContext);
  auto one = compute_footprint(huge, kMaxContext, 1);
  ASSERT_TRUE(one.ok()) << one.error().to_string();
  EXPECT_EQ(one->slot_bytes, kMaxLayers * kMaxContext * kMaxKvDim * 4);
  auto many = compute_footprint(huge, kMaxContext, 1 << 20);
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.error().message.find("exceed 2^63 bytes"), std::string::npos);
}

TEST(Footprint, Formatting) {
  EXPECT_EQ(with_commas(1826619392), "1,826,619,392");
  EXPECT_EQ(with_commas(999), "999");
  EXPECT_EQ(format_bytes(53248), "53,248 B (52.00 KiB, 53.25 kB)");
  EXPECT_EQ(format_bytes(1826619392), "1,826,619,392 B (1.70 GiB, 1.83 GB)");
}

// The figure equals what the CPU backend allocates: the backend's own count
// of the buffers it made, and the heap growth the C library reports.
TEST(Footprint, EqualsTheCpuBackendsAllocation) {
  const ModelConfig c = *preset_config("muse-glimmer");
  for (std::int64_t context : {2048, 32768, 131072}) {
    auto f = compute_footprint(c, context, 1);
    ASSERT_TRUE(f.ok());
    const auto before = mallinfo2();
    auto cache = make_cpu_cache(c, {.context = context});
    ASSERT_TRUE(cache.ok());
    const auto after = mallinfo2();
    EXPECT_EQ((*cache)->allocated_bytes(), f->slot_bytes) << context;
    const auto heap = static_cast<std::int64_t>((after.hblkhd + after.uordblks) -
                                                (before.hblkhd + before.uordblks));
    EXPECT_GE(heap, f->slot_bytes) << context;
    EXPECT_LT(heap, f->slot_bytes + (1 << 20)) << context;  // bookkeeping only
  }
}

}  // namespace
}  // namespace kvring
