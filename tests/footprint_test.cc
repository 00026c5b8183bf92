#include "kvring/footprint.h"
#include "kvring/store.h"
#include "kvring/backend.h"

#include <gtest/gtest.h>

#include <limits>

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
  EXPECT_EQ(f->block_rows, 32);
  // Full planes are whole blocks of the pool: 500 positions, two of 256.
  auto g = compute_footprint(c, 500, 1);
  EXPECT_EQ(g->sliding_rows, 64);
  EXPECT_EQ(g->block_rows, 256);
  EXPECT_EQ(g->full_rows, 512);
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
  EXPECT_EQ(with_commas(-1234), "-1,234");
  EXPECT_EQ(with_commas(std::numeric_limits<std::int64_t>::min()), "-9,223,372,036,854,775,808");
  EXPECT_EQ(format_bytes(53248), "53,248 B (52.00 KiB, 53.25 kB)");
  EXPECT_EQ(format_bytes(1826619392), "1,826,619,392 B (1.70 GiB, 1.83 GB)");
}

// The figure equals what the CPU backend allocates: the backend's own count
// of the buffers it made, and the growth of the process's address space
// (the planes are mappings of their own, cpu::HostPages).
TEST(Footprint, EqualsTheCpuBackendsAllocation) {
  const ModelConfig c = *preset_config("muse-glimmer");
  for (std::int64_t context : {2048, 32768, 131072}) {
    auto f = compute_footprint(c, context, 1);
    ASSERT_TRUE(f.ok());
    const std::int64_t before = testing::proc_status_bytes("VmSize");
    auto cache = make_cpu_cache(c, {.context = context});
    ASSERT_TRUE(cache.ok());
    const std::int64_t after = testing::proc_status_bytes("VmSize");
    ASSERT_GT(before, 0);
    EXPECT_EQ((*cache)->allocated_bytes(), f->slot_bytes) << context;
    // The address space grows by the planes, within what the rest of the
    // process maps or gives back meanwhile (the C library trims its heap
    // by a few pages at times): page rounding and bookkeeping only.
    EXPECT_GE(after - before, f->slot_bytes - (1 << 16)) << context;
    EXPECT_LT(after - before, f->slot_bytes + (1 << 20)) << context;
  }
}

// A sequence's full-attention memory follows its live rows: 64 sequences of
// 8192 tokens hold the full-attention bytes of 4 of 131072, within one block
// a sequence and layer.
TEST(Footprint, SequencesFitByTheirLiveRows) {
  const ModelConfig c = *preset_config("muse-glimmer");
  auto short_seq = fit_sequences(c, 8192, std::int64_t{1} << 40);
  auto long_seq = fit_sequences(c, 131072, std::int64_t{1} << 40);
  ASSERT_TRUE(short_seq.ok() && long_seq.ok());
  EXPECT_EQ(64 * short_seq->full_bytes, 4 * long_seq->full_bytes);
  // 8193 tokens take one more block in each of the 13 full layers.
  auto one_more = fit_sequences(c, 8193, std::int64_t{1} << 40);
  EXPECT_EQ(one_more->full_bytes - short_seq->full_bytes, 13 * 256 * c.kv_dim() * 4);
  EXPECT_EQ(short_seq->sliding_bytes, 39 * 2048 * c.kv_dim() * 4);
  // 10 GiB hold 5 sequences of 131072 tokens (1,826,619,392 B each).
  auto ten = fit_sequences(c, 131072, std::int64_t{10} << 30);
  EXPECT_EQ(ten->sequence_bytes, 1826619392);
  EXPECT_EQ(ten->sequences, 5);
  EXPECT_FALSE(ten->capped);
  // More than a store holds: the answer is the store's bound, marked.
  const ModelConfig tiny = make_hybrid_config("tiny", 2, 2, 1, 1, 1, 32, 64);
  auto many = fit_sequences(tiny, 1, std::int64_t{1} << 40);
  ASSERT_TRUE(many.ok());
  EXPECT_TRUE(many->capped);
  EXPECT_EQ(many->sequences, kMaxFootprintSlots);
  EXPECT_FALSE(fit_sequences(c, 0, 1 << 30).ok());
  EXPECT_FALSE(fit_sequences(c, 131073, 1 << 30).ok());
  EXPECT_FALSE(fit_sequences(c, 10, 0).ok());
  EXPECT_FALSE(fit_sequences(c, 10, 1 << 30, /*block_rows=*/100).ok());
}

// The fit's figure is what a CPU store uses for a sequence of that length.
TEST(Footprint, FitEqualsWhatTheStoreHolds) {
  const ModelConfig c = make_hybrid_config("fit", 8, 4, 4, 2, 16, 32, 1024);
  auto store = make_store(BackendKind::kCpu, c, {.max_sequences = 3, .block_rows = 16});
  ASSERT_TRUE(store.ok());
  for (std::int64_t length : {1, 16, 17, 100}) {
    auto seq = (*store)->add_sequence();
    ASSERT_TRUE(seq.ok());
    std::vector<float> k(static_cast<std::size_t>(length * c.kv_dim()), 0.5f);
    const SeqSpan span{*seq, 0, length};
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      ASSERT_TRUE((*store)->store(l, {&span, 1}, host_view(k.data(), length, c.kv_dim()),
                                  host_view(k.data(), length, c.kv_dim())).ok());
    auto fit = fit_sequences(c, length, 1 << 30, 16);
    ASSERT_TRUE(fit.ok());
    EXPECT_EQ(*(*store)->blocks_held(*seq) * (*store)->block_bytes(), fit->full_bytes) << length;
    EXPECT_EQ(6 * (*store)->ring_bytes(), fit->sliding_bytes);
    ASSERT_TRUE((*store)->remove_sequence(*seq).ok());
  }
  // The store of a fit allocates what the fit says, within the memory.
  for (const auto& [length, slack] : {std::pair<std::int64_t, std::int64_t>{100, 0}, {1000, 8}, {1, 0}}) {
    SCOPED_TRACE(length);
    const std::int64_t memory = 3'000'000;
    auto fit = fit_sequences(c, length, memory, 0, slack);
    ASSERT_TRUE(fit.ok());
    ASSERT_GT(fit->sequences, 0);
    auto fitted = make_store(BackendKind::kCpu, c,
                             {.max_sequences = fit->sequences, .slack = slack, .block_rows = fit->block_rows,
                              .pool_blocks = fit->pool_blocks});
    ASSERT_TRUE(fitted.ok()) << fitted.error().to_string();
    EXPECT_EQ((*fitted)->allocated_bytes(), fit->sequences * fit->sequence_bytes);
    EXPECT_LE((*fitted)->allocated_bytes(), memory);
    EXPECT_EQ((*fitted)->pool_blocks(), fit->pool_blocks);
  }
  // A pool past kMaxPoolBlocks caps the fit.
  const ModelConfig wide = make_hybrid_config("wide", 1024, 1, 1, 1, 1, 32, 1 << 20);
  auto capped = fit_sequences(wide, 1 << 20, std::int64_t{1} << 60, 16);
  ASSERT_TRUE(capped.ok()) << capped.error().to_string();
  EXPECT_TRUE(capped->capped);
  EXPECT_LE(capped->pool_blocks, kMaxPoolBlocks);
  EXPECT_EQ(capped->sequences, kMaxPoolBlocks / (1024 * ((1 << 20) / 16)));
  // So does a store past kMaxStoreBytes: 2^43 bytes a sequence, 2^63 - 2^40
  // of memory, at most 2^19 sequences.
  const ModelConfig big = make_hybrid_config("big", 1024, 0, 64, 64, 1024, 32768, 32768);
  auto huge = fit_sequences(big, 32768, std::numeric_limits<std::int64_t>::max() - (std::int64_t{1} << 40) + 1);
  ASSERT_TRUE(huge.ok()) << huge.error().to_string();
  EXPECT_EQ(huge->sequence_bytes, std::int64_t{1} << 43);
  EXPECT_EQ(huge->sequences, std::int64_t{1} << 19);
  EXPECT_TRUE(huge->capped);
  EXPECT_TRUE(resolve_store_options(big, {.max_sequences = huge->sequences, .pool_blocks = huge->pool_blocks}).ok());
}

TEST(Footprint, ParsesByteCounts) {
  EXPECT_EQ(*parse_bytes("1048576"), 1048576);
  EXPECT_EQ(*parse_bytes("80GiB"), std::int64_t{80} << 30);
  EXPECT_EQ(*parse_bytes("141GB"), 141000000000);
  EXPECT_EQ(*parse_bytes("512 MiB"), std::int64_t{512} << 20);
  EXPECT_FALSE(parse_bytes("").ok());
  EXPECT_FALSE(parse_bytes("GiB").ok());
  EXPECT_FALSE(parse_bytes("10XB").ok());
  EXPECT_FALSE(parse_bytes("-5").ok());
  EXPECT_FALSE(parse_bytes("99999999TiB").ok());
  // A fraction, exact, the bytes rounded down.
  EXPECT_EQ(*parse_bytes("79.5GiB"), std::int64_t{159} << 29);
  EXPECT_EQ(*parse_bytes("79.6GiB"), (std::int64_t{796} << 30) / 10);
  EXPECT_EQ(*parse_bytes("0.5 KiB"), 512);
  EXPECT_EQ(*parse_bytes("1.999B"), 1);
  EXPECT_EQ(*parse_bytes("0.000000000000000001TiB"), 0);
  EXPECT_EQ(*parse_bytes("8388607.999999999999999999TiB"), std::numeric_limits<std::int64_t>::max());
  EXPECT_FALSE(parse_bytes("8388608.5TiB").ok());
  EXPECT_FALSE(parse_bytes("1.GiB").ok());
  EXPECT_FALSE(parse_bytes(".5GiB").ok());
  EXPECT_FALSE(parse_bytes("1.5.5GiB").ok());
  EXPECT_FALSE(parse_bytes("1.0000000000000000001GiB").ok());
  EXPECT_FALSE(parse_bytes("1e9").ok());
  EXPECT_NE(parse_bytes("1.GiB").error().message.find("decimal point"), std::string::npos);
}

}  // namespace
}  // namespace kvring
