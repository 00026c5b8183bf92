// CUDA planes: the bytes stored equal the CPU backend's for the same inputs
// (f16 ties, subnormals, overflow, infinities and NaNs included), in both
// layouts, through the host API, the device API and the all-layers store,
// across wraps; snapshots round-trip; failures change nothing.
#include <gtest/gtest.h>

#include <algorithm>

#include "cuda/testing.h"
#include "cuda_test_util.h"
#include "kvring/backend.h"
#include "kvring/footprint.h"

namespace kvring {
namespace {

using testing::DeviceArray;
using testing::expect_same_planes;
using testing::KvStream;
using testing::plane_bytes;
using testing::PlaneBytes;
using testing::small_config;

std::unique_ptr<KvCache> cuda_cache(const ModelConfig& c, CacheOptions o = {}) {
  auto r = make_cuda_cache(c, o);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? std::move(*r) : nullptr;
}
std::unique_ptr<CudaCache> typed_cuda_cache(const ModelConfig& c, CacheOptions o = {}) {
  auto r = CudaCache::create(c, o);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? std::move(*r) : nullptr;
}
std::unique_ptr<KvCache> cpu_cache(const ModelConfig& c, CacheOptions o = {}) {
  auto r = make_cpu_cache(c, o);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? std::move(*r) : nullptr;
}

// Geometries that reach every store path: head_dim 16 (vector path), 128
// (muse-glimmer's), 12 with 3 KV heads (the element-wise path).
std::vector<ModelConfig> store_configs() {
  return {small_config(32, 200, 4, 4, 2, 16), make_hybrid_config("hd128", 4, 4, 16, 2, 128, 40, 200),
          make_hybrid_config("hd12", 4, 4, 6, 3, 12, 33, 200)};
}

TEST(CudaCache, NoGpuMeansNoCudaCache) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible";
  EXPECT_FALSE(cuda_device_available());
  auto c = make_cuda_cache(small_config());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ErrorCode::kUnsupported);
  EXPECT_EQ(make_cache(BackendKind::kCuda, small_config()).error().code, ErrorCode::kUnsupported);
  EXPECT_EQ(*parse_backend("auto"), BackendKind::kCpu);
}

TEST(CudaCache, AutoPicksCudaWhereAGpuIsVisible) {
  KVRING_SKIP_WITHOUT_GPU();
  EXPECT_EQ(*parse_backend("auto"), BackendKind::kCuda);
  auto c = make_cache(BackendKind::kCuda, small_config());
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ((*c)->backend(), BackendKind::kCuda);
}

// The conversion every store kernel uses equals f32_to_f16 (f16.h) on all
// 2^32 inputs, NaNs included (both map every NaN to 0x7fff).
TEST(CudaCache, F16ConversionMatchesTheSharedFunctionOnEveryInput) {
  KVRING_SKIP_WITHOUT_GPU();
  auto s = cuda::testing::sweep_f16_conversion();
  ASSERT_TRUE(s.ok()) << s.error().to_string();
  EXPECT_EQ(s->checked, std::uint64_t{1} << 32);
  EXPECT_EQ(s->mismatches, 0u) << std::hex << "first input 0x" << s->first_input << ": device 0x"
                               << s->first_device << ", f32_to_f16 0x" << s->first_shared;
}

TEST(CudaCache, PlanesHaveTheDesignedShapesAndFootprint) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig muse = *preset_config("muse-glimmer");
  auto c = cuda_cache(muse, {.context = 4096});
  ASSERT_TRUE(c);
  for (std::int64_t l = 0; l < 52; ++l) {
    const bool full = l % 4 == 3;
    EXPECT_EQ(c->layout(l), full ? Layout::kHeadMajor : Layout::kTokenMajor);
    EXPECT_EQ(c->ring(l).capacity(), full ? 4096 : 2048);
  }
  auto f = compute_footprint(muse, 4096, 1);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(c->allocated_bytes(), f->slot_bytes);
  auto cpu = cpu_cache(muse, {.context = 4096});
  EXPECT_EQ(c->allocated_bytes(), cpu->allocated_bytes());
}

TEST(CudaCache, ZeroFilledAtAllocationAndAfterReset) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = small_config();
  auto c = cuda_cache(cfg);
  ASSERT_TRUE(c);
  for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
    const PlaneBytes b = plane_bytes(*c, l);
    EXPECT_TRUE(std::all_of(b.k.begin(), b.k.end(), [](auto x) { return x == 0; }));
    EXPECT_TRUE(std::all_of(b.v.begin(), b.v.end(), [](auto x) { return x == 0; }));
  }
  KvStream s(cfg.kv_dim(), 50, 3);
  for (std::int64_t l = 0; l < cfg.n_layers; ++l)
    ASSERT_TRUE(c->store_batch(l, 0, 50, s.krow(0), s.vrow(0)).ok());
  const PlaneBytes written = plane_bytes(*c, 0);
  EXPECT_FALSE(std::all_of(written.k.begin(), written.k.end(), [](auto x) { return x == 0; }));
  ASSERT_TRUE(c->reset().ok());
  for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
    EXPECT_EQ(c->ring(l).len(), 0);
    const PlaneBytes b = plane_bytes(*c, l);
    EXPECT_TRUE(std::all_of(b.k.begin(), b.k.end(), [](auto x) { return x == 0; }));
    EXPECT_TRUE(std::all_of(b.v.begin(), b.v.end(), [](auto x) { return x == 0; }));
  }
}

// Batches of many sizes (and one token at a time), across several wraps:
// after every batch the CUDA planes hold exactly the CPU planes' bytes.
TEST(CudaCache, StoredBytesEqualTheCpuBackendAcrossWraps) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& cfg : store_configs()) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t n = 200;
    KvStream s(cfg.kv_dim(), n, 42, /*specials=*/true);
    for (std::int64_t chunk : {1, 3, 7, 32, 33, 64, 199}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      auto gpu = cuda_cache(cfg);
      auto cpu = cpu_cache(cfg);
      ASSERT_TRUE(gpu && cpu);
      for (std::int64_t p = 0; p < n;) {
        const std::int64_t count = std::min(chunk, n - p);
        for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
          if (count == 1) {
            ASSERT_TRUE(gpu->store_token(l, p, s.krow(p), s.vrow(p)).ok());
            ASSERT_TRUE(cpu->store_token(l, p, s.krow(p), s.vrow(p)).ok());
          } else {
            ASSERT_TRUE(gpu->store_batch(l, p, count, s.krow(p), s.vrow(p)).ok());
            ASSERT_TRUE(cpu->store_batch(l, p, count, s.krow(p), s.vrow(p)).ok());
          }
        }
        p += count;
        if (chunk > 1 || p % 37 == 0 || p == n) expect_same_planes(*gpu, *cpu);
        if (HasFailure()) return;
      }
    }
  }
}

// The device-pointer API (one token, batches, all layers at once) stores
// the same bytes as the CPU backend.
TEST(CudaCache, DeviceApiStoresTheSameBytes) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& cfg : store_configs()) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t n = 150, kv = cfg.kv_dim(), L = cfg.n_layers;
    KvStream s(kv, n, 9, /*specials=*/true);
    DeviceArray<float> dk(s.k), dv(s.v);
    // Row p of every layer for the all-layers store: [n, L, kv].
    std::vector<float> lk, lv;
    for (std::int64_t p = 0; p < n; ++p)
      for (std::int64_t l = 0; l < L; ++l) {
        lk.insert(lk.end(), s.krow(p), s.krow(p) + kv);
        lv.insert(lv.end(), s.vrow(p), s.vrow(p) + kv);
      }
    DeviceArray<float> dlk(lk), dlv(lv);

    auto cpu = cpu_cache(cfg);
    auto tok = typed_cuda_cache(cfg);
    auto bat = typed_cuda_cache(cfg);
    auto all = typed_cuda_cache(cfg);
    ASSERT_TRUE(cpu && tok && bat && all);
    for (std::int64_t l = 0; l < L; ++l) ASSERT_TRUE(cpu->store_batch(l, 0, n, s.krow(0), s.vrow(0)).ok());
    for (std::int64_t p = 0; p < n; ++p) {
      for (std::int64_t l = 0; l < L; ++l)
        ASSERT_TRUE(tok->store_token_device(l, p, dk.get() + p * kv, dv.get() + p * kv).ok());
      ASSERT_TRUE(all->store_token_all_layers_device(p, dlk.get() + p * L * kv, dlv.get() + p * L * kv).ok());
    }
    constexpr std::int64_t kCounts[] = {1, 5, 33, 40};
    for (std::int64_t p = 0, i = 0; p < n; ++i) {
      const std::int64_t count = std::min(kCounts[i % 4], n - p);
      for (std::int64_t l = 0; l < L; ++l)
        ASSERT_TRUE(bat->store_batch_device(l, p, count, dk.get() + p * kv, dv.get() + p * kv).ok());
      p += count;
    }
    for (auto* c : {tok.get(), bat.get(), all.get()}) {
      ASSERT_TRUE(c->synchronize().ok());
      expect_same_planes(*c, *cpu);
    }
  }
}

// The all-layers batch store leaves the planes and rings of per-layer
// batch stores and of the CPU backend: across wraps (two spans a ring) and
// across launches (40 and 41 layers have more spans than one launch takes;
// with 41 layers, a full layer every third, the cut after 48 spans falls
// between the two spans of layer 28), on the vector and element paths.
TEST(CudaCache, AllLayersBatchStoreMatchesPerLayerStores) {
  KVRING_SKIP_WITHOUT_GPU();
  std::vector<ModelConfig> cfgs = store_configs();
  cfgs.push_back(make_hybrid_config("40-layers", 40, 4, 4, 2, 16, 24, 300));
  cfgs.push_back(make_hybrid_config("41-layers-hd12", 41, 3, 6, 3, 12, 24, 300));
  for (const ModelConfig& cfg : cfgs) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t n = 150, kv = cfg.kv_dim(), L = cfg.n_layers;
    // Every layer gets tokens of its own.
    std::vector<KvStream> per;
    for (std::int64_t l = 0; l < L; ++l) per.emplace_back(kv, n, 300 + static_cast<std::uint64_t>(l), true);
    auto cpu = cpu_cache(cfg);
    auto one = typed_cuda_cache(cfg);
    auto all = typed_cuda_cache(cfg);
    ASSERT_TRUE(cpu && one && all);
    constexpr std::int64_t kCounts[] = {1, 5, 33, 40, 71};
    for (std::int64_t p = 0, i = 0; p < n; ++i) {
      const std::int64_t count = std::min(kCounts[i % 5], n - p);
      std::vector<float> lk, lv;  // [L, count, kv]
      for (const KvStream& t : per) {
        lk.insert(lk.end(), t.krow(p), t.krow(p) + count * kv);
        lv.insert(lv.end(), t.vrow(p), t.vrow(p) + count * kv);
      }
      DeviceArray<float> dk(lk), dv(lv);
      for (std::int64_t l = 0; l < L; ++l) {
        const KvStream& t = per[static_cast<std::size_t>(l)];
        ASSERT_TRUE(cpu->store_batch(l, p, count, t.krow(p), t.vrow(p)).ok());
        ASSERT_TRUE(one->store_batch_device(l, p, count, dk.get() + l * count * kv,
                                            dv.get() + l * count * kv)
                        .ok());
      }
      const Status st = all->store_batch_all_layers_device(p, count, dk.get(), dv.get());
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_TRUE(one->synchronize().ok());
      ASSERT_TRUE(all->synchronize().ok());
      p += count;
    }
    expect_same_planes(*all, *one);
    expect_same_planes(*all, *cpu);
  }
}

// read_rows gives the live rows in logical order whatever the rotation;
// install puts them back byte-identically, through pageable and pinned host
// buffers alike.
TEST(CudaCache, SnapshotsRoundTripAfterWraps) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& cfg : store_configs()) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t kv = cfg.kv_dim();
    for (std::int64_t n : {1, 31, 45, 77, 200}) {
      SCOPED_TRACE("tokens " + std::to_string(n));
      KvStream s(kv, n, 100 + static_cast<std::uint64_t>(n), true);
      auto gpu = cuda_cache(cfg);
      auto cpu = cpu_cache(cfg);
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        ASSERT_TRUE(gpu->store_batch(l, 0, n, s.krow(0), s.vrow(0)).ok());
        ASSERT_TRUE(cpu->store_batch(l, 0, n, s.krow(0), s.vrow(0)).ok());
      }
      auto restored = cuda_cache(cfg);
      auto restored_pinned = cuda_cache(cfg);
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        const RingState r = gpu->ring(l);
        const auto rows = static_cast<std::size_t>(r.len() * kv);
        std::vector<std::uint16_t> gk(rows), gv(rows), ck(rows), cv(rows);
        ASSERT_TRUE(gpu->read_rows(l, r.origin_logical(), r.len(), gk.data(), gv.data()).ok());
        ASSERT_TRUE(cpu->read_rows(l, r.origin_logical(), r.len(), ck.data(), cv.data()).ok());
        EXPECT_EQ(gk, ck);
        EXPECT_EQ(gv, cv);
        // A range in the middle of the live rows.
        if (r.len() >= 3) {
          const std::int64_t first = r.origin_logical() + 1, count = r.len() - 2;
          std::vector<std::uint16_t> mk(static_cast<std::size_t>(count * kv)), mv(mk.size());
          ASSERT_TRUE(gpu->read_rows(l, first, count, mk.data(), mv.data()).ok());
          EXPECT_TRUE(std::equal(mk.begin(), mk.end(), ck.begin() + kv));
          EXPECT_TRUE(std::equal(mv.begin(), mv.end(), cv.begin() + kv));
        }
        ASSERT_TRUE(restored->install(l, r, gk.data(), gv.data()).ok());
        // Pinned buffers take the direct DMA path.
        void *hk = nullptr, *hv = nullptr;
        ASSERT_EQ(cudaHostAlloc(&hk, rows * 2 + 2, cudaHostAllocDefault), cudaSuccess);
        ASSERT_EQ(cudaHostAlloc(&hv, rows * 2 + 2, cudaHostAllocDefault), cudaSuccess);
        auto* pk = static_cast<std::uint16_t*>(hk);
        auto* pv = static_cast<std::uint16_t*>(hv);
        ASSERT_TRUE(gpu->read_rows(l, r.origin_logical(), r.len(), pk, pv).ok());
        EXPECT_TRUE(std::equal(gk.begin(), gk.end(), pk));
        EXPECT_TRUE(std::equal(gv.begin(), gv.end(), pv));
        ASSERT_TRUE(restored_pinned->install(l, r, pk, pv).ok());
        cudaFreeHost(pk);
        cudaFreeHost(pv);
      }
      expect_same_planes(*restored, *gpu);
      expect_same_planes(*restored_pinned, *gpu);
    }
  }
}

// A snapshot larger than one staging slot (8 MiB) crosses chunk boundaries.
TEST(CudaCache, LargeSnapshotsCrossStagingChunks) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = make_hybrid_config("big", 4, 4, 16, 2, 128, 2048, 40000);
  const std::int64_t n = testing::quick() ? 17000 : 40000, kv = cfg.kv_dim();
  KvStream s(kv, n, 77);
  auto gpu = cuda_cache(cfg, {.context = n});
  ASSERT_TRUE(gpu);
  const std::int64_t layer = 3;  // full plane: n rows, 20 MB of K
  ASSERT_TRUE(gpu->store_batch(layer, 0, n, s.krow(0), s.vrow(0)).ok());
  std::vector<std::uint16_t> k(static_cast<std::size_t>(n * kv)), v(k.size());
  ASSERT_TRUE(gpu->read_rows(layer, 0, n, k.data(), v.data()).ok());
  for (std::size_t i = 0; i < k.size(); i += 997) {
    ASSERT_EQ(k[i], f32_to_f16(s.k[i])) << i;
    ASSERT_EQ(v[i], f32_to_f16(s.v[i])) << i;
  }
  auto again = cuda_cache(cfg, {.context = n});
  ASSERT_TRUE(again->install(layer, gpu->ring(layer), k.data(), v.data()).ok());
  EXPECT_TRUE(plane_bytes(*again, layer) == plane_bytes(*gpu, layer));
}

TEST(CudaCache, FailuresLeaveTheCacheUnchanged) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = small_config(32, 64);
  const std::int64_t kv = cfg.kv_dim();
  KvStream s(kv, 128, 7);
  auto c = typed_cuda_cache(cfg);
  ASSERT_TRUE(c);
  CudaCache& cache = *c;
  for (std::int64_t l = 0; l < 4; ++l) ASSERT_TRUE(cache.store_batch(l, 0, 40, s.krow(0), s.vrow(0)).ok());
  std::vector<PlaneBytes> before;
  for (std::int64_t l = 0; l < 4; ++l) before.push_back(plane_bytes(cache, l));
  auto unchanged = [&] {
    ASSERT_TRUE(cache.synchronize().ok());
    for (std::int64_t l = 0; l < 4; ++l) {
      EXPECT_EQ(cache.ring(l).next_position(), 40);
      EXPECT_TRUE(plane_bytes(cache, l) == before[static_cast<std::size_t>(l)]) << "layer " << l;
    }
  };
  DeviceArray<float> dk(s.k), dv(s.v);
  for (std::int64_t bad : {41, 39, 0}) {
    Status st = cache.store_token(1, bad, s.krow(0), s.vrow(0));
    ASSERT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(st.error().expected, 40);
    EXPECT_EQ(st.error().got, bad);
    EXPECT_EQ(cache.store_batch(2, bad, 5, s.krow(0), s.vrow(0)).error().code,
              ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(cache.store_token_device(1, bad, dk.get(), dv.get()).error().code,
              ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(cache.store_batch_device(2, bad, 5, dk.get(), dv.get()).error().code,
              ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(cache.store_token_all_layers_device(bad, dk.get(), dv.get()).error().code,
              ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(cache.store_batch_all_layers_device(bad, 5, dk.get(), dv.get()).error().code,
              ErrorCode::kCacheDiscontinuity);
  }
  unchanged();
  // Layers that disagree: the all-layers store refuses for every layer.
  {
    auto d = typed_cuda_cache(cfg);
    ASSERT_TRUE(d->store_token(0, 0, s.krow(0), s.vrow(0)).ok());
    const PlaneBytes l1 = plane_bytes(*d, 1);
    Status st = d->store_token_all_layers_device(0, dk.get(), dv.get());
    EXPECT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(st.error().layer, 0);
    st = d->store_batch_all_layers_device(0, 3, dk.get(), dv.get());
    EXPECT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(st.error().layer, 0);
    ASSERT_TRUE(d->synchronize().ok());
    EXPECT_EQ(d->ring(1).len(), 0);
    EXPECT_TRUE(plane_bytes(*d, 1) == l1);
  }
  // Layers 0 and 1 would take the batch, layer 2 refuses it: none changes.
  {
    auto d = typed_cuda_cache(cfg);
    ASSERT_TRUE(d->store_token(2, 0, s.krow(0), s.vrow(0)).ok());
    const PlaneBytes l0 = plane_bytes(*d, 0);
    Status st = d->store_batch_all_layers_device(0, 3, dk.get(), dv.get());
    EXPECT_EQ(st.error().code, ErrorCode::kCacheDiscontinuity);
    EXPECT_EQ(st.error().layer, 2);
    ASSERT_TRUE(d->synchronize().ok());
    EXPECT_EQ(d->ring(0).len(), 0);
    EXPECT_EQ(d->ring(1).len(), 0);
    EXPECT_TRUE(plane_bytes(*d, 0) == l0);
  }
  EXPECT_EQ(cache.store_batch(3, 40, 25, s.krow(40), s.vrow(40)).error().code,
            ErrorCode::kCapacityExceeded);
  EXPECT_EQ(cache.store_batch_device(3, 40, 25, dk.get(), dv.get()).error().code,
            ErrorCode::kCapacityExceeded);
  // The sliding layers would take 25 rows; the full ones refuse them all.
  EXPECT_EQ(cache.store_batch_all_layers_device(40, 25, dk.get(), dv.get()).error().code,
            ErrorCode::kCapacityExceeded);
  EXPECT_EQ(cache.store_token(4, 40, s.krow(0), s.vrow(0)).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_token_device(-1, 40, dk.get(), dv.get()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_token_device(0, 40, nullptr, dv.get()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_batch_device(0, 40, 0, dk.get(), dv.get()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_batch_all_layers_device(40, 0, dk.get(), dv.get()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_batch_all_layers_device(40, 5, dk.get(), nullptr).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(cache.store_batch_all_layers_device(40, std::int64_t{1} << 60, dk.get(), dv.get())
                .error()
                .code,
            ErrorCode::kInvalidArgument);
  std::vector<std::uint16_t> k(64 * 64), v(64 * 64);
  EXPECT_FALSE(cache.read_rows(0, 0, 1, k.data(), v.data()).ok());
  EXPECT_FALSE(cache.read_rows(0, 39, 2, k.data(), v.data()).ok());
  // An install of another shape or rotation.
  auto wrong = RingState::sequential(32, true, 41);
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(cache.install(3, *wrong, k.data(), v.data()).ok());
  unchanged();
}

}  // namespace
}  // namespace kvring
