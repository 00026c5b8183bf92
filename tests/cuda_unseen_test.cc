// The CUDA backend against the CPU backend where the other CUDA tests do
// not look: head dims and GQA groups on either side of the kernels'
// choices (general kernel at 1, 4, 6, 8, 127, 129, 192; the tensor-core
// kernel at groups of 7, 9 and 16), windows of 1, 2, 31, 32 and 33 rows
// and contexts below the 32-row plane minimum, decodes of one batch whose
// queries sit on either side of the split rule's boundaries (128, 2048,
// 8192 rows), outputs written over their own queries in device memory on
// every kernel and combine path, outputs interleaved with the queries in
// one device buffer, 16-bit host queries of odd strides, one-token
// device prefills of a sequence and its fork into a shared block, and
// hostile arguments (null views, host memory labelled device, overlaps,
// views past their allocation) on every entry point, which must be
// refused as the CPU backend refuses them, changing nothing and leaving
// no sticky CUDA error.
#include <gtest/gtest.h>

#include <cuda.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/allocation.h"
#include "cuda/kernels.h"
#include "cuda/launch_policy.h"
#include "cuda_geometry_check.h"
#include "cuda_mapped_pieces.h"
#include "cuda_test_util.h"
#include "kvring/f16.h"

namespace kvring {
namespace {

using testing::check_against_cpu;
using testing::DeviceArray;
using testing::edge_plan;
using testing::Geometry;
using testing::geometry;
using testing::last_arrival_policy;
using testing::Outputs;
using testing::random_floats;
using testing::resident_policy;
using testing::same_bits;
using testing::seq_image;
using testing::SeqInputs;

constexpr double kTolerance = 1e-5;
constexpr double kF16Tolerance = 1e-3;

// Last arrival in runs of 4 splits a CTA, items uploaded, no first blocks.
cuda::LaunchPolicy runs_policy() {
  cuda::LaunchPolicy p = cuda::device_launch_policy();
  p.hd128_resident = 0;
  p.hd128_cluster = 1;
  p.general_cluster = 1;
  p.warp_splits = cuda::WarpSplits::kNever;
  p.split_run = 4;
  p.inline_items = false;
  p.first_blocks = false;
  p.query_major = cuda::QueryMajor::kNever;
  return p;
}

// Like run_plan's device branch, but every attention call's out is its q
// (one device buffer, rows padded to whole float4s), or where
// `interleaved` out's rows lie between q's in one buffer (q at row 2i, out
// at row 2i + 1 of rows of ws floats).
void run_plan_in_place(KvStore& store, const std::vector<SeqId>& ids, const std::vector<SeqInputs>& seqs,
                       const std::vector<testing::Step>& plan, Outputs& outs, bool interleaved = false) {
  const ModelConfig& c = store.config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, ws0 = (width + 3) / 4 * 4;
  // Row stride of q and out: one padded row, or two where interleaved.
  const std::int64_t ws = interleaved ? 2 * ws0 : ws0;
  std::vector<std::int64_t> at(seqs.size(), 0);
  for (const testing::Step& st : plan) {
    std::int64_t rows = 0;
    for (const auto& [i, n] : st.chunks) rows += n;
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      std::vector<float> k(static_cast<std::size_t>(rows * kv)), v(k.size()), qp(static_cast<std::size_t>(rows * ws), NAN);
      std::vector<SeqSpan> spans;
      std::vector<SeqQuery> queries;
      std::int64_t r = 0;
      for (const auto& [i, n] : st.chunks) {
        const SeqInputs& s = seqs[static_cast<std::size_t>(i)];
        const std::int64_t p0 = at[static_cast<std::size_t>(i)];
        const std::size_t src = static_cast<std::size_t>((l * s.len + p0) * kv);
        std::memcpy(k.data() + r * kv, s.k.data() + src, static_cast<std::size_t>(n * kv) * 4);
        std::memcpy(v.data() + r * kv, s.v.data() + src, static_cast<std::size_t>(n * kv) * 4);
        for (std::int64_t j = 0; j < n; ++j)
          std::memcpy(qp.data() + (r + j) * ws, s.q.data() + static_cast<std::size_t>((l * s.len + p0 + j) * width),
                      static_cast<std::size_t>(width) * 4);
        spans.push_back(SeqSpan{ids[static_cast<std::size_t>(i)], p0, n});
        queries.push_back(SeqQuery{ids[static_cast<std::size_t>(i)], p0});
        r += n;
      }
      DeviceArray<float> dk(k), dv(v), dq(qp);
      const ConstView ck = testing::device_in(dk.get(), rows, kv), cv = testing::device_in(dv.get(), rows, kv),
                      cq{dq.get(), MemorySpace::kDevice, DType::kF32, rows, width, ws};
      float* const out_at = interleaved ? dq.get() + ws0 : dq.get();
      const MutView co{out_at, MemorySpace::kDevice, DType::kF32, rows, width, ws};
      Status status;
      if (st.decode) {
        status = store.store(l, spans, ck, cv);
        if (status.ok()) status = store.attend_decode(l, queries, cq, co);
      } else {
        status = store.prefill(l, spans, ck, cv, cq, co);
      }
      if (status.ok()) status = store.synchronize();
      ASSERT_TRUE(status.ok()) << status.to_string();
      const std::vector<float> padded = dq.download();
      r = 0;
      for (const auto& [i, n] : st.chunks) {
        for (std::int64_t j = 0; j < n; ++j) {
          const float* o = padded.data() + (r + j) * ws + (interleaved ? ws0 : 0);
          outs[{i, l, at[static_cast<std::size_t>(i)] + j}] = std::vector<float>(o, o + width);
          if (interleaved) {
            // q's row is as it was: nothing wrote past out's rows.
            const SeqInputs& s = seqs[static_cast<std::size_t>(i)];
            const std::size_t at_q = static_cast<std::size_t>((l * s.len + at[static_cast<std::size_t>(i)] + j) * width);
            EXPECT_EQ(0, std::memcmp(padded.data() + (r + j) * ws, s.q.data() + at_q, static_cast<std::size_t>(width) * 4))
                << "a query row was overwritten";
          }
        }
        r += n;
      }
    }
    for (const auto& [i, n] : st.chunks) at[static_cast<std::size_t>(i)] += n;
  }
}

// ---- Geometries around the kernels' thresholds ------------------------------------

// Head dims the general kernel takes on either side of its lanes' and
// vector paths' boundaries (1, 4, 6, 8, 127, 129, 192: dims a lane, float4
// combines, element-wise or 8-wide stores), with groups of 1 to 64, and
// the tensor-core kernel at groups of 7 (a head set one short), 9 (a
// second set of one head) and 16 (two full sets), under windows of 2, 8,
// 31, 32 and 33 rows: outputs within 1e-5 of the CPU's and the CPU's bytes.
TEST(CudaUnseen, HeadDimsAndGroupsAroundTheKernelChoices) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::vector<Geometry> gs = {
      // 2200 rows on a full layer: 18 splits, the two-level combine.
      geometry("hd8-group7-w31", 2, 2, 7, 1, 8, 31, 2300, 16, {2200, 40}, 400),
      geometry("hd127-group2-w32", 2, 2, 4, 2, 127, 32, 400, 32, {350, 31}, 64),
      geometry("hd129-group3-w33", 2, 2, 6, 2, 129, 33, 400, 16, {330, 33}, 100, 5),
      geometry("hd192-group1", 2, 2, 2, 2, 192, 40, 300, 64, {280, 12}, 64),
      geometry("hd4-group16-w2", 2, 2, 16, 1, 4, 2, 300, 16, {260, 3}, 64, 2),
      geometry("hd6-group12", 3, 3, 12, 1, 6, 17, 300, 16, {290, 20}, 64),
      geometry("hd64-group64-w8", 2, 2, 64, 1, 64, 8, 300, 16, {260, 9}, 64),
      geometry("hd1-group64", 2, 2, 64, 1, 1, 3, 200, 16, {150, 4}, 32),
      geometry("tc-group7-w31", 2, 2, 14, 2, 128, 31, 700, 16, {650, 40}, 128),
      geometry("tc-group9-w33", 2, 2, 9, 1, 128, 33, 500, 32, {420, 17}, 100, 7),
      geometry("tc-group16-w32", 2, 2, 32, 2, 128, 32, 600, 16, {520, 5}, 128),
  };
  const cuda::LaunchPolicy policies[] = {resident_policy(), last_arrival_policy(), runs_policy()};
  std::uint64_t seed = 501;
  for (const Geometry& g : gs) {
    SCOPED_TRACE(g.config.name);
    ASSERT_TRUE(g.config.validate().ok()) << g.config.validate().to_string();
    check_against_cpu(g, seed, kTolerance, policies[seed % 3]);
    ++seed;
    if (HasFailure()) return;
  }
}

// Windows of 1, 2, 31, 32 and 33 rows under contexts below, at and just
// past the 32-row plane minimum (8, 20, 31, 32, 33), with and without
// slack: the planes hold 32 rows at least, so a full layer of a context of
// 8 reaches 32 positions, and a ring shorter than its window stops at the
// context. Every sequence runs to the furthest position the store takes;
// outputs and bytes are the CPU's, and the next store is refused with the
// CPU's code on both backends, changing nothing.
TEST(CudaUnseen, WindowsAndContextsAroundTheThirtyTwoRowMinimum) {
  KVRING_SKIP_WITHOUT_GPU();
  struct Case {
    std::string name;
    std::int64_t heads, kv_heads, head_dim, window, context, slack;
  };
  const std::vector<Case> cases = {
      {"ctx8-w4", 4, 2, 16, 4, 8, 0},          {"ctx8-w1-slack1", 4, 1, 8, 1, 8, 1},
      {"ctx20-w33", 4, 2, 16, 33, 20, 0},      {"ctx31-w32-tc", 16, 2, 128, 32, 31, 0},
      {"ctx32-w31-slack31", 6, 3, 20, 31, 32, 31}, {"ctx33-w33-tc-slack3", 8, 1, 128, 33, 33, 3},
      {"ctx33-w2-slack2", 4, 1, 32, 2, 33, 2},  {"ctx100-w32-hd128-group3", 6, 2, 128, 32, 100, 0},
  };
  std::uint64_t seed = 601;
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    const ModelConfig c = make_hybrid_config(cs.name, 2, 2, cs.heads, cs.kv_heads, cs.head_dim, cs.window, cs.context);
    ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
    const StoreOptions o{.max_sequences = 3, .context = cs.context, .slack = cs.slack};
    auto probe = testing::new_store(BackendKind::kCpu, c, o);
    ASSERT_TRUE(probe);
    // The furthest position every layer takes (a full plane's capacity, a
    // ring's position_limit), and a sequence short of it.
    const auto stop = [](const KvStore& s, std::int64_t l) {
      return s.layout(l) == Layout::kHeadMajor ? s.capacity(l) : s.position_limit(l);
    };
    std::int64_t limit = KvStore::kNoPositionLimit;
    for (std::int64_t l = 0; l < c.n_layers; ++l) limit = std::min(limit, stop(*probe, l));
    ASSERT_LT(limit, KvStore::kNoPositionLimit);
    Geometry g{c, o, {limit, std::max<std::int64_t>(3, limit / 3)}, 7};
    check_against_cpu(g, seed, kTolerance, seed % 2 == 0 ? last_arrival_policy() : resident_policy(), false);
    if (HasFailure()) return;
    // One more position: refused alike, nothing changed.
    auto cpu = testing::new_store(BackendKind::kCpu, c, o);
    auto gpu = testing::new_store(BackendKind::kCuda, c, o);
    ASSERT_TRUE(cpu && gpu);
    const SeqId cs_id = *cpu->add_sequence(), gs_id = *gpu->add_sequence();
    const auto k = random_floats(static_cast<std::size_t>(c.n_layers * (limit + 1) * c.kv_dim()), seed + 3, 2.0f);
    const SeqSpan cspan{cs_id, 0, limit}, gspan{gs_id, 0, limit};
    DeviceArray<float> dk(k);
    ASSERT_TRUE(cpu->store_all_layers(std::span(&cspan, 1), testing::host_in(k.data(), c.n_layers * limit, c.kv_dim()),
                                      testing::host_in(k.data(), c.n_layers * limit, c.kv_dim()))
                    .ok());
    ASSERT_TRUE(gpu->store_all_layers(std::span(&gspan, 1), testing::device_in(dk.get(), c.n_layers * limit, c.kv_dim()),
                                      testing::device_in(dk.get(), c.n_layers * limit, c.kv_dim()))
                    .ok());
    ASSERT_TRUE(gpu->synchronize().ok());
    const auto cbefore = seq_image(*cpu, cs_id), gbefore = seq_image(*gpu, gs_id);
    EXPECT_TRUE(cbefore == gbefore);
    const SeqSpan cnext{cs_id, limit, 1}, gnext{gs_id, limit, 1};
    const std::int64_t width = c.n_heads * c.head_dim;
    const auto q = random_floats(static_cast<std::size_t>(width), seed + 4);
    std::vector<float> out(q.size());
    int refused_layers = 0;
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      // Layers that stop at `limit`; the others (rings that hold their
      // window) would take the position.
      if (stop(*cpu, l) != limit) continue;
      ++refused_layers;
      const Status a = cpu->store(l, std::span(&cnext, 1), testing::host_in(k.data(), 1, c.kv_dim()),
                                  testing::host_in(k.data(), 1, c.kv_dim()));
      const Status b = gpu->store(l, std::span(&gnext, 1), testing::device_in(dk.get(), 1, c.kv_dim()),
                                  testing::device_in(dk.get(), 1, c.kv_dim()));
      EXPECT_FALSE(a.ok()) << "layer " << l;
      EXPECT_FALSE(b.ok()) << "layer " << l;
      if (!a.ok() && !b.ok()) {
        EXPECT_EQ(a.error().code, b.error().code) << "layer " << l << ": " << b.to_string();
      }
      const Status pa = cpu->prefill(l, std::span(&cnext, 1), testing::host_in(k.data(), 1, c.kv_dim()),
                                     testing::host_in(k.data(), 1, c.kv_dim()), testing::host_in(q.data(), 1, width),
                                     host_view(out.data(), 1, width));
      const Status pb = gpu->prefill(l, std::span(&gnext, 1), testing::device_in(dk.get(), 1, c.kv_dim()),
                                     testing::device_in(dk.get(), 1, c.kv_dim()), testing::host_in(q.data(), 1, width),
                                     host_view(out.data(), 1, width));
      EXPECT_FALSE(pa.ok()) << "layer " << l;
      EXPECT_FALSE(pb.ok()) << "layer " << l;
      if (!pa.ok() && !pb.ok()) {
        EXPECT_EQ(pa.error().code, pb.error().code) << "layer " << l << ": " << pb.to_string();
      }
    }
    EXPECT_GE(refused_layers, 1);
    ASSERT_TRUE(gpu->synchronize().ok());
    EXPECT_TRUE(seq_image(*cpu, cs_id) == cbefore);
    EXPECT_TRUE(seq_image(*gpu, gs_id) == gbefore);
    EXPECT_EQ(*gpu->next_position(gs_id), limit);
    ++seed;
    if (HasFailure()) return;
  }
}

// ---- Split boundaries ------------------------------------------------------------------

// 8200 stored rows (no attention), then one decode batch whose queries see
// 1, 2, 128, 129, 256, 257, 2048, 2049, 4097, 8192, 8193 and 8200 rows of
// the full layer (one split, two, the single- and two-level combines, the
// band's 64 splits and the 33 just past it, in one launch: its split bound
// from its most, its run rule from its fewest), and queries of the sliding
// layer whose window of 2049 rows wraps its ring: every output within
// 1e-5 of the CPU's, and each query alone (a decode of one query on a full
// plane carries its splits' first blocks) gives the batch's bits, on the
// tensor-core and the general kernels and under two policies.
TEST(CudaUnseen, ADecodeBatchAcrossEverySplitBoundary) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::int64_t len = 8200, window = 2049;
  for (const ModelConfig& c : {make_hybrid_config("tc-bounds", 2, 2, 16, 2, 128, window, 8448),
                               make_hybrid_config("hd48-bounds", 2, 2, 6, 2, 48, window, 8448)}) {
    SCOPED_TRACE(c.name);
    const StoreOptions o{.max_sequences = 2, .context = 8448, .slack = window, .block_rows = 64};
    const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
    const auto k = random_floats(static_cast<std::size_t>(c.n_layers * len * kv), 701, 2.0f);
    const auto v = random_floats(k.size(), 702, 2.0f);
    auto cpu = testing::new_store(BackendKind::kCpu, c, o);
    auto gpu = testing::new_store(BackendKind::kCuda, c, o);
    auto forced = testing::new_cuda_store(c, o, runs_policy());
    ASSERT_TRUE(cpu && gpu && forced);
    std::vector<SeqId> ids;
    for (KvStore* s : {cpu.get(), gpu.get(), forced.get()}) {
      const SeqId id = *s->add_sequence();
      ids.push_back(id);
      const SeqSpan span{id, 0, len};
      ASSERT_TRUE(s->store_all_layers(std::span(&span, 1), testing::host_in(k.data(), c.n_layers * len, kv),
                                      testing::host_in(v.data(), c.n_layers * len, kv))
                      .ok());
    }
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const bool full = c.kind(l) == LayerKind::kFullNope;
      const RingState r = *cpu->ring(ids[0], l);
      std::vector<std::int64_t> positions;
      if (full) {
        positions = {0, 1, 127, 128, 255, 256, 2047, 2048, 4096, 8191, 8192, len - 1};
      } else {
        // The ring holds 2 x 2049 rows: queries whose window starts at its origin on.
        positions = {r.origin_logical() + window - 1, r.origin_logical() + window, 7000, 8191, 8192, len - 1};
      }
      const auto n = static_cast<std::int64_t>(positions.size());
      const auto q = random_floats(static_cast<std::size_t>(n * width), 703 + static_cast<std::uint64_t>(l));
      std::vector<std::vector<float>> batch(3, std::vector<float>(q.size(), NAN));
      for (int s = 0; s < 3; ++s) {
        KvStore& st = s == 0 ? *cpu : s == 1 ? *gpu : *forced;
        std::vector<SeqQuery> qs;
        for (const std::int64_t p : positions) qs.push_back({ids[static_cast<std::size_t>(s)], p});
        const Status status = st.attend_decode(l, qs, testing::host_in(q.data(), n, width),
                                               host_view(batch[static_cast<std::size_t>(s)].data(), n, width));
        ASSERT_TRUE(status.ok()) << status.to_string();
      }
      for (std::int64_t i = 0; i < n; ++i) {
        SCOPED_TRACE("position " + std::to_string(positions[static_cast<std::size_t>(i)]));
        auto row = [&](const std::vector<float>& x) {
          return std::vector<float>(x.begin() + i * width, x.begin() + (i + 1) * width);
        };
        const Outputs co{{{0, l, i}, row(batch[0])}}, go{{{0, l, i}, row(batch[1])}}, fo{{{0, l, i}, row(batch[2])}};
        EXPECT_LE(testing::worst_difference(go, co), kTolerance);
        EXPECT_TRUE(same_bits(go, fo)) << "the two policies' batches differ";
        // Alone, on device views, under each policy.
        for (int s = 1; s < 3; ++s) {
          KvStore& st = s == 1 ? *gpu : *forced;
          const std::int64_t ws = (width + 3) / 4 * 4;
          std::vector<float> qp(static_cast<std::size_t>(ws), 0.0f);
          std::memcpy(qp.data(), q.data() + i * width, static_cast<std::size_t>(width) * 4);
          DeviceArray<float> dq(qp), dout(qp.size());
          dout.poison();
          const SeqQuery one{ids[static_cast<std::size_t>(s)], positions[static_cast<std::size_t>(i)]};
          ASSERT_TRUE(st.attend_decode(l, std::span(&one, 1), testing::device_in(dq.get(), 1, width),
                                       device_view(dout.get(), 1, width))
                          .ok());
          ASSERT_TRUE(st.synchronize().ok());
          auto alone = dout.download();
          alone.resize(static_cast<std::size_t>(width));
          EXPECT_TRUE(same_bits({{{0, l, i}, alone}}, go)) << "store " << s << ": a query alone differs from the batch";
        }
      }
      if (HasFailure()) return;
    }
    EXPECT_TRUE(seq_image(*gpu, ids[1]) == seq_image(*cpu, ids[0]));
  }
}


// ---- Outputs over their queries -----------------------------------------------------

// out == q in device memory (allowed: each output row is written after its
// query row is read). Every CTA of a query reads the query, and on the
// split paths (last arrival, runs of splits, resident grids, clusters,
// warp splits, the two-level combine past 16 splits) one CTA writes the
// output while others may still be reading: an output written before all
// reads of its row are done would corrupt the other splits. Prefill
// chunks, one-token prefills that store their rows, and decodes, on the
// tensor-core kernel (groups 8 and 3) and the general one (head_dim 17,
// rows padded): the bits of the same calls with q and out apart, and
// within 1e-5 of the CPU's; and with out's rows interleaved between q's in
// one buffer, the same bits with every query row left as it was.
TEST(CudaUnseen, OutputsOverTheirOwnQueriesOnEveryPath) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::vector<Geometry> gs = {
      geometry("tc-group8-inplace", 2, 2, 16, 2, 128, 64, 2300, 16, {2150, 300}, 300),
      geometry("tc-group3-inplace", 2, 2, 6, 2, 128, 31, 400, 32, {330, 9}, 64),
      geometry("hd17-group3-inplace", 2, 2, 6, 2, 17, 33, 900, 16, {800, 40}, 200),
  };
  const std::vector<std::pair<const char*, cuda::LaunchPolicy>> policies = {
      {"device", cuda::device_launch_policy()},
      {"resident", resident_policy()},
      {"last arrival, warp splits, query-major", last_arrival_policy()},
      {"runs of 4, uploaded items", runs_policy()}};
  std::uint64_t seed = 801;
  for (const Geometry& g : gs) {
    SCOPED_TRACE(g.config.name);
    const ModelConfig& c = g.config;
    const int n = static_cast<int>(g.lengths.size());
    const auto seqs = testing::inputs_of_lengths(c, g.lengths, seed);
    const auto plan = edge_plan(seqs, seed * 3, g.max_chunk);
    Outputs c_out, apart;
    {
      auto cpu = testing::new_store(BackendKind::kCpu, c, g.options);
      auto gpu = testing::new_store(BackendKind::kCuda, c, g.options);
      ASSERT_TRUE(cpu && gpu);
      testing::run_plan(*cpu, testing::add_sequences(*cpu, n, seed, false), seqs, plan, c_out);
      ASSERT_FALSE(HasFatalFailure());
      testing::run_plan(*gpu, testing::add_sequences(*gpu, n, seed, false), seqs, plan, apart, true);
      ASSERT_FALSE(HasFatalFailure());
      EXPECT_LE(testing::worst_difference(apart, c_out), kTolerance);
    }
    for (const auto& [name, policy] : policies) {
      SCOPED_TRACE(name);
      for (const bool interleaved : {false, true}) {
        if (interleaved && std::string(name) != "device") continue;
        SCOPED_TRACE(interleaved ? "interleaved" : "in place");
        auto gpu = testing::new_cuda_store(c, g.options, policy);
        ASSERT_TRUE(gpu);
        Outputs got;
        run_plan_in_place(*gpu, testing::add_sequences(*gpu, n, seed, false), seqs, plan, got, interleaved);
        ASSERT_FALSE(HasFatalFailure());
        EXPECT_TRUE(same_bits(got, apart)) << "outputs differ from those of q and out apart";
        EXPECT_LE(testing::worst_difference(got, c_out), kTolerance);
        if (HasFailure()) return;
      }
    }
    ++seed;
  }
}

// The same under the f16 numeric (tiles of 8 queries, splits of 2048 rows
// combined by a second kernel, one-split queries written by the tile's
// CTA while the tile's other splits' CTAs read every query of the tile).
TEST(CudaUnseen, F16OutputsOverTheirOwnQueries) {
  KVRING_SKIP_WITHOUT_GPU();
  Geometry g = geometry("f16-group8-inplace", 2, 2, 16, 2, 128, 300, 2400, 16, {2250, 60}, 400);
  g.options.attention = AttentionNumeric::kF16;
  {
    auto probe = CudaStore::create(g.config, g.options);
    if (!probe.ok() && probe.error().code == ErrorCode::kUnsupported &&
        probe.error().message.find("sm_90a") != std::string::npos)
      GTEST_SKIP() << probe.error().message;
  }
  const ModelConfig& c = g.config;
  const int n = static_cast<int>(g.lengths.size());
  const auto seqs = testing::inputs_of_lengths(c, g.lengths, 901);
  const auto plan = edge_plan(seqs, 903, g.max_chunk);
  auto cpu = testing::new_store(BackendKind::kCpu, c, g.options);
  auto gpu = testing::new_store(BackendKind::kCuda, c, g.options);
  ASSERT_TRUE(cpu && gpu);
  Outputs c_out, apart;
  testing::run_plan(*cpu, testing::add_sequences(*cpu, n, 1, false), seqs, plan, c_out);
  ASSERT_FALSE(HasFatalFailure());
  testing::run_plan(*gpu, testing::add_sequences(*gpu, n, 1, false), seqs, plan, apart, true);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_LE(testing::worst_difference(apart, c_out), kF16Tolerance);
  for (const int stages : {2, 3}) {
    SCOPED_TRACE(stages == 2 ? "kernel of two stages" : "deep kernel");
    cuda::LaunchPolicy p = cuda::device_launch_policy();
    p.f16_stages = stages;
    for (const bool interleaved : {false, true}) {
      SCOPED_TRACE(interleaved ? "interleaved" : "in place");
      auto s = testing::new_cuda_store(c, g.options, p);
      ASSERT_TRUE(s);
      Outputs got;
      run_plan_in_place(*s, testing::add_sequences(*s, n, 1, false), seqs, plan, got, interleaved);
      ASSERT_FALSE(HasFatalFailure());
      EXPECT_TRUE(same_bits(got, apart)) << "outputs differ from those of q and out apart";
      EXPECT_LE(testing::worst_difference(got, c_out), kF16Tolerance);
    }
  }
}

// ---- A fork's shared block, written by one-token device prefills ------------------

// A sequence and its fork share the block their next position falls in.
// One-token prefills of device K/V, q and out (one launch that stores each
// row as it attends) of both in one batch, then of each alone, then a
// decode of both: the launch must write each sequence's row into its own
// copy of the block (the copy made before the launch) and read the rows
// before it from there. Outputs within 1e-5 of the CPU's, every plane and
// the blocks held the CPU's, and the one-launch path taken.
TEST(CudaUnseen, OneTokenPrefillsOfAForkIntoItsSharedBlock) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& c : {make_hybrid_config("fork-tc", 2, 2, 16, 2, 128, 24, 512),
                               make_hybrid_config("fork-hd20", 2, 2, 6, 3, 20, 24, 512)}) {
    SCOPED_TRACE(c.name);
    const StoreOptions o{.max_sequences = 4, .context = 512, .block_rows = 16};
    const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, ws = (width + 3) / 4 * 4, first = 40;
    cuda::AttendStats stats;
    cuda::LaunchPolicy p = cuda::device_launch_policy();
    p.stats = &stats;
    auto cpu = testing::new_store(BackendKind::kCpu, c, o);
    auto gpu = testing::new_cuda_store(c, o, p);
    ASSERT_TRUE(cpu && gpu);
    const auto in = testing::seq_inputs(c, first, 1001);
    Outputs ignored;
    const SeqId ca = *cpu->add_sequence(), ga = *gpu->add_sequence();
    testing::run_plan(*cpu, {ca}, {in}, {{false, {{0, first}}}}, ignored);
    testing::run_plan(*gpu, {ga}, {in}, {{false, {{0, first}}}}, ignored);
    ASSERT_FALSE(HasFatalFailure());
    const SeqId cb = *cpu->fork_sequence(ca), gb = *gpu->fork_sequence(ga);
    // Steps: both, the parent alone, the fork alone, a decode of both.
    struct Step {
      std::vector<int> who;  // 0 the parent, 1 the fork
      bool decode;
    };
    const std::vector<Step> steps = {{{1, 0}, false}, {{0}, false}, {{1}, false}, {{0, 1}, true}};
    std::int64_t next[2] = {first, first};
    std::uint64_t seed = 1003;
    for (const Step& st : steps) {
      const auto rows = static_cast<std::int64_t>(st.who.size());
      for (std::int64_t l = 0; l < c.n_layers; ++l) {
        SCOPED_TRACE("layer " + std::to_string(l) + (st.decode ? " decode" : " prefill"));
        const auto k = random_floats(static_cast<std::size_t>(rows * kv), seed++, 2.0f);
        const auto v = random_floats(k.size(), seed++, 2.0f);
        const auto q = random_floats(static_cast<std::size_t>(rows * width), seed++);
        std::vector<float> qp(static_cast<std::size_t>(rows * ws), 0.0f);
        for (std::int64_t i = 0; i < rows; ++i)
          std::memcpy(qp.data() + i * ws, q.data() + i * width, static_cast<std::size_t>(width) * 4);
        std::vector<SeqSpan> cspans, gspans;
        std::vector<SeqQuery> cq, gq;
        for (const int w : st.who) {
          cspans.push_back({w == 0 ? ca : cb, next[w], 1});
          gspans.push_back({w == 0 ? ga : gb, next[w], 1});
          cq.push_back({w == 0 ? ca : cb, next[w]});
          gq.push_back({w == 0 ? ga : gb, next[w]});
        }
        std::vector<float> cout(q.size());
        DeviceArray<float> dk(k), dv(v), dq(qp), dout(qp.size());
        dout.poison();
        const ConstView hk = testing::host_in(k.data(), rows, kv), hv = testing::host_in(v.data(), rows, kv),
                        hq = testing::host_in(q.data(), rows, width);
        const ConstView dkv = testing::device_in(dk.get(), rows, kv), dvv = testing::device_in(dv.get(), rows, kv),
                        dqv{dq.get(), MemorySpace::kDevice, DType::kF32, rows, width, ws};
        const MutView dov{dout.get(), MemorySpace::kDevice, DType::kF32, rows, width, ws};
        const long own_before = stats.own_rows;
        if (st.decode) {
          ASSERT_TRUE(cpu->store(l, cspans, hk, hv).ok());
          ASSERT_TRUE(cpu->attend_decode(l, cq, hq, host_view(cout.data(), rows, width)).ok());
          ASSERT_TRUE(gpu->store(l, gspans, dkv, dvv).ok());
          ASSERT_TRUE(gpu->attend_decode(l, gq, dqv, dov).ok());
        } else {
          ASSERT_TRUE(cpu->prefill(l, cspans, hk, hv, hq, host_view(cout.data(), rows, width)).ok());
          ASSERT_TRUE(gpu->prefill(l, gspans, dkv, dvv, dqv, dov).ok());
          EXPECT_EQ(stats.own_rows - own_before, 1) << "a one-token device prefill took another path";
        }
        ASSERT_TRUE(gpu->synchronize().ok());
        const auto padded = dout.download();
        for (std::int64_t i = 0; i < rows; ++i) {
          const Outputs go{{{0, l, i}, std::vector<float>(padded.begin() + i * ws, padded.begin() + i * ws + width)}};
          const Outputs co{{{0, l, i}, std::vector<float>(cout.begin() + i * width, cout.begin() + (i + 1) * width)}};
          EXPECT_LE(testing::worst_difference(go, co), kTolerance) << "row " << i;
        }
      }
      for (const int w : st.who) ++next[w];
      EXPECT_TRUE(seq_image(*gpu, ga) == seq_image(*cpu, ca)) << "the parent's planes";
      EXPECT_TRUE(seq_image(*gpu, gb) == seq_image(*cpu, cb)) << "the fork's planes";
      EXPECT_EQ(*gpu->blocks_held(ga), *cpu->blocks_held(ca));
      EXPECT_EQ(*gpu->blocks_held_alone(gb), *cpu->blocks_held_alone(cb));
      EXPECT_EQ(gpu->free_blocks(), cpu->free_blocks());
      if (HasFailure()) return;
    }
  }
}

// ---- 16-bit host queries -------------------------------------------------------------

// Queries in host memory as f16 and bf16 at 2-byte aligned addresses with
// odd row strides (the CUDA backend converts them to f32 on the host before
// staging), K/V in host bf16 and f16 of odd strides, out in host f32 of an
// odd stride: a prefill chunk and a decode on both kernels give the CPU's
// outputs within 1e-5 and its bytes, and write no element of out's padding.
TEST(CudaUnseen, SixteenBitHostQueriesOfOddStrides) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& c : {make_hybrid_config("h16-tc", 2, 2, 16, 2, 128, 24, 256),
                               make_hybrid_config("h16-hd17", 2, 2, 6, 2, 17, 24, 256)}) {
    for (const DType dt : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(std::string(c.name).append(" ").append(dtype_name(dt)));
      const StoreOptions o{.max_sequences = 2, .context = 256, .block_rows = 16};
      auto cpu = testing::new_store(BackendKind::kCpu, c, o);
      auto gpu = testing::new_store(BackendKind::kCuda, c, o);
      ASSERT_TRUE(cpu && gpu);
      const SeqId cs = *cpu->add_sequence(), gs = *gpu->add_sequence();
      const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
      const std::int64_t qstride = width + 3, kstride = kv + 5, ostride = width + 1, chunk = 37;
      std::uint64_t seed = 1101;
      std::int64_t at = 0;
      for (const std::int64_t rows : {chunk, std::int64_t{1}, chunk, std::int64_t{1}}) {
        for (std::int64_t l = 0; l < c.n_layers; ++l) {
          SCOPED_TRACE("layer " + std::to_string(l) + " rows " + std::to_string(rows));
          auto bits_of = [&](std::size_t n, float scale) {
            const auto f = random_floats(n, seed++, scale);
            std::vector<std::uint16_t> b(n);
            for (std::size_t i = 0; i < n; ++i) {
              std::uint32_t u;
              std::memcpy(&u, &f[i], 4);
              b[i] = dt == DType::kF16 ? f32_to_f16(f[i]) : static_cast<std::uint16_t>(u >> 16);
            }
            return b;
          };
          // One element in from each buffer's start: 2-byte aligned only.
          const auto qb = bits_of(static_cast<std::size_t>(1 + rows * qstride), 1.0f);
          const auto kb = bits_of(static_cast<std::size_t>(1 + rows * kstride), 2.0f);
          const ConstView q{qb.data() + 1, MemorySpace::kHost, dt, rows, width, qstride};
          const DType kdt = dt == DType::kF16 ? DType::kBF16 : DType::kF16;
          const auto kb2 = bits_of(kb.size(), 2.0f);
          const ConstView k{kb.data() + 1, MemorySpace::kHost, dt, rows, kv, kstride};
          const ConstView v{kb2.data() + 1, MemorySpace::kHost, kdt, rows, kv, kstride};
          std::vector<float> co(static_cast<std::size_t>(rows * ostride), -3.0f), go(co.size(), -3.0f);
          const MutView cov{co.data(), MemorySpace::kHost, DType::kF32, rows, width, ostride};
          const MutView gov{go.data(), MemorySpace::kHost, DType::kF32, rows, width, ostride};
          const SeqSpan csp{cs, at, rows}, gsp{gs, at, rows};
          if (rows == 1) {
            // store, then decode
            ASSERT_TRUE(cpu->store(l, std::span(&csp, 1), k, v).ok());
            ASSERT_TRUE(gpu->store(l, std::span(&gsp, 1), k, v).ok());
            const SeqQuery cq{cs, at}, gq{gs, at};
            ASSERT_TRUE(cpu->attend_decode(l, std::span(&cq, 1), q, cov).ok());
            const Status st = gpu->attend_decode(l, std::span(&gq, 1), q, gov);
            ASSERT_TRUE(st.ok()) << st.to_string();
          } else {
            ASSERT_TRUE(cpu->prefill(l, std::span(&csp, 1), k, v, q, cov).ok());
            const Status st = gpu->prefill(l, std::span(&gsp, 1), k, v, q, gov);
            ASSERT_TRUE(st.ok()) << st.to_string();
          }
          for (std::int64_t i = 0; i < rows; ++i) {
            const Outputs g1{{{0, l, i}, std::vector<float>(go.begin() + i * ostride, go.begin() + i * ostride + width)}};
            const Outputs c1{{{0, l, i}, std::vector<float>(co.begin() + i * ostride, co.begin() + i * ostride + width)}};
            EXPECT_LE(testing::worst_difference(g1, c1), kTolerance) << "row " << i;
            if (i + 1 < rows) {
              EXPECT_EQ(go[static_cast<std::size_t>(i * ostride + width)], -3.0f) << "out's padding written, row " << i;
            }
          }
        }
        at += rows;
      }
      EXPECT_TRUE(seq_image(*gpu, gs) == seq_image(*cpu, cs));
      if (HasFailure()) return;
    }
  }
}

// ---- Hostile arguments ----------------------------------------------------------------

// Hostile calls on every entry point, each made on a CPU store (host
// buffers) and a CUDA store (device buffers of the same layout): null
// views of rows, outputs over part of their queries, over their queries
// at another stride, over V; f32 views two bytes off their alignment;
// views of the wrong shape; a query past the sequence. Both refuse alike
// (the same code), and neither changes. On the CUDA store alone: host
// memory labelled device on every entry point, queries and outputs off
// their 16-byte alignment, and views that run past their allocation on the
// entry points the other tests leave out (store_all_layers, a prefill's
// chunk and queries, a one-token prefill's K/V, install_rows, read_rows'
// V), all refused as invalid arguments, changing nothing. Then no CUDA
// error is pending, and a valid call on each store gives the CPU's output.
TEST(CudaUnseen, HostileArgumentsAreRefusedAsTheCpuRefusesThem) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("hostile", 2, 2, 4, 2, 16, 24, 256);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, n = 4, len = 40;
  const StoreOptions o{.max_sequences = 4, .context = 256, .block_rows = 16};
  auto cpu = testing::new_store(BackendKind::kCpu, c, o);
  auto gpu = testing::new_store(BackendKind::kCuda, c, o);
  ASSERT_TRUE(cpu && gpu);
  const auto in = testing::seq_inputs(c, len, 1201);
  Outputs ignored;
  const SeqId ca = *cpu->add_sequence(), ga = *gpu->add_sequence();
  testing::run_plan(*cpu, {ca}, {in}, {{false, {{0, len}}}}, ignored);
  testing::run_plan(*gpu, {ga}, {in}, {{false, {{0, len}}}}, ignored);
  ASSERT_FALSE(HasFatalFailure());
  const SeqId cd = *cpu->add_detached_sequence(), gd = *gpu->add_detached_sequence();
  const std::int64_t full = 1;
  auto ring = RingState::sequential(cpu->capacity(full), false, 20);
  ASSERT_TRUE(ring.ok());
  ASSERT_TRUE(cpu->install_plane(cd, full, *ring).ok());
  ASSERT_TRUE(gpu->install_plane(gd, full, *ring).ok());
  const testing::SeqImage cbefore = seq_image(*cpu, ca), gbefore = seq_image(*gpu, ga);
  ASSERT_TRUE(cbefore == gbefore);
  const std::int64_t cfree = cpu->free_blocks(), gfree = gpu->free_blocks();

  // One buffer of random floats per backend, the same layout: k at 0, v
  // after it, q after that, a spare region after q.
  const std::int64_t ws = (width + 3) / 4 * 4, k0 = 0, v0 = 4 * n * kv, q0 = 8 * n * kv, spare = q0 + 4 * n * ws;
  const std::size_t total = static_cast<std::size_t>(spare + 4 * n * ws);
  std::vector<float> host = random_floats(total, 1203);
  DeviceArray<float> dev(host);
  struct Mem {
    float* base;
    MemorySpace space;
  };
  auto view = [](const Mem& m, std::int64_t at, std::int64_t rows, std::int64_t cols, std::int64_t stride) {
    return MutView{m.base + at, m.space, DType::kF32, rows, cols, stride};
  };
  struct Case {
    const char* what;
    std::function<Status(KvStore&, const Mem&, SeqId live, SeqId detached)> call;
  };
  const std::vector<Case> cases = {
      {"store: k null",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         return s.store(full, std::span(&sp, 1), MutView{nullptr, m.space, DType::kF32, n, kv, kv},
                        view(m, v0, n, kv, kv));
       }},
      {"store_all_layers: v null",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, 1};
         return s.store_all_layers(std::span(&sp, 1), view(m, k0, c.n_layers, kv, kv),
                                   MutView{nullptr, m.space, DType::kF32, c.n_layers, kv, kv});
       }},
      {"prefill: q null",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         return s.prefill(full, std::span(&sp, 1), view(m, k0, n, kv, kv), view(m, v0, n, kv, kv),
                          MutView{nullptr, m.space, DType::kF32, n, width, ws}, view(m, spare, n, width, ws));
       }},
      {"attend_decode: out null",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqQuery qq{a, len - 1};
         return s.attend_decode(full, std::span(&qq, 1), view(m, q0, 1, width, ws),
                                MutView{nullptr, m.space, DType::kF32, 1, width, ws});
       }},
      {"read_rows: v null",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         return s.read_rows(a, full, 0, n, reinterpret_cast<std::uint16_t*>(m.base + spare), nullptr, m.space);
       }},
      {"install_rows: k null",
       [&](KvStore& s, const Mem& m, SeqId, SeqId d) {
         return s.install_rows(d, full, 0, n, nullptr, reinterpret_cast<std::uint16_t*>(m.base + spare), m.space);
       }},
      {"prefill: out over q shifted by one row",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         return s.prefill(full, std::span(&sp, 1), view(m, k0, n, kv, kv), view(m, v0, n, kv, kv),
                          view(m, q0, n, width, ws), view(m, q0 + ws, n, width, ws));
       }},
      {"attend_decode: out over q at another stride",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const std::vector<SeqQuery> qs = {{a, len - 1}, {a, len - 2}};
         return s.attend_decode(full, qs, view(m, q0, 2, width, ws), view(m, q0, 2, width, ws + 4));
       }},
      {"attend_decode: out over q by one element",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const std::vector<SeqQuery> qs = {{a, len - 1}, {a, len - 2}};
         return s.attend_decode(full, qs, view(m, q0, 2, width, ws), view(m, q0 + 2 * ws - 4, 2, width, ws));
       }},
      {"prefill: out over v's last row",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         return s.prefill(full, std::span(&sp, 1), view(m, k0, n, kv, kv), view(m, v0, n, kv, kv),
                          view(m, q0, n, width, ws), view(m, v0 + (n - 1) * kv, n, width, ws));
       }},
      {"store: k two bytes off its f32 alignment",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         const void* off = reinterpret_cast<const char*>(m.base + k0) + 2;
         return s.store(full, std::span(&sp, 1), ConstView{off, m.space, DType::kF32, n, kv, kv},
                        view(m, v0, n, kv, kv));
       }},
      {"prefill: q of the wrong width",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         return s.prefill(full, std::span(&sp, 1), view(m, k0, n, kv, kv), view(m, v0, n, kv, kv),
                          view(m, q0, n, width - 4, ws), view(m, spare, n, width, ws));
       }},
      {"prefill: out in bf16",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqSpan sp{a, len, n};
         return s.prefill(full, std::span(&sp, 1), view(m, k0, n, kv, kv), view(m, v0, n, kv, kv),
                          view(m, q0, n, width, ws), MutView{m.base + spare, m.space, DType::kBF16, n, width, 2 * ws});
       }},
      {"attend_decode: a position not yet stored",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqQuery qq{a, len};
         return s.attend_decode(0, std::span(&qq, 1), view(m, q0, 1, width, ws), view(m, spare, 1, width, ws));
       }},
      {"attend_decode: a negative position",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const SeqQuery qq{a, -1};
         return s.attend_decode(0, std::span(&qq, 1), view(m, q0, 1, width, ws), view(m, spare, 1, width, ws));
       }},
      {"prefill: a detached sequence",
       [&](KvStore& s, const Mem& m, SeqId, SeqId d) {
         const SeqSpan sp{d, 20, n};
         return s.prefill(full, std::span(&sp, 1), view(m, k0, n, kv, kv), view(m, v0, n, kv, kv),
                          view(m, q0, n, width, ws), view(m, spare, n, width, ws));
       }},
      {"prefill: one sequence twice",
       [&](KvStore& s, const Mem& m, SeqId a, SeqId) {
         const std::vector<SeqSpan> sp = {{a, len, 1}, {a, len + 1, 1}};
         return s.prefill(full, sp, view(m, k0, 2, kv, kv), view(m, v0, 2, kv, kv), view(m, q0, 2, width, ws),
                          view(m, spare, 2, width, ws));
       }},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.what);
    const Status a = cs.call(*cpu, Mem{host.data(), MemorySpace::kHost}, ca, cd);
    const Status b = cs.call(*gpu, Mem{dev.get(), MemorySpace::kDevice}, ga, gd);
    EXPECT_FALSE(a.ok());
    EXPECT_FALSE(b.ok());
    if (!a.ok() && !b.ok()) {
      EXPECT_EQ(a.error().code, b.error().code) << "cpu: " << a.to_string() << "; cuda: " << b.to_string();
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  EXPECT_TRUE(seq_image(*cpu, ca) == cbefore);
  EXPECT_TRUE(seq_image(*gpu, ga) == gbefore);
  EXPECT_EQ(cpu->free_blocks(), cfree);
  EXPECT_EQ(gpu->free_blocks(), gfree);

  // The CUDA store alone.
  auto refused = [&](const Status& st, const char* what, const char* needle) {
    EXPECT_FALSE(st.ok()) << what;
    if (st.ok()) return;
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_NE(st.to_string().find(needle), std::string::npos) << what << ": " << st.to_string();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what;
  };
  const Mem d{dev.get(), MemorySpace::kDevice};
  const Mem h_as_d{host.data(), MemorySpace::kDevice};
  const SeqSpan span{ga, len, n}, one{ga, len, 1}, all{ga, len, 1};
  const SeqQuery last{ga, len - 1};
  // Room for install's 20 rows of K then V.
  std::vector<std::uint16_t> hrows(static_cast<std::size_t>(2 * 20 * kv));
  DeviceArray<std::uint16_t> drows(hrows.size());
  const char* not_device = "not a device allocation";
  refused(gpu->store_all_layers(std::span(&all, 1), view(h_as_d, k0, c.n_layers, kv, kv), view(d, v0, c.n_layers, kv, kv)),
          "store_all_layers: host k labelled device", not_device);
  refused(gpu->prefill(full, std::span(&span, 1), view(d, k0, n, kv, kv), view(h_as_d, v0, n, kv, kv),
                       view(d, q0, n, width, ws), view(d, spare, n, width, ws)),
          "prefill: host v labelled device", not_device);
  refused(gpu->prefill(full, std::span(&one, 1), view(d, k0, 1, kv, kv), view(d, v0, 1, kv, kv),
                       view(h_as_d, q0, 1, width, ws), view(d, spare, 1, width, ws)),
          "one-token prefill: host q labelled device", not_device);
  refused(gpu->attend_decode(full, std::span(&last, 1), view(d, q0, 1, width, ws), view(h_as_d, spare, 1, width, ws)),
          "attend_decode: host out labelled device", not_device);
  refused(gpu->read_rows(ga, full, 0, n, drows.get(), hrows.data(), MemorySpace::kDevice),
          "read_rows: host v labelled device", not_device);
  refused(gpu->install_rows(gd, full, 0, n, hrows.data(), drows.get() + 20 * kv, MemorySpace::kDevice),
          "install_rows: host k labelled device", not_device);
  refused(gpu->install(gd, full, *ring, drows.get(), hrows.data() + 20 * kv, MemorySpace::kDevice),
          "install: host v labelled device", not_device);
  // Device rows labelled host: the staging copies would read device memory.
  refused(gpu->install_rows(gd, full, 0, n, drows.get(), hrows.data(), MemorySpace::kHost),
          "install_rows: device k labelled host", "device allocation");
  refused(gpu->attend_decode(full, std::span(&last, 1), view(d, q0 + 1, 1, width, ws), view(d, spare, 1, width, ws)),
          "attend_decode: q off 16 bytes", "16-byte");
  refused(gpu->prefill(full, std::span(&span, 1), view(d, k0, n, kv, kv), view(d, v0, n, kv, kv),
                       view(d, q0, n, width, ws), view(d, spare + 2, n, width, ws)),
          "prefill: out off 16 bytes", "16-byte");

  // Views past their allocation.
  testing::MappedPieces piece(1);
  piece.map();
  if (HasFatalFailure()) return;
  std::vector<float> fill(piece.piece_bytes() / sizeof(float));
  {
    const auto f = random_floats(fill.size(), 1205, 2.0f);
    fill = f;
  }
  ASSERT_EQ(cudaMemcpy(piece.end() - piece.piece_bytes(), fill.data(), piece.piece_bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // `floats` ending `over` floats past the end.
  auto at_end = [&](std::int64_t floats, std::int64_t over) {
    return reinterpret_cast<float*>(piece.end()) - (floats - over);
  };
  const char* past = "allocation";
  refused(gpu->store_all_layers(std::span(&all, 1), testing::device_in(at_end(c.n_layers * kv, 1), c.n_layers, kv),
                                view(d, v0, c.n_layers, kv, kv)),
          "store_all_layers: k one float past", past);
  refused(gpu->prefill(full, std::span(&span, 1), view(d, k0, n, kv, kv), testing::device_in(at_end(n * kv, 1), n, kv),
                       view(d, q0, n, width, ws), view(d, spare, n, width, ws)),
          "prefill: v one float past", past);
  refused(gpu->prefill(full, std::span(&span, 1), view(d, k0, n, kv, kv), view(d, v0, n, kv, kv),
                       ConstView{at_end((n - 1) * ws + width, 4), MemorySpace::kDevice, DType::kF32, n, width, ws},
                       view(d, spare, n, width, ws)),
          "prefill: q 4 floats past", past);
  refused(gpu->prefill(0, std::span(&one, 1), testing::device_in(at_end(kv, 1), 1, kv), view(d, v0, 1, kv, kv),
                       view(d, q0, 1, width, ws), view(d, spare, 1, width, ws)),
          "one-token prefill: k one float past", past);
  auto* rows_end = reinterpret_cast<std::uint16_t*>(piece.end()) - n * kv + 1;
  refused(gpu->install_rows(gd, full, 0, n, drows.get(), rows_end, MemorySpace::kDevice),
          "install_rows: v one value past", past);
  refused(gpu->read_rows(ga, full, 0, n, drows.get(), rows_end, MemorySpace::kDevice), "read_rows: v one value past",
          past);
  ASSERT_TRUE(gpu->synchronize().ok());
  EXPECT_TRUE(seq_image(*gpu, ga) == gbefore);
  EXPECT_EQ(gpu->free_blocks(), gfree);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  // Views that end exactly at the end are taken, and every store still
  // works: a one-token prefill from the piece's last row on both stores.
  const auto last_k = std::vector<float>(fill.end() - kv, fill.end());
  const auto q = random_floats(static_cast<std::size_t>(width), 1207);
  std::vector<float> cout(q.size()), gout(q.size());
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const SeqSpan cnext{ca, len, 1}, gnext{ga, len, 1};
    ASSERT_TRUE(cpu->prefill(l, std::span(&cnext, 1), testing::host_in(last_k.data(), 1, kv),
                             testing::host_in(last_k.data(), 1, kv), testing::host_in(q.data(), 1, width),
                             host_view(cout.data(), 1, width))
                    .ok());
    const Status st = gpu->prefill(l, std::span(&gnext, 1), testing::device_in(at_end(kv, 0), 1, kv),
                                   testing::device_in(at_end(kv, 0), 1, kv), testing::host_in(q.data(), 1, width),
                                   host_view(gout.data(), 1, width));
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_LE(testing::worst_difference({{{0, l, 0}, gout}}, {{{0, l, 0}, cout}}), kTolerance) << "layer " << l;
  }
  EXPECT_TRUE(seq_image(*gpu, ga) == seq_image(*cpu, ca));
}

}  // namespace
}  // namespace kvring
