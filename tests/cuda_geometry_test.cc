// Model geometries at the edges of what the config accepts, on the CUDA
// backend against the CPU backend: head dims 1, 2, 3, 252, 255 and 256 (the
// general kernel: scalar and vector combines and stores), 128 with groups
// of 1, 2, 3, 32, 64 and 1024 query heads per KV head (the tensor-core
// kernels: one to 128 head sets a KV head), 1024 KV heads, kv_dim at its
// bound of 65536 on both kernels, 1024 layers, windows of one row and past
// the context, blocks of 65536 rows, a model of sliding layers alone run
// past its context (to just below 2^62), 600 sequences in one batch
// (descriptors uploaded), 70000 queries in one call (launches cut at the
// grid's 65535), and a long context over a small pool for 4096 slots (the
// block-table mirror sized by the pool). For each, the stored bytes equal
// the CPU backend's, decode and prefill outputs (the random batches of
// cuda_test_util.h, then a step of one-token prefills and one of decodes
// of every sequence) agree with it within 1e-5, and two CUDA stores, one
// on the device's launch policy with host views and one whose policy
// forces resident grids or last arrival with device views, give the same
// bits. The f16 numeric at groups of 1, 3, 48 and 64 and at kv_dim 65536
// agrees with the CPU's within 1e-3. 16-bit K/V sources with odd row
// lengths and strides store the CPU's bytes. A geometry the backend
// cannot attend over is refused by name at the call (head dims past 256,
// f16 positions past 2^42) or at creation (the f16 numeric past its
// kernel), changing nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "cuda/kernels.h"
#include "cuda/launch_policy.h"
#include "cuda_geometry_check.h"
#include "cuda_test_util.h"
#include "kvring/f16.h"

namespace kvring {
namespace {

using testing::Outputs;
using testing::Geometry;
using testing::SeqInputs;
using testing::check_against_cpu;
using testing::geometry;
using testing::last_arrival_policy;
using testing::resident_policy;

constexpr double kTolerance = 1e-5;
// The f16 numerics of the two backends differ in the order of f32 sums
// (cuda_attention_test.cc).
constexpr double kF16Tolerance = 1e-3;

// g with scores scaled by 1/sqrt(scalar) (query_pre_attn_scalar).
Geometry scaled(Geometry g, double scalar) {
  g.config.query_pre_attn_scalar = scalar;
  g.config.name += "-scaled";
  return g;
}

std::vector<Geometry> f32_geometries() {
  std::vector<Geometry> g = {
      // The general kernel: head_dim 1 (a group of 3) with a full layer past
      // 2048 rows (17+ splits: the two-level combine, scalar partials).
      geometry("hd1-group3", 2, 2, 3, 1, 1, 5, 2304, 16, {2200, 40, 7}, 300),
      // head_dim 2 under a one-row window.
      geometry("hd2-window1", 3, 3, 2, 2, 2, 1, 300, 32, {290, 33}, 64),
      // head_dim 3 under a window larger than the context (the ring holds
      // the context, which the sequence fills).
      geometry("hd3-window-past-context", 2, 2, 6, 3, 3, 5000, 1000, 64, {1000, 300}, 200),
      geometry("hd255", 2, 2, 2, 1, 255, 200, 1200, 16, {1100, 50}, 256),
      geometry("hd256", 2, 2, 4, 2, 256, 130, 600, 128, {560, 20}, 128),
      // The tensor-core kernels: groups of 1, 2 and 3 (one head set, part
      // full), 32 and 64 (4 and 8 sets), 1024 (128 sets).
      geometry("tc-group1", 2, 2, 4, 4, 128, 100, 1200, 16, {1100, 60}, 200),
      geometry("tc-group2", 2, 2, 4, 2, 128, 17, 700, 32, {650, 5}, 100),
      // Gemma 3 27B's score scale (query_pre_attn_scalar 168, head_dim 128),
      // on the tensor-core kernels and the general one.
      scaled(geometry("tc-group8", 2, 2, 16, 2, 128, 300, 2500, 16, {2300, 90}, 300), 168),
      scaled(geometry("hd96", 2, 2, 4, 2, 96, 40, 300, 16, {250, 30}, 64), 50.5),
      geometry("tc-group3", 2, 2, 6, 2, 128, 300, 700, 64, {690, 130}, 150),
      geometry("tc-group32", 2, 2, 32, 1, 128, 64, 600, 16, {520, 30}, 128),
      geometry("tc-group64", 2, 2, 128, 2, 128, 64, 300, 16, {260, 9}, 64),
      geometry("tc-group1024", 2, 2, 1024, 1, 128, 32, 160, 16, {140, 9}, 64),
      geometry("hd64-group1024", 2, 2, 1024, 1, 64, 32, 160, 16, {140, 9}, 64),
      // The most KV heads (1024) at head_dim 1; head_dim 252, a multiple of
      // 4 (vector combines) but not of 8 (element-wise stores).
      geometry("hd1-kv1024", 2, 2, 1024, 1024, 1, 8, 64, 16, {50, 9}, 16),
      geometry("hd252", 2, 2, 4, 2, 252, 150, 400, 32, {300, 12}, 100),
      // kv_dim 65536, the config's bound, on each kernel.
      geometry("kvdim65536-hd256", 2, 2, 256, 256, 256, 40, 64, 16, {60, 10}, 16),
      geometry("kvdim65536-tc", 2, 2, 1024, 512, 128, 24, 48, 16, {40, 8}, 16),
      geometry("kvdim65536-hd64", 2, 2, 1024, 1024, 64, 20, 40, 16, {30, 4}, 8),
      // The config's most layers.
      geometry("layers1024", 1024, 4, 2, 1, 8, 6, 64, 16, {20, 5}, 8),
      // Every layer full, in blocks of 65536 rows (the largest; one a plane).
      geometry("all-full-block65536", 2, 1, 2, 2, 4, 0, 300, 65536, {290, 70}, 64),
      // Every layer sliding, its ring holding the window: positions run past
      // the context (64), and there is no pool.
      geometry("all-sliding-past-context", 2, 0, 4, 2, 16, 16, 64, 16, {300, 100}, 64),
  };
  // 600 sequences: batches of up to 600 items (uploaded) and store
  // descriptors past what a launch's parameters carry.
  std::vector<std::int64_t> many;
  for (int i = 0; i < 600; ++i) many.push_back(3 + i % 13);
  g.push_back(geometry("tc-600-sequences", 2, 2, 2, 1, 128, 8, 64, 16, many, 8));
  return g;
}

TEST(CudaGeometry, EdgeGeometriesAgreeWithTheCpuBackend) {
  KVRING_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 1;
  for (const Geometry& g : f32_geometries()) {
    // The second store's policy alternates between the geometries.
    const bool resident = seed % 2 == 1;
    SCOPED_TRACE(g.config.name + (resident ? ", resident grids or last arrival" : ", last arrival"));
    ASSERT_TRUE(g.config.validate().ok()) << g.config.validate().to_string();
    check_against_cpu(g, seed++, kTolerance, resident ? resident_policy() : last_arrival_policy());
    if (HasFailure()) return;  // later geometries would repeat a shared failure
  }
}

TEST(CudaGeometry, F16NumericAtGroupsOf1To64AgreesWithTheCpuBackend) {
  KVRING_SKIP_WITHOUT_GPU();
  std::vector<Geometry> gs = {
      // Two splits of 2048 rows, blocks of 16 under 64-row key tiles (each
      // tile row by row).
      geometry("f16-group1", 2, 2, 1, 1, 128, 64, 2200, 16, {2100, 40}, 300),
      geometry("f16-group3", 2, 2, 6, 2, 128, 100, 400, 32, {350, 70}, 100),
      scaled(geometry("f16-group8", 2, 2, 16, 2, 128, 300, 2500, 16, {2300, 90}, 300), 168),
      // A tile of one query, of 64 and of 48 (query, head) rows.
      geometry("f16-group64", 2, 2, 64, 1, 128, 40, 200, 16, {150, 20}, 64),
      geometry("f16-group48", 2, 2, 48, 1, 128, 40, 200, 32, {150, 20}, 64),
      // kv_dim 65536: 512 KV heads (the grid's y), groups of 1 and 2.
      geometry("f16-kvdim65536-group1", 2, 2, 512, 512, 128, 24, 48, 16, {40, 8}, 16),
      geometry("f16-kvdim65536-group2", 2, 2, 1024, 512, 128, 24, 48, 16, {40, 8}, 16),
  };
  std::uint64_t seed = 101;
  for (Geometry& g : gs) {
    SCOPED_TRACE(g.config.name);
    g.options.attention = AttentionNumeric::kF16;
    {
      auto probe = CudaStore::create(g.config, g.options);
      if (!probe.ok() && probe.error().code == ErrorCode::kUnsupported &&
          probe.error().message.find("sm_90a") != std::string::npos)
        GTEST_SKIP() << probe.error().message;
    }
    check_against_cpu(g, seed, kF16Tolerance, seed % 2 == 1 ? resident_policy() : last_arrival_policy());
    ++seed;
    if (HasFailure()) return;
  }
}

// K/V in f16 and bf16, in device memory on the GPU (rows one element apart
// from 16-byte alignment, odd strides) and host memory on the CPU, store
// the same bytes for odd row lengths (kv_dim 1, 9, 255); a prefill chunk
// from such sources gives the CPU's outputs; rows read back into device
// memory are the rows read into host memory.
TEST(CudaGeometry, SixteenBitSourcesOfOddRowsStoreTheCpuBytes) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::vector<ModelConfig> configs = {make_hybrid_config("kv1", 2, 2, 2, 1, 1, 7, 256),
                                            make_hybrid_config("kv9", 2, 2, 6, 3, 3, 7, 256),
                                            make_hybrid_config("kv255", 2, 2, 2, 1, 255, 7, 256)};
  for (const ModelConfig& c : configs) {
    for (const DType dt : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(c.name + " " + dtype_name(dt));
      const StoreOptions o{.max_sequences = 2, .context = 256, .block_rows = 16};
      auto gpu = testing::new_store(BackendKind::kCuda, c, o);
      auto cpu = testing::new_store(BackendKind::kCpu, c, o);
      ASSERT_TRUE(gpu && cpu);
      const SeqId gs = *gpu->add_sequence(), cs = *cpu->add_sequence();
      const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, stride = kv + 1;
      const std::int64_t stored = 45, chunk = 10, rows = stored + chunk;
      // K's rows then V's, one element in from the start of the buffer.
      const auto f = testing::random_floats(static_cast<std::size_t>(1 + 2 * rows * stride), 61, 3.0f);
      std::vector<std::uint16_t> bits(f.size());
      for (std::size_t i = 0; i < f.size(); ++i) {
        std::uint32_t u;
        std::memcpy(&u, &f[i], 4);
        bits[i] = dt == DType::kF16 ? f32_to_f16(f[i]) : static_cast<std::uint16_t>(u >> 16);
      }
      testing::DeviceArray<std::uint16_t> dev(bits);
      auto views = [&](const std::uint16_t* base, MemorySpace space, std::int64_t first, std::int64_t n) {
        const std::uint16_t* k = base + 1 + first * stride;
        return std::pair{ConstView{k, space, dt, n, kv, stride}, ConstView{k + rows * stride, space, dt, n, kv, stride}};
      };
      const auto [dk, dv] = views(dev.get(), MemorySpace::kDevice, 0, stored);
      const auto [hk, hv] = views(bits.data(), MemorySpace::kHost, 0, stored);
      const SeqSpan sg{gs, 0, stored}, sc{cs, 0, stored};
      for (std::int64_t l = 0; l < c.n_layers; ++l) {
        ASSERT_TRUE(gpu->store(l, std::span(&sg, 1), dk, dv).ok());
        ASSERT_TRUE(cpu->store(l, std::span(&sc, 1), hk, hv).ok());
      }
      // A prefill chunk of the next rows from the same sources.
      const auto q = testing::random_floats(static_cast<std::size_t>(chunk * width), 62);
      const std::int64_t qs = (width + 3) / 4 * 4;
      std::vector<float> qp(static_cast<std::size_t>(chunk * qs), 0.0f);
      for (std::int64_t i = 0; i < chunk; ++i)
        std::memcpy(qp.data() + i * qs, q.data() + i * width, static_cast<std::size_t>(width) * 4);
      testing::DeviceArray<float> dq(qp), dout(qp.size());
      const auto [ck, cv] = views(dev.get(), MemorySpace::kDevice, stored, chunk);
      const auto [hck, hcv] = views(bits.data(), MemorySpace::kHost, stored, chunk);
      const SeqSpan pg{gs, stored, chunk}, pc{cs, stored, chunk};
      for (std::int64_t l = 0; l < c.n_layers; ++l) {
        SCOPED_TRACE("layer " + std::to_string(l));
        dout.poison();
        std::vector<float> hout(static_cast<std::size_t>(chunk * width));
        ASSERT_TRUE(gpu->prefill(l, std::span(&pg, 1), ck, cv, ConstView{dq.get(), MemorySpace::kDevice, DType::kF32, chunk, width, qs},
                                 MutView{dout.get(), MemorySpace::kDevice, DType::kF32, chunk, width, qs})
                        .ok());
        ASSERT_TRUE(cpu->prefill(l, std::span(&pc, 1), hck, hcv, testing::host_in(q.data(), chunk, width),
                                 host_view(hout.data(), chunk, width))
                        .ok());
        ASSERT_TRUE(gpu->synchronize().ok());
        const std::vector<float> padded = dout.download();
        Outputs g_out, c_out;
        for (std::int64_t i = 0; i < chunk; ++i) {
          g_out[{0, l, i}] = std::vector<float>(padded.begin() + i * qs, padded.begin() + i * qs + width);
          c_out[{0, l, i}] = std::vector<float>(hout.begin() + i * width, hout.begin() + (i + 1) * width);
        }
        EXPECT_LE(testing::worst_difference(g_out, c_out), kTolerance);
      }
      EXPECT_TRUE(testing::seq_image(*gpu, gs) == testing::seq_image(*cpu, cs));
      for (std::int64_t l = 0; l < c.n_layers; ++l) {
        const auto host_rows = testing::live_rows(*gpu, gs, l);
        EXPECT_TRUE(host_rows == testing::live_rows(*cpu, cs, l)) << "layer " << l;
        const RingState r = *gpu->ring(gs, l);
        testing::DeviceArray<std::uint16_t> dr(static_cast<std::size_t>(2 * r.len() * kv + 1));
        dr.poison();
        // The rows one element in: 2-byte aligned only.
        ASSERT_TRUE(gpu->read_rows(gs, l, r.origin_logical(), r.len(), dr.get() + 1, dr.get() + 1 + r.len() * kv,
                                   MemorySpace::kDevice)
                        .ok());
        ASSERT_TRUE(gpu->synchronize().ok());
        const auto back = dr.download();
        const auto n = static_cast<std::ptrdiff_t>(r.len() * kv);
        EXPECT_EQ(back[0], 0xffffu) << "layer " << l << ": a write before the destination";
        EXPECT_TRUE(std::equal(back.begin() + 1, back.begin() + 1 + n, host_rows.first.begin())) << "layer " << l;
        EXPECT_TRUE(std::equal(back.begin() + 1 + n, back.end(), host_rows.second.begin())) << "layer " << l;
      }
    }
  }
}

// One prefill chunk of `n` rows at `position`, then one decode step, of
// sequence `seq` in layer `layer`, with host views, inputs from `seed`:
// the chunk's outputs then the decode's, or the first error.
Result<std::vector<float>> chunk_then_decode(KvStore& s, SeqId seq, std::int64_t layer, std::int64_t position,
                                             std::int64_t n, std::uint64_t seed) {
  const ModelConfig& c = s.config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const auto k = testing::random_floats(static_cast<std::size_t>((n + 1) * kv), seed, 2.0f);
  const auto v = testing::random_floats(k.size(), seed + 1, 2.0f);
  const auto q = testing::random_floats(static_cast<std::size_t>((n + 1) * width), seed + 2);
  std::vector<float> out(q.size());
  const SeqSpan chunk{seq, position, n};
  KVRING_RETURN_IF_ERROR(s.prefill(layer, std::span(&chunk, 1), testing::host_in(k.data(), n, kv),
                                   testing::host_in(v.data(), n, kv), testing::host_in(q.data(), n, width),
                                   host_view(out.data(), n, width)));
  const SeqSpan step{seq, position + n, 1};
  KVRING_RETURN_IF_ERROR(s.store(layer, std::span(&step, 1), testing::host_in(k.data() + n * kv, 1, kv),
                                 testing::host_in(v.data() + n * kv, 1, kv)));
  const SeqQuery query{seq, position + n};
  KVRING_RETURN_IF_ERROR(s.attend_decode(layer, std::span(&query, 1), testing::host_in(q.data() + n * width, 1, width),
                                         host_view(out.data() + n * width, 1, width)));
  return out;
}

// Every layer of `seq` installed as a ring that reached `next` (rows from
// `seed`).
Status install_at(KvStore& s, SeqId seq, std::int64_t next, std::uint64_t seed) {
  for (std::int64_t l = 0; l < s.n_layers(); ++l) {
    auto ring = RingState::sequential(s.capacity(l), true, next);
    if (!ring) return ring.error();
    const auto f = testing::random_floats(static_cast<std::size_t>(2 * ring->len() * s.config().kv_dim()),
                                          seed + static_cast<std::uint64_t>(l), 2.0f);
    std::vector<std::uint16_t> bits(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) bits[i] = f32_to_f16(f[i]);
    KVRING_RETURN_IF_ERROR(s.install(seq, l, *ring, bits.data(), bits.data() + bits.size() / 2));
  }
  return Status::Ok();
}

// A model of sliding layers alone runs to any position below 2^62: a ring
// installed far out (2^40, and just below 2^62) then a prefill chunk and a
// decode give the CPU's outputs and bytes, on both kernels. Under the f16
// numeric, whose tiles name their first split of 2048 positions as a
// 32-bit index, 2^40 agrees with the CPU, and positions from 2^42 on are
// refused with kUnsupported, storing nothing.
TEST(CudaGeometry, SlidingLayersFarPastTheContext) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::int64_t far = std::int64_t{1} << 40, edge = (std::int64_t{1} << 62) - 64;
  struct Far {
    ModelConfig config;
    AttentionNumeric numeric;
    std::int64_t next;
  };
  const ModelConfig tc = make_hybrid_config("far-tc", 2, 0, 16, 2, 128, 40, 64);
  const ModelConfig general = make_hybrid_config("far-hd20", 2, 0, 6, 3, 20, 40, 64);
  for (const Far& f : {Far{tc, AttentionNumeric::kF32, far}, Far{tc, AttentionNumeric::kF32, edge},
                       Far{general, AttentionNumeric::kF32, far}, Far{general, AttentionNumeric::kF32, edge},
                       Far{tc, AttentionNumeric::kF16, far}}) {
    SCOPED_TRACE(f.config.name + " " + attention_numeric_name(f.numeric) + " at " + std::to_string(f.next));
    const StoreOptions o{.max_sequences = 1, .context = 64, .attention = f.numeric};
    if (f.numeric == AttentionNumeric::kF16) {
      auto probe = CudaStore::create(f.config, o);
      if (!probe.ok()) {
        EXPECT_NE(probe.error().message.find("sm_90a"), std::string::npos) << probe.error().to_string();
        continue;
      }
    }
    auto gpu = testing::new_store(BackendKind::kCuda, f.config, o);
    auto cpu = testing::new_store(BackendKind::kCpu, f.config, o);
    ASSERT_TRUE(gpu && cpu);
    const SeqId gs = *gpu->add_sequence(), cs = *cpu->add_sequence();
    ASSERT_TRUE(install_at(*gpu, gs, f.next, 81).ok());
    ASSERT_TRUE(install_at(*cpu, cs, f.next, 81).ok());
    for (std::int64_t l = 0; l < f.config.n_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      auto g = chunk_then_decode(*gpu, gs, l, f.next, 9, 83 + static_cast<std::uint64_t>(l));
      auto c = chunk_then_decode(*cpu, cs, l, f.next, 9, 83 + static_cast<std::uint64_t>(l));
      ASSERT_TRUE(g.ok()) << g.error().to_string();
      ASSERT_TRUE(c.ok()) << c.error().to_string();
      const Outputs go{{{0, l, 0}, *g}}, co{{{0, l, 0}, *c}};
      EXPECT_LE(testing::worst_difference(go, co),
                f.numeric == AttentionNumeric::kF16 ? kF16Tolerance : kTolerance);
    }
    EXPECT_TRUE(testing::seq_image(*gpu, gs) == testing::seq_image(*cpu, cs));
  }
  // Past what the f16 numeric's tiles index: refused, nothing stored.
  const StoreOptions o{.max_sequences = 1, .context = 64, .attention = AttentionNumeric::kF16};
  auto probe = CudaStore::create(tc, o);
  if (!probe.ok()) return;
  auto gpu = testing::new_store(BackendKind::kCuda, tc, o);
  ASSERT_TRUE(gpu);
  const SeqId gs = *gpu->add_sequence();
  const std::int64_t past = std::int64_t{1} << 43;
  ASSERT_TRUE(install_at(*gpu, gs, past, 85).ok());
  const testing::SeqImage before = testing::seq_image(*gpu, gs);
  const auto r = chunk_then_decode(*gpu, gs, 0, past, 9, 87);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kUnsupported) << r.error().to_string();
  EXPECT_TRUE(testing::seq_image(*gpu, gs) == before);
  EXPECT_EQ(*gpu->next_position(gs), past);
}

// A context of 2^20 positions in blocks of 16 rows for 4096 slots, over
// a pool of 64 blocks: the device's block-table mirror holds as many
// entries a table as the pool has blocks (1 MiB), not a full plane's at
// the context (1 GiB), and the store runs like the CPU's.
TEST(CudaGeometry, TheBlockTableMirrorIsBoundedByThePool) {
  KVRING_SKIP_WITHOUT_GPU();
  Geometry g = geometry("long-context-small-pool", 1, 1, 2, 1, 8, 0, std::int64_t{1} << 20, 16, {40, 20, 5}, 16);
  g.options.max_sequences = 4096;
  g.options.pool_blocks = 64;
  {
    auto store = CudaStore::create(g.config, g.options);
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    EXPECT_LT((*store)->workspace_bytes(), std::int64_t{256} << 20);
  }
  check_against_cpu(g, 301, kTolerance, last_arrival_policy());
}

// More queries than one launch's grid takes (65535): a prefill chunk of
// 70000 rows of one sequence (its item cut in two launches) from device
// views, and a decode of 70000 queries over two sequences (each appearing
// 35000 times; its items uploaded, in two launches), give the CPU's
// outputs and bytes.
TEST(CudaGeometry, SeventyThousandQueriesInOneCall) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig c = make_hybrid_config("many-queries", 2, 0, 2, 1, 4, 4, 70016);
  const std::int64_t n = 70000, short_len = 10, kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  const StoreOptions o{.max_sequences = 2, .context = 70016};
  auto gpu = testing::new_store(BackendKind::kCuda, c, o);
  auto cpu = testing::new_store(BackendKind::kCpu, c, o);
  ASSERT_TRUE(gpu && cpu);
  const SeqId ga = *gpu->add_sequence(), gb = *gpu->add_sequence();
  const SeqId ca = *cpu->add_sequence(), cb = *cpu->add_sequence();
  const auto k = testing::random_floats(static_cast<std::size_t>(n * kv), 91, 2.0f);
  const auto v = testing::random_floats(k.size(), 92, 2.0f);
  const auto q = testing::random_floats(static_cast<std::size_t>(n * width), 93);
  testing::DeviceArray<float> dk(k), dv(v), dq(q), dout(q.size());
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    std::vector<float> co(q.size());
    const SeqSpan chunk_g{ga, 0, n}, chunk_c{ca, 0, n};
    dout.poison();
    ASSERT_TRUE(gpu->prefill(l, std::span(&chunk_g, 1), testing::device_in(dk.get(), n, kv),
                             testing::device_in(dv.get(), n, kv), testing::device_in(dq.get(), n, width),
                             device_view(dout.get(), n, width))
                    .ok());
    ASSERT_TRUE(cpu->prefill(l, std::span(&chunk_c, 1), testing::host_in(k.data(), n, kv),
                             testing::host_in(v.data(), n, kv), testing::host_in(q.data(), n, width),
                             host_view(co.data(), n, width))
                    .ok());
    ASSERT_TRUE(gpu->synchronize().ok());
    EXPECT_LE(testing::worst_difference({{{0, l, 0}, dout.download()}}, {{{0, l, 0}, co}}), kTolerance);
    const SeqSpan sg{gb, 0, short_len}, sc{cb, 0, short_len};
    ASSERT_TRUE(gpu->store(l, std::span(&sg, 1), testing::host_in(k.data(), short_len, kv),
                           testing::host_in(v.data(), short_len, kv))
                    .ok());
    ASSERT_TRUE(cpu->store(l, std::span(&sc, 1), testing::host_in(k.data(), short_len, kv),
                           testing::host_in(v.data(), short_len, kv))
                    .ok());
    std::vector<SeqQuery> gq, cq;
    for (std::int64_t i = 0; i < n; ++i) {
      gq.push_back(i % 2 == 0 ? SeqQuery{ga, n - 1} : SeqQuery{gb, short_len - 1});
      cq.push_back(i % 2 == 0 ? SeqQuery{ca, n - 1} : SeqQuery{cb, short_len - 1});
    }
    std::vector<float> go(q.size());
    ASSERT_TRUE(gpu->attend_decode(l, gq, testing::host_in(q.data(), n, width), host_view(go.data(), n, width)).ok());
    ASSERT_TRUE(cpu->attend_decode(l, cq, testing::host_in(q.data(), n, width), host_view(co.data(), n, width)).ok());
    EXPECT_LE(testing::worst_difference({{{0, l, 1}, go}}, {{{0, l, 1}, co}}), kTolerance);
  }
  EXPECT_TRUE(testing::seq_image(*gpu, ga) == testing::seq_image(*cpu, ca));
  EXPECT_TRUE(testing::seq_image(*gpu, gb) == testing::seq_image(*cpu, cb));
}

// Head dims past the kernels' (256): the store keeps and reads rows like
// the CPU's, and attention, decode or prefill, host or device views, is
// refused with kUnsupported naming head_dim, storing nothing.
TEST(CudaGeometry, HeadDimsPastTheKernelsStoreButRefuseAttention) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const std::int64_t hd : {257, 512, 1024}) {
    const ModelConfig c = make_hybrid_config("hd" + std::to_string(hd), 2, 2, 4, 2, hd, 8, 64);
    SCOPED_TRACE(c.name);
    const StoreOptions o{.max_sequences = 2, .context = 64, .block_rows = 16};
    auto gpu = testing::new_store(BackendKind::kCuda, c, o);
    auto cpu = testing::new_store(BackendKind::kCpu, c, o);
    ASSERT_TRUE(gpu && cpu);
    const SeqId gs = *gpu->add_sequence(), cs = *cpu->add_sequence();
    const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim, rows = 20, more = 3;
    const auto k = testing::random_floats(static_cast<std::size_t>(c.n_layers * rows * kv), 71, 2.0f);
    const auto v = testing::random_floats(k.size(), 72, 2.0f);
    const SeqSpan sg{gs, 0, rows}, sc{cs, 0, rows};
    ASSERT_TRUE(gpu->store_all_layers(std::span(&sg, 1), testing::host_in(k.data(), c.n_layers * rows, kv),
                                      testing::host_in(v.data(), c.n_layers * rows, kv))
                    .ok());
    ASSERT_TRUE(cpu->store_all_layers(std::span(&sc, 1), testing::host_in(k.data(), c.n_layers * rows, kv),
                                      testing::host_in(v.data(), c.n_layers * rows, kv))
                    .ok());
    const testing::SeqImage before = testing::seq_image(*gpu, gs);
    EXPECT_TRUE(before == testing::seq_image(*cpu, cs));
    const auto q = testing::random_floats(static_cast<std::size_t>(more * width), 73);
    std::vector<float> out(q.size());
    testing::DeviceArray<float> dk(k), dq(q), dout(q.size());
    auto refused = [&](const Status& st, const char* what) {
      EXPECT_FALSE(st.ok()) << what;
      if (st.ok()) return;
      EXPECT_EQ(st.error().code, ErrorCode::kUnsupported) << what << ": " << st.to_string();
      EXPECT_NE(st.error().message.find("head_dim"), std::string::npos) << what << ": " << st.to_string();
    };
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const SeqQuery dec{gs, rows - 1};
      refused(gpu->attend_decode(l, std::span(&dec, 1), testing::host_in(q.data(), 1, width),
                                 host_view(out.data(), 1, width)),
              "host decode");
      refused(gpu->attend_decode(l, std::span(&dec, 1), testing::device_in(dq.get(), 1, width),
                                 device_view(dout.get(), 1, width)),
              "device decode");
      const SeqSpan chunk{gs, rows, more};
      refused(gpu->prefill(l, std::span(&chunk, 1), testing::host_in(k.data(), more, kv),
                           testing::host_in(v.data(), more, kv), testing::host_in(q.data(), more, width),
                           host_view(out.data(), more, width)),
              "host prefill");
      refused(gpu->prefill(l, std::span(&chunk, 1), testing::device_in(dk.get(), more, kv),
                           testing::device_in(dk.get(), more, kv), testing::device_in(dq.get(), more, width),
                           device_view(dout.get(), more, width)),
              "device prefill");
      const SeqSpan one{gs, rows, 1};
      refused(gpu->prefill(l, std::span(&one, 1), testing::device_in(dk.get(), 1, kv),
                           testing::device_in(dk.get(), 1, kv), testing::device_in(dq.get(), 1, width),
                           device_view(dout.get(), 1, width)),
              "one-token device prefill");
    }
    ASSERT_TRUE(gpu->synchronize().ok());
    EXPECT_TRUE(testing::seq_image(*gpu, gs) == before) << "a refused call changed the store";
    EXPECT_EQ(*gpu->next_position(gs), rows);
  }
}

// The f16 numeric's kernel takes head_dim 128 and at most kF16Rows (64)
// query heads per KV head: any other geometry is refused at creation with
// kUnsupported, naming what it has.
TEST(CudaGeometry, F16NumericRefusesGeometriesPastItsKernel) {
  KVRING_SKIP_WITHOUT_GPU();
  const StoreOptions o{.max_sequences = 1, .context = 64, .attention = AttentionNumeric::kF16};
  for (const ModelConfig& c : {make_hybrid_config("f16-group65", 2, 2, 65, 1, 128, 8, 64),
                               make_hybrid_config("f16-group1024", 2, 2, 1024, 1, 128, 8, 64),
                               make_hybrid_config("f16-hd256", 2, 2, 2, 1, 256, 8, 64),
                               make_hybrid_config("f16-hd1", 2, 2, 2, 1, 1, 8, 64)}) {
    SCOPED_TRACE(c.name);
    ASSERT_TRUE(c.validate().ok());
    const auto r = CudaStore::create(c, o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, ErrorCode::kUnsupported) << r.error().to_string();
  }
  // A group of exactly 64 is the kernel's.
  const auto ok = CudaStore::create(make_hybrid_config("f16-group64", 2, 2, 64, 1, 128, 8, 64), o);
  if (!ok.ok()) {
    EXPECT_NE(ok.error().message.find("sm_90a"), std::string::npos) << ok.error().to_string();
  }
}

}  // namespace
}  // namespace kvring
