// CUDA attention and stores in batches: a sequence's stored bytes and
// outputs are the same bits alone or in any batch (any order, any slot, any
// blocks, chunked or token by token, host or device views), and agree with
// the CPU backend (bytes exactly, outputs within 1e-5); every combine path
// of the splits gives the same bits.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cuda/kernels.h"
#include "kvring/f16.h"
#include "cuda/launch_policy.h"
#include "cuda_test_util.h"

namespace kvring {
namespace {

using testing::Outputs;
using testing::SeqInputs;

constexpr double kTolerance = 1e-5;

// Geometries for both kernels: head_dim 128 (tensor cores, GQA 8 and a
// group of 12 that needs two head sets) and others (64, odd 17).
struct Case {
  ModelConfig config;
  std::int64_t block_rows;
};
std::vector<Case> cases() {
  return {{make_hybrid_config("tc-gqa8", 4, 2, 16, 2, 128, 48, 4096), 16},
          {make_hybrid_config("tc-group12", 2, 2, 12, 1, 128, 40, 4096), 64},
          {make_hybrid_config("hd64", 4, 2, 8, 2, 64, 33, 4096), 32},
          {make_hybrid_config("hd17", 2, 2, 6, 2, 17, 24, 4096), 16}};
}

std::vector<SeqInputs> inputs(const ModelConfig& c, std::uint64_t seed, int n, std::int64_t longest) {
  std::mt19937_64 rng(seed);
  std::vector<SeqInputs> s;
  for (int i = 0; i < n; ++i) {
    // Lengths from a few rows to past several splits and ring wraps.
    const std::int64_t len = i == 0 ? longest : 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(longest));
    s.push_back(testing::seq_inputs(c, len, seed * 100 + static_cast<std::uint64_t>(i)));
  }
  return s;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// One sink a query head over every regime: far above the scores (it takes
// nearly all the weight), near them, far below (its head's bits are those
// without sinks), exactly 0, and one near the largest float (its head's
// outputs are all 0).
std::vector<float> sinks_of(const ModelConfig& c) {
  const float pattern[] = {16.0f, 1.5f, -0.75f, 0.0f, -80.0f, 3.0f, 0.25f, -3.5f};
  std::vector<float> s(static_cast<std::size_t>(c.n_heads));
  for (std::size_t h = 0; h < s.size(); ++h) s[h] = pattern[h % 8] + 0.125f * static_cast<float>(h / 8);
  s.back() = 3e38f;
  return s;
}

// Each sequence alone in a one-sequence store, with its own random chunking.
Outputs solo_outputs(BackendKind kind, const Case& cs, const std::vector<SeqInputs>& seqs,
                     std::vector<testing::SeqImage>* images, std::uint64_t seed) {
  Outputs all;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    auto store = testing::new_store(kind, cs.config, {.max_sequences = 1, .context = 1024, .block_rows = cs.block_rows});
    if (!store) return all;
    auto id = store->add_sequence();
    EXPECT_TRUE(id.ok());
    const std::vector<SeqInputs> one = {seqs[i]};
    Outputs o;
    testing::run_plan(*store, {*id}, one, testing::random_plan(one, seed + i, 64), o);
    for (auto& [key, val] : o) all[{static_cast<int>(i), std::get<1>(key), std::get<2>(key)}] = val;
    if (images) images->push_back(testing::seq_image(*store, *id));
  }
  return all;
}

TEST(CudaBatch, BatchesEqualSoloRunsAndTheCpuBackend) {
  KVRING_SKIP_WITHOUT_GPU();
  const int n_seqs = testing::quick() ? 3 : 6;
  const std::int64_t longest = testing::quick() ? 300 : 700;
  for (const Case& cs : cases()) {
    for (std::uint64_t seed : {1u, 2u}) {
      SCOPED_TRACE(cs.config.name + " seed " + std::to_string(seed));
      const auto seqs = inputs(cs.config, seed, n_seqs, longest);
      std::vector<testing::SeqImage> solo_images;
      const Outputs solo = solo_outputs(BackendKind::kCuda, cs, seqs, &solo_images, seed * 7);
      const auto plan = testing::random_plan(seqs, seed * 13, 80);
      const StoreOptions o{.max_sequences = n_seqs + 3, .context = 1024, .block_rows = cs.block_rows};
      auto gpu = testing::new_store(BackendKind::kCuda, cs.config, o);
      auto cpu = testing::new_store(BackendKind::kCpu, cs.config, o);
      ASSERT_TRUE(gpu && cpu);
      const auto gids = testing::add_with_churn(*gpu, n_seqs, seed * 17);
      const auto cids = testing::add_with_churn(*cpu, n_seqs, seed * 19);
      Outputs g, c;
      // Host views on the GPU for the first seed, device views for the second.
      testing::run_plan(*gpu, gids, seqs, plan, g, seed == 2);
      testing::run_plan(*cpu, cids, seqs, plan, c);
      ASSERT_EQ(g.size(), solo.size());
      double worst = 0;
      for (const auto& [key, val] : g) {
        const auto& [i, l, p] = key;
        ASSERT_TRUE(same_bits(val, solo.at(key)))
            << "sequence " << i << " layer " << l << " position " << p << " differs from its solo run";
        const auto& ref = c.at(key);
        for (std::size_t e = 0; e < val.size(); ++e) {
          ASSERT_TRUE(std::isfinite(val[e]));
          worst = std::max(worst, std::abs(double(val[e]) - ref[e]) / std::max(1.0, std::abs(double(ref[e]))));
        }
      }
      EXPECT_LE(worst, kTolerance);
      std::printf("  %s seed %llu: CUDA vs CPU worst %.2e over %zu outputs\n", cs.config.name.c_str(),
                  static_cast<unsigned long long>(seed), worst, g.size());
      for (int i = 0; i < n_seqs; ++i) {
        const auto gi = testing::seq_image(*gpu, gids[static_cast<std::size_t>(i)]);
        EXPECT_TRUE(gi == solo_images[static_cast<std::size_t>(i)]) << "sequence " << i << " bytes";
        EXPECT_TRUE(gi == testing::seq_image(*cpu, cids[static_cast<std::size_t>(i)]))
            << "sequence " << i << " bytes differ from the CPU backend's";
      }
    }
  }
}

// The device's launch policy with the resident and cluster combines off:
// every launch of several splits combines by last arrival.
cuda::LaunchPolicy last_arrival_only() {
  cuda::LaunchPolicy p = cuda::device_launch_policy();
  p.hd128_resident = 0;
  p.hd128_cluster = 1;
  p.general_cluster = 1;
  return p;
}

// One long sequence decoded with many splits: resident grids (with the
// epoch count wrapping too), clusters and the global workspace, in either
// grid order, with a CTA a split or runs of splits a CTA, or a warp a
// split, give the same bits, and so does a batch around it, on a layer
// with attention sinks and one without. Each store
// runs under a policy that forces its path, and its launches are counted
// by the path they took. KVRING_COMBINE_PATH=N runs path N alone (0-8), so
// a sanitizer can take the paths in parallel processes; the bits are
// compared across paths only when all of them run.
TEST(CudaBatch, EveryCombinePathGivesTheSameBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const Case cs{make_hybrid_config("tc-long", 2, 2, 16, 2, 128, 64, 8192), 256};
  const std::int64_t len = testing::quick() ? 2100 : 5000;  // 17+ splits: two-level combine
  const std::vector<SeqInputs> seqs = {testing::seq_inputs(cs.config, len, 5),
                                       testing::seq_inputs(cs.config, 150, 6)};
  const cuda::LaunchPolicy device = cuda::device_launch_policy();
  enum Path { kResident, kEpochWrap, kCluster, kClusterWave, kLastArrival, kQueryMajor, kRuns, kRunsQueryMajor,
              kWarpSplits };
  constexpr int kPaths = 9;
  const char* const names[] = {"resident", "resident across the epoch wrap", "cluster",
                               "cluster within one wave, else last arrival", "last arrival",
                               "last arrival, query-major", "last arrival, runs of 4 splits a CTA",
                               "last arrival, runs of up to 32 splits a CTA, query-major",
                               "decodes a warp a split, runs of 16 splits a CTA"};
  const int short_decode_ctas = 2 * cuda::attend_grid(16, 2, 128).items;
  std::vector<Outputs> runs;
  std::vector<cuda::AttendStats> stats(kPaths);
  const char* only = std::getenv("KVRING_COMBINE_PATH");
  const int only_path = only != nullptr ? std::atoi(only) : -1;
  ASSERT_LT(only_path, kPaths) << "KVRING_COMBINE_PATH names a path 0-" << kPaths - 1;
  for (const Path path : {kResident, kEpochWrap, kCluster, kClusterWave, kLastArrival, kQueryMajor, kRuns,
                          kRunsQueryMajor, kWarpSplits}) {
    if (only_path >= 0 && path != only_path) continue;
    SCOPED_TRACE(names[path]);
    cuda::LaunchPolicy policy = path >= kLastArrival ? last_arrival_only() : device;
    policy.split_run = 1;  // a CTA a split but where the path says otherwise
    if (path == kEpochWrap) policy.first_epoch = 0xffffffffu;  // the second launch wraps
    if (path == kCluster || path == kClusterWave) policy.hd128_resident = 0;
    // Clusters only while the launch's CTAs run at once: the short
    // sequence's solo decodes; every larger launch by last arrival.
    if (path == kClusterWave) policy.hd128_cluster_ctas = short_decode_ctas;
    if (path == kLastArrival) policy.query_major = cuda::QueryMajor::kNever;
    if (path == kQueryMajor || path == kRunsQueryMajor) policy.query_major = cuda::QueryMajor::kAlways;
    if (path == kRuns) policy.split_run = 4;
    if (path == kRunsQueryMajor) policy.split_run = 32;
    // Every decode (at most 8192 rows) a warp a split, runs of 16: each
    // warp takes several splits of a run.
    policy.warp_splits = path == kWarpSplits ? cuda::WarpSplits::kAlways : cuda::WarpSplits::kNever;
    if (path == kWarpSplits) policy.split_run = 16;
    policy.stats = &stats[path];
    auto store = testing::new_cuda_store(cs.config, {.max_sequences = 2, .context = 8192, .block_rows = cs.block_rows}, policy);
    ASSERT_TRUE(store);
    // Layer 1 with sinks, layer 0 without: both ends of every path.
    ASSERT_TRUE(store->set_attention_sinks(1, sinks_of(cs.config)).ok());
    std::vector<SeqId> ids = {*store->add_sequence(), *store->add_sequence()};
    // A prefill of most of both, then decodes of both together and of
    // each alone (the short one's two splits fit any resident grid or
    // cluster). At quick sizes (the sanitizers' runs) most rows are stored
    // without attention and the prefill is a last chunk of 64 rows each,
    // still over all the splits.
    std::vector<std::int64_t> at = {0, 0};
    if (testing::quick()) {
      at = {len - 70, 80};
      for (std::int64_t l = 0; l < cs.config.n_layers; ++l)
        for (std::size_t i = 0; i < 2; ++i) {
          const SeqInputs& s = seqs[i];
          const std::int64_t kv = cs.config.kv_dim();
          const SeqSpan span{ids[i], 0, at[i]};
          ASSERT_TRUE(store->store(l, std::span(&span, 1), testing::host_in(s.k.data() + l * s.len * kv, at[i], kv),
                                   testing::host_in(s.v.data() + l * s.len * kv, at[i], kv)).ok());
        }
    }
    std::vector<testing::Step> plan = {{false, {{0, len - 6 - at[0]}, {1, 144 - at[1]}}}};
    for (int i = 0; i < 4; ++i) plan.push_back({true, {{1, 1}, {0, 1}}});
    for (int i = 0; i < 2; ++i) plan.push_back({true, {{0, 1}}});
    for (int i = 0; i < 2; ++i) plan.push_back({true, {{1, 1}}});
    Outputs o;
    testing::run_plan(*store, ids, seqs, plan, o, true, nullptr, &at);
    // Layer 1's last head has a sink near the largest float: the path
    // divided by it (one or two levels), its outputs are 0.
    for (const auto& [key, val] : o) {
      if (std::get<1>(key) != 1) continue;
      for (std::int64_t e = (cs.config.n_heads - 1) * cs.config.head_dim; e < cs.config.n_heads * cs.config.head_dim; ++e)
        ASSERT_EQ(val[static_cast<std::size_t>(e)], 0.0f) << "position " << std::get<2>(key);
    }
    runs.push_back(std::move(o));
    const cuda::AttendStats& n = stats[path];
    std::printf("  %s: launches by path: resident %ld, cluster %ld, last arrival %ld (query-major %ld, "
                "runs of splits %ld, a warp a split %ld)\n",
                names[path], n.resident, n.cluster, n.last_arrival, n.query_major, n.split_runs, n.warp_splits);
  }
  if (only_path >= 0) {
    std::printf("  path %d alone: the cross-path comparison needs all %d\n", only_path, kPaths);
    return;
  }
  for (std::size_t r = 1; r < runs.size(); ++r)
    for (const auto& [key, val] : runs[0])
      ASSERT_TRUE(same_bits(val, runs[r].at(key))) << names[r] << ", position " << std::get<2>(key);

  // Each forced path was taken where the device runs it: the long
  // sequence's decodes alone (over 16 splits of each work item, more than a
  // cluster holds) are resident grids, the short one's clusters of two.
  if (device.hd128_resident >= short_decode_ctas) {
    EXPECT_GT(stats[kResident].resident, 0);
    EXPECT_GT(stats[kEpochWrap].resident, 1);
  }
  EXPECT_EQ(stats[kCluster].resident, 0);
  if (device.hd128_cluster >= 2) {
    EXPECT_GT(stats[kCluster].cluster, 0);
    EXPECT_GT(stats[kClusterWave].cluster, 0);
    EXPECT_GT(stats[kClusterWave].last_arrival, 0);
  }
  EXPECT_EQ(stats[kClusterWave].resident, 0);
  for (const Path path : {kLastArrival, kQueryMajor, kRuns, kRunsQueryMajor}) {
    EXPECT_EQ(stats[path].resident, 0);
    EXPECT_EQ(stats[path].cluster, 0);
    EXPECT_GT(stats[path].last_arrival, 0);
  }
  EXPECT_EQ(stats[kLastArrival].query_major, 0);
  EXPECT_GT(stats[kQueryMajor].query_major, 0);
  EXPECT_GT(stats[kRunsQueryMajor].query_major, 0);
  for (const Path path : {kResident, kEpochWrap, kCluster, kClusterWave, kLastArrival, kQueryMajor})
    EXPECT_EQ(stats[path].split_runs, 0) << names[path];
  // Every launch of several splits ran in runs (the long sequence's 17 or
  // more splits combine in two levels; runs of 16 or 32 owe group
  // combines until their end).
  EXPECT_EQ(stats[kRuns].split_runs, stats[kRuns].last_arrival);
  EXPECT_EQ(stats[kRunsQueryMajor].split_runs, stats[kRunsQueryMajor].last_arrival);
  // Every decode of the warp path (4 of both, 2 of each alone, a launch a
  // layer) took the warp-split kernel; no other path did.
  EXPECT_EQ(stats[kWarpSplits].warp_splits, 8 * cs.config.n_layers);
  for (const Path path : {kResident, kEpochWrap, kCluster, kClusterWave, kLastArrival, kQueryMajor, kRuns,
                          kRunsQueryMajor})
    EXPECT_EQ(stats[path].warp_splits, 0) << names[path];
}

// The f16 numeric's kernel: the deep one where a launch fits one wave of
// it, never on a device of unknown size, and either where forced.
TEST(CudaF16, KernelFollowsTheRule) {
  cuda::LaunchPolicy p;
  p.f16_deep_wave = 264;
  EXPECT_TRUE(p.f16_deep_for(1));
  EXPECT_TRUE(p.f16_deep_for(264));
  EXPECT_FALSE(p.f16_deep_for(265));
  p.f16_deep_wave = 0;
  EXPECT_FALSE(p.f16_deep_for(1));
  p.f16_stages = 3;
  EXPECT_TRUE(p.f16_deep_for(1 << 20));
  p.f16_stages = 2;
  p.f16_deep_wave = 264;
  EXPECT_FALSE(p.f16_deep_for(1));
}

// The rule for runs of splits: powers of two, never longer than the
// splits; in decode launches where every query has as many splits, the
// shortest run that fits one wave, else the longest; else the longest of
// at most 8 that leaves two waves; a CTA a split in prefill launches and
// on a device of unknown size; a forced run as long as the splits allow.
TEST(CudaBatch, RunsOfSplitsFollowTheRule) {
  cuda::LaunchPolicy p;
  p.hd128_wave = 132;
  EXPECT_EQ(p.split_run_for(2 * 64, 64, 64, true), 1);          // one sequence at 131072 rows: 128 CTAs
  EXPECT_EQ(p.split_run_for(4 * 2 * 64, 64, 64, true), 4);      // 4 x 131072: 128 CTAs of 4 splits
  EXPECT_EQ(p.split_run_for(32 * 2 * 64, 64, 64, true), 32);    // 32 x 32768: 128 CTAs of 32 splits
  EXPECT_EQ(p.split_run_for(128 * 2 * 16, 16, 16, true), 16);   // 128 rings: none fits, a CTA a ring
  EXPECT_EQ(p.split_run_for(64 * 2 * 64, 64, 1, true), 8);      // mixed lengths
  EXPECT_EQ(p.split_run_for(10 * 2 * 64, 64, 1, true), 4);      // 320 CTAs of 4 splits; 8 leaves 160
  EXPECT_EQ(p.split_run_for(1024 * 2 * 1, 1, 1, true), 1);
  EXPECT_EQ(p.split_run_for(1024 * 2 * 3, 3, 3, true), 2);
  EXPECT_EQ(p.split_run_for(512 * 2 * 64, 64, 64, false), 1);   // a prefill chunk
  p.hd128_wave = 0;  // unknown device: a CTA a split
  EXPECT_EQ(p.split_run_for(32 * 2 * 64, 64, 64, true), 1);
  p.split_run = 6;   // forced: the longest power of two up to it and the splits
  EXPECT_EQ(p.split_run_for(2, 1, 1, true), 1);
  EXPECT_EQ(p.split_run_for(16, 16, 16, false), 4);
  p.split_run = 32;
  EXPECT_EQ(p.split_run_for(17 * 2, 17, 3, true), 16);
  EXPECT_EQ(p.split_run_for(5 * 2, 5, 5, true), 4);
}

// A plan of all but each sequence's last 3 rows in one prefill, then 3
// decodes of all of them together.
std::vector<testing::Step> prefill_then_decodes(const std::vector<SeqInputs>& seqs) {
  const int n = static_cast<int>(seqs.size());
  std::vector<testing::Step> plan(1);
  for (int i = 0; i < n; ++i) {
    const std::int64_t len = seqs[static_cast<std::size_t>(i)].len;
    if (len > 3) plan[0].chunks.emplace_back(i, len - 3);
  }
  for (int d = 0; d < 3; ++d) {
    plan.push_back({true, {}});
    for (int i = 0; i < n; ++i)
      if (seqs[static_cast<std::size_t>(i)].len > 2 - d) plan.back().chunks.emplace_back(i, 1);
  }
  return plan;
}

// A batch in runs of splits gives each sequence its solo bits: lengths
// from one split to two-level combines, decoded together, by the rule
// (with a wave of 2 CTAs), and equal lengths in forced runs of 16 splits,
// whose runs each complete whole groups (arrive_run).
TEST(CudaBatch, RunsOfSplitsGiveTheSoloBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const Case cs{make_hybrid_config("tc-runs", 2, 2, 16, 2, 128, 64, 4096), 64};
  for (const bool equal : {false, true}) {
    SCOPED_TRACE(equal ? "equal lengths" : "lengths that differ");
    const int n = testing::quick() ? 5 : 9;
    std::vector<SeqInputs> seqs = inputs(cs.config, 31, n, 3000);
    if (equal)
      for (int i = 1; i < n; ++i)
        seqs[static_cast<std::size_t>(i)] = testing::seq_inputs(cs.config, 3000, 300 + static_cast<std::uint64_t>(i));
    cuda::AttendStats stats;
    cuda::LaunchPolicy policy = last_arrival_only();
    policy.hd128_wave = 2;
    policy.warp_splits = cuda::WarpSplits::kNever;
    if (equal) policy.split_run = 16;
    policy.stats = &stats;
    auto batch = testing::new_cuda_store(cs.config, {.max_sequences = n, .context = 4096, .block_rows = 64}, policy);
    ASSERT_TRUE(batch);
    std::vector<SeqId> ids;
    for (int i = 0; i < n; ++i) ids.push_back(*batch->add_sequence());
    Outputs together;
    testing::run_plan(*batch, ids, seqs, prefill_then_decodes(seqs), together, true);
    EXPECT_GT(stats.split_runs, 0);
    for (int i = 0; i < n; ++i) {
      SCOPED_TRACE("sequence " + std::to_string(i));
      auto solo = testing::new_cuda_store(cs.config, {.max_sequences = 1, .context = 4096, .block_rows = 64},
                                          cuda::device_launch_policy());
      ASSERT_TRUE(solo);
      const std::vector<SeqInputs> one = {seqs[static_cast<std::size_t>(i)]};
      Outputs o;
      testing::run_plan(*solo, {*solo->add_sequence()}, one,
                        testing::random_plan(one, 40 + static_cast<std::uint64_t>(i), 700), o, true);
      for (const auto& [key, val] : o) {
        const auto& [s, l, p] = key;
        ASSERT_TRUE(same_bits(val, together.at({i, l, p}))) << "layer " << l << " position " << p;
      }
    }
  }
}

// Decodes of a warp a split (the warp-split kernel) give each sequence its
// solo bits (the CTA kernel's): lengths from a few rows to 64 splits of a
// full layer (two-level combines) and 300-row sliding windows (three
// splits, the last of 44 rows, so some tiles are empty), a group of 8 query
// heads and one of 12 (two head sets, the second of 4 heads), with the
// rule's runs (a split a warp here) and forced runs of 32 (8 splits a warp),
// for decodes and for one-token prefill chunks.
TEST(CudaBatch, WarpSplitsGiveTheSoloBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::vector<ModelConfig> configs = {make_hybrid_config("tc-warp8", 2, 2, 16, 2, 128, 300, 8192),
                                            make_hybrid_config("tc-warp12", 2, 2, 12, 1, 128, 300, 8192)};
  for (const ModelConfig& config : configs) {
    const int n = testing::quick() ? 5 : 9;
    const std::vector<SeqInputs> seqs = inputs(config, 37, n, 8190);
    Outputs solo;
    for (int i = 0; i < n; ++i) {
      auto store = testing::new_cuda_store(config, {.max_sequences = 1, .context = 8192, .block_rows = 64},
                                           cuda::device_launch_policy());
      ASSERT_TRUE(store);
      const std::vector<SeqInputs> one = {seqs[static_cast<std::size_t>(i)]};
      Outputs o;
      testing::run_plan(*store, {*store->add_sequence()}, one,
                        testing::random_plan(one, 50 + static_cast<std::uint64_t>(i), 900), o, true);
      for (auto& [key, val] : o) solo[{i, std::get<1>(key), std::get<2>(key)}] = std::move(val);
    }
    for (const int run : {0, 32}) {
      SCOPED_TRACE(config.name + (run == 0 ? ", the rule's runs" : ", runs of 32"));
      cuda::AttendStats stats;
      cuda::LaunchPolicy policy = cuda::device_launch_policy();
      policy.warp_splits = cuda::WarpSplits::kAlways;
      policy.split_run = run;
      policy.stats = &stats;
      auto batch = testing::new_cuda_store(config, {.max_sequences = n, .context = 8192, .block_rows = 64}, policy);
      ASSERT_TRUE(batch);
      std::vector<SeqId> ids;
      for (int i = 0; i < n; ++i) ids.push_back(*batch->add_sequence());
      // The last step as one-token prefill chunks: each query's own row is
      // read from its chunk.
      std::vector<testing::Step> plan = prefill_then_decodes(seqs);
      plan.back().decode = false;
      Outputs together;
      testing::run_plan(*batch, ids, seqs, plan, together, true);
      EXPECT_EQ(stats.warp_splits, 3 * config.n_layers);
      ASSERT_EQ(together.size(), solo.size());
      for (const auto& [key, val] : solo) {
        const auto& [i, l, p] = key;
        ASSERT_TRUE(same_bits(val, together.at(key))) << "sequence " << i << " layer " << l << " position " << p;
      }
    }
  }
}

// The rule for the warp-split kernel's runs: its warps' count of splits (a
// split a warp) times a power of two, no longer than covers the splits;
// with equal split counts the shortest that fits one wave, else the one
// that covers a query's splits; else a split a warp; a forced run the
// longest up to it.
TEST(CudaBatch, WarpRunsFollowTheRule) {
  static_assert(cuda::kWarpSplitWarps == 4, "the expectations below assume CTAs of 4 warps");
  cuda::LaunchPolicy p;
  p.hd128_warp_wave = 264;
  EXPECT_EQ(p.warp_run_for(128 * 2 * 16, 16, 16), 16);  // 128 rings: 256 CTAs of 16 splits
  EXPECT_EQ(p.warp_run_for(4 * 2 * 16, 16, 16), 4);     // 4 rings: 32 CTAs of 4
  EXPECT_EQ(p.warp_run_for(64 * 2 * 64, 64, 64), 32);   // 64 x 8192: 256 CTAs of 32
  EXPECT_EQ(p.warp_run_for(4 * 2 * 64, 64, 64), 4);     // 4 x 8192: 128 CTAs of 4
  EXPECT_EQ(p.warp_run_for(64 * 2 * 64, 64, 3), 4);     // lengths that differ
  EXPECT_EQ(p.warp_run_for(100 * 2 * 2, 2, 2), 4);      // 2 splits: covered by 4
  p.hd128_warp_wave = 0;  // unknown device: a split a warp
  EXPECT_EQ(p.warp_run_for(128 * 2 * 16, 16, 16), 4);
  p.split_run = 40;       // forced: the longest up to it that the splits need
  EXPECT_EQ(p.warp_run_for(2 * 64, 64, 64), 32);
  EXPECT_EQ(p.warp_run_for(2 * 16, 16, 16), 16);
  p.split_run = 1;
  EXPECT_EQ(p.warp_run_for(2 * 64, 64, 64), 4);
}

// The split count is not monotonic in the rows seen (8192 rows: 64 splits;
// 8193: 33): the most and fewest splits of a range of row counts are those
// of every count in it.
TEST(CudaBatch, SplitCountsOfARangeAreItsMostAndFewest) {
  for (const std::int64_t n0 : {1, 100, 8000, 8192, 8193, 16000, 16384, 16385, 30000, 131000})
    for (const std::int64_t len : {0, 1, 5, 191, 192, 193, 300, 9000, 20000}) {
      const std::int64_t n1 = n0 + len;
      std::int64_t most = 0, least = cuda::kAttendMaxSplits + 1;
      for (std::int64_t n = n0; n <= n1; ++n) {
        most = std::max(most, cuda::attend_splits(n));
        least = std::min(least, cuda::attend_splits(n));
      }
      EXPECT_EQ(cuda::attend_splits_most(n0, n1), most) << n0 << ".." << n1;
      EXPECT_EQ(cuda::attend_splits_least(n0, n1), least) << n0 << ".." << n1;
    }
}

// One sequence of `len` rows whose rows before `before` are stored without
// attention: the rest as one prefill chunk gives every query the bits of
// its one-token decode, in a store of options `o`.
void expect_chunk_gives_decode_bits(const ModelConfig& c, std::int64_t len, std::int64_t before,
                                    const StoreOptions& o, std::uint64_t seed) {
  const std::int64_t kv = c.kv_dim();
  const std::vector<SeqInputs> seqs = {testing::seq_inputs(c, len, seed)};
  Outputs chunked, decoded;
  for (const bool decode : {false, true}) {
    auto store = testing::new_cuda_store(c, o, cuda::device_launch_policy());
    ASSERT_TRUE(store);
    const std::vector<SeqId> ids = {*store->add_sequence()};
    const SeqInputs& s = seqs[0];
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      const SeqSpan span{ids[0], 0, before};
      ASSERT_TRUE(store->store(l, std::span(&span, 1), testing::host_in(s.k.data() + l * len * kv, before, kv),
                               testing::host_in(s.v.data() + l * len * kv, before, kv)).ok());
    }
    std::vector<std::int64_t> at = {before};
    std::vector<testing::Step> plan;
    if (decode) {
      for (std::int64_t i = before; i < len; ++i) plan.push_back({true, {{0, 1}}});
    } else {
      plan.push_back({false, {{0, len - before}}});
    }
    testing::run_plan(*store, ids, seqs, plan, decode ? decoded : chunked, true, nullptr, &at);
  }
  ASSERT_EQ(chunked.size(), decoded.size());
  for (const auto& [key, val] : chunked) {
    for (const float x : val) ASSERT_TRUE(std::isfinite(x)) << "position " << std::get<2>(key);
    ASSERT_TRUE(same_bits(val, decoded.at(key))) << "layer " << std::get<1>(key) << ", position " << std::get<2>(key);
  }
}

// A prefill chunk across 8192 rows, where a query's split count drops from
// 64 to 33: the launch is sized for the most splits of any of its queries,
// and every query gets the bits of its one-token decode.
TEST(CudaBatch, PrefillAcrossASplitBandGivesDecodeBits) {
  KVRING_SKIP_WITHOUT_GPU();
  expect_chunk_gives_decode_bits(make_hybrid_config("tc-band", 2, 2, 16, 2, 128, 64, 8448), 8300, 8100,
                                 {.max_sequences = 1, .context = 8448, .block_rows = 256}, 77);
}

// Under the f16 numeric, a 512-token chunk at the end of a long context
// (131072 rows; 32768 quick), whose launch takes the kernel of many waves,
// gives every query the bits of its one-token decode, which takes the
// deep kernel.
TEST(CudaF16, LongChunkGivesDecodeBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::int64_t len = testing::quick() ? 32768 : 131072;
  expect_chunk_gives_decode_bits(make_hybrid_config("f16-long", 2, 2, 16, 2, 128, 64, len), len, len - 512,
                                 {.max_sequences = 1, .context = len, .attention = AttentionNumeric::kF16}, 79);
}

// Under the f16 numeric with a window of one row, a chunk across position
// 2048 holds, on the sliding layer, a tile of queries that spans two
// splits while each of its queries sees one (the call has no workspace);
// every query gets the bits of its one-token decode.
TEST(CudaF16, TileAcrossASplitOfOneSplitQueriesGivesDecodeBits) {
  KVRING_SKIP_WITHOUT_GPU();
  expect_chunk_gives_decode_bits(make_hybrid_config("f16-w1", 2, 2, 16, 2, 128, 1, 2304), 2100, 2001,
                                 {.max_sequences = 1, .context = 2304, .attention = AttentionNumeric::kF16}, 81);
}

// A decode batch is one attention launch per layer, whatever its size.
// Adds a sequence to `store` for each of `seqs` and stores each whole, as
// one prefill step of device views; their ids.
std::vector<SeqId> add_and_prefill(KvStore& store, const std::vector<SeqInputs>& seqs) {
  std::vector<SeqId> ids;
  std::vector<testing::Step> plan(1);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    ids.push_back(*store.add_sequence());
    plan[0].chunks.emplace_back(static_cast<int>(i), seqs[i].len);
  }
  Outputs o;
  testing::run_plan(store, ids, seqs, plan, o, true);
  return ids;
}

TEST(CudaBatch, DecodeOfManySequencesIsOneLaunch) {
  KVRING_SKIP_WITHOUT_GPU();
  const Case cs = cases()[0];
  const int n = testing::quick() ? 4 : 12;
  cuda::AttendStats stats;
  cuda::LaunchPolicy policy = last_arrival_only();
  policy.stats = &stats;
  auto store = testing::new_cuda_store(cs.config, {.max_sequences = n, .context = 1024, .block_rows = 16}, policy);
  ASSERT_TRUE(store);
  const auto seqs = inputs(cs.config, 9, n, testing::quick() ? 300 : 600);
  const std::vector<SeqId> ids = add_and_prefill(*store, seqs);
  const cuda::AttendStats before = stats;
  std::vector<SeqQuery> queries;
  for (int i = 0; i < n; ++i) queries.push_back({ids[static_cast<std::size_t>(i)], seqs[static_cast<std::size_t>(i)].len - 1});
  const std::int64_t width = cs.config.n_heads * cs.config.head_dim;
  testing::DeviceArray<float> q(testing::random_floats(static_cast<std::size_t>(n * width), 3)), out(static_cast<std::size_t>(n * width));
  for (std::int64_t l = 0; l < cs.config.n_layers; ++l)
    ASSERT_TRUE(store->attend_decode(l, queries, testing::device_in(q.get(), n, width), device_view(out.get(), n, width)).ok());
  ASSERT_TRUE(store->synchronize().ok());
  // Sliding layers see 48 rows (one split, no combine); each full layer's
  // decode of all the sequences is one last-arrival launch.
  EXPECT_EQ(stats.last_arrival - before.last_arrival, cs.config.n_layers / 2);
}

// A decode of up to kAttendInlineItems sequences carries its items in the
// launch's parameters, a larger one uploads them, and so does every batch
// under a policy that turns the former off; either way each query's bits
// are those of its decode alone (its one item in the parameters), on the
// CTA kernel, the warp-split kernel (sliding layers of the tensor-core
// geometry) and the general kernel.
TEST(CudaBatch, ItemsInTheLaunchOrUploadedGiveTheSoloBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const int n = cuda::kAttendInlineItems + 5;
  const int head = cuda::kAttendInlineItems;
  for (const Case& cs : {cases()[0], cases()[2]}) {
    for (const bool in_launch : {true, false}) {
      SCOPED_TRACE(cs.config.name + (in_launch ? ", items in the launch" : ", items uploaded"));
      cuda::AttendStats stats;
      cuda::LaunchPolicy policy = cuda::device_launch_policy();
      policy.inline_items = in_launch;
      policy.stats = &stats;
      auto store = testing::new_cuda_store(cs.config, {.max_sequences = n, .context = 1024, .block_rows = cs.block_rows},
                                           policy);
      ASSERT_TRUE(store);
      const auto seqs = inputs(cs.config, 23, n, testing::quick() ? 300 : 600);
      const std::vector<SeqId> ids = add_and_prefill(*store, seqs);
      const std::int64_t width = cs.config.n_heads * cs.config.head_dim;
      testing::DeviceArray<float> q(testing::random_floats(static_cast<std::size_t>(n * width), 5));
      testing::DeviceArray<float> all(static_cast<std::size_t>(n * width)), first(static_cast<std::size_t>(head * width)),
          solo(static_cast<std::size_t>(n * width));
      // Queries of sequences [from, from + count), at their last rows, into
      // out from its row 0.
      auto decode = [&](std::int64_t layer, int from, int count, float* out) {
        std::vector<SeqQuery> queries;
        for (int i = from; i < from + count; ++i)
          queries.push_back({ids[static_cast<std::size_t>(i)], seqs[static_cast<std::size_t>(i)].len - 1});
        return store->attend_decode(layer, queries, testing::device_in(q.get() + from * width, count, width),
                                    device_view(out, count, width));
      };
      for (std::int64_t l = 0; l < cs.config.n_layers; ++l) {
        all.poison();
        first.poison();
        solo.poison();
        const long before = stats.inline_items;
        ASSERT_TRUE(decode(l, 0, n, all.get()).ok());
        ASSERT_TRUE(store->synchronize().ok());
        EXPECT_EQ(stats.inline_items, before) << "a launch of " << n << " items carried them";
        ASSERT_TRUE(decode(l, 0, head, first.get()).ok());
        ASSERT_TRUE(store->synchronize().ok());
        EXPECT_EQ(stats.inline_items, before + (in_launch ? 1 : 0));
        for (int i = 0; i < n; ++i) {
          ASSERT_TRUE(decode(l, i, 1, solo.get() + i * width).ok());
        }
        ASSERT_TRUE(store->synchronize().ok());
        EXPECT_EQ(stats.inline_items, before + (in_launch ? 1 : 0));
        const std::vector<float> a = all.download(), f = first.download(), one = solo.download();
        for (int i = 0; i < n; ++i) {
          const float* want = one.data() + i * width;
          ASSERT_TRUE(std::isfinite(want[0]));
          ASSERT_EQ(std::memcmp(a.data() + i * width, want, static_cast<std::size_t>(width) * 4), 0)
              << "layer " << l << " sequence " << i << ": the batch of " << n << " differs from its solo decode";
          if (i < head) {
            ASSERT_EQ(std::memcmp(f.data() + i * width, want, static_cast<std::size_t>(width) * 4), 0)
                << "layer " << l << " sequence " << i << ": the batch of " << head << " differs from its solo decode";
          }
        }
      }
      if (cs.config.head_dim == cuda::kTensorHeadDim) {
        EXPECT_GT(stats.warp_splits, 0);
      }
    }
  }
}

// A decode of one query on a full plane carries the block of each split's
// first row in its parameters, read from the host's table as it is
// enqueued (LaunchPolicy::first_blocks), outside a capture only. Its bits
// are those of the same decode reading every block from the table on the
// device: over sequences whose blocks interleave in the pool, and over a
// fork whose last block, shared with its source, was copied on write and
// holds the first row of the fork's last split. A decode captured into a
// graph carries none, and its replays give the uncaptured bits.
TEST(CudaBatch, ADecodeCarriesItsSplitsFirstBlocksWithTheTablesBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const Case cs = cases()[0];  // head_dim 128, blocks of 16 rows
  const ModelConfig& c = cs.config;
  const std::int64_t width = c.n_heads * c.head_dim;
  // The source holds rows [0, 643); the fork stores row 643, in the block
  // of rows [640, 656) where its last split (of 128 rows) begins.
  const std::int64_t filled = 643;
  ASSERT_EQ(cuda::attend_split_rows(filled + 1), 128);
  const std::vector<testing::SeqInputs> seqs = inputs(c, 41, 3, filled + 1);
  std::vector<testing::SeqInputs> lengths = seqs;
  lengths[0].len = filled;
  const std::vector<testing::Step> plan = testing::random_plan(lengths, 7, 64);
  const std::vector<float> qs = testing::random_floats(static_cast<std::size_t>(4 * c.n_layers * width), 9);

  struct Run {
    testing::Outputs outs;
    std::vector<std::vector<float>> solos;  // (layer, sequence) in order
    cuda::AttendStats stats;
  };
  auto run = [&](bool carried, Run& r) {
    cuda::LaunchPolicy policy = cuda::device_launch_policy();
    policy.first_blocks = carried;
    policy.stats = &r.stats;
    auto store = testing::new_cuda_store(c, {.max_sequences = 4, .context = 1024, .block_rows = cs.block_rows}, policy);
    ASSERT_TRUE(store);
    std::vector<SeqId> ids;
    for (int i = 0; i < 3; ++i) ids.push_back(*store->add_sequence());
    testing::run_plan(*store, ids, seqs, plan, r.outs, true);
    const auto fork = store->fork_sequence(ids[0]);
    ASSERT_TRUE(fork.ok()) << fork.error().to_string();
    std::vector<std::int64_t> at = {filled};
    testing::Outputs fork_outs;
    testing::run_plan(*store, {*fork}, {seqs[0]}, {{true, {{0, 1}}}}, fork_outs, true, nullptr, &at);
    for (std::int64_t l = 0; l < c.n_layers; ++l) r.outs[{3, l, filled}] = fork_outs.at({0, l, filled});
    // Each sequence and the fork at its last row, alone.
    const std::vector<SeqQuery> queries = {{ids[0], filled - 1}, {ids[1], seqs[1].len - 1}, {ids[2], seqs[2].len - 1},
                                           {*fork, filled}};
    testing::DeviceArray<float> q(qs), out(static_cast<std::size_t>(width));
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      for (std::size_t i = 0; i < queries.size(); ++i) {
        out.poison();
        const float* qi = q.get() + (l * 4 + static_cast<std::int64_t>(i)) * width;
        ASSERT_TRUE(store->attend_decode(l, std::span(&queries[i], 1), testing::device_in(qi, 1, width),
                                         device_view(out.get(), 1, width)).ok());
        ASSERT_TRUE(store->synchronize().ok());
        r.solos.push_back(out.download());
      }
    if (!carried) return;
    // The fork's decode on a full layer, captured: no launch carries blocks,
    // and each replay gives the bits of the decode enqueued directly.
    std::int64_t full = 0;
    while (store->layout(full) == Layout::kTokenMajor) ++full;
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const long before = r.stats.first_blocks;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    out.poison();
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    const Status captured = store->attend_decode(full, std::span(&queries[3], 1),
                                                 testing::device_in(q.get() + (full * 4 + 3) * width, 1, width),
                                                 device_view(out.get(), 1, width), stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(captured.ok()) << captured.to_string();
    EXPECT_EQ(r.stats.first_blocks, before) << "a captured decode carried its blocks";
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    const std::vector<float>& direct = r.solos[static_cast<std::size_t>(full * 4 + 3)];
    for (int replay = 0; replay < 2; ++replay) {
      out.poison();
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_TRUE(same_bits(out.download(), direct)) << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  };
  Run carried, read;
  run(true, carried);
  run(false, read);
  EXPECT_GT(carried.stats.first_blocks, 0);
  EXPECT_EQ(read.stats.first_blocks, 0);
  ASSERT_EQ(carried.outs.size(), read.outs.size());
  for (const auto& [key, o] : read.outs) {
    ASSERT_TRUE(std::isfinite(o[0]));
    EXPECT_TRUE(same_bits(carried.outs.at(key), o))
        << "sequence " << std::get<0>(key) << " layer " << std::get<1>(key) << " position " << std::get<2>(key);
  }
  ASSERT_EQ(carried.solos.size(), read.solos.size());
  for (std::size_t i = 0; i < read.solos.size(); ++i) {
    ASSERT_TRUE(std::isfinite(read.solos[i][0]));
    EXPECT_TRUE(same_bits(carried.solos[i], read.solos[i])) << "layer " << i / 4 << ", decode " << i % 4;
  }
}

// Decode steps (each layer's one-token store, then its decode) enqueued
// back to back with no wait between them, then a step captured in a CUDA
// graph and replayed, give the bits of the same steps run with a wait after
// every call, with the store and attention kernels launched as
// programmatic dependents (the device's policy) and without: each kernel
// waits for the one before it, in a stream and in a graph. The same steps
// as one-token prefills (one launch that stores the row as it attends; on
// the CTA kernels and, for head_dim 128, the warp-split kernel) give the
// same bits and bytes, through new blocks and ring wraps. Those bits are
// the CPU backend's within kTolerance, and the stored bytes its own.
// Resident decodes captured into CUDA graphs take their epochs from the
// clock on the device, a new one at every replay: two graphs (a decode of
// each of two sequences) replayed in turn across the wrap of the epoch,
// and with it the switch to the other half of the tagged words, give the
// bits of the same decodes uncaptured at every replay; none reads the
// partials an earlier launch left.
TEST(CudaBatch, CapturedResidentDecodesReplayAcrossTheEpochWrap) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("tc-long", 2, 2, 16, 2, 128, 64, 8192);
  const std::int64_t layer = 1, kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  ASSERT_EQ(c.kind(layer), LayerKind::kFullNope);
  const std::vector<SeqInputs> seqs = {testing::seq_inputs(c, 5000, 71), testing::seq_inputs(c, 3001, 72)};
  cuda::AttendStats stats;
  cuda::LaunchPolicy policy = cuda::device_launch_policy();
  policy.first_epoch = 0xfffffffeu;  // the uncaptured decodes take the last two epochs
  policy.stats = &stats;
  const std::int64_t ctas = cuda::attend_splits(5000) * cuda::attend_grid(16, 2, 128).items;
  if (policy.hd128_resident < ctas) GTEST_SKIP() << "this device holds no resident grid of " << ctas << " CTAs";
  auto store = testing::new_cuda_store(c, {.max_sequences = 2, .context = 8192, .block_rows = 256}, policy);
  ASSERT_TRUE(store);
  auto* cuda_store = dynamic_cast<CudaStore*>(store.get());
  ASSERT_NE(cuda_store, nullptr);
  const cudaStream_t stream = cuda_store->stream();
  std::vector<SeqId> ids;
  std::vector<std::unique_ptr<testing::DeviceArray<float>>> q, out;
  for (const SeqInputs& s : seqs) {
    ids.push_back(*store->add_sequence());
    const SeqSpan span{ids.back(), 0, s.len};
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      ASSERT_TRUE(store->store(l, std::span(&span, 1), testing::host_in(s.k.data() + l * s.len * kv, s.len, kv),
                               testing::host_in(s.v.data() + l * s.len * kv, s.len, kv)).ok());
    const float* last = s.q.data() + (layer * s.len + s.len - 1) * width;
    q.push_back(std::make_unique<testing::DeviceArray<float>>(std::vector<float>(last, last + width)));
    out.push_back(std::make_unique<testing::DeviceArray<float>>(static_cast<std::size_t>(width)));
  }
  auto decode = [&](std::size_t i) {
    const SeqQuery query{ids[i], seqs[i].len - 1};
    const Status st = store->attend_decode(layer, std::span(&query, 1), testing::device_in(q[i]->get(), 1, width),
                                           device_view(out[i]->get(), 1, width));
    ASSERT_TRUE(st.ok()) << st.to_string();
  };
  std::vector<std::vector<float>> want;
  for (std::size_t i = 0; i < 2; ++i) {
    decode(i);
    ASSERT_TRUE(store->synchronize().ok());
    want.push_back(out[i]->download());
  }
  std::vector<cudaGraphExec_t> graphs;
  for (std::size_t i = 0; i < 2; ++i) {
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    decode(i);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    graphs.push_back(exec);
  }
  // Every decode, the captured ones too, was a resident grid.
  EXPECT_EQ(stats.resident, 4);
  EXPECT_EQ(stats.last_arrival + stats.cluster, 0);
  for (int replay = 0; replay < 6; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    for (std::size_t i = 0; i < 2; ++i) {
      ASSERT_EQ(cudaMemsetAsync(out[i]->get(), 0xff, static_cast<std::size_t>(width) * sizeof(float), stream),
                cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(graphs[i], stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      ASSERT_TRUE(same_bits(out[i]->download(), want[i])) << "sequence " << i;
    }
  }
  for (cudaGraphExec_t g : graphs) cudaGraphExecDestroy(g);
}

// A one-sequence CUDA store under `policy` whose sequence `g` holds
// `filled` rows of every layer (k0, v0: layer after layer); null on failure.
std::unique_ptr<KvStore> filled_store(const ModelConfig& c, const StoreOptions& o, const cuda::LaunchPolicy& policy,
                                      const std::vector<float>& k0, const std::vector<float>& v0,
                                      std::int64_t filled, SeqId& g) {
  auto gpu = testing::new_cuda_store(c, o, policy);
  if (!gpu) return nullptr;
  g = *gpu->add_sequence();
  const SeqSpan fill{g, 0, filled};
  const std::int64_t rows = c.n_layers * filled;
  const Status st = gpu->store_all_layers(std::span(&fill, 1), host_view(k0.data(), rows, c.kv_dim()),
                                          host_view(v0.data(), rows, c.kv_dim()));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return st.ok() ? std::move(gpu) : nullptr;
}

// A one-token prefill is one launch that stores its row while it attends
// only where its queries and outputs are device memory; with host views it
// attends, then stores, since a host output's staging comes after the
// attention and a failure there must find the row not yet stored. Both
// ways give the same outputs and stored bytes.
TEST(CudaBatch, OneTokenPrefillsWithHostQueriesAttendThenStore) {
  KVRING_SKIP_WITHOUT_GPU();
  const Case cs = cases().front();
  const ModelConfig& c = cs.config;
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, L = c.n_layers, filled = 200;
  const StoreOptions o{.max_sequences = 1, .context = 1024, .block_rows = cs.block_rows};
  const auto k0 = testing::random_floats(static_cast<std::size_t>(L * filled * kv), 81);
  const auto v0 = testing::random_floats(k0.size(), 82);
  const auto k = testing::random_floats(static_cast<std::size_t>(L * kv), 83);
  const auto v = testing::random_floats(k.size(), 84);
  const auto q = testing::random_floats(static_cast<std::size_t>(L * width), 85);
  auto run = [&](bool host, std::vector<float>& outs, testing::SeqImage& image, long& own) {
    cuda::AttendStats stats;
    cuda::LaunchPolicy policy = cuda::device_launch_policy();
    policy.stats = &stats;
    SeqId g;
    auto gpu = filled_store(c, o, policy, k0, v0, filled, g);
    ASSERT_TRUE(gpu);
    testing::DeviceArray<float> dk(k), dv(v), dq(q), dout(q.size());
    dout.poison();
    outs.assign(q.size(), 0.0f);
    for (std::int64_t l = 0; l < L; ++l) {
      const SeqSpan span{g, filled, 1};
      const ConstView kr = testing::device_in(dk.get() + l * kv, 1, kv);
      const ConstView vr = testing::device_in(dv.get() + l * kv, 1, kv);
      const Status st =
          host ? gpu->prefill(l, std::span(&span, 1), kr, vr, host_view(q.data() + l * width, 1, width),
                              host_view(outs.data() + l * width, 1, width))
               : gpu->prefill(l, std::span(&span, 1), kr, vr, testing::device_in(dq.get() + l * width, 1, width),
                              device_view(dout.get() + l * width, 1, width));
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    ASSERT_TRUE(gpu->synchronize().ok());
    if (!host) outs = dout.download();
    image = testing::seq_image(*gpu, g);
    own = stats.own_rows;
  };
  std::vector<float> dev_out, host_out;
  testing::SeqImage dev_image, host_image;
  long dev_own = -1, host_own = -1;
  run(false, dev_out, dev_image, dev_own);
  run(true, host_out, host_image, host_own);
  EXPECT_EQ(dev_own, L);
  EXPECT_EQ(host_own, 0);
  EXPECT_TRUE(same_bits(host_out, dev_out));
  EXPECT_TRUE(host_image == dev_image) << "stored bytes";
}

TEST(CudaBatch, ChainedAndCapturedStepsGiveTheSteppedBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::int64_t filled = 300, steps = 6, tokens = steps + 1;  // the last token is the captured step's
  for (const Case& cs : cases()) {
    SCOPED_TRACE(cs.config.name);
    const ModelConfig& c = cs.config;
    const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, L = c.n_layers;
    // Device queries and outputs are 16-byte rows: each (step, layer) row
    // of q and out starts a multiple of 4 floats in, and its view's row
    // stride says so.
    const std::int64_t stride = (width + 3) / 4 * 4;
    const StoreOptions o{.max_sequences = 1, .context = 1024, .block_rows = cs.block_rows};
    const auto k0 = testing::random_floats(static_cast<std::size_t>(L * filled * kv), 61);
    const auto v0 = testing::random_floats(k0.size(), 62);
    const auto k = testing::random_floats(static_cast<std::size_t>(tokens * L * kv), 63);
    const auto v = testing::random_floats(k.size(), 64);
    const auto q = testing::random_floats(static_cast<std::size_t>(tokens * L * stride), 65);
    auto row = [&](std::int64_t t, std::int64_t l) { return t * L + l; };
    // The outputs of every step and the stored bytes, on the GPU: `chained`,
    // steps enqueued back to back and the last captured in a graph and
    // replayed twice; else a wait after every call and no graph.
    cuda::AttendStats stats;
    auto run = [&](bool programmatic, bool chained, bool prefill, bool warp_splits, std::vector<float>& outs,
                   testing::SeqImage& image) {
      cuda::LaunchPolicy policy = cuda::device_launch_policy();
      policy.programmatic = policy.programmatic && programmatic;
      if (warp_splits) policy.warp_splits = cuda::WarpSplits::kAlways;
      policy.stats = &stats;
      SeqId g;
      auto gpu = filled_store(c, o, policy, k0, v0, filled, g);
      ASSERT_TRUE(gpu);
      testing::DeviceArray<float> dk(k), dv(v), dq(q), dout(q.size());
      dout.poison();
      auto wait = [&] {
        if (!chained) {
          ASSERT_TRUE(gpu->synchronize().ok());
        }
      };
      auto step = [&](std::int64_t t) {
        for (std::int64_t l = 0; l < L; ++l) {
          const SeqSpan span{g, filled + t, 1};
          const SeqQuery query{g, filled + t};
          const ConstView kr = testing::device_in(dk.get() + row(t, l) * kv, 1, kv);
          const ConstView vr = testing::device_in(dv.get() + row(t, l) * kv, 1, kv);
          ConstView qv = testing::device_in(dq.get() + row(t, l) * stride, 1, width);
          MutView ov = device_view(dout.get() + row(t, l) * stride, 1, width);
          qv.row_stride = ov.row_stride = stride;
          if (prefill) {
            const Status st = gpu->prefill(l, std::span(&span, 1), kr, vr, qv, ov);
            ASSERT_TRUE(st.ok()) << st.to_string();
            wait();
            continue;
          }
          ASSERT_TRUE(gpu->store(l, std::span(&span, 1), kr, vr).ok());
          wait();
          const Status st = gpu->attend_decode(l, std::span(&query, 1), qv, ov);
          ASSERT_TRUE(st.ok()) << st.to_string();
          wait();
        }
      };
      for (std::int64_t t = 0; t < steps; ++t) step(t);
      if (!chained) {
        step(steps);
      } else {
        auto* cuda_store = dynamic_cast<CudaStore*>(gpu.get());
        ASSERT_NE(cuda_store, nullptr);
        const cudaStream_t stream = cuda_store->stream();
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
        step(steps);
        cudaGraph_t graph = nullptr;
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        cudaGraphExec_t exec = nullptr;
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        // A replay stores the same token again and decodes the same rows;
        // the outputs are poisoned before each.
        for (int replay = 0; replay < 2; ++replay) {
          ASSERT_EQ(cudaMemsetAsync(dout.get() + row(steps, 0) * stride, 0xff,
                                    static_cast<std::size_t>(L * stride) * sizeof(float), stream),
                    cudaSuccess);
          ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        }
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
      ASSERT_TRUE(gpu->synchronize().ok());
      outs = dout.download();
      image = testing::seq_image(*gpu, g);
    };
    std::vector<float> want;
    testing::SeqImage want_image;
    run(false, false, false, false, want, want_image);
    EXPECT_EQ(stats.own_rows, 0);
    struct Way {
      bool programmatic, chained, prefill, warp_splits;
      const char* name;
    };
    std::vector<Way> ways = {{true, true, false, false, "programmatic"},
                             {false, true, false, false, "plain"},
                             {false, false, true, false, "prefills, waits"},
                             {true, true, true, false, "prefills, programmatic"},
                             {false, true, true, false, "prefills, plain"}};
    if (c.head_dim == 128) ways.push_back({true, true, true, true, "prefills, warp splits"});
    for (const Way& w : ways) {
      SCOPED_TRACE(w.name);
      std::vector<float> got;
      testing::SeqImage image;
      const long own_before = stats.own_rows;
      run(w.programmatic, w.chained, w.prefill, w.warp_splits, got, image);
      // Each one-token prefill was one launch that stored its row (a
      // replay of the graph launches no call).
      EXPECT_EQ(stats.own_rows - own_before, w.prefill ? tokens * L : 0);
      ASSERT_TRUE(same_bits(got, want));
      EXPECT_TRUE(image == want_image) << "stored bytes";
    }
    // The CPU backend on the same steps.
    auto cpu = testing::new_store(BackendKind::kCpu, c, o);
    ASSERT_TRUE(cpu);
    const SeqId h = *cpu->add_sequence();
    const SeqSpan fill{h, 0, filled};
    ASSERT_TRUE(cpu->store_all_layers(std::span(&fill, 1), host_view(k0.data(), L * filled, kv),
                                      host_view(v0.data(), L * filled, kv)).ok());
    std::vector<float> ref(q.size());
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t l = 0; l < L; ++l) {
        const SeqSpan span{h, filled + t, 1};
        const SeqQuery query{h, filled + t};
        ASSERT_TRUE(cpu->store(l, std::span(&span, 1), host_view(k.data() + row(t, l) * kv, 1, kv),
                               host_view(v.data() + row(t, l) * kv, 1, kv)).ok());
        ASSERT_TRUE(cpu->attend_decode(l, std::span(&query, 1), host_view(q.data() + row(t, l) * stride, 1, width),
                                       host_view(ref.data() + row(t, l) * stride, 1, width)).ok());
      }
    double worst = 0;
    for (std::int64_t r = 0; r < tokens * L; ++r)
      for (std::int64_t e = r * stride; e < r * stride + width; ++e) {
        const auto x = static_cast<std::size_t>(e);
        ASSERT_TRUE(std::isfinite(want[x])) << e;
        worst = std::max(worst, std::abs(double(want[x]) - ref[x]) / std::max(1.0, std::abs(double(ref[x]))));
      }
    EXPECT_LE(worst, kTolerance);
    EXPECT_TRUE(want_image == testing::seq_image(*cpu, h)) << "stored bytes differ from the CPU backend's";
  }
}

// A decode step of several sequences written as one-token prefills (one
// call a layer, every chunk one row) from device K/V of each dtype, in
// rows 16-byte aligned and not: the outputs and stored bytes of a store,
// then a decode, of the same rows, bit for bit, for sequences whose rings
// wrap, fill exactly or hold one row, and whose full planes open a new
// block; each call is one launch that stores its rows.
TEST(CudaBatch, OneTokenPrefillsOfManySequencesAndEveryDtype) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const Case& cs : {cases()[0], cases()[3]}) {
    SCOPED_TRACE(cs.config.name);
    const ModelConfig& c = cs.config;
    const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, L = c.n_layers;
    const std::int64_t ws = (width + 3) / 4 * 4, steps = 3;
    // Rows before the steps: past a ring wrap, a full window, one less
    // than a block, one row.
    const std::vector<std::int64_t> lens = {300, c.sliding_window, cs.block_rows - 1, 1};
    const std::int64_t n = static_cast<std::int64_t>(lens.size());
    const StoreOptions o{.max_sequences = n, .context = 1024, .block_rows = cs.block_rows};
    const auto q = testing::random_floats(static_cast<std::size_t>(steps * L * n * ws), 71);
    testing::DeviceArray<float> dq(q);
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16})
      for (const std::int64_t pad : {std::int64_t{0}, std::int64_t{1}}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + (pad ? ", unaligned rows" : ""));
        // Step t, layer l: rows [(t * L + l) * n, + n) of the sources.
        const std::int64_t stride = kv + pad, rows = steps * L * n;
        const auto f = testing::random_floats(static_cast<std::size_t>(2 * rows * stride), 72, 3.0f);
        std::vector<std::uint16_t> bits(f.size());
        for (std::size_t i = 0; i < f.size(); ++i) {
          std::uint32_t u;
          std::memcpy(&u, &f[i], 4);
          bits[i] = dt == DType::kF16 ? f32_to_f16(f[i]) : static_cast<std::uint16_t>(u >> 16);
        }
        const std::size_t bytes = f.size() * static_cast<std::size_t>(dtype_bytes(dt));
        void* src = nullptr;
        ASSERT_EQ(cudaMalloc(&src, bytes), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(src, dt == DType::kF32 ? static_cast<const void*>(f.data()) : bits.data(), bytes,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copy has landed (DeviceArray)
        const std::int64_t esize = dtype_bytes(dt);
        auto view = [&](std::int64_t first, int which) {
          const char* base = static_cast<const char*>(src) + (which * rows + first) * stride * esize;
          return ConstView{base, MemorySpace::kDevice, dt, n, kv, stride};
        };
        std::vector<std::vector<float>> outs;
        std::vector<std::vector<testing::SeqImage>> images;
        for (const bool prefill : {true, false}) {
          cuda::AttendStats stats;
          cuda::LaunchPolicy policy = cuda::device_launch_policy();
          policy.stats = &stats;
          auto st = testing::new_cuda_store(c, o, policy);
          ASSERT_TRUE(st);
          std::vector<SeqId> ids;
          for (std::int64_t i = 0; i < n; ++i) {
            ids.push_back(*st->add_sequence());
            const std::int64_t len = lens[static_cast<std::size_t>(i)];
            const auto k0 = testing::random_floats(static_cast<std::size_t>(L * len * kv), 80 + static_cast<std::uint64_t>(i));
            const auto v0 = testing::random_floats(k0.size(), 90 + static_cast<std::uint64_t>(i));
            const SeqSpan fill{ids.back(), 0, len};
            ASSERT_TRUE(st->store_all_layers(std::span(&fill, 1), host_view(k0.data(), L * len, kv),
                                             host_view(v0.data(), L * len, kv)).ok());
          }
          testing::DeviceArray<float> dout(q.size());
          dout.poison();
          for (std::int64_t t = 0; t < steps; ++t)
            for (std::int64_t l = 0; l < L; ++l) {
              std::vector<SeqSpan> spans;
              std::vector<SeqQuery> queries;
              for (std::int64_t i = 0; i < n; ++i) {
                const std::int64_t p = lens[static_cast<std::size_t>(i)] + t;
                spans.push_back({ids[static_cast<std::size_t>(i)], p, 1});
                queries.push_back({ids[static_cast<std::size_t>(i)], p});
              }
              const std::int64_t first = (t * L + l) * n;
              const ConstView qv{dq.get() + first * ws, MemorySpace::kDevice, DType::kF32, n, width, ws};
              const MutView ov{dout.get() + first * ws, MemorySpace::kDevice, DType::kF32, n, width, ws};
              const Status done = prefill ? st->prefill(l, spans, view(first, 0), view(first, 1), qv, ov)
                                          : [&] {
                                              const Status s1 = st->store(l, spans, view(first, 0), view(first, 1));
                                              return s1.ok() ? st->attend_decode(l, queries, qv, ov) : s1;
                                            }();
              ASSERT_TRUE(done.ok()) << done.to_string();
            }
          ASSERT_TRUE(st->synchronize().ok());
          EXPECT_EQ(stats.own_rows, prefill ? steps * L : 0);
          outs.push_back(dout.download());
          images.emplace_back();
          for (const SeqId id : ids) images.back().push_back(testing::seq_image(*st, id));
        }
        cudaFree(src);
        ASSERT_TRUE(same_bits(outs[0], outs[1]));
        for (std::int64_t i = 0; i < n; ++i)
          EXPECT_TRUE(images[0][static_cast<std::size_t>(i)] == images[1][static_cast<std::size_t>(i)])
              << "stored bytes of sequence " << i;
      }
  }
}

// ---- The f16 numeric ----------------------------------------------------------

// Outputs of the f16 numeric differ from the CPU backend's f16 numeric by
// the order of f32 sums (and the weights' f16 rounding where a weight lies
// at a rounding boundary).
constexpr double kF16Tolerance = 1e-3;

// The f16 numeric refuses geometries its kernel does not take, by name.
TEST(CudaF16, RefusesHeadDimsOtherThan128) {
  KVRING_SKIP_WITHOUT_GPU();
  const auto r = make_store(BackendKind::kCuda, make_hybrid_config("hd64", 2, 2, 8, 2, 64, 33, 4096),
                            {.attention = AttentionNumeric::kF16});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(r.error().message.find("head_dim 128"), std::string::npos) << r.error().message;
}

// Scores past |m c| of about 2^24 (docs/DESIGN.md, "Attention numerics"):
// the row whose score is the maximum keeps its whole weight, in the decode
// and the prefill kernels alike, rather than the rounding of m c making
// its f16 weight overflow or vanish (a NaN output).
TEST(CudaF16, HugeScoresKeepTheMaximumWeight) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("f16-huge", 1, 1, 8, 1, 128, 0, 64);
  const std::int64_t hd = c.head_dim, width = c.n_heads * hd, n = 3;
  std::vector<float> k(static_cast<std::size_t>(n * hd), 0.5f), v(k.size());
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t d = 0; d < hd; ++d) v[static_cast<std::size_t>(j * hd + d)] = 0.25f * static_cast<float>(j + 1);
  // Row 1 takes all the weight: half its dimensions and the queries' are
  // large (Attention.F16NumericHugeScoresKeepTheMaximumWeight's head_dim 128
  // case, where m c is about 2^33).
  for (std::int64_t d = 0; d < hd / 2; ++d) k[static_cast<std::size_t>(hd + d)] = 32752.0f;
  for (const float big : {32752.0f, 1e30f}) {
    SCOPED_TRACE("query element " + std::to_string(big));
    std::vector<float> q(static_cast<std::size_t>(n * width), 0.5f);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t h = 0; h < c.n_heads; ++h)
        for (std::int64_t d = 0; d < hd / 2; ++d) q[static_cast<std::size_t>(r * width + h * hd + d)] = big;
    for (const bool decode : {true, false}) {
      SCOPED_TRACE(decode ? "decode" : "prefill");
      auto store = testing::new_store(BackendKind::kCuda, c,
                                      {.max_sequences = 1, .context = 64, .attention = AttentionNumeric::kF16});
      ASSERT_TRUE(store);
      const SeqId seq = *store->add_sequence();
      std::vector<float> out(static_cast<std::size_t>(n * width), NAN);
      const SeqSpan all{seq, 0, n};
      if (decode) {
        ASSERT_TRUE(store->store(0, {&all, 1}, testing::host_in(k.data(), n, hd), testing::host_in(v.data(), n, hd)).ok());
        const SeqQuery last{seq, n - 1};
        ASSERT_TRUE(store->attend_decode(0, {&last, 1}, testing::host_in(q.data() + (n - 1) * width, 1, width),
                                         host_view(out.data() + (n - 1) * width, 1, width)).ok());
      } else {
        ASSERT_TRUE(store->prefill(0, {&all, 1}, testing::host_in(k.data(), n, hd), testing::host_in(v.data(), n, hd),
                                   testing::host_in(q.data(), n, width), host_view(out.data(), n, width)).ok());
        // Row 1 sees rows 0 and 1, row 1 the maximum.
        for (std::int64_t i = width; i < 2 * width; ++i) EXPECT_EQ(out[static_cast<std::size_t>(i)], 0.5f) << i;
      }
      for (std::int64_t i = (n - 1) * width; i < n * width; ++i) EXPECT_EQ(out[static_cast<std::size_t>(i)], 0.5f) << i;
    }
  }
}

// Sequences in random batches and chunks (device views, churned slots and
// blocks) give the bits of their solo token-by-token decodes (97-token
// chunks under a sanitizer), across two splits and many wraps of a 300-row
// ring; outputs agree with the CPU backend's f16 numeric, past the splits
// too.
TEST(CudaF16, BitsNeverDependOnTheBatchAndAgreeWithTheCpu) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("f16-gqa8", 2, 2, 16, 2, 128, 300, 4608);
  const bool quick = testing::quick();
  const std::int64_t longest = 2 * kF16AttendSplitRows + (quick ? 70 : 400);
  std::mt19937_64 rng(31);
  std::vector<SeqInputs> seqs = {testing::seq_inputs(c, longest, 91)};
  for (int i = 0; i < (quick ? 2 : 4); ++i)
    seqs.push_back(testing::seq_inputs(c, 1 + static_cast<std::int64_t>(rng() % 500), 92 + static_cast<std::uint64_t>(i)));
  const int n = static_cast<int>(seqs.size());
  const StoreOptions o{.max_sequences = n + 3, .context = 4608, .block_rows = 16,
                       .attention = AttentionNumeric::kF16};
  Outputs solo;
  for (int i = 0; i < n; ++i) {
    StoreOptions one = o;
    one.max_sequences = 1;
    auto store = testing::new_store(BackendKind::kCuda, c, one);
    ASSERT_TRUE(store);
    const std::vector<SeqId> ids = {*store->add_sequence()};
    std::vector<testing::Step> plan;
    for (std::int64_t p = 0, len = seqs[static_cast<std::size_t>(i)].len; p < len;) {
      const std::int64_t n = quick ? std::min<std::int64_t>(97, len - p) : 1;
      plan.push_back({n == 1, {{0, n}}});
      p += n;
    }
    Outputs out;
    testing::run_plan(*store, ids, {seqs[static_cast<std::size_t>(i)]}, plan, out);
    for (auto& [key, val] : out) solo[{i, std::get<1>(key), std::get<2>(key)}] = val;
  }
  // The batch under either kernel (copies one or two tiles ahead) gives
  // the solo decodes' bits, whichever kernel the rule gave those.
  Outputs batched;
  for (const int stages : {2, 3}) {
    SCOPED_TRACE("the kernel of " + std::to_string(stages) + " stages");
    cuda::LaunchPolicy policy = cuda::device_launch_policy();
    policy.f16_stages = stages;
    auto gpu = testing::new_cuda_store(c, o, policy);
    ASSERT_TRUE(gpu);
    const auto ids = testing::add_with_churn(*gpu, n, 33);
    batched.clear();
    testing::run_plan(*gpu, ids, seqs, testing::random_plan(seqs, 35, 600), batched, true);
    ASSERT_EQ(batched.size(), solo.size());
    for (const auto& [key, val] : batched) {
      for (const float x : val) ASSERT_TRUE(std::isfinite(x));
      ASSERT_TRUE(same_bits(val, solo.at(key)))
          << "sequence " << std::get<0>(key) << " layer " << std::get<1>(key) << " position "
          << std::get<2>(key) << " differs from its solo decode";
    }
  }

  // The CPU backend: the short sequences whole, and the long one's last
  // 8 positions (its rows before them stored without attention).
  auto cpu = testing::new_store(BackendKind::kCpu, c, o);
  ASSERT_TRUE(cpu);
  std::vector<SeqInputs> short_seqs(seqs.begin() + 1, seqs.end());
  std::vector<SeqId> cids;
  for (int i = 1; i < n; ++i) cids.push_back(*cpu->add_sequence());
  Outputs c_short;
  testing::run_plan(*cpu, cids, short_seqs, testing::random_plan(short_seqs, 37, 100), c_short);
  const SeqId long_id = *cpu->add_sequence();
  const std::int64_t kv = c.kv_dim(), before = longest - 8;
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const SeqSpan span{long_id, 0, before};
    ASSERT_TRUE(cpu->store(l, std::span(&span, 1), testing::host_in(seqs[0].k.data() + l * longest * kv, before, kv),
                           testing::host_in(seqs[0].v.data() + l * longest * kv, before, kv)).ok());
  }
  Outputs c_long;
  std::vector<std::int64_t> at = {before};
  testing::run_plan(*cpu, {long_id}, {seqs[0]}, {{false, {{0, 8}}}}, c_long, false, nullptr, &at);
  double worst = 0;
  std::size_t compared = 0;
  auto compare = [&](const std::vector<float>& got, const std::vector<float>& ref) {
    for (std::size_t e = 0; e < ref.size(); ++e)
      worst = std::max(worst, std::abs(double(got[e]) - ref[e]) / std::max(1.0, std::abs(double(ref[e]))));
    ++compared;
  };
  for (const auto& [key, ref] : c_short) compare(batched.at({std::get<0>(key) + 1, std::get<1>(key), std::get<2>(key)}), ref);
  for (const auto& [key, ref] : c_long) compare(batched.at({0, std::get<1>(key), std::get<2>(key)}), ref);
  EXPECT_EQ(compared, c_short.size() + 8 * static_cast<std::size_t>(c.n_layers));
  EXPECT_LE(worst, kF16Tolerance);
  std::printf("  f16 numeric: CUDA vs CPU worst %.2e over %zu outputs\n", worst, compared);
}

// ---- Attention sinks (KvStore::set_attention_sinks) ----

// A decode captured into a CUDA graph while its layer has sinks reads the
// device's sinks when it runs: replayed after new sinks are set, it gives
// the bits of a decode with them; after they are removed, the bits of a
// decode without sinks.
TEST(CudaSinks, ACapturedDecodeReadsTheSinksWhenItRuns) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = cases().front().config;
  const std::int64_t layer = 1, len = 600, kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const SeqInputs in = testing::seq_inputs(c, len, 61);
  auto store = testing::new_store(BackendKind::kCuda, c, {.max_sequences = 1, .context = 1024, .block_rows = 16});
  ASSERT_TRUE(store);
  auto* cuda_store = dynamic_cast<CudaStore*>(store.get());
  ASSERT_NE(cuda_store, nullptr);
  const SeqId id = *store->add_sequence();
  const SeqSpan span{id, 0, len};
  ASSERT_TRUE(store->store(layer, std::span(&span, 1), testing::host_in(in.k.data() + layer * len * kv, len, kv),
                           testing::host_in(in.v.data() + layer * len * kv, len, kv)).ok());
  const float* last = in.q.data() + (layer * len + len - 1) * width;
  testing::DeviceArray<float> q(std::vector<float>(last, last + width)), out(static_cast<std::size_t>(width));
  auto decode = [&]() {
    const SeqQuery query{id, len - 1};
    const Status st = store->attend_decode(layer, std::span(&query, 1), testing::device_in(q.get(), 1, width),
                                           device_view(out.get(), 1, width));
    ASSERT_TRUE(st.ok()) << st.to_string();
  };
  auto decoded = [&]() {
    out.poison();
    decode();
    EXPECT_TRUE(store->synchronize().ok());
    return out.download();
  };
  std::vector<float> first = sinks_of(c), second = first;
  for (float& x : second) x = x < 1e30f ? x + 0.5f : x;
  ASSERT_TRUE(store->set_attention_sinks(layer, first).ok());
  const std::vector<float> with_first = decoded();
  const cudaStream_t stream = cuda_store->stream();
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  decode();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);
  auto replayed = [&]() {
    out.poison();
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return out.download();
  };
  EXPECT_TRUE(same_bits(replayed(), with_first));
  ASSERT_TRUE(store->set_attention_sinks(layer, second).ok());
  const std::vector<float> with_second = decoded();
  EXPECT_FALSE(same_bits(with_second, with_first));
  EXPECT_TRUE(same_bits(replayed(), with_second));
  ASSERT_TRUE(store->set_attention_sinks(layer, {}).ok());
  const std::vector<float> without = decoded();
  EXPECT_FALSE(same_bits(without, with_second));
  EXPECT_TRUE(same_bits(replayed(), without));
  cudaGraphExecDestroy(exec);
}

// One geometry of cases() under one numeric; the f16 numeric runs at
// head_dim 128 only. Each is a test of its own, so that a sanitizer run
// can take one.
struct SinksCase {
  std::size_t geometry;
  AttentionNumeric numeric;
};
std::vector<SinksCase> sinks_cases() {
  std::vector<SinksCase> out;
  const std::vector<Case> all = cases();
  for (std::size_t g = 0; g < all.size(); ++g)
    for (const AttentionNumeric numeric : {AttentionNumeric::kF32, AttentionNumeric::kF16})
      if (numeric == AttentionNumeric::kF32 || all[g].config.head_dim == 128) out.push_back({g, numeric});
  return out;
}
std::string sinks_case_label(const SinksCase& sc) {
  return cases()[sc.geometry].config.name + (sc.numeric == AttentionNumeric::kF16 ? "_f16" : "_f32");
}
void PrintTo(const SinksCase& sc, std::ostream* os) { *os << sinks_case_label(sc); }
std::string sinks_case_name(const ::testing::TestParamInfo<SinksCase>& info) {
  std::string name = sinks_case_label(info.param);
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

class CudaSinksEveryKernel : public ::testing::TestWithParam<SinksCase> {};

// Sinks on the GPU, for each geometry of both kernels and under both
// numerics (the f16 one at head_dim 128): a batch with sinks on every layer
// gives each sequence's solo bits and agrees with the CPU backend with the
// same sinks; a head whose sink lies far below its scores keeps the bits
// of a run without sinks, one near the largest float writes 0, and the
// other heads' outputs move.
TEST_P(CudaSinksEveryKernel, AgreesWithTheCpuBackend) {
  KVRING_SKIP_WITHOUT_GPU();
  const int n_seqs = 3;
  const Case cs = cases()[GetParam().geometry];
  const ModelConfig& c = cs.config;
  const AttentionNumeric numeric = GetParam().numeric;
  const bool f16 = numeric == AttentionNumeric::kF16;
  // Past several splits of a full layer under either numeric.
  const std::int64_t longest = f16 ? kF16AttendSplitRows + (testing::quick() ? 70 : 300)
                                   : (testing::quick() ? 300 : 700);
  const auto seqs = inputs(c, 41, n_seqs, longest);
  const auto plan = testing::random_plan(seqs, 43, 80);
  const std::vector<float> sinks = sinks_of(c);
  const StoreOptions o{.max_sequences = n_seqs + 3, .context = 4096, .block_rows = cs.block_rows,
                       .attention = numeric};
  auto run = [&](BackendKind kind, bool with_sinks, int only) {
    StoreOptions so = o;
    if (only >= 0) so.max_sequences = 1;
    auto store = testing::new_store(kind, c, so);
    Outputs out;
    EXPECT_TRUE(store);
    if (!store) return out;
    for (std::int64_t l = 0; with_sinks && l < c.n_layers; ++l) {
      EXPECT_TRUE(store->set_attention_sinks(l, sinks).ok());
    }
    if (only >= 0) {
      const std::vector<SeqInputs> one = {seqs[static_cast<std::size_t>(only)]};
      testing::run_plan(*store, {*store->add_sequence()}, one, testing::random_plan(one, 47, 64), out);
      Outputs keyed;
      for (auto& [key, val] : out) keyed[{only, std::get<1>(key), std::get<2>(key)}] = val;
      return keyed;
    }
    const auto ids = testing::add_with_churn(*store, n_seqs, 45);
    testing::run_plan(*store, ids, seqs, plan, out, kind == BackendKind::kCuda);
    return out;
  };
  const Outputs gpu = run(BackendKind::kCuda, true, -1);
  const Outputs cpu = run(BackendKind::kCpu, true, -1);
  const Outputs plain = run(BackendKind::kCuda, false, -1);
  ASSERT_EQ(gpu.size(), cpu.size());
  ASSERT_EQ(gpu.size(), plain.size());
  for (int i = 0; i < n_seqs; ++i) {
    const Outputs solo = run(BackendKind::kCuda, true, i);
    ASSERT_FALSE(solo.empty());
    for (const auto& [key, val] : solo)
      ASSERT_TRUE(same_bits(val, gpu.at(key))) << "sequence " << i << " layer " << std::get<1>(key)
                                               << " position " << std::get<2>(key) << " differs from its solo run";
  }
  const double worst = testing::worst_difference(gpu, cpu);
  EXPECT_LE(worst, f16 ? kF16Tolerance : kTolerance);
  const std::int64_t hd = c.head_dim;
  std::size_t moved = 0, heads = 0;
  for (const auto& [key, val] : gpu) {
    const std::vector<float>& without = plain.at(key);
    for (std::int64_t h = 0; h < c.n_heads; ++h) {
      const float sink = sinks[static_cast<std::size_t>(h)];
      const float* got = val.data() + h * hd;
      const float* ref = without.data() + h * hd;
      if (sink == 3e38f) {
        for (std::int64_t e = 0; e < hd; ++e) ASSERT_EQ(got[e], 0.0f) << "head " << h;
      } else if (sink < -70.0f) {
        ASSERT_EQ(std::memcmp(got, ref, static_cast<std::size_t>(hd) * 4), 0) << "head " << h;
      } else {
        ++heads;
        if (std::memcmp(got, ref, static_cast<std::size_t>(hd) * 4) != 0) ++moved;
      }
    }
  }
  EXPECT_EQ(moved, heads) << "every head with a sink near or above its scores moves";
  std::printf("  %s %s: sinks, CUDA vs CPU worst %.2e over %zu outputs\n", c.name.c_str(), f16 ? "f16" : "f32",
              worst, gpu.size());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaSinksEveryKernel, ::testing::ValuesIn(sinks_cases()), sinks_case_name);

}  // namespace
}  // namespace kvring
