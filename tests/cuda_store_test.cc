// The CUDA store: creation and its refusals, the f16 conversion, zero fill,
// stores of any batch and every layer at once (by every way a store's
// descriptors travel), fork and truncate, device
// views (f32, f16 and bf16, strided) on a user stream, snapshots,
// refusals that leave the store as it was, and descriptor uploads with the
// device's memory spent.
#include <gtest/gtest.h>

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "cuda/allocation.h"
#include "cuda/kernels.h"
#include "cuda/testing.h"
#include "cuda_mapped_pieces.h"
#include "cuda_test_util.h"
#include "kvring/backend.h"
#include "kvring/cache.h"
#include "kvring/pack.h"
#include "pack/pack_common.h"

namespace kvring {
namespace {

using testing::DeviceArray;
using testing::random_floats;
using testing::seq_image;

ModelConfig config() { return make_hybrid_config("store-test", 4, 2, 4, 2, 16, 24, 1024); }
StoreOptions options(std::int64_t seqs = 4) {
  return {.max_sequences = seqs, .context = 512, .slack = 8, .block_rows = 16};
}

TEST(CudaStore, NoGpuMeansNoCudaStore) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible";
  auto s = make_store(BackendKind::kCuda, config());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kUnsupported);
}

TEST(CudaStore, CapabilityCheckNamesTheCapability) {
  const Status refused = cuda::testing::check_capability(8, 0, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(refused.to_string().find("compute capability 8.0"), std::string::npos) << refused.to_string();
  EXPECT_TRUE(cuda::testing::check_capability(9, 0, true).ok());
  KVRING_SKIP_WITHOUT_GPU();
  // This build's GPU passes the check.
  auto s = CudaStore::create(config(), options());
  ASSERT_TRUE(s.ok()) << s.error().to_string();
}

// The f16 numeric runs where wgmma does: a 9.0 device with a build for
// sm_90a. Elsewhere the store refuses it, naming the capability and the
// build's targets.
TEST(CudaStore, F16NumericNeedsSm90a) {
  EXPECT_TRUE(cuda::testing::check_f16_numeric(9, 0, "-gencode=arch=compute_90a,code=sm_90a").ok());
  struct Case {
    int major, minor;
    const char* targets;
  };
  for (const Case& c : {Case{9, 0, "-gencode=arch=compute_90,code=sm_90"},
                        Case{10, 0, "-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a"},
                        Case{8, 0, "-gencode=arch=compute_90a,code=sm_90a"}}) {
    const Status refused = cuda::testing::check_f16_numeric(c.major, c.minor, c.targets);
    ASSERT_FALSE(refused.ok()) << c.major << "." << c.minor << " " << c.targets;
    EXPECT_EQ(refused.error().code, ErrorCode::kUnsupported);
    EXPECT_NE(refused.to_string().find(std::to_string(c.major) + "." + std::to_string(c.minor)), std::string::npos)
        << refused.to_string();
    EXPECT_NE(refused.to_string().find(c.targets), std::string::npos) << refused.to_string();
  }
}

TEST(CudaStore, F16ConversionMatchesTheSharedFunctionOnEveryInput) {
  KVRING_SKIP_WITHOUT_GPU();
  auto r = cuda::testing::sweep_f16_conversion();
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  EXPECT_EQ(r->checked, std::uint64_t{1} << 32);
  EXPECT_EQ(r->mismatches, 0u) << "first at 0x" << std::hex << r->first_input;
}

TEST(CudaStore, ZeroFilledAtCreationAndOnAdd) {
  KVRING_SKIP_WITHOUT_GPU();
  auto s = testing::new_store(BackendKind::kCuda, config(), options());
  ASSERT_TRUE(s);
  auto a = *s->add_sequence();
  const ModelConfig c = config();
  const auto x = random_floats(static_cast<std::size_t>(40 * c.kv_dim() * c.n_layers), 4);
  const SeqSpan span{a, 0, 40};
  ASSERT_TRUE(s->store_all_layers(std::span(&span, 1), host_view(x.data(), 40 * c.n_layers, c.kv_dim()),
                                  host_view(x.data(), 40 * c.n_layers, c.kv_dim())).ok());
  ASSERT_TRUE(s->remove_sequence(a).ok());
  auto b = *s->add_sequence();  // the same slot
  const auto im = seq_image(*s, b);
  for (std::size_t l = 0; l < im.k.size(); ++l)
    for (std::size_t i = 0; i < im.k[l].size(); ++i) ASSERT_TRUE(im.k[l][i] == 0 && im.v[l][i] == 0);
}

// An add, a reset and a fork set the rows of every ring of their slot in
// one call: with 600 sliding rings (1200 planes' ranges a clear, 2400 a
// fork into a slot a wrap left, so two and three launches), rows of 34
// bytes (ranges at addresses that are not 16-byte aligned) and of 128, and
// with rings of 64 Ki elements a plane (many blocks a range), the CUDA
// store's planes equal the CPU store's after the same calls. Each call
// runs with an error of the caller's pending on the thread (a failed
// cudaMalloc): the calls succeed and leave it for the caller to read.
TEST(CudaStore, ClearsAndForksOfManyRingsEqualTheCpuStore) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig configs[] = {make_hybrid_config("rings", 700, 7, 2, 1, 17, 24, 64),
                                 make_hybrid_config("rings", 700, 7, 2, 1, 64, 24, 64),
                                 make_hybrid_config("wide-rings", 4, 2, 4, 2, 128, 500, 1024)};
  for (const ModelConfig& c : configs) {
    SCOPED_TRACE(c.name + " head_dim " + std::to_string(c.head_dim));
    const StoreOptions o{.max_sequences = 3, .context = c.max_context, .slack = 4, .block_rows = 16};
    const std::int64_t kv = c.kv_dim(), cap = testing::new_store(BackendKind::kCpu, c, o)->capacity(0);
    ASSERT_GE(cap, c.sliding_window);
    const auto x = random_floats(static_cast<std::size_t>((cap + 7) * kv * c.n_layers), 31);
    std::vector<testing::SeqImage> images[2];
    for (const BackendKind kind : {BackendKind::kCpu, BackendKind::kCuda}) {
      auto s = testing::new_store(kind, c, o);
      ASSERT_TRUE(s);
      const bool cuda = kind == BackendKind::kCuda;
      // The call `f` succeeds with a caller's error pending, which stays.
      auto pending = [&](auto f) {
        if (cuda) testing::leave_pending_error();
        f();
        if (cuda) {
          EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation) << "the caller's error was consumed";
        }
      };
      auto write = [&](SeqId seq, std::int64_t count) {
        const SeqSpan span{seq, 0, count};
        const ConstView view = host_view(x.data(), count * c.n_layers, kv);
        pending([&] { ASSERT_TRUE(s->store_all_layers(std::span(&span, 1), view, view).ok()); });
      };
      auto add = [&](auto call) {
        SeqId id{};
        pending([&] {
          auto r = call();
          ASSERT_TRUE(r.ok()) << r.error().to_string();
          id = *r;
        });
        return id;
      };
      std::vector<testing::SeqImage>& im = images[cuda];
      const SeqId a = add([&] { return s->add_sequence(); });
      write(a, cap + 7);
      const SeqId b = add([&] { return s->add_sequence(); });
      write(b, 9);
      ASSERT_TRUE(s->remove_sequence(a).ok());
      const SeqId f = add([&] { return s->fork_sequence(b); });  // into a's slot: 9 rows copied, the rest cleared
      im.push_back(seq_image(*s, f));
      im.push_back(seq_image(*s, b));
      pending([&] { ASSERT_TRUE(s->reset_sequence(b).ok()); });
      im.push_back(seq_image(*s, b));
      write(b, 5);
      const SeqId g = add([&] { return s->fork_sequence(b); });  // into a fresh slot: copies only
      im.push_back(seq_image(*s, g));
      ASSERT_TRUE(s->remove_sequence(f).ok());
      const SeqId h = add([&] { return s->add_sequence(); });  // f's slot, cleared
      im.push_back(seq_image(*s, h));
    }
    ASSERT_EQ(images[0].size(), images[1].size());
    EXPECT_TRUE(images[0][0] == images[0][1]) << "the CPU fork differs from its source";
    EXPECT_FALSE(images[0][0] == images[0][2]) << "the source held only zeros";
    const char* what[] = {"the fork into a wrapped slot", "its source", "the source reset", "a fork into a fresh slot",
                          "an add into the fork's slot"};
    for (std::size_t i = 0; i < images[0].size(); ++i) EXPECT_TRUE(images[0][i] == images[1][i]) << what[i];
  }
}

// store_all_layers of a batch equals per-layer stores, on any slots, and the
// CPU backend's bytes.
TEST(CudaStore, AllLayersBatchEqualsPerLayerStoresAndTheCpu) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim();
  auto a = testing::new_store(BackendKind::kCuda, c, options());
  auto b = testing::new_store(BackendKind::kCuda, c, options());
  auto cpu = testing::new_store(BackendKind::kCpu, c, options());
  ASSERT_TRUE(a && b && cpu);
  const auto ia = testing::add_with_churn(*a, 3, 1), ib = testing::add_with_churn(*b, 3, 2),
             ic = testing::add_with_churn(*cpu, 3, 3);
  std::mt19937_64 rng(5);
  std::vector<std::int64_t> at(3, 0);
  for (int step = 0; step < 12; ++step) {
    std::vector<int> order = {0, 1, 2};
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<SeqSpan> sa, sb, sc;
    std::int64_t rows = 0;
    std::vector<std::int64_t> counts;
    for (int i : order) {
      const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 30);
      sa.push_back({ia[static_cast<std::size_t>(i)], at[static_cast<std::size_t>(i)], n});
      sb.push_back({ib[static_cast<std::size_t>(i)], at[static_cast<std::size_t>(i)], n});
      sc.push_back({ic[static_cast<std::size_t>(i)], at[static_cast<std::size_t>(i)], n});
      at[static_cast<std::size_t>(i)] += n;
      rows += n;
    }
    const auto k = random_floats(static_cast<std::size_t>(rows * kv * c.n_layers), rng());
    const auto v = random_floats(k.size(), rng());
    const auto hk = host_view(k.data(), rows * c.n_layers, kv), hv = host_view(v.data(), rows * c.n_layers, kv);
    DeviceArray<float> dk(k), dv(v);
    ASSERT_TRUE(a->store_all_layers(sa, testing::device_in(dk.get(), rows * c.n_layers, kv),
                                    testing::device_in(dv.get(), rows * c.n_layers, kv)).ok());
    ASSERT_TRUE(cpu->store_all_layers(sc, hk, hv).ok());
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      ASSERT_TRUE(b->store(l, sb, host_view(k.data() + l * rows * kv, rows, kv),
                           host_view(v.data() + l * rows * kv, rows, kv)).ok());
    ASSERT_TRUE(a->synchronize().ok());
  }
  for (std::size_t i = 0; i < 3; ++i) {
    const auto x = seq_image(*a, ia[i]);
    EXPECT_TRUE(x == seq_image(*b, ib[i])) << i;
    EXPECT_TRUE(x == seq_image(*cpu, ic[i])) << i;
  }
}

// A store's descriptors travel three ways (one span in the launch's
// parameters; up to 30 KiB of spans, table writes and block lists in
// them; more through an uploaded buffer), with or without new blocks; each
// way writes the CPU backend's bytes, and the block-table mirror the reads
// go through is right after each.
TEST(CudaStore, StoreDescriptorsTravelEveryWay) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim();
  constexpr int kSeqs = 200;  // 200 x 4 layers of spans: past 30 KiB
  auto gpu = testing::new_store(BackendKind::kCuda, c, options(kSeqs));
  auto cpu = testing::new_store(BackendKind::kCpu, c, options(kSeqs));
  ASSERT_TRUE(gpu && cpu);
  std::vector<SeqId> g, h;
  for (int i = 0; i < kSeqs; ++i) {
    auto a = gpu->add_sequence();
    auto b = cpu->add_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    g.push_back(*a);
    h.push_back(*b);
  }
  std::mt19937_64 rng(23);
  std::vector<std::int64_t> at(kSeqs, 0);
  // A store of `n` rows into each of sequences [0, seqs) and every layer:
  // in one call, or a call a layer.
  auto store = [&](int seqs, std::int64_t n, bool one_call) {
    std::vector<SeqSpan> sg, sh;
    for (int i = 0; i < seqs; ++i) {
      sg.push_back({g[static_cast<std::size_t>(i)], at[static_cast<std::size_t>(i)], n});
      sh.push_back({h[static_cast<std::size_t>(i)], at[static_cast<std::size_t>(i)], n});
    }
    if (one_call) {
      const std::int64_t rows = seqs * n * c.n_layers;
      const auto k = random_floats(static_cast<std::size_t>(rows * kv), rng());
      const auto v = random_floats(k.size(), rng());
      DeviceArray<float> dk(k), dv(v);
      ASSERT_TRUE(gpu->store_all_layers(sg, testing::device_in(dk.get(), rows, kv),
                                        testing::device_in(dv.get(), rows, kv)).ok());
      ASSERT_TRUE(cpu->store_all_layers(sh, host_view(k.data(), rows, kv), host_view(v.data(), rows, kv)).ok());
    } else {
      for (std::int64_t l = 0; l < c.n_layers; ++l) {
        const auto lk = random_floats(static_cast<std::size_t>(seqs * n * kv), rng());
        const auto lv = random_floats(lk.size(), rng());
        DeviceArray<float> ldk(lk), ldv(lv);
        ASSERT_TRUE(gpu->store(l, sg, testing::device_in(ldk.get(), seqs * n, kv),
                               testing::device_in(ldv.get(), seqs * n, kv)).ok());
        ASSERT_TRUE(cpu->store(l, sh, host_view(lk.data(), seqs * n, kv), host_view(lv.data(), seqs * n, kv)).ok());
        ASSERT_TRUE(gpu->synchronize().ok());
      }
    }
    ASSERT_TRUE(gpu->synchronize().ok());
    for (int i = 0; i < seqs; ++i) at[static_cast<std::size_t>(i)] += n;
  };
  auto same = [&](int seqs) {
    for (int i = 0; i < seqs; ++i)
      ASSERT_TRUE(seq_image(*gpu, g[static_cast<std::size_t>(i)]) == seq_image(*cpu, h[static_cast<std::size_t>(i)]))
          << "sequence " << i;
  };
  // One sequence, a call a layer: 37 rows (a full layer's call takes new
  // blocks: one span with table writes, in the parameters), then 3 rows
  // inside its last block (one span, no writes).
  store(1, 37, false);
  store(1, 3, false);
  same(1);
  // Four sequences into every layer at once, across a block boundary and
  // inside one: up to 30 KiB in the parameters.
  store(4, 20, true);
  store(4, 2, true);
  same(4);
  // Every sequence into every layer: 800 spans, uploaded, with new blocks
  // for most and without.
  store(kSeqs, 17, true);
  store(kSeqs, 1, true);
  same(kSeqs);
}

// A fork shares the prefix; writes past it change only the writer, and a
// truncated sequence rewritten equals one that never held the old rows.
TEST(CudaStore, ForkAndTruncateKeepSequencesApart) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const auto base = testing::seq_inputs(c, 100, 21), other = testing::seq_inputs(c, 100, 22);
  // Sequence X: base[0, 60) then other[60, 100); Y: base[0, 100).
  testing::SeqInputs x = base;
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    for (std::int64_t p = 60; p < 100; ++p) {
      std::memcpy(x.k.data() + (l * 100 + p) * kv, other.k.data() + (l * 100 + p) * kv, kv * 4);
      std::memcpy(x.v.data() + (l * 100 + p) * kv, other.v.data() + (l * 100 + p) * kv, kv * 4);
      std::memcpy(x.q.data() + (l * 100 + p) * width, other.q.data() + (l * 100 + p) * width, width * 4);
    }
  auto solo = [&](const testing::SeqInputs& s) {
    auto st = testing::new_store(BackendKind::kCuda, c, options(1));
    auto id = *st->add_sequence();
    testing::Outputs o;
    testing::run_plan(*st, {id}, {s}, {{false, {{0, 100}}}}, o);
    return std::make_pair(seq_image(*st, id), o);
  };
  const auto [img_x, out_x] = solo(x);
  const auto [img_y, out_y] = solo(base);

  auto st = testing::new_store(BackendKind::kCuda, c, options(4));
  auto y = *st->add_sequence();
  std::vector<std::int64_t> prog_y = {0};
  testing::Outputs oy;
  testing::run_plan(*st, {y}, {base}, {{false, {{0, 60}}}}, oy, false, nullptr, &prog_y);
  auto f = st->fork_sequence(y);
  ASSERT_TRUE(f.ok());
  // The fork continues with other[60, 100) in a batch with y's own rows,
  // on device views; y continues with base.
  std::vector<std::int64_t> prog = {60, 60};
  testing::Outputs o;
  testing::run_plan(*st, {*f, y}, {x, base}, {{false, {{0, 17}, {1, 40}}}, {true, {{0, 1}}}, {false, {{0, 22}}}}, o, true,
                    nullptr, &prog);
  EXPECT_TRUE(seq_image(*st, *f) == img_x);
  EXPECT_TRUE(seq_image(*st, y) == img_y);
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    for (std::int64_t p = 60; p < 100; ++p) {
      ASSERT_EQ(o.at({0, l, p}), out_x.at({0, l, p})) << l << " " << p;
      ASSERT_EQ(o.at({1, l, p}), out_y.at({0, l, p})) << l << " " << p;
    }
  // A sequence whose rings have wrapped, truncated by 5 tokens (within the
  // slack of 8) and rewritten with other rows, equals one that never held
  // the old rows.
  const std::int64_t n = 100;
  auto z = *st->add_sequence();
  const auto zin = testing::seq_inputs(c, n, 23), zother = testing::seq_inputs(c, n, 24);
  testing::Outputs oz;
  testing::run_plan(*st, {z}, {zin}, {{false, {{0, n}}}}, oz, true);
  const Status t = st->truncate_sequence(z, 5);
  ASSERT_TRUE(t.ok()) << t.to_string();
  testing::SeqInputs mix = zin;
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    for (std::int64_t p = n - 5; p < n; ++p) {
      std::memcpy(mix.k.data() + (l * n + p) * kv, zother.k.data() + (l * n + p) * kv, kv * 4);
      std::memcpy(mix.v.data() + (l * n + p) * kv, zother.v.data() + (l * n + p) * kv, kv * 4);
    }
  std::vector<std::int64_t> prog_t = {n - 5};
  testing::Outputs ot;
  testing::run_plan(*st, {z}, {mix}, {{false, {{0, 5}}}}, ot, true, nullptr, &prog_t);
  auto solo_mix = testing::new_store(BackendKind::kCuda, c, options(1));
  auto zs = *solo_mix->add_sequence();
  testing::Outputs om;
  testing::run_plan(*solo_mix, {zs}, {mix}, {{false, {{0, n}}}}, om);
  EXPECT_TRUE(seq_image(*st, z) == seq_image(*solo_mix, zs));
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    for (std::int64_t p = n - 5; p < n; ++p) ASSERT_EQ(ot.at({0, l, p}), om.at({0, l, p}));
  // The fork was untouched by all of it.
  EXPECT_TRUE(seq_image(*st, *f) == img_x);
}

// Reads whose K and V outputs overlap are refused, in host and device
// memory; outputs that only touch are read.
TEST(CudaStore, ReadsRefuseOverlappingOutputs) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim();
  auto st = testing::new_store(BackendKind::kCuda, c, options(1));
  const SeqId seq = *st->add_sequence();
  const auto x = random_floats(static_cast<std::size_t>(c.n_layers * 8 * kv), 31);
  const SeqSpan span{seq, 0, 8};
  ASSERT_TRUE(st->store_all_layers({&span, 1}, host_view(x.data(), 8 * c.n_layers, kv),
                                   host_view(x.data(), 8 * c.n_layers, kv)).ok());
  std::vector<std::uint16_t> host(static_cast<std::size_t>(4 * 8 * kv));
  DeviceArray<std::uint16_t> dev(host.size());
  for (const bool on_device : {false, true}) {
    std::uint16_t* base = on_device ? dev.get() : host.data();
    const MemorySpace space = on_device ? MemorySpace::kDevice : MemorySpace::kHost;
    const Status r = st->read_rows(seq, 1, 0, 8, base, base + 4 * kv, space);
    ASSERT_FALSE(r.ok()) << on_device;
    EXPECT_NE(r.error().message.find("the k and v buffers overlap"), std::string::npos) << r.error().to_string();
    EXPECT_TRUE(st->read_rows(seq, 1, 0, 8, base, base + 8 * kv, space).ok()) << on_device;
    EXPECT_TRUE(st->synchronize().ok());
  }
}

// A store made on GPU 1 and driven from a thread whose current device is
// GPU 0 leaves GPU 0 current after every call, and stores and decodes as a
// CPU store does.
TEST(CudaStore, CallsLeaveTheThreadsCurrentDevice) {
  KVRING_SKIP_WITHOUT_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, rows = 40;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  auto g = testing::new_store(BackendKind::kCuda, c, options());
  ASSERT_TRUE(g);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto h = testing::new_store(BackendKind::kCpu, c, options());
  const SeqId gs = *g->add_sequence(), hs = *h->add_sequence();
  auto current = [] {
    int d = -1;
    EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
    return d;
  };
  const auto k = random_floats(static_cast<std::size_t>(rows * kv), 41);
  const auto q = random_floats(static_cast<std::size_t>(width), 42);
  std::vector<float> go(q.size()), ho(q.size());
  const SeqSpan sg{gs, 0, rows}, sh{hs, 0, rows};
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    ASSERT_TRUE(g->store(l, std::span(&sg, 1), host_view(k.data(), rows, kv), host_view(k.data(), rows, kv)).ok());
    EXPECT_EQ(current(), 0);
    ASSERT_TRUE(h->store(l, std::span(&sh, 1), host_view(k.data(), rows, kv), host_view(k.data(), rows, kv)).ok());
    const SeqQuery qg{gs, rows - 1}, qh{hs, rows - 1};
    ASSERT_TRUE(g->attend_decode(l, std::span(&qg, 1), host_view(q.data(), 1, width), host_view(go.data(), 1, width)).ok());
    EXPECT_EQ(current(), 0);
    ASSERT_TRUE(h->attend_decode(l, std::span(&qh, 1), host_view(q.data(), 1, width), host_view(ho.data(), 1, width)).ok());
    for (std::size_t i = 0; i < go.size(); ++i) EXPECT_NEAR(go[i], ho[i], 1e-5f) << l << " " << i;
  }
  EXPECT_TRUE(seq_image(*g, gs) == seq_image(*h, hs));
  EXPECT_EQ(current(), 0);
  g.reset();
  EXPECT_EQ(current(), 0);
}

// f16 and bf16 K/V on the device, strided rows, on a user stream: the bytes
// the CPU backend stores from the same host views.
TEST(CudaStore, DeviceViewsOfEveryDtypeOnAUserStream) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), rows = 37, stride = kv + 8;
  cudaStream_t user = nullptr;
  ASSERT_EQ(cudaStreamCreate(&user), cudaSuccess);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto g = testing::new_store(BackendKind::kCuda, c, options());
    auto h = testing::new_store(BackendKind::kCpu, c, options());
    auto gs = *g->add_sequence();
    auto hs = *h->add_sequence();
    const auto f = random_floats(static_cast<std::size_t>(rows * stride * 2), 31, 3.0f);
    std::vector<std::uint16_t> bits(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) {
      std::uint32_t u;
      std::memcpy(&u, &f[i], 4);
      bits[i] = dt == DType::kF16 ? f32_to_f16(f[i]) : static_cast<std::uint16_t>(u >> 16);
    }
    const void* host = dt == DType::kF32 ? static_cast<const void*>(f.data()) : bits.data();
    const std::size_t bytes = f.size() * static_cast<std::size_t>(dtype_bytes(dt));
    void* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copy has landed (DeviceArray)
    const auto off = rows * stride * dtype_bytes(dt);
    const ConstView dk{dev, MemorySpace::kDevice, dt, rows, kv, stride};
    const ConstView dv{static_cast<char*>(dev) + off, MemorySpace::kDevice, dt, rows, kv, stride};
    const ConstView hk{host, MemorySpace::kHost, dt, rows, kv, stride};
    const ConstView hv{static_cast<const char*>(host) + off, MemorySpace::kHost, dt, rows, kv, stride};
    const SeqSpan sg{gs, 0, rows}, sh{hs, 0, rows};
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      ASSERT_TRUE(g->store(l, std::span(&sg, 1), dk, dv, user).ok());
      ASSERT_TRUE(h->store(l, std::span(&sh, 1), hk, hv).ok());
    }
    ASSERT_TRUE(g->synchronize(user).ok());
    EXPECT_TRUE(seq_image(*g, gs) == seq_image(*h, hs));
    cudaFree(dev);
  }
  cudaStreamDestroy(user);
}

// Snapshots: read_rows / install round trip through another store.
TEST(CudaStore, SnapshotsRoundTripAfterWraps) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  auto a = testing::new_store(BackendKind::kCuda, c, options());
  auto b = testing::new_store(BackendKind::kCuda, c, options());
  const auto ia = testing::add_with_churn(*a, 1, 7);
  const auto ib = testing::add_with_churn(*b, 1, 8);
  const auto in = testing::seq_inputs(c, 150, 41);
  testing::Outputs o;
  testing::run_plan(*a, ia, {in}, testing::random_plan({in}, 3, 40), o);
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const RingState r = *a->ring(ia[0], l);
    std::vector<std::uint16_t> k(static_cast<std::size_t>(r.len() * c.kv_dim())), v(k.size());
    ASSERT_TRUE(a->read_rows(ia[0], l, r.origin_logical(), r.len(), k.data(), v.data()).ok());
    auto seq = RingState::sequential(r.capacity(), r.wraps(), r.next_position());
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(b->install(ib[0], l, *seq, k.data(), v.data()).ok());
    std::vector<std::uint16_t> k2(k.size()), v2(k.size());
    ASSERT_TRUE(b->read_rows(ib[0], l, r.origin_logical(), r.len(), k2.data(), v2.data()).ok());
    EXPECT_EQ(k, k2);
    EXPECT_EQ(v, v2);
  }
}

// A pack written from a CUDA store's sequence, planes a group at a time, is the
// file the same history gives on the CPU backend, and restores there and
// into a CUDA store, a group of planes at a time; a damaged one changes
// neither.
TEST(CudaStore, APackOfASequenceIsTheCpuBackendsPack) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  // Removed with everything in it however the test ends.
  struct TempDir {
    std::string path;
    ~TempDir() {
      if (!path.empty()) std::filesystem::remove_all(path);
    }
  } temp;
  std::string pattern = (std::filesystem::temp_directory_path() / "kvring-cuda-pack-XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  temp.path = pattern;
  const std::string& dir = temp.path;
  auto gpu = testing::new_store(BackendKind::kCuda, c, options());
  auto cpu = testing::new_store(BackendKind::kCpu, c, options());
  const auto ig = testing::add_with_churn(*gpu, 2, 17);
  const auto ic = testing::add_with_churn(*cpu, 2, 18);
  const std::vector<testing::SeqInputs> in = {testing::seq_inputs(c, 150, 43), testing::seq_inputs(c, 9, 44)};
  const auto plan = testing::random_plan(in, 5, 40);
  testing::Outputs og, oc;
  testing::run_plan(*gpu, ig, in, plan, og);
  testing::run_plan(*cpu, ic, in, plan, oc);
  const std::vector<std::int32_t> ids(150, 7);
  // add_with_churn leaves no free slot in `cpu`: restores go to a store of
  // their own.
  auto target = testing::new_store(BackendKind::kCpu, c, options());
  auto gpu_target = testing::new_store(BackendKind::kCuda, c, options());
  for (std::size_t i = 0; i < ig.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    const std::vector<std::int32_t> seq_ids(ids.begin(), ids.begin() + in[i].len);
    for (const Encoding enc : {Encoding::kF16Le, Encoding::kF32Le}) {
      const WriteOptions o{.encoding = enc, .chunk_tokens = 16};
      const Status wg = write_pack(*gpu, ig[i], dir + "/gpu.kvpack", seq_ids, "m", o);
      ASSERT_TRUE(wg.ok()) << wg.to_string();
      ASSERT_TRUE(write_pack(*cpu, ic[i], dir + "/cpu.kvpack", seq_ids, "m", o).ok());
      const auto bytes = [](const std::string& path) {
        auto src = open_pack_file(path);
        EXPECT_TRUE(src.ok());
        std::vector<std::uint8_t> out(src.ok() ? static_cast<std::size_t>((*src)->size()) : 0);
        if (src.ok()) {
          EXPECT_TRUE((*src)->read_at(0, (*src)->size(), out.data()).ok());
        }
        return out;
      };
      const auto want = bytes(dir + "/cpu.kvpack");
      ASSERT_FALSE(want.empty());
      EXPECT_TRUE(bytes(dir + "/gpu.kvpack") == want);
      // Restored on the CPU backend, the sequence writes the same pack.
      auto src = open_pack_file(dir + "/gpu.kvpack");
      ASSERT_TRUE(src.ok());
      auto back = restore_pack(**src, {}, *target);
      ASSERT_TRUE(back.ok()) << back.error().to_string();
      ASSERT_TRUE(write_pack(*target, *back, dir + "/back.kvpack", seq_ids, "m", o).ok());
      EXPECT_TRUE(bytes(dir + "/back.kvpack") == want);
      ASSERT_TRUE(target->remove_sequence(*back).ok());
      // Restored into a GPU store a plane at a time, the same. A chunk
      // damaged in the last plane leaves that store as it was.
      auto on_gpu = pack_internal::restore_pack_in_groups(**src, {}, *gpu_target, nullptr, 1);
      ASSERT_TRUE(on_gpu.ok()) << on_gpu.error().to_string();
      ASSERT_TRUE(write_pack(*gpu_target, *on_gpu, dir + "/back-gpu.kvpack", seq_ids, "m", o).ok());
      EXPECT_TRUE(bytes(dir + "/back-gpu.kvpack") == want);
      ASSERT_TRUE(gpu_target->remove_sequence(*on_gpu).ok());
      std::vector<std::uint8_t> bad = want;
      bad[bad.size() - 3] ^= 0x20;
      auto damaged = memory_pack_source(bad.data(), static_cast<std::int64_t>(bad.size()), "bad.kvpack");
      const std::int64_t free_blocks = gpu_target->free_blocks();
      auto refused = pack_internal::restore_pack_in_groups(*damaged, {}, *gpu_target, nullptr, 1);
      ASSERT_FALSE(refused.ok());
      EXPECT_EQ(refused.error().code, ErrorCode::kCorruption) << refused.error().to_string();
      EXPECT_EQ(gpu_target->free_blocks(), free_blocks);
      EXPECT_EQ(gpu_target->sequence_count(), 0);
    }
  }
}

// The scratch of a prefill call (its chunk's f16 rows) stays with the
// store, counted by workspace_bytes, until release_scratch hands it back;
// calls after that take it again and give the same outputs. While the
// store's stream is being captured, release_scratch refuses and the
// capture goes on.
TEST(CudaStore, ScratchStaysUntilReleased) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  auto made = CudaStore::create(c, options());
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  CudaStore& st = **made;
  const std::int64_t n = 100, kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const std::vector<float> k = random_floats(static_cast<std::size_t>(n * kv), 1);
  const std::vector<float> v = random_floats(static_cast<std::size_t>(n * kv), 2);
  const std::vector<float> q = random_floats(static_cast<std::size_t>(n * width), 3);
  std::vector<float> first(static_cast<std::size_t>(n * width)), again(first.size());
  auto prefill = [&](std::int64_t layer, std::vector<float>& out) {
    auto id = st.add_sequence();
    ASSERT_TRUE(id.ok());
    const SeqSpan span{*id, 0, n};
    ASSERT_TRUE(st.prefill(layer, std::span(&span, 1), host_view(k.data(), n, kv), host_view(v.data(), n, kv),
                           host_view(q.data(), n, width), host_view(out.data(), n, width))
                    .ok());
  };
  prefill(0, first);
  const std::int64_t kept = st.workspace_bytes();
  ASSERT_TRUE(st.release_scratch().ok());
  const std::int64_t released = st.workspace_bytes();
  EXPECT_GE(kept - released, n * kv * 2 * 2) << "the chunk's f16 K and V rows";
  prefill(0, again);
  EXPECT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)), 0);
  EXPECT_GE(st.workspace_bytes(), released + n * kv * 2 * 2);

  ASSERT_EQ(cudaStreamBeginCapture(st.stream(), cudaStreamCaptureModeRelaxed), cudaSuccess);
  const Status refused = st.release_scratch();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(st.stream(), &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.to_string().find("captured"), std::string::npos) << refused.to_string();
  EXPECT_GE(st.workspace_bytes(), released + n * kv * 2 * 2) << "a refused release keeps the scratch";
}

// Attention sinks on the CUDA store: a model whose config has them is
// refused attention until its layer's sinks are set, then attends as the
// CPU store with the same sinks; set on the device in order after the
// store's earlier work, they count in workspace_bytes; removed, the layer
// gives the bits of a store that never had them. While the store's stream
// is being captured, setting them is refused and leaves them unchanged.
TEST(CudaStore, AttentionSinksApplyAndAreRemoved) {
  KVRING_SKIP_WITHOUT_GPU();
  ModelConfig c = config();
  c.attention_sinks = true;
  const std::int64_t n = 40, kv = c.kv_dim(), width = c.n_heads * c.head_dim, layer = 1;
  const std::vector<float> k = random_floats(static_cast<std::size_t>(n * kv), 3, 1.0f),
                           v = random_floats(static_cast<std::size_t>(n * kv), 4, 1.0f),
                           q = random_floats(static_cast<std::size_t>(n * width), 5, 1.0f);
  std::vector<float> sinks(static_cast<std::size_t>(c.n_heads));
  for (std::size_t h = 0; h < sinks.size(); ++h) sinks[h] = 0.75f * static_cast<float>(h) - 1.0f;
  auto made = CudaStore::create(c, options(1));
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  CudaStore& g = **made;
  auto cpu = testing::new_store(BackendKind::kCpu, c, options(1));
  ASSERT_TRUE(cpu);
  // A prefill of the n rows into a fresh sequence; its outputs.
  auto prefill = [&](KvStore& s, std::vector<float>& out) -> Status {
    out.assign(static_cast<std::size_t>(n * width), 0.25f);
    auto id = s.add_sequence();
    if (!id.ok()) return id.status();
    const SeqSpan span{*id, 0, n};
    Status st = s.prefill(layer, std::span(&span, 1), host_view(k.data(), n, kv), host_view(v.data(), n, kv),
                          host_view(q.data(), n, width), host_view(out.data(), n, width));
    if (Status r = s.remove_sequence(*id); st.ok()) st = r;
    return st;
  };
  std::vector<float> got, want, plain;
  const Status refused = prefill(g, got);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::kConfig) << refused.to_string();
  EXPECT_NE(refused.to_string().find("set_attention_sinks"), std::string::npos) << refused.to_string();
  EXPECT_EQ(got, std::vector<float>(got.size(), 0.25f));

  const std::int64_t before = g.workspace_bytes();
  ASSERT_TRUE(g.set_attention_sinks(layer, sinks).ok());
  EXPECT_EQ(g.workspace_bytes(), before + c.n_layers * c.n_heads * 4);
  ASSERT_TRUE(cpu->set_attention_sinks(layer, sinks).ok());
  ASSERT_TRUE(prefill(g, got).ok());
  ASSERT_TRUE(prefill(*cpu, want).ok());
  double worst = 0;
  for (std::size_t e = 0; e < want.size(); ++e)
    worst = std::max(worst, std::abs(double(got[e]) - want[e]) / std::max(1.0, std::abs(double(want[e]))));
  EXPECT_LE(worst, 1e-5);

  // Refused during a capture of the store's stream; the sinks stay.
  ASSERT_EQ(cudaStreamBeginCapture(g.stream(), cudaStreamCaptureModeRelaxed), cudaSuccess);
  const Status capturing = g.set_attention_sinks(layer, {});
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(g.stream(), &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  ASSERT_FALSE(capturing.ok());
  EXPECT_EQ(capturing.error().code, ErrorCode::kInvalidArgument) << capturing.to_string();
  EXPECT_EQ(g.attention_sinks(layer).size(), sinks.size());
  std::vector<float> again;
  ASSERT_TRUE(prefill(g, again).ok());
  EXPECT_EQ(std::memcmp(again.data(), got.data(), got.size() * 4), 0);

  // Removed: the bits of a store without sinks (a config without them).
  ModelConfig without = c;
  without.attention_sinks = false;
  auto other = testing::new_store(BackendKind::kCuda, without, options(1));
  ASSERT_TRUE(other);
  ASSERT_TRUE(prefill(*other, plain).ok());
  EXPECT_NE(std::memcmp(plain.data(), got.data(), got.size() * 4), 0) << "the sinks moved the outputs";
  ModelConfig removable = without;
  auto r = CudaStore::create(removable, options(1));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE((*r)->set_attention_sinks(layer, sinks).ok());
  ASSERT_TRUE((*r)->set_attention_sinks(layer, {}).ok());
  EXPECT_TRUE((*r)->attention_sinks(layer).empty());
  ASSERT_TRUE(prefill(**r, again).ok());
  EXPECT_EQ(std::memcmp(again.data(), plain.data(), plain.size() * 4), 0);
}

TEST(CudaStore, RefusalsLeaveTheStoreUnchanged) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  auto s = testing::new_store(BackendKind::kCuda, c, {.max_sequences = 2, .context = 512, .block_rows = 16, .pool_blocks = 6});
  ASSERT_TRUE(s);
  auto a = *s->add_sequence();
  const auto in = testing::seq_inputs(c, 40, 51);
  testing::Outputs o;
  testing::run_plan(*s, {a}, {in}, {{false, {{0, 40}}}}, o);
  const auto before = seq_image(*s, a);
  const std::int64_t free_before = s->free_blocks();
  const std::int64_t n = 8;
  DeviceArray<float> k(random_floats(static_cast<std::size_t>(n * kv), 1)), q(static_cast<std::size_t>(n * width + 4)),
      out(static_cast<std::size_t>(n * width + 4));
  const SeqSpan span{a, 40, n};
  const std::int64_t full_layer = 1;
  auto check = [&](const Status& st, const char* what) {
    EXPECT_FALSE(st.ok()) << what;
    EXPECT_TRUE(seq_image(*s, a) == before) << what;
    EXPECT_EQ(s->free_blocks(), free_before) << what;
  };
  // q on the device as f16: unsupported.
  check(s->prefill(full_layer, std::span(&span, 1), testing::device_in(k.get(), n, kv), testing::device_in(k.get(), n, kv),
                   ConstView{q.get(), MemorySpace::kDevice, DType::kF16, n, width, width},
                   device_view(out.get(), n, width)),
        "f16 device q");
  // out rows not 16-byte aligned.
  check(s->prefill(full_layer, std::span(&span, 1), testing::device_in(k.get(), n, kv), testing::device_in(k.get(), n, kv),
                   testing::device_in(q.get(), n, width), MutView{out.get(), MemorySpace::kDevice, DType::kF32, n, width, width + 1}),
        "out stride");
  // Host memory passed as device memory.
  std::vector<float> hostk(static_cast<std::size_t>(n * kv));
  check(s->store(full_layer, std::span(&span, 1), ConstView{hostk.data(), MemorySpace::kDevice, DType::kF32, n, kv, kv},
                 testing::device_in(k.get(), n, kv)),
        "host memory as device");
  // Device memory passed as host memory: the staging copies would fault.
  check(s->store(full_layer, std::span(&span, 1), ConstView{k.get(), MemorySpace::kHost, DType::kF32, n, kv, kv},
                 testing::device_in(k.get(), n, kv)),
        "device memory as host");
  check(s->prefill(full_layer, std::span(&span, 1), testing::device_in(k.get(), n, kv), testing::device_in(k.get(), n, kv),
                   testing::device_in(q.get(), n, width), MutView{out.get(), MemorySpace::kHost, DType::kF32, n, width, width}),
        "device out as host");
  // 2^31 query rows, more than the launches index, in views that claim rows
  // their buffers do not hold: refused before any row is read, as views
  // past their allocations (ViewsPastTheirAllocationsAreRefused).
  {
    const std::int64_t huge = std::int64_t{1} << 31;
    const std::int64_t sliding_layer = 0;
    ASSERT_EQ(c.kind(sliding_layer), LayerKind::kSlidingRope);
    const SeqSpan hspan{a, 40, huge};
    const Status st = s->prefill(sliding_layer, std::span(&hspan, 1), testing::device_in(k.get(), huge, kv),
                                 testing::device_in(k.get(), huge, kv), testing::device_in(q.get(), huge, width),
                                 device_view(out.get(), huge, width));
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.to_string().find("allocation"), std::string::npos) << st.to_string();
    check(st, "2^31 query rows");
    // In host views, which carry no extent to check, the launches' limit
    // refuses them, before a row is read.
    std::vector<float> hq(static_cast<std::size_t>(n * width)), hout(hq.size());
    const Status hst = s->prefill(sliding_layer, std::span(&hspan, 1), testing::host_in(hostk.data(), huge, kv),
                                  testing::host_in(hostk.data(), huge, kv), testing::host_in(hq.data(), huge, width),
                                  host_view(hout.data(), huge, width));
    EXPECT_EQ(hst.error().code, ErrorCode::kUnsupported) << hst.to_string();
    check(hst, "2^31 query rows in host views");
  }
  // A position that does not follow.
  const SeqSpan gap{a, 41, n};
  check(s->store(full_layer, std::span(&gap, 1), testing::device_in(k.get(), n, kv), testing::device_in(k.get(), n, kv)), "gap");
  // The pool runs dry part-way through an all-layers store.
  const std::int64_t big = 200;
  DeviceArray<float> kb(static_cast<std::size_t>(big * kv * c.n_layers));
  const SeqSpan bspan{a, 40, big};
  check(s->store_all_layers(std::span(&bspan, 1), testing::device_in(kb.get(), big * c.n_layers, kv),
                            testing::device_in(kb.get(), big * c.n_layers, kv)),
        "pool exhausted");
  ASSERT_TRUE(s->synchronize().ok());
}

// A device view that runs past the memory that holds it is refused before
// anything is read or written (a kernel past it would fault, and the GPU's
// context would be lost), and leaves the store as it was; views that fill
// their allocations exactly, or run across two allocations mapped back to
// back, are taken. The refusals end a few bytes past the mapped range (its
// size is the driver's granularity, so nothing rounds it up).
TEST(CudaStore, ViewsPastTheirAllocationsAreRefused) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  auto s = testing::new_store(BackendKind::kCuda, c, options());
  ASSERT_TRUE(s);
  auto a = *s->add_sequence();
  const auto in = testing::seq_inputs(c, 40, 61);
  testing::Outputs o;
  testing::run_plan(*s, {a}, {in}, {{false, {{0, 40}}}}, o);
  const auto before = seq_image(*s, a);
  const std::int64_t n = 8;
  const std::int64_t full_layer = 1;
  ASSERT_EQ(c.kind(full_layer), LayerKind::kFullNope);
  testing::MappedPieces b2b(2);  // two pieces back to back
  b2b.map();
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<float> fill = random_floats(static_cast<std::size_t>(1024 * width), 6);
  ASSERT_EQ(cudaMemcpy(b2b.end() - fill.size() * sizeof(float), fill.data(), fill.size() * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  for (char* at : {b2b.at(1) - fill.size() * sizeof(float), b2b.at(1)})
    ASSERT_EQ(cudaMemcpy(at, fill.data(), fill.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  // The copies land before the store's streams, which do not wait for the
  // legacy stream, read them.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // `bytes` before the end, plus `over` past it.
  auto floats_at_end = [&](std::int64_t floats, std::int64_t over) {
    return reinterpret_cast<float*>(b2b.end() - (floats - over) * static_cast<std::int64_t>(sizeof(float)));
  };
  auto refused = [&](const Status& st, const char* what) {
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_NE(st.to_string().find("allocation"), std::string::npos) << what << ": " << st.to_string();
    EXPECT_TRUE(seq_image(*s, a) == before) << what;
  };
  DeviceArray<float> k(random_floats(static_cast<std::size_t>(n * kv), 3)),
      v(random_floats(static_cast<std::size_t>(n * kv), 4)), q(random_floats(static_cast<std::size_t>(n * width), 5)),
      out(static_cast<std::size_t>(n * width));
  const SeqSpan span{a, 40, n};
  refused(s->store(full_layer, std::span(&span, 1), testing::device_in(floats_at_end(n * kv, 1), n, kv),
                   testing::device_in(v.get(), n, kv)),
          "k one float past");
  refused(s->store(full_layer, std::span(&span, 1), testing::device_in(k.get(), n, kv),
                   testing::device_in(floats_at_end(n * kv, 1), n, kv)),
          "v one float past");
  // The last row's end bounds the view, not n row strides: a view whose
  // stride runs past the end but whose last row ends there is taken below.
  const std::int64_t strided = (n - 1) * (width + 4) + width;
  refused(s->prefill(full_layer, std::span(&span, 1), testing::device_in(k.get(), n, kv), testing::device_in(v.get(), n, kv),
                     testing::device_in(q.get(), n, width),
                     MutView{floats_at_end(strided, 4), MemorySpace::kDevice, DType::kF32, n, width, width + 4}),
          "out of a wider stride, 4 floats past");
  const SeqQuery last{a, 39};
  refused(s->attend_decode(full_layer, {&last, 1}, testing::device_in(floats_at_end(width, 4), 1, width),
                           device_view(out.get(), 1, width)),
          "q 4 floats past");
  refused(s->attend_decode(full_layer, {&last, 1}, testing::device_in(q.get(), 1, width),
                           device_view(floats_at_end(width, 4), 1, width)),
          "out 4 floats past");
  // Row buffers: 40 live rows, the last one's final value past the end.
  auto* rk = reinterpret_cast<std::uint16_t*>(b2b.end()) - 40 * kv + 1;
  DeviceArray<std::uint16_t> rv(static_cast<std::size_t>(40 * kv));
  refused(s->read_rows(a, full_layer, 0, 40, rk, rv.get(), MemorySpace::kDevice), "read_rows, one value past");
  RingState whole = before.rings[static_cast<std::size_t>(full_layer)];
  ASSERT_EQ(whole.len(), 40);
  auto d = *s->add_detached_sequence();
  const RingState d_ring = *s->ring(d, full_layer);
  const std::int64_t d_blocks = *s->blocks_held(d), free_blocks = s->free_blocks();
  const Status ist = s->install(d, full_layer, whole, rk, rv.get(), MemorySpace::kDevice);
  EXPECT_EQ(ist.error().code, ErrorCode::kInvalidArgument) << ist.to_string();
  EXPECT_NE(ist.to_string().find("allocation"), std::string::npos) << ist.to_string();
  EXPECT_TRUE(*s->ring(d, full_layer) == d_ring);
  EXPECT_EQ(*s->blocks_held(d), d_blocks);
  EXPECT_EQ(s->free_blocks(), free_blocks);
  ASSERT_TRUE(s->synchronize().ok());

  // Views that end exactly at the end are taken: k and v (rows 40 to 47),
  // then a strided out whose last row ends there (rows 48 to 55).
  ASSERT_TRUE(s->store(full_layer, std::span(&span, 1), testing::device_in(floats_at_end(n * kv, 0), n, kv),
                       testing::device_in(floats_at_end(n * kv, 0), n, kv))
                  .ok());
  const SeqSpan next{a, 48, n};
  ASSERT_TRUE(s->prefill(full_layer, std::span(&next, 1), testing::device_in(k.get(), n, kv),
                         testing::device_in(v.get(), n, kv), testing::device_in(q.get(), n, width),
                         MutView{floats_at_end(strided, 0), MemorySpace::kDevice, DType::kF32, n, width, width + 4})
                  .ok());
  ASSERT_TRUE(s->synchronize().ok());
  const std::int64_t live = 56;
  std::vector<std::uint16_t> hk(static_cast<std::size_t>(live * kv)), hv(hk.size());
  ASSERT_TRUE(s->read_rows(a, full_layer, 0, live, hk.data(), hv.data()).ok());
  for (std::int64_t i = 0; i < n * kv; ++i) {
    const std::uint16_t want = f32_to_f16(fill[fill.size() - static_cast<std::size_t>(n * kv - i)]);
    ASSERT_EQ(hk[static_cast<std::size_t>(40 * kv + i)], want) << "k value " << i;
    ASSERT_EQ(hv[static_cast<std::size_t>(40 * kv + i)], want) << "v value " << i;
  }
  auto* fk = reinterpret_cast<std::uint16_t*>(b2b.end()) - live * kv;
  DeviceArray<std::uint16_t> fv(static_cast<std::size_t>(live * kv));
  ASSERT_TRUE(s->read_rows(a, full_layer, 0, live, fk, fv.get(), MemorySpace::kDevice).ok());
  ASSERT_TRUE(s->synchronize().ok());
  std::vector<std::uint16_t> back(hk.size());
  ASSERT_EQ(cudaMemcpy(back.data(), fk, back.size() * sizeof(std::uint16_t), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, hk);
  EXPECT_EQ(fv.download(), hv);

  // Rows across the seam between the two allocations are taken, and read
  // the values on both sides.
  const std::int64_t take = 400;
  const float* src = reinterpret_cast<const float*>(b2b.at(1)) - (take / 2) * kv;
  auto b = *s->add_sequence();
  const SeqSpan across{b, 0, take};
  ASSERT_TRUE(s->store(full_layer, std::span(&across, 1), testing::device_in(src, take, kv),
                       testing::device_in(src, take, kv))
                  .ok());
  ASSERT_TRUE(s->synchronize().ok());
  std::vector<float> want(static_cast<std::size_t>(take * kv));
  ASSERT_EQ(cudaMemcpy(want.data(), src, want.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<std::uint16_t> gk(want.size()), gv(want.size());
  ASSERT_TRUE(s->read_rows(b, full_layer, 0, take, gk.data(), gv.data()).ok());
  for (std::size_t i = 0; i < want.size(); ++i) ASSERT_EQ(gk[i], f32_to_f16(want[i])) << "element " << i;
  EXPECT_EQ(gk, gv);
}

// A caller's stream of another GPU is refused (kInvalidArgument) before
// the store changes: launched there, the store's kernels would fail after
// the call began to write rows, and a sequence whose sliding rings are
// full would be refused until reset.
TEST(CudaStore, AStreamOfAnotherGpuIsRefused) {
  KVRING_SKIP_WITHOUT_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  if (CUDART_VERSION < 12080) GTEST_SKIP() << "a stream's device is asked from CUDA 12.8 on";
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto s = testing::new_store(BackendKind::kCuda, c, options());
  ASSERT_TRUE(s);
  const SeqId a = *s->add_sequence();
  const auto in = testing::seq_inputs(c, 40, 71);  // past the 32-row rings
  testing::Outputs o;
  testing::run_plan(*s, {a}, {in}, {{false, {{0, 40}}}}, o);
  const auto before = seq_image(*s, a);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceArray<float> k(random_floats(static_cast<std::size_t>(kv), 72)),
      q(random_floats(static_cast<std::size_t>(width), 73)), out(static_cast<std::size_t>(width));
  const SeqSpan next{a, 40, 1};
  const SeqQuery last{a, 39};
  auto refused = [&](const Status& st, const char* what, std::int64_t l) {
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << what << " " << l << ": " << st.to_string();
    EXPECT_NE(st.to_string().find("GPU 1"), std::string::npos) << what << " " << l << ": " << st.to_string();
  };
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    refused(s->store(l, std::span(&next, 1), testing::device_in(k.get(), 1, kv), testing::device_in(k.get(), 1, kv),
                     other),
            "store", l);
    refused(s->prefill(l, std::span(&next, 1), testing::device_in(k.get(), 1, kv), testing::device_in(k.get(), 1, kv),
                       testing::device_in(q.get(), 1, width), device_view(out.get(), 1, width), other),
            "prefill", l);
    refused(s->attend_decode(l, std::span(&last, 1), testing::device_in(q.get(), 1, width),
                             device_view(out.get(), 1, width), other),
            "attend_decode", l);
  }
  EXPECT_TRUE(seq_image(*s, a) == before);
  // Nothing was lost: the same rows on the store's own stream are taken.
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const Status st = s->store(l, std::span(&next, 1), testing::device_in(k.get(), 1, kv),
                               testing::device_in(k.get(), 1, kv));
    EXPECT_TRUE(st.ok()) << l << ": " << st.to_string();
  }
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// Managed memory is host and device memory at once: an out labelled
// device over the K a prefill reads labelled host is refused as any
// overlap of out with k is (the prefill stores K after it writes out).
TEST(CudaStore, ManagedOutputOverHostLabelledRowsIsRefused) {
  KVRING_SKIP_WITHOUT_GPU();
  int managed = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&managed, cudaDevAttrManagedMemory, 0), cudaSuccess);
  if (managed == 0) GTEST_SKIP() << "no managed memory";
  const ModelConfig c = config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, n = 8;
  auto s = testing::new_store(BackendKind::kCuda, c, options());
  ASSERT_TRUE(s);
  const SeqId a = *s->add_sequence();
  const auto in = testing::seq_inputs(c, 40, 74);
  testing::Outputs o;
  testing::run_plan(*s, {a}, {in}, {{false, {{0, 40}}}}, o);
  const auto before = seq_image(*s, a);
  const std::vector<float> fill = random_floats(static_cast<std::size_t>(n * width), 75);
  float* m = nullptr;
  ASSERT_EQ(cudaMallocManaged(reinterpret_cast<void**>(&m), fill.size() * sizeof(float)), cudaSuccess);
  std::memcpy(m, fill.data(), fill.size() * sizeof(float));
  DeviceArray<float> q(random_floats(static_cast<std::size_t>(n * width), 76));
  const SeqSpan span{a, 40, n};
  const ConstView host_k{m, MemorySpace::kHost, DType::kF32, n, kv, kv};
  for (const std::int64_t l : {std::int64_t{0}, std::int64_t{1}}) {
    const Status st = s->prefill(l, std::span(&span, 1), host_k, host_k, testing::device_in(q.get(), n, width),
                                 device_view(m, n, width));
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument) << l << ": " << st.to_string();
    EXPECT_NE(st.to_string().find("out overlaps k"), std::string::npos) << l << ": " << st.to_string();
  }
  EXPECT_TRUE(seq_image(*s, a) == before);
  EXPECT_EQ(0, std::memcmp(m, fill.data(), fill.size() * sizeof(float)));
  EXPECT_EQ(cudaFree(m), cudaSuccess);
}

// The f16 numeric's CUDA attention takes positions below 2^31 x
// kF16AttendSplitRows; a query past them is refused (kUnsupported) before
// any device work, where the CPU backend takes it.
TEST(CudaStore, F16AttentionPastItsPositionsIsRefused) {
  KVRING_SKIP_WITHOUT_GPU();
  // The f16 numeric's kernels take head_dim 128.
  const ModelConfig c = make_hybrid_config("sliding-only", 2, 0, 8, 2, 128, 24, 1024);
  const StoreOptions o{.max_sequences = 1, .context = 512, .slack = 8, .attention = AttentionNumeric::kF16};
  auto made = make_store(BackendKind::kCuda, c, o);
  if (!made.ok() && made.error().code == ErrorCode::kUnsupported) GTEST_SKIP() << made.error().to_string();
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  std::unique_ptr<KvStore> g = std::move(*made);
  auto h = testing::new_store(BackendKind::kCpu, c, o);
  ASSERT_TRUE(h);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const std::int64_t limit = (std::int64_t{std::numeric_limits<std::int32_t>::max()} + 1) * kF16AttendSplitRows;
  const std::int64_t cap = g->capacity(0);
  std::vector<std::uint16_t> k(static_cast<std::size_t>(cap * kv)), v(k.size());
  const std::vector<float> kf = random_floats(k.size() * 2, 77);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = f32_to_f16(kf[i]);
    v[i] = f32_to_f16(kf[k.size() + i]);
  }
  const std::vector<float> q = random_floats(static_cast<std::size_t>(width), 78);
  // Rings full to the position before `end`.
  for (const std::int64_t end : {limit - 1, limit, limit + 5}) {
    auto ring = RingState::from_parts(cap, true, cap, end - cap, (end - cap) % cap);
    ASSERT_TRUE(ring.ok()) << ring.status().to_string();
    std::vector<float> go(q.size()), ho(q.size());
    std::vector<Status> got;
    for (KvStore* s : {g.get(), h.get()}) {
      const SeqId d = *s->add_detached_sequence();
      for (std::int64_t l = 0; l < c.n_layers; ++l) ASSERT_TRUE(s->install(d, l, *ring, k.data(), v.data()).ok());
      ASSERT_TRUE(s->attach_sequence(d).ok());
      const auto before = seq_image(*s, d);
      const SeqQuery last{d, end - 1};
      got.push_back(s->attend_decode(0, std::span(&last, 1), host_view(q.data(), 1, width),
                                     host_view((s == g.get() ? go : ho).data(), 1, width)));
      EXPECT_TRUE(seq_image(*s, d) == before) << end;
      ASSERT_TRUE(s->remove_sequence(d).ok());
    }
    EXPECT_TRUE(got[1].ok()) << end << ": " << got[1].to_string();
    if (end - 1 < limit) {
      ASSERT_TRUE(got[0].ok()) << end << ": " << got[0].to_string();
      for (std::size_t i = 0; i < go.size(); ++i) EXPECT_NEAR(go[i], ho[i], 1e-3f) << end << " " << i;
    } else {
      EXPECT_EQ(got[0].error().code, ErrorCode::kUnsupported) << end << ": " << got[0].to_string();
      EXPECT_NE(got[0].to_string().find(std::to_string(limit)), std::string::npos) << got[0].to_string();
    }
  }
}

// The device's free memory, taken in pieces down to 4 KiB while it lives.
class MemorySpent {
 public:
  MemorySpent() {
    for (std::size_t piece = std::size_t{1} << 30; piece >= 4096; piece /= 2) {
      void* p = nullptr;
      while (cudaMalloc(&p, piece) == cudaSuccess) held_.push_back(p);
      (void)cudaGetLastError();
    }
  }
  ~MemorySpent() {
    for (void* p : held_) EXPECT_EQ(cudaFree(p), cudaSuccess);
  }
  MemorySpent(const MemorySpent&) = delete;
  MemorySpent& operator=(const MemorySpent&) = delete;

 private:
  std::vector<void*> held_;
};

// With the device's memory spent and every descriptor buffer still read by
// enqueued work, a call that uploads descriptors waits for a busy buffer
// instead of failing, and block tables too large for any buffer go up in
// pieces: forks (each mirrors its tables through them) go on, and a failed
// prefill's rollback restores the mirror, so its sequence is not stale.
TEST(CudaStore, DescriptorUploadsWaitForABusyBufferWhenMemoryIsSpent) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("store-test", 4, 2, 4, 2, 16, 24, 65536);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, more = 16;
  const std::int64_t forks = cuda::kInitialDescriptorChunks + 2;
  std::int64_t full = -1;
  for (std::int64_t l = 0; l < c.n_layers && full < 0; ++l)
    if (c.kind(l) == LayerKind::kFullNope) full = l;
  ASSERT_GE(full, 0);
  auto sleep_on = [](cudaStream_t side) {
    return cudaLaunchHostFunc(
        side, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr);
  };
  // 60 rows: a fork's tables fit one buffer; 33000: 2 full layers x 2063
  // blocks of 16 rows, 66 KB of table entries, more than any buffer holds.
  for (const std::int64_t n : {std::int64_t{60}, std::int64_t{33000}}) {
    const StoreOptions o{.max_sequences = forks + 1, .context = n + more, .slack = 8, .block_rows = 16};
    auto s = testing::new_store(BackendKind::kCuda, c, o);
    ASSERT_TRUE(s);
    const SeqId a = *s->add_sequence();
    DeviceArray<float> k(random_floats(static_cast<std::size_t>(n * kv), 81)),
        v(random_floats(static_cast<std::size_t>(n * kv), 82)),
        q(random_floats(static_cast<std::size_t>(width), 83)), out(static_cast<std::size_t>(width));
    const SeqSpan first{a, 0, n - 1}, last{a, n - 1, 1};
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      ASSERT_TRUE(s->store(l, std::span(&first, 1), testing::device_in(k.get(), n - 1, kv),
                           testing::device_in(v.get(), n - 1, kv))
                      .ok());
    // Every kernel the spent part launches is loaded first (a lazily
    // loaded module needs device memory).
    {
      auto warm = s->fork_sequence(a);
      ASSERT_TRUE(warm.ok()) << warm.error().to_string();
      ASSERT_TRUE(s->remove_sequence(*warm).ok());
      const SeqQuery at{a, n - 2};
      ASSERT_TRUE(s->attend_decode(full, std::span(&at, 1), testing::device_in(q.get(), 1, width),
                                   device_view(out.get(), 1, width))
                      .ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaStream_t side = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
    std::vector<SeqId> made;
    {
      const MemorySpent spent;
      void* probe = nullptr;
      ASSERT_NE(cudaMalloc(&probe, std::size_t{64} << 10), cudaSuccess) << "the device's memory was not spent";
      (void)cudaGetLastError();
      // The last row lands on `side` behind a host function that sleeps,
      // and the store's later work, on its own stream, waits for it: each
      // fork's descriptor buffers stay busy until the sleep ends.
      ASSERT_EQ(sleep_on(side), cudaSuccess);
      for (std::int64_t l = 0; l < c.n_layers; ++l)
        ASSERT_TRUE(s->store(l, std::span(&last, 1), testing::device_in(k.get() + (n - 1) * kv, 1, kv),
                             testing::device_in(v.get() + (n - 1) * kv, 1, kv), side)
                        .ok());
      for (std::int64_t i = 0; i < forks; ++i) {
        auto f = s->fork_sequence(a);
        ASSERT_TRUE(f.ok()) << n << " rows, fork " << i << ": " << f.error().to_string();
        made.push_back(*f);
      }
      ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
    }
    const auto want = seq_image(*s, a);
    EXPECT_EQ(want.rings[0].next_position(), n);
    for (const SeqId f : made) EXPECT_TRUE(seq_image(*s, f) == want) << n;
    if (n == 60) {
      // One fork takes one buffer here. All buffers but one busy; a prefill
      // of host rows at a block's edge takes the last to mirror its new
      // block, then fails to stage its rows; its rollback finds every
      // buffer busy and no memory for another.
      for (const SeqId f : made) ASSERT_TRUE(s->remove_sequence(f).ok());
      const std::vector<float> hk = random_floats(static_cast<std::size_t>(more * kv), 84),
                               hq = random_floats(static_cast<std::size_t>(more * width), 85);
      std::vector<float> hout(static_cast<std::size_t>(more * width));
      const SeqSpan next{a, n, more};
      Status failed;
      {
        const MemorySpent spent;
        ASSERT_EQ(sleep_on(side), cudaSuccess);
        const SeqQuery at{a, n - 1};
        ASSERT_TRUE(s->attend_decode(full, std::span(&at, 1), testing::device_in(q.get(), 1, width),
                                     device_view(out.get(), 1, width), side)
                        .ok());
        for (int i = 0; i + 1 < cuda::kInitialDescriptorChunks; ++i) {
          auto f = s->fork_sequence(a);
          ASSERT_TRUE(f.ok()) << "fork " << i << ": " << f.error().to_string();
        }
        failed = s->prefill(full, std::span(&next, 1), host_view(hk.data(), more, kv), host_view(hk.data(), more, kv),
                            host_view(hq.data(), more, width), host_view(hout.data(), more, width));
        ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
      }
      EXPECT_FALSE(failed.ok()) << "the prefill staged its rows with the device's memory spent";
      EXPECT_TRUE(seq_image(*s, a) == want);
      // With memory again, the same prefill lands.
      const Status st = s->prefill(full, std::span(&next, 1), host_view(hk.data(), more, kv),
                                   host_view(hk.data(), more, kv), host_view(hq.data(), more, width),
                                   host_view(hout.data(), more, width));
      EXPECT_TRUE(st.ok()) << st.to_string();
    }
    EXPECT_EQ(cudaStreamDestroy(side), cudaSuccess);
  }
}

// An attention that cannot stage its host queries or its host output (the
// device's memory spent) fails with the buffer it could not make, and
// returns only once the caller's stream has drained, as every failure after
// the call's first enqueue does: nothing of the call still runs behind the
// error. The store is unchanged, and with memory again the same call gives
// the bits of the same attention on device views.
TEST(CudaStore, AttentionThatCannotStageFailsCleanlyWhenMemoryIsSpent) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("store-test", 2, 2, 4, 2, 16, 24, 4096);
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, n = 300, seqs = 3;
  const std::int64_t full = 1;
  ASSERT_EQ(c.kind(full), LayerKind::kFullNope);
  const std::vector<float> hq = random_floats(static_cast<std::size_t>(seqs * width), 91, 2.0f);
  DeviceArray<float> k(random_floats(static_cast<std::size_t>(n * kv), 92)),
      v(random_floats(static_cast<std::size_t>(n * kv), 93)), q(hq),
      out(static_cast<std::size_t>(seqs * width));
  // Case 0 stages host queries, case 1 a host output. Before the memory is
  // spent each store makes the pinned buffer and the other case's staging,
  // so that the one buffer the failing call lacks is the one named.
  for (const int host_q : {1, 0}) {
    SCOPED_TRACE(host_q ? "host queries" : "host output");
    auto s = testing::new_store(BackendKind::kCuda, c, {.max_sequences = seqs, .context = n, .block_rows = 16});
    ASSERT_TRUE(s);
    std::vector<SeqQuery> at;
    for (std::int64_t i = 0; i < seqs; ++i) {
      const SeqId a = *s->add_sequence();
      const SeqSpan span{a, 0, n - i};
      for (std::int64_t l = 0; l < c.n_layers; ++l)
        ASSERT_TRUE(s->store(l, std::span(&span, 1), testing::device_in(k.get(), n - i, kv),
                             testing::device_in(v.get(), n - i, kv))
                        .ok());
      at.push_back({a, n - i - 1});
    }
    std::vector<float> hout(hq.size(), 0.0f);
    const auto h_q = host_view(hq.data(), seqs, width);
    const auto h_out = host_view(hout.data(), seqs, width);
    const auto d_q = testing::device_in(q.get(), seqs, width);
    const auto d_out = device_view(out.get(), seqs, width);
    // The reference (device views), which also loads the kernels; then the
    // other case's staging.
    ASSERT_TRUE(s->attend_decode(full, at, d_q, d_out).ok());
    ASSERT_TRUE(s->synchronize().ok());  // the store's stream does not block the copy's
    std::vector<float> want(hq.size());
    ASSERT_EQ(cudaMemcpy(want.data(), out.get(), want.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_TRUE(s->attend_decode(full, at, host_q ? d_q : h_q, host_q ? h_out : d_out).ok());
    std::vector<decltype(seq_image(*s, at[0].seq))> before;
    for (const SeqQuery& a : at) before.push_back(seq_image(*s, a.seq));
    cudaStream_t side = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
    Status failed;
    cudaError_t drained = cudaErrorUnknown;
    {
      const MemorySpent spent;
      ASSERT_EQ(cudaLaunchHostFunc(
                    side, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr),
                cudaSuccess);
      failed = s->attend_decode(full, at, host_q ? h_q : d_q, host_q ? d_out : h_out, side);
      drained = cudaStreamQuery(side);
      ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
    }
    ASSERT_FALSE(failed.ok()) << "the call staged with the device's memory spent";
    EXPECT_NE(failed.to_string().find(host_q ? "attention queries" : "attention output"), std::string::npos)
        << failed.to_string();
    EXPECT_EQ(drained, cudaSuccess) << "the failed call returned before the stream's earlier work ended";
    for (std::size_t i = 0; i < at.size(); ++i) EXPECT_TRUE(seq_image(*s, at[i].seq) == before[i]) << i;
    // With memory again, the same call, into zeroed outputs.
    ASSERT_EQ(cudaMemset(out.get(), 0, hq.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the call on `side`, which does not wait for it
    std::fill(hout.begin(), hout.end(), 0.0f);
    const Status again = s->attend_decode(full, at, host_q ? h_q : d_q, host_q ? d_out : h_out, side);
    ASSERT_TRUE(again.ok()) << again.to_string();
    ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
    std::vector<float> got(hq.size());
    if (host_q) {
      ASSERT_EQ(cudaMemcpy(got.data(), out.get(), got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      got = hout;
    }
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
    EXPECT_EQ(cudaStreamDestroy(side), cudaSuccess);
  }
}

}  // namespace
}  // namespace kvring
