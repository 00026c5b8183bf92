// CUDA attention: within 1e-5 (relative) of a float64 reference at awkward
// sizes for both kernels (head_dim 128 on tensor cores; any other head_dim
// up to 256), and bitwise the same across ring rotations, prefill chunkings,
// restores, the host and device APIs, and runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "cuda/testing.h"
#include "cuda_test_util.h"

namespace kvring {
namespace {

using testing::DeviceArray;
using testing::expect_same_planes;
using testing::KvStream;
using testing::random_floats;

constexpr double kTolerance = 1e-5;

std::unique_ptr<CudaCache> cuda_cache(const ModelConfig& c, std::int64_t context) {
  auto r = CudaCache::create(c, {.context = context});
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? std::move(*r) : nullptr;
}

// Geometries for both kernels: muse-glimmer's heads; GQA groups that leave
// tensor-core rows idle (3) or need two head sets (12); odd, tiny and large
// head_dim; no GQA at all.
std::vector<ModelConfig> attention_configs() {
  return {make_hybrid_config("tc-muse", 4, 4, 16, 2, 128, 2048, 32768),
          make_hybrid_config("tc-group3", 4, 4, 6, 2, 128, 48, 32768),
          make_hybrid_config("tc-group12", 4, 4, 12, 1, 128, 48, 32768),
          make_hybrid_config("hd17-group3", 4, 4, 6, 2, 17, 48, 32768),
          make_hybrid_config("hd256", 4, 4, 4, 2, 256, 40, 32768),
          make_hybrid_config("hd1", 4, 4, 3, 1, 1, 33, 32768),
          make_hybrid_config("hd64-mha", 4, 4, 8, 8, 64, 32, 32768)};
}

// Float64 attention of q (f32 [n_heads, head_dim]) at position p over the
// rows the cache holds (read back as f16 bits), logical order. `scale` is
// the same weighted average of |V|: the size of the terms the output sums,
// which a relative error is measured against (a plain |out| can cancel to
// nearly zero, most easily at head_dim 1).
struct Reference {
  std::vector<double> out, scale;
};
Reference reference(const KvCache& c, std::int64_t layer, std::int64_t p, const float* q) {
  const ModelConfig& cfg = c.config();
  const std::int64_t hd = cfg.head_dim, kv = cfg.kv_dim(), group = cfg.gqa_group();
  const std::int64_t lo = visible_begin(cfg, cfg.kind(layer), p), n = p - lo + 1;
  std::vector<std::uint16_t> k(static_cast<std::size_t>(n * kv)), v(k.size());
  EXPECT_TRUE(c.read_rows(layer, lo, n, k.data(), v.data()).ok());
  std::vector<double> out(static_cast<std::size_t>(cfg.n_heads * hd), 0.0), s(static_cast<std::size_t>(n));
  std::vector<double> scale(out.size(), 0.0);
  for (std::int64_t h = 0; h < cfg.n_heads; ++h) {
    const std::int64_t g = h / group;
    double m = -INFINITY;
    for (std::int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (std::int64_t d = 0; d < hd; ++d)
        dot += static_cast<double>(q[h * hd + d]) * f16_to_f32(k[static_cast<std::size_t>(j * kv + g * hd + d)]);
      s[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(hd));
      m = std::max(m, s[static_cast<std::size_t>(j)]);
    }
    double sum = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
      sum += w;
      for (std::int64_t d = 0; d < hd; ++d) {
        const double x = f16_to_f32(v[static_cast<std::size_t>(j * kv + g * hd + d)]);
        out[static_cast<std::size_t>(h * hd + d)] += w * x;
        scale[static_cast<std::size_t>(h * hd + d)] += w * std::fabs(x);
      }
    }
    for (std::int64_t d = 0; d < hd; ++d) {
      out[static_cast<std::size_t>(h * hd + d)] /= sum;
      scale[static_cast<std::size_t>(h * hd + d)] /= sum;
    }
  }
  return {out, scale};
}

// Largest over heads of |out - ref| / |scale| (2-norms over head_dim; the
// scale defaults to |ref|); NaN counts as infinitely wrong.
template <class T>
double worst_relative_error(const float* out, const T* ref, std::int64_t heads, std::int64_t hd,
                            const double* scale = nullptr) {
  double worst = 0;
  for (std::int64_t h = 0; h < heads; ++h) {
    double num = 0, den = 0;
    for (std::int64_t d = 0; d < hd; ++d) {
      const double o = out[h * hd + d], r = static_cast<double>(ref[h * hd + d]);
      const double sc = scale ? scale[h * hd + d] : r;
      if (!std::isfinite(o)) return INFINITY;
      num += (o - r) * (o - r);
      den += sc * sc;
    }
    worst = std::max(worst, std::sqrt(num) / std::max(std::sqrt(den), 1e-30));
  }
  return worst;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> nan_filled(std::size_t n) { return std::vector<float>(n, NAN); }

// Decode after stores up to awkward positions: small visible ranges on the
// sliding layers, up to 20000 rows (many splits) on the full layer.
TEST(CudaAttention, DecodeMatchesAFloat64Reference) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::int64_t n_max = testing::quick() ? 2300 : 20000;
  const std::vector<std::int64_t> checkpoints = {0,    1,    2,    6,    16,   30,   31,   32,   33,
                                                 47,   48,   49,   63,   64,   127,  128,  129,  191,
                                                 192,  193,  1000, 2047, 2048, 2049, 2299, 5000, 8192,
                                                 16384, 16385, 19999};
  for (const ModelConfig& cfg : attention_configs()) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t per_query = cfg.n_heads * cfg.head_dim;
    KvStream s(cfg.kv_dim(), n_max, 1234);
    auto gpu = cuda_cache(cfg, n_max);
    auto cpu = make_cpu_cache(cfg, {.context = n_max});
    ASSERT_TRUE(gpu && cpu.ok());
    double worst_ref = 0, worst_plain = 0, worst_cpu = 0;
    std::int64_t stored = 0;
    for (std::int64_t p : checkpoints) {
      if (p >= n_max) break;
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        ASSERT_TRUE(gpu->store_batch(l, stored, p + 1 - stored, s.krow(stored), s.vrow(stored)).ok());
        ASSERT_TRUE((*cpu)->store_batch(l, stored, p + 1 - stored, s.krow(stored), s.vrow(stored)).ok());
      }
      stored = p + 1;
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        SCOPED_TRACE("position " + std::to_string(p) + " layer " + std::to_string(l));
        const auto q = random_floats(static_cast<std::size_t>(per_query), 7 * p + l + 1);
        auto out = nan_filled(q.size()), out_cpu = nan_filled(q.size());
        const Status st = gpu->attend_decode(l, p, q.data(), out.data());
        ASSERT_TRUE(st.ok()) << st.to_string();
        ASSERT_TRUE((*cpu)->attend_decode(l, p, q.data(), out_cpu.data()).ok());
        const auto ref = reference(*gpu, l, p, q.data());
        const double e = worst_relative_error(out.data(), ref.out.data(), cfg.n_heads, cfg.head_dim,
                                              ref.scale.data());
        EXPECT_LE(e, kTolerance);
        worst_ref = std::max(worst_ref, e);
        worst_plain = std::max(worst_plain, worst_relative_error(out.data(), ref.out.data(),
                                                                 cfg.n_heads, cfg.head_dim));
        worst_cpu = std::max(worst_cpu, worst_relative_error(out.data(), out_cpu.data(), cfg.n_heads,
                                                             cfg.head_dim, ref.scale.data()));
      }
    }
    std::printf("  %-12s worst relative error vs float64 %.2e (to |out|: %.2e), vs CPU backend %.2e\n",
                cfg.name.c_str(), worst_ref, worst_plain, worst_cpu);
    EXPECT_LE(worst_cpu, 4 * kTolerance);
  }
}

// One token at a time (store_token + attend_decode) and prefill in chunks
// of 1, 7 and 512 give the same output bits for every query, and the same
// plane bytes, across the window edge (2047, 2048, 2049 for muse-glimmer's
// window); a second run gives the same bits again.
TEST(CudaAttention, PrefillChunkingsAndDecodeGiveTheSameBits) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& cfg : attention_configs()) {
    if (cfg.name == "hd1" || cfg.name == "hd64-mha") continue;  // covered above; saves time
    // Under compute-sanitizer, the small windows exercise the same kernels.
    if (testing::quick() && cfg.sliding_window > 64) continue;
    SCOPED_TRACE(cfg.name);
    const std::int64_t n = cfg.sliding_window + 52, kv = cfg.kv_dim();
    const std::int64_t per_query = cfg.n_heads * cfg.head_dim;
    KvStream s(kv, n, 555);
    const auto q = random_floats(static_cast<std::size_t>(n * per_query), 556);
    // out[layer] = [n, per_query]
    // Decode one token at a time; at the window edge, check against float64
    // while the rows are still live.
    auto run_decode = [&] {
      std::vector<std::vector<float>> out(static_cast<std::size_t>(cfg.n_layers),
                                          nan_filled(static_cast<std::size_t>(n * per_query)));
      auto c = cuda_cache(cfg, n);
      const std::int64_t w = cfg.sliding_window;
      for (std::int64_t p = 0; p < n; ++p)
        for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
          float* o = out[static_cast<std::size_t>(l)].data() + p * per_query;
          EXPECT_TRUE(c->store_token(l, p, s.krow(p), s.vrow(p)).ok());
          EXPECT_TRUE(c->attend_decode(l, p, q.data() + p * per_query, o).ok());
          if (p == w - 1 || p == w || p == w + 1) {
            const auto ref = reference(*c, l, p, q.data() + p * per_query);
            EXPECT_LE(worst_relative_error(o, ref.out.data(), cfg.n_heads, cfg.head_dim, ref.scale.data()),
                      kTolerance)
                << "position " << p << " layer " << l;
          }
        }
      return std::pair{std::move(c), std::move(out)};
    };
    auto run_prefill = [&](std::int64_t chunk) {
      std::vector<std::vector<float>> out(static_cast<std::size_t>(cfg.n_layers),
                                          nan_filled(static_cast<std::size_t>(n * per_query)));
      auto c = cuda_cache(cfg, n);
      for (std::int64_t p = 0; p < n; p += chunk) {
        const std::int64_t count = std::min(chunk, n - p);
        for (std::int64_t l = 0; l < cfg.n_layers; ++l)
          EXPECT_TRUE(c->prefill(l, p, count, s.krow(p), s.vrow(p), q.data() + p * per_query,
                                 out[static_cast<std::size_t>(l)].data() + p * per_query).ok());
      }
      return std::pair{std::move(c), std::move(out)};
    };
    auto [dec_cache, dec] = run_decode();
    for (std::int64_t chunk : {1, 7, 512, 512}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      auto [pre_cache, pre] = run_prefill(chunk);
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        const auto& a = dec[static_cast<std::size_t>(l)];
        const auto& b = pre[static_cast<std::size_t>(l)];
        for (std::int64_t p = 0; p < n; ++p)
          ASSERT_EQ(std::memcmp(a.data() + p * per_query, b.data() + p * per_query,
                                static_cast<std::size_t>(per_query) * sizeof(float)),
                    0)
              << "layer " << l << " position " << p;
      }
      expect_same_planes(*pre_cache, *dec_cache);
    }
  }
}

// The same logical rows at different ring rotations (a prefix of filler
// tokens of varying length shifts them) give the same bits on a sliding
// layer; so does a cache restored from a snapshot.
TEST(CudaAttention, RotationAndRestoreDoNotChangeTheBits) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& cfg : attention_configs()) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t w = cfg.sliding_window, m = w + 52, kv = cfg.kv_dim();
    const std::int64_t per_query = cfg.n_heads * cfg.head_dim;
    KvStream content(kv, m, 31);
    const auto q = random_floats(static_cast<std::size_t>(per_query), 32);
    std::vector<float> first;
    std::set<std::int64_t> rotations;
    for (std::int64_t shift : {std::int64_t{0}, std::int64_t{1}, w / 2, w - 1, w, w + 1, 2 * w + 5}) {
      SCOPED_TRACE("shift " + std::to_string(shift));
      const std::int64_t total = shift + m;
      KvStream filler(kv, std::max<std::int64_t>(shift, 1), 1000 + static_cast<std::uint64_t>(shift));
      auto c = cuda_cache(cfg, total);
      const std::int64_t layer = 0;  // sliding
      if (shift > 0) {
        ASSERT_TRUE(c->store_batch(layer, 0, shift, filler.krow(0), filler.vrow(0)).ok());
      }
      ASSERT_TRUE(c->store_batch(layer, shift, m, content.krow(0), content.vrow(0)).ok());
      rotations.insert(c->ring(layer).origin_physical());
      auto out = nan_filled(q.size());
      ASSERT_TRUE(c->attend_decode(layer, total - 1, q.data(), out.data()).ok());
      if (first.empty()) {
        first = out;
        const auto ref = reference(*c, layer, total - 1, q.data());
        EXPECT_LE(worst_relative_error(out.data(), ref.out.data(), cfg.n_heads, cfg.head_dim,
                                       ref.scale.data()),
                  kTolerance);
      } else {
        EXPECT_TRUE(same_bits(out, first));
      }
      // Restore the plane into a fresh cache: same rotation, same bits.
      const RingState r = c->ring(layer);
      std::vector<std::uint16_t> k(static_cast<std::size_t>(r.len() * kv)), v(k.size());
      ASSERT_TRUE(c->read_rows(layer, r.origin_logical(), r.len(), k.data(), v.data()).ok());
      auto restored = cuda_cache(cfg, total);
      ASSERT_TRUE(restored->install(layer, r, k.data(), v.data()).ok());
      auto again = nan_filled(q.size());
      ASSERT_TRUE(restored->attend_decode(layer, total - 1, q.data(), again.data()).ok());
      EXPECT_TRUE(same_bits(again, first));
    }
    EXPECT_GE(rotations.size(), 3u);
  }
}

// A query whose splits fit one thread-block cluster combines them through
// the cluster's shared memory; with clusters capped off, through the global
// workspace. Both give the same bits for both kernels, from one split to
// more than a cluster holds, on sliding and full layers, for decode and for
// prefill chunks that mix split counts.
// The split combines, forced through the test hooks: mode 0 is the default
// choice (a resident grid where one fits, head_dim 128 only), mode 1 takes
// a thread-block cluster where the splits fit one, else the last CTA to
// arrive; mode 2 always the last CTA to arrive, its grid split-major; mode
// 3 the same, its grid query-major when it has several queries.
void set_combine_path(int mode) {
  cuda::testing::set_attend_cluster_cap(mode >= 2 ? 1 : 0);
  cuda::testing::set_attend_resident(mode == 0);
  cuda::testing::set_attend_query_major(mode == 2 ? -1 : mode == 3 ? 1 : 0);
}

// Restores the default combine path when a test leaves, however it leaves.
struct DefaultPathAtExit {
  ~DefaultPathAtExit() { set_combine_path(0); }
};

// The path counter a launch of `splits` splits (over `ctas` CTAs, head_dim
// hd) advances in `mode`; null for one split.
long cuda::testing::AttendPathCounts::*expected_path(int mode, int splits, int ctas, int hd) {
  using C = cuda::testing::AttendPathCounts;
  if (splits < 2) return nullptr;
  if (mode == 0 && hd == 128 && ctas <= cuda::testing::attend_resident_limit(hd)) return &C::resident;
  if (mode != 2 && splits <= cuda::testing::attend_cluster_limit(hd)) return &C::cluster;
  return &C::last_arrival;
}

// One decode on every combine path: the same bits, not NaN (outputs are
// poisoned first), and each on the path it was forced to (the launch
// counters say which ran).
void expect_same_bits_on_every_path(KvCache& c, std::int64_t layer, std::int64_t p,
                                    const std::vector<float>& q) {
  const ModelConfig& cfg = c.config();
  const std::int64_t n = p - visible_begin(cfg, cfg.kind(layer), p) + 1;
  const int splits = cuda::testing::attend_splits_for(n);
  const int hd = static_cast<int>(cfg.head_dim);
  const int items = hd == 128 ? static_cast<int>(cfg.n_kv_heads * ((cfg.gqa_group() + 7) / 8))
                              : static_cast<int>(cfg.n_heads);
  std::vector<std::vector<float>> outs;
  for (int mode : {0, 1, 2}) {
    auto out = nan_filled(q.size());
    const auto before = cuda::testing::attend_path_counts();
    set_combine_path(mode);
    const Status st = c.attend_decode(layer, p, q.data(), out.data());
    set_combine_path(0);
    ASSERT_TRUE(st.ok()) << st.to_string();
    const auto after = cuda::testing::attend_path_counts();
    using C = cuda::testing::AttendPathCounts;
    const auto path = expected_path(mode, splits, splits * items, hd);
    for (auto counter : {&C::resident, &C::cluster, &C::last_arrival})
      EXPECT_EQ(after.*counter - before.*counter, counter == path ? 1 : 0) << "mode " << mode;
    outs.push_back(std::move(out));
  }
  EXPECT_TRUE(same_bits(outs[0], outs[1]));
  EXPECT_TRUE(same_bits(outs[0], outs[2]));
  EXPECT_FALSE(std::isnan(outs[0][0]));
}

TEST(CudaAttention, EveryCombinePathGivesTheSameBits) {
  KVRING_SKIP_WITHOUT_GPU();
  const DefaultPathAtExit restore;
  // Groups of 8, 3 and 12 query heads (so 8, 3, 8 and 4 heads an item) on
  // tensor cores; head_dim 17 on the general kernel.
  const auto all = attention_configs();
  for (const ModelConfig& cfg : {all[0], all[1], all[2], all[3]}) {
    SCOPED_TRACE(cfg.name);
    const int hd = static_cast<int>(cfg.head_dim);
    const int limit = cuda::testing::attend_cluster_limit(hd);
    const int resident = cuda::testing::attend_resident_limit(hd);
    std::printf("  %-12s clusters of up to %d CTAs, resident grids of up to %d\n",
                cfg.name.c_str(), limit, resident);
    EXPECT_GE(limit, 1);
    // Any GPU this backend builds for takes cooperative launches; the
    // decodes below (grids of 18 x 2 CTAs at most) then run resident.
    if (hd == 128) {
      EXPECT_GE(resident, 36);
    } else {
      EXPECT_EQ(resident, 0);
    }
    const std::int64_t n = 2300, per_query = cfg.n_heads * cfg.head_dim;
    KvStream s(cfg.kv_dim(), n, 88);
    auto c = cuda_cache(cfg, n);
    ASSERT_TRUE(c);
    std::int64_t stored = 0;
    int compared = 0;
    for (std::int64_t p : {0, 127, 128, 255, 256, 1000, 2047, 2048, 2175, 2176, 2299}) {
      for (std::int64_t l = 0; l < cfg.n_layers; ++l)
        ASSERT_TRUE(c->store_batch(l, stored, p + 1 - stored, s.krow(stored), s.vrow(stored)).ok());
      stored = p + 1;
      for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
        SCOPED_TRACE("position " + std::to_string(p) + " layer " + std::to_string(l));
        expect_same_bits_on_every_path(*c, l, p,
                                       random_floats(static_cast<std::size_t>(per_query), 3 * p + l));
        ++compared;
      }
    }
    EXPECT_EQ(compared, 11 * cfg.n_layers);

    // Up to 64 splits (8 groups, the last one short) on the full layers.
    {
      const std::int64_t big = testing::quick() ? 9000 : 20000;
      KvStream sb(cfg.kv_dim(), big, 89);
      auto cb = cuda_cache(cfg, big);
      ASSERT_TRUE(cb);
      for (std::int64_t l = 0; l < cfg.n_layers; ++l)
        ASSERT_TRUE(cb->store_batch(l, 0, big, sb.krow(0), sb.vrow(0)).ok());
      for (std::int64_t p : {std::int64_t{8191}, std::int64_t{8192}, big - 1}) {
        for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
          // A sliding layer holds only the last window of rows.
          if (cfg.kind(l) == LayerKind::kSlidingRope && p != big - 1) continue;
          SCOPED_TRACE("long plane, position " + std::to_string(p) + " layer " + std::to_string(l));
          expect_same_bits_on_every_path(
              *cb, l, p, random_floats(static_cast<std::size_t>(per_query), 5 * p + l));
        }
      }
    }

    // Prefill chunks whose queries have different split counts (CTAs
    // without a split of their query), on every path, the last-arrival one
    // with both grid orders. On an H200, 20 queries from 2040 (17 splits on
    // the full layers) are too many CTAs for a resident grid; 20 from 250
    // (3 splits), 3 from 2046 (16, 16 and 17 splits) and 16 from 120
    // (queries of one split and of two) fit one.
    for (const auto& [start, count] : {std::pair<std::int64_t, std::int64_t>{250, 20},
                                       {2040, 20}, {2046, 3}, {120, 16}}) {
      SCOPED_TRACE("prefill of " + std::to_string(count) + " from " + std::to_string(start));
      std::vector<std::vector<float>> outs;
      for (int mode : {0, 1, 2, 3}) {
        auto p = cuda_cache(cfg, n);
        ASSERT_TRUE(p);
        for (std::int64_t l = 0; l < cfg.n_layers; ++l)
          ASSERT_TRUE(p->store_batch(l, 0, start, s.krow(0), s.vrow(0)).ok());
        const auto q = random_floats(static_cast<std::size_t>(count * per_query), 4 + start);
        std::vector<float> out = nan_filled(static_cast<std::size_t>(cfg.n_layers * count * per_query));
        const auto before = cuda::testing::attend_path_counts();
        set_combine_path(mode);
        for (std::int64_t l = 0; l < cfg.n_layers; ++l)
          ASSERT_TRUE(p->prefill(l, start, count, s.krow(start), s.vrow(start), q.data(),
                                 out.data() + l * count * per_query)
                          .ok());
        set_combine_path(0);
        // In mode 3 the launch of every layer whose chunk has a query of
        // several splits ran query-major (the last query sees the most
        // rows), in mode 2 none did.
        long several = 0;
        for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
          const std::int64_t rows = cfg.kind(l) == LayerKind::kSlidingRope
                                        ? std::min(start + count, cfg.sliding_window)
                                        : start + count;
          if (cuda::testing::attend_splits_for(rows) >= 2) ++several;
        }
        EXPECT_GE(several, 1);
        const long query_major = cuda::testing::attend_path_counts().query_major - before.query_major;
        EXPECT_EQ(query_major, mode == 3 ? several : 0) << "mode " << mode;
        outs.push_back(std::move(out));
      }
      EXPECT_TRUE(same_bits(outs[0], outs[1]));
      EXPECT_TRUE(same_bits(outs[0], outs[2]));
      EXPECT_TRUE(same_bits(outs[0], outs[3]));
      EXPECT_FALSE(std::isnan(outs[0][0]));
    }
  }
}

// Resident grids tell fresh partials from old ones by the launch's epoch.
// When the 32-bit count wraps, the words are zeroed first: the launch that
// takes epoch 1 again must not take the partials an earlier epoch-1 launch
// left (here: the words of 64 CTAs, 32 splits of each KV head, of which
// the 6 CTAs of the launch in between overwrote 6).
TEST(CudaAttention, ResidentEpochWrapLeavesNoStalePartials) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = attention_configs()[0];
  if (cuda::testing::attend_resident_limit(128) < 64) GTEST_SKIP() << "no resident grid of 64 CTAs";
  const std::int64_t n = 4000, per_query = cfg.n_heads * cfg.head_dim;
  const std::int64_t full = 3;  // a full-attention layer of the test geometry
  ASSERT_EQ(cfg.kind(full), LayerKind::kFullNope);
  KvStream s(cfg.kv_dim(), n, 90);
  auto c = cuda_cache(cfg, n);
  ASSERT_TRUE(c);
  for (std::int64_t l = 0; l < cfg.n_layers; ++l)
    ASSERT_TRUE(c->store_batch(l, 0, n, s.krow(0), s.vrow(0)).ok());
  const DefaultPathAtExit restore;
  auto decode = [&](std::int64_t p, int mode, std::uint64_t seed) {
    const auto q = random_floats(static_cast<std::size_t>(per_query), seed);
    auto out = nan_filled(q.size());
    set_combine_path(mode);
    EXPECT_TRUE(c->attend_decode(full, p, q.data(), out.data()).ok());
    set_combine_path(0);
    return out;
  };
  const long resident_before = cuda::testing::attend_path_counts().resident;
  decode(3999, 0, 1);                                    // epoch 1: 32 splits
  cuda::testing::set_attend_next_epoch(0xffffffffu);
  const auto b = decode(300, 0, 2);                       // epoch 2^32 - 1: 3 splits
  const auto c1 = decode(2500, 0, 3);                     // wraps: zeroed, epoch 1
  const auto d = decode(3500, 0, 4);                      // epoch 2
  EXPECT_EQ(cuda::testing::attend_path_counts().resident - resident_before, 4);
  EXPECT_TRUE(same_bits(b, decode(300, 2, 2)));
  EXPECT_TRUE(same_bits(c1, decode(2500, 2, 3)));
  EXPECT_TRUE(same_bits(d, decode(3500, 2, 4)));
  EXPECT_FALSE(std::isnan(c1[0]));
}

// A decode captured into a CUDA graph and replayed with new queries gives
// the bits of direct launches: a captured launch cannot carry a fresh epoch
// into its replays, so it takes another combine path.
TEST(CudaAttention, GraphReplaysGiveTheBitsOfDirectLaunches) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = attention_configs()[0];
  const std::int64_t n = 4000, per_query = cfg.n_heads * cfg.head_dim, p = n - 1;
  const std::int64_t full = 3;
  KvStream s(cfg.kv_dim(), n, 91);
  auto c = cuda_cache(cfg, n);
  ASSERT_TRUE(c);
  for (std::int64_t l = 0; l < cfg.n_layers; ++l)
    ASSERT_TRUE(c->store_batch(l, 0, n, s.krow(0), s.vrow(0)).ok());
  DeviceArray<float> dq(static_cast<std::size_t>(per_query)), dout(static_cast<std::size_t>(per_query));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const long resident_before = cuda::testing::attend_path_counts().resident;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status captured = c->attend_decode_device(full, p, dq.get(), dout.get(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured.to_string();
  EXPECT_EQ(cuda::testing::attend_path_counts().resident, resident_before);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (std::uint64_t seed : {11, 12, 13}) {
    SCOPED_TRACE("replay with query seed " + std::to_string(seed));
    const auto q = random_floats(static_cast<std::size_t>(per_query), seed);
    dq.upload(q);
    dout.poison();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto replayed = dout.download();
    auto direct = nan_filled(q.size());
    ASSERT_TRUE(c->attend_decode(full, p, q.data(), direct.data()).ok());
    EXPECT_TRUE(same_bits(replayed, direct));
    EXPECT_FALSE(std::isnan(replayed[0]));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The device-pointer API gives the host API's bits (outputs poisoned first).
TEST(CudaAttention, DeviceApiMatchesTheHostApi) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const ModelConfig& cfg : {attention_configs()[0], attention_configs()[3]}) {
    SCOPED_TRACE(cfg.name);
    const std::int64_t n = 3000, chunk = 300, kv = cfg.kv_dim();
    const std::int64_t per_query = cfg.n_heads * cfg.head_dim;
    KvStream s(kv, n, 71);
    const auto q = random_floats(static_cast<std::size_t>(chunk * per_query), 72);
    auto host = cuda_cache(cfg, n);
    auto dev = cuda_cache(cfg, n);
    DeviceArray<float> dk(s.k), dv(s.v), dq(q);
    DeviceArray<float> dout(static_cast<std::size_t>(chunk * per_query));
    const std::int64_t start = n - chunk;
    for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
      ASSERT_TRUE(host->store_batch(l, 0, start, s.krow(0), s.vrow(0)).ok());
      ASSERT_TRUE(dev->store_batch_device(l, 0, start, dk.get(), dv.get()).ok());
      auto out = nan_filled(q.size());
      ASSERT_TRUE(host->prefill(l, start, chunk, s.krow(start), s.vrow(start), q.data(), out.data()).ok());
      dout.poison();
      ASSERT_TRUE(dev->prefill_device(l, start, chunk, dk.get() + start * kv, dv.get() + start * kv,
                                      dq.get(), dout.get()).ok());
      ASSERT_TRUE(dev->synchronize().ok());
      EXPECT_TRUE(same_bits(dout.download(), out)) << "prefill, layer " << l;
      // Decode of the last position through both APIs.
      std::vector<float> one(q.begin(), q.begin() + per_query);
      auto out1 = nan_filled(one.size());
      ASSERT_TRUE(host->attend_decode(l, n - 1, one.data(), out1.data()).ok());
      dout.poison();
      ASSERT_TRUE(dev->attend_decode_device(l, n - 1, dq.get(), dout.get()).ok());
      ASSERT_TRUE(dev->synchronize().ok());
      auto got = dout.download();
      got.resize(static_cast<std::size_t>(per_query));
      EXPECT_TRUE(same_bits(got, out1)) << "decode, layer " << l;
    }
    expect_same_planes(*host, *dev);
  }
}

TEST(CudaAttention, BadRequestsAreRefusedAndChangeNothing) {
  KVRING_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = make_hybrid_config("t", 4, 4, 16, 2, 128, 64, 4096);
  const std::int64_t per_query = cfg.n_heads * cfg.head_dim;
  KvStream s(cfg.kv_dim(), 200, 5);
  auto c = cuda_cache(cfg, 4096);
  for (std::int64_t l = 0; l < cfg.n_layers; ++l)
    ASSERT_TRUE(c->store_batch(l, 0, 100, s.krow(0), s.vrow(0)).ok());
  const auto q = random_floats(static_cast<std::size_t>(per_query), 6);
  auto out = nan_filled(q.size());
  DeviceArray<float> dq(q), dout(q.size() + 4);
  EXPECT_EQ(c->attend_decode(0, 100, q.data(), out.data()).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(c->attend_decode(0, 10, q.data(), out.data()).error().code,
            ErrorCode::kInvalidArgument);  // its window [0, 10] is overwritten
  EXPECT_EQ(c->attend_decode(4, 99, q.data(), out.data()).error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(c->attend_decode_device(0, 99, dq.get(), dout.get() + 1).error().code,
            ErrorCode::kInvalidArgument);  // misaligned
  EXPECT_EQ(c->attend_decode_device(3, 99, nullptr, dout.get()).error().code,
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(c->prefill(1, 101, 5, s.krow(0), s.vrow(0), q.data(), out.data()).error().code,
            ErrorCode::kCacheDiscontinuity);
  EXPECT_EQ(c->ring(1).next_position(), 100);
  EXPECT_TRUE(std::isnan(out[0]));  // nothing written

  // head_dim beyond the kernels: stores work, attention says so.
  const ModelConfig big = make_hybrid_config("hd512", 4, 4, 2, 1, 512, 32, 256);
  auto b = cuda_cache(big, 256);
  KvStream bs(big.kv_dim(), 10, 8);
  ASSERT_TRUE(b->store_batch(0, 0, 5, bs.krow(0), bs.vrow(0)).ok());
  const auto bq = random_floats(static_cast<std::size_t>(2 * 512 * 5), 9);
  std::vector<float> bout(bq.size());
  const Status st = b->attend_decode(0, 4, bq.data(), bout.data());
  EXPECT_EQ(st.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(st.error().message.find("head_dim"), std::string::npos) << st.to_string();
  const auto before = testing::plane_bytes(*b, 0);
  EXPECT_EQ(b->prefill(0, 5, 5, bs.krow(5), bs.vrow(5), bq.data(), bout.data()).error().code,
            ErrorCode::kUnsupported);
  EXPECT_EQ(b->ring(0).next_position(), 5);
  EXPECT_TRUE(testing::plane_bytes(*b, 0) == before);
}

}  // namespace
}  // namespace kvring
