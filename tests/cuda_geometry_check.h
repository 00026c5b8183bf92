// The check of a geometry on the CUDA backend against the CPU backend that
// cuda_geometry_test.cc and cuda_unseen_test.cc share: a geometry's
// sequences through a CPU store, a CUDA store on the device's launch
// policy (host views) and one under a policy that forces other combine
// paths (device views), the random batches of cuda_test_util.h, then a
// step of one-token prefills and one of decodes of every sequence.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/launch_policy.h"
#include "cuda_test_util.h"

namespace kvring::testing {

struct Geometry {
  ModelConfig config;
  StoreOptions options;
  std::vector<std::int64_t> lengths;  // per sequence, each at least 3
  std::int64_t max_chunk;
};

// make_hybrid_config's layers (layer l full when l % full_every ==
// full_every - 1; 0: every layer slides) at context `context`.
inline Geometry geometry(std::string name, std::int64_t layers, std::int64_t full_every, std::int64_t heads,
                         std::int64_t kv_heads, std::int64_t head_dim, std::int64_t window, std::int64_t context,
                         std::int64_t block_rows, std::vector<std::int64_t> lengths, std::int64_t max_chunk,
                         std::int64_t slack = 0) {
  Geometry g{make_hybrid_config(std::move(name), layers, full_every, heads, kv_heads, head_dim, window, context),
             {}, std::move(lengths), max_chunk};
  // A few slots beyond the sequences, for add_with_churn's fillers.
  g.options = {.max_sequences = static_cast<std::int64_t>(g.lengths.size()) + 3, .context = context,
               .slack = slack, .block_rows = block_rows};
  return g;
}

// Policies for the second CUDA store, which take the paths the device's
// own policy takes least on small batches (it prefers clusters): without
// clusters, so the tensor-core kernel's launches that fit combine in
// resident grids and the rest by last arrival (warp splits never); or
// every launch of several splits by last arrival, query-major, decodes a
// warp a split on the tensor-core kernel, the f16 numeric's deep kernel.
inline cuda::LaunchPolicy resident_policy() {
  cuda::LaunchPolicy p = cuda::device_launch_policy();
  p.hd128_cluster = 1;
  p.general_cluster = 1;
  p.warp_splits = cuda::WarpSplits::kNever;
  p.f16_stages = 2;
  return p;
}
inline cuda::LaunchPolicy last_arrival_policy() {
  cuda::LaunchPolicy p = cuda::device_launch_policy();
  p.hd128_resident = 0;
  p.hd128_cluster = 1;
  p.general_cluster = 1;
  p.query_major = cuda::QueryMajor::kAlways;
  p.warp_splits = cuda::WarpSplits::kAlways;
  p.f16_stages = 3;
  return p;
}

// Seeded inputs of sequences of `lengths` positions.
inline std::vector<SeqInputs> inputs_of_lengths(const ModelConfig& c, const std::vector<std::int64_t>& lengths,
                                                std::uint64_t seed) {
  std::vector<SeqInputs> s;
  for (std::size_t i = 0; i < lengths.size(); ++i) s.push_back(seq_inputs(c, lengths[i], seed * 1000 + i));
  return s;
}

// Random batches of prefill chunks and decodes up to each sequence's last
// two tokens, then a step of one-token prefill chunks of every sequence
// (on device views, one launch that stores its rows) and a step of
// decodes of every sequence.
inline std::vector<Step> edge_plan(const std::vector<SeqInputs>& seqs, std::uint64_t seed, std::int64_t max_chunk) {
  std::vector<SeqInputs> head(seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i) head[i].len = seqs[i].len - 2;
  std::vector<Step> plan = random_plan(head, seed, max_chunk);
  for (const bool decode : {false, true}) {
    Step st;
    st.decode = decode;
    for (std::size_t i = 0; i < seqs.size(); ++i) st.chunks.emplace_back(static_cast<int>(i), 1);
    plan.push_back(st);
  }
  return plan;
}

inline bool same_bits(const Outputs& a, const Outputs& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [key, x] : a) {
    const auto it = b.find(key);
    if (it == b.end() || it->second.size() != x.size() ||
        std::memcmp(x.data(), it->second.data(), x.size() * 4) != 0)
      return false;
  }
  return true;
}

// n sequences: add_with_churn's (every plane takes its fillers' rows)
// where `churn`, else plain adds.
inline std::vector<SeqId> add_sequences(KvStore& s, int n, std::uint64_t seed, bool churn) {
  if (churn) return add_with_churn(s, n, seed);
  std::vector<SeqId> ids;
  for (int i = 0; i < n; ++i) {
    auto id = s.add_sequence();
    EXPECT_TRUE(id.ok());
    if (id.ok()) ids.push_back(*id);
  }
  return ids;
}

// The geometry's sequences through a CPU store and two CUDA stores (the
// second under `policy`, with device views): outputs within `tolerance`
// of the CPU's, the two CUDA stores' bits equal, every plane image and
// live row the CPU's.
inline void check_against_cpu(const Geometry& g, std::uint64_t seed, double tolerance,
                              const cuda::LaunchPolicy& policy, bool churn = true) {
  const ModelConfig& c = g.config;
  const int n = static_cast<int>(g.lengths.size());
  const auto seqs = inputs_of_lengths(c, g.lengths, seed);
  const auto plan = edge_plan(seqs, seed * 3, g.max_chunk);
  auto cpu = new_store(BackendKind::kCpu, c, g.options);
  auto gpu = new_store(BackendKind::kCuda, c, g.options);
  auto forced = new_cuda_store(c, g.options, policy);
  ASSERT_TRUE(cpu && gpu && forced);
  const auto cids = add_sequences(*cpu, n, seed * 5, churn);
  const auto gids = add_sequences(*gpu, n, seed * 7, churn);
  const auto fids = add_sequences(*forced, n, seed * 11, churn);
  ASSERT_EQ(static_cast<int>(cids.size()), n);
  ASSERT_EQ(static_cast<int>(gids.size()), n);
  ASSERT_EQ(static_cast<int>(fids.size()), n);
  Outputs c_out, g_out, f_out;
  run_plan(*cpu, cids, seqs, plan, c_out);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  run_plan(*gpu, gids, seqs, plan, g_out);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  run_plan(*forced, fids, seqs, plan, f_out, true);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  std::int64_t positions = 0;
  for (const std::int64_t len : g.lengths) positions += len;
  ASSERT_EQ(c_out.size(), static_cast<std::size_t>(positions * c.n_layers));
  const double worst = worst_difference(g_out, c_out);
  EXPECT_LE(worst, tolerance);
  EXPECT_TRUE(same_bits(g_out, f_out)) << "the device's policy with host views and another with device views "
                                          "give different bits";
  std::printf("  %s: CUDA vs CPU worst %.2e over %zu outputs\n", c.name.c_str(), worst, c_out.size());
  for (int i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const SeqImage image = seq_image(*cpu, cids[k]);
    EXPECT_TRUE(seq_image(*gpu, gids[k]) == image) << "sequence " << i << ": planes differ from the CPU's";
    EXPECT_TRUE(seq_image(*forced, fids[k]) == image) << "sequence " << i << ": planes differ from the CPU's";
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      const auto rows = live_rows(*cpu, cids[k], l);
      EXPECT_TRUE(live_rows(*gpu, gids[k], l) == rows) << "sequence " << i << " layer " << l;
      EXPECT_TRUE(live_rows(*forced, fids[k], l) == rows) << "sequence " << i << " layer " << l;
    }
    if (::testing::Test::HasFailure()) return;  // one sequence's report is enough
  }
}

}  // namespace kvring::testing
