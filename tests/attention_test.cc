// The read side on the CPU backend: decode and chunked prefill against a
// float64 reference, and bitwise independence of rotation, chunking, blocks,
// split boundaries and thread count, on the vector and the scalar path;
// attention sinks against the reference with them, and refused when bad.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cpu/attention_cpu.h"
#include "cpu/parallel.h"
#include "kvring/cache.h"
#include "kvring/f16.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::random_floats;

// K/V/Q for a stream of logical positions.
struct Data {
  std::int64_t kv_dim, q_dim;
  std::vector<float> k, v, q;
  Data(const ModelConfig& c, std::int64_t n, std::uint64_t seed)
      : kv_dim(c.kv_dim()),
        q_dim(c.n_heads * c.head_dim),
        k(random_floats(static_cast<std::size_t>(n * kv_dim), seed, 2.0f)),
        v(random_floats(static_cast<std::size_t>(n * kv_dim), seed + 1, 2.0f)),
        q(random_floats(static_cast<std::size_t>(n * q_dim), seed + 2, 2.0f)) {}
  const float* krow(std::int64_t p) const { return k.data() + p * kv_dim; }
  const float* vrow(std::int64_t p) const { return v.data() + p * kv_dim; }
  const float* qrow(std::int64_t p) const { return q.data() + p * q_dim; }
};

// float64 attention over the f16-rounded rows, for query position p, with
// e^sinks[h] in head h's denominator where sinks are given.
std::vector<double> reference(const ModelConfig& c, LayerKind kind, const Data& d, std::int64_t p,
                              const std::vector<float>& sinks = {}) {
  const std::int64_t hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
  const std::int64_t lo = visible_begin(c, kind, p);
  std::vector<double> out(static_cast<std::size_t>(c.n_heads * hd), 0.0);
  for (std::int64_t h = 0; h < c.n_heads; ++h) {
    const std::int64_t g = h / group;
    const double sink = sinks.empty() ? -INFINITY : sinks[static_cast<std::size_t>(h)];
    std::vector<double> s;
    double m = sink;
    for (std::int64_t j = lo; j <= p; ++j) {
      double dot = 0;
      for (std::int64_t e = 0; e < hd; ++e)
        dot += static_cast<double>(d.qrow(p)[h * hd + e]) *
               f16_to_f32(f32_to_f16(d.krow(j)[g * hd + e]));
      s.push_back(dot / std::sqrt(c.score_scale_dim()));
      m = std::max(m, s.back());
    }
    double sum = std::exp(sink - m);
    for (double& x : s) sum += (x = std::exp(x - m));
    for (std::int64_t j = lo; j <= p; ++j)
      for (std::int64_t e = 0; e < hd; ++e)
        out[static_cast<std::size_t>(h * hd + e)] +=
            s[static_cast<std::size_t>(j - lo)] / sum * f16_to_f32(f32_to_f16(d.vrow(j)[g * hd + e]));
  }
  return out;
}

double rel_error(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// Decode at every position (poisoned outputs) against float64, for both
// plane kinds at awkward sizes.
TEST(Attention, DecodeMatchesFloat64AtAwkwardSizes) {
  struct Shape { std::int64_t heads, kv_heads, head_dim, window, positions; };
  const Shape shapes[] = {{1, 1, 1, 1, 5},   {3, 1, 3, 3, 9},    {4, 2, 7, 7, 20},
                          {6, 3, 17, 17, 40}, {2, 2, 31, 31, 70}, {8, 1, 32, 32, 70},
                          {4, 2, 33, 33, 80}, {16, 2, 128, 33, 70}};
  std::uint64_t seed = 100;
  for (const Shape& s : shapes) {
    const ModelConfig c =
        make_hybrid_config("t", 2, 2, s.heads, s.kv_heads, s.head_dim, s.window, 256);
    SCOPED_TRACE("heads " + std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) +
                 " head_dim " + std::to_string(s.head_dim) + " window " + std::to_string(s.window));
    Data d(c, s.positions, seed++);
    auto cache = make_cpu_cache(c);
    ASSERT_TRUE(cache.ok());
    std::vector<float> out(static_cast<std::size_t>(d.q_dim));
    for (std::int64_t p = 0; p < s.positions; ++p)
      for (std::int64_t l = 0; l < 2; ++l) {
        ASSERT_TRUE((*cache)->store_token(l, p, d.krow(p), d.vrow(p)).ok());
        std::fill(out.begin(), out.end(), NAN);
        ASSERT_TRUE((*cache)->attend_decode(l, p, d.qrow(p), out.data()).ok());
        const double err = rel_error(out.data(), reference(c, c.kind(l), d, p));
        ASSERT_LT(err, 1e-5) << "layer " << l << " position " << p;
      }
  }
}

// Runs a whole stream through one layer kind with prefill chunks of `chunk`
// (1: store_token + attend_decode) and returns every output; `sinks`, where
// given, are set on every layer first.
std::vector<float> run_stream(const ModelConfig& c, std::int64_t layer, const Data& d,
                              std::int64_t n, std::int64_t chunk, CacheOptions options = {},
                              const std::vector<float>& sinks = {}) {
  auto cache = make_cpu_cache(c, options);
  EXPECT_TRUE(cache.ok());
  if (!sinks.empty()) {
    for (std::int64_t l = 0; l < c.n_layers; ++l)
      EXPECT_TRUE((*cache)->store().set_attention_sinks(l, sinks).ok());
  }
  std::vector<float> out(static_cast<std::size_t>(n * d.q_dim), NAN);
  for (std::int64_t p = 0; p < n;) {
    const std::int64_t m = std::min(chunk, n - p);
    float* o = out.data() + p * d.q_dim;
    if (chunk == 1) {
      EXPECT_TRUE((*cache)->store_token(layer, p, d.krow(p), d.vrow(p)).ok());
      EXPECT_TRUE((*cache)->attend_decode(layer, p, d.qrow(p), o).ok());
    } else {
      EXPECT_TRUE((*cache)->prefill(layer, p, m, d.krow(p), d.vrow(p), d.qrow(p), o).ok());
    }
    p += m;
  }
  return out;
}

// A score scale other than 1/sqrt(head_dim) (query_pre_attn_scalar, Gemma 3
// 27B's 168 at head_dim 128): decode and prefill follow it, under both
// numerics, on every path, and the outputs are not the usual scale's.
TEST(Attention, TheScoreScaleFollowsQueryPreAttnScalar) {
  ModelConfig c = make_hybrid_config("scaled", 2, 2, 16, 2, 128, 33, 256);
  ModelConfig usual = c;
  c.query_pre_attn_scalar = 168;
  ASSERT_TRUE(c.validate().ok());
  const std::int64_t n = 70;
  Data d(c, n, 41);
  for (const AttentionNumeric numeric : {AttentionNumeric::kF32, AttentionNumeric::kF16}) {
    SCOPED_TRACE(numeric == AttentionNumeric::kF32 ? "f32" : "f16");
    for (std::int64_t l = 0; l < 2; ++l) {
      const std::vector<float> decoded = run_stream(c, l, d, n, 1, {.attention = numeric});
      const std::vector<float> prefilled = run_stream(c, l, d, n, 16, {.attention = numeric});
      EXPECT_EQ(decoded, prefilled) << "layer " << l;
      const std::vector<float> other = run_stream(usual, l, d, n, 1, {.attention = numeric});
      double worst = 0, moved = 0;
      for (std::int64_t p = 0; p < n; ++p) {
        worst = std::max(worst, rel_error(decoded.data() + p * d.q_dim, reference(c, c.kind(l), d, p)));
        moved = std::max(moved, rel_error(other.data() + p * d.q_dim, reference(c, c.kind(l), d, p)));
      }
      EXPECT_LT(worst, numeric == AttentionNumeric::kF32 ? 1e-5 : 2e-3) << "layer " << l;
      EXPECT_GT(moved, 1e-3) << "layer " << l << ": the usual scale gives the same outputs";
    }
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(Attention, PrefillChunksGiveDecodeBitsAndMatchFloat64) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 4, 2, 16, 32, 1024);
  Data d(c, 700, 7);
  for (std::int64_t layer : {0, 1}) {  // sliding, full
    const auto decode = run_stream(c, layer, d, 700, 1);
    for (std::int64_t chunk : {2, 7, 31, 32, 33, 512}) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " chunk " + std::to_string(chunk));
      const auto prefill = run_stream(c, layer, d, 700, chunk);
      EXPECT_TRUE(same_bits(prefill, decode));
    }
    for (std::int64_t p : {0, 1, 31, 32, 33, 511, 512, 699}) {
      const double err = rel_error(decode.data() + p * d.q_dim, reference(c, c.kind(layer), d, p));
      EXPECT_LT(err, 1e-5) << "layer " << layer << " position " << p;
    }
  }
}

// The same visible rows at different ring rotations: the rows of logical
// window [p - W + 1, p] are the same values, preceded by different amounts
// of other context, so the ring holds them rotated differently.
TEST(Attention, SlidingResultIsIndependentOfRotation) {
  const std::int64_t W = 32;
  const ModelConfig c = make_hybrid_config("t", 1, 0, 4, 2, 16, W, 1024);
  Data window(c, W, 11);
  std::vector<float> first;
  for (std::int64_t shift : {0, 1, 5, 31, 32, 33, 100}) {
    auto cache = make_cpu_cache(c);
    ASSERT_TRUE(cache.ok());
    Data junk(c, shift + 1, 500 + static_cast<std::uint64_t>(shift));
    if (shift > 0) {
      ASSERT_TRUE((*cache)->store_batch(0, 0, shift, junk.krow(0), junk.vrow(0)).ok());
    }
    for (std::int64_t j = 0; j < W; ++j)
      ASSERT_TRUE((*cache)->store_token(0, shift + j, window.krow(j), window.vrow(j)).ok());
    std::vector<float> out(static_cast<std::size_t>(window.q_dim), NAN);
    ASSERT_TRUE((*cache)->attend_decode(0, shift + W - 1, window.qrow(0), out.data()).ok());
    EXPECT_EQ((*cache)->ring(0).origin_physical(), shift % W);
    if (first.empty()) first = out;
    EXPECT_TRUE(same_bits(out, first)) << "shift " << shift;
  }
}

TEST(Attention, ResultIsIndependentOfThreadCount) {
  if (cpu::worker_count() < 2) GTEST_SKIP() << "one core: no second thread count to compare";
  const ModelConfig c = make_hybrid_config("t", 2, 2, 16, 2, 64, 256, 2048);
  Data d(c, 600, 21);
  for (std::int64_t layer : {0, 1}) {
    cpu::set_thread_limit(1);
    const auto serial = run_stream(c, layer, d, 600, 300);
    cpu::set_thread_limit(0);
    const auto threaded = run_stream(c, layer, d, 600, 300);
    EXPECT_TRUE(same_bits(serial, threaded)) << "layer " << layer;
  }
}

// Runs the scalar path for the test's scope (and restores the machine's).
class ScalarPath {
 public:
  ScalarPath() : saved_(cpu::attention_isa()) { cpu::set_attention_isa(cpu::AttentionIsa::kScalar); }
  ~ScalarPath() { cpu::set_attention_isa(saved_); }

 private:
  cpu::AttentionIsa saved_;
};

// A query's splits are a function of its own row count: at most 64 of them,
// each a multiple of 256 rows.
TEST(Attention, SplitLengthDependsOnTheRowCountOnly) {
  EXPECT_EQ(cpu::attend_split_rows(1), 256);
  EXPECT_EQ(cpu::attend_split_rows(16384), 256);
  EXPECT_EQ(cpu::attend_split_rows(16385), 512);
  EXPECT_EQ(cpu::attend_split_rows(131072), 2048);
  for (std::int64_t rows : {1, 255, 256, 257, 5000, 16383, 16385, 32768, 100000, 131072, 1 << 20}) {
    const std::int64_t split = cpu::attend_split_rows(rows);
    EXPECT_EQ(split % 256, 0) << rows;
    EXPECT_LE((rows + split - 1) / split, 64) << rows;
  }
}

// Queries whose rows span several splits, with muse-glimmer's head shape (8
// query heads a KV head, head_dim 128): on a sliding layer whose window
// moves across split boundaries and rotates through its ring, and on a full
// layer. One token at a time, prefill chunks ending on and off the
// boundaries, small blocks, a ring with slack (another rotation) and one
// thread all give the same bits; float64 agrees at the boundaries.
TEST(Attention, SplitBoundariesKeepTheBits) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 16, 2, 128, 600, 2048);
  const std::int64_t n = 1100;
  Data d(c, n, 31);
  for (std::int64_t layer : {0, 1}) {  // sliding, full
    SCOPED_TRACE("layer " + std::to_string(layer));
    const auto decode = run_stream(c, layer, d, n, 1);
    for (std::int64_t chunk : {255, 256, 257, 700}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      EXPECT_TRUE(same_bits(run_stream(c, layer, d, n, chunk), decode));
    }
    EXPECT_TRUE(same_bits(run_stream(c, layer, d, n, 300, {.slack = 37, .block_rows = 16}), decode));
    cpu::set_thread_limit(1);
    const auto serial = run_stream(c, layer, d, n, 550);
    cpu::set_thread_limit(0);
    EXPECT_TRUE(same_bits(serial, decode));
    for (std::int64_t p : {255, 256, 257, 511, 512, 513, 599, 600, 855, 856, 1099}) {
      const double err = rel_error(decode.data() + p * d.q_dim, reference(c, c.kind(layer), d, p));
      EXPECT_LT(err, 1e-5) << "position " << p;
    }
  }
}

// The scalar path (machines without AVX2, head_dim not a multiple of 8)
// keeps the contract too, and agrees with the vector path within 1e-5.
TEST(Attention, ScalarPathKeepsTheBitsAndAgrees) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 16, 2, 128, 300, 1024);
  const std::int64_t n = 600;
  Data d(c, n, 41);
  for (std::int64_t layer : {0, 1}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const auto vector = run_stream(c, layer, d, n, 600);
    std::vector<float> decode;
    {
      ScalarPath scalar;
      decode = run_stream(c, layer, d, n, 1);
      EXPECT_TRUE(same_bits(run_stream(c, layer, d, n, 257), decode));
      cpu::set_thread_limit(1);
      const auto serial = run_stream(c, layer, d, n, 600);
      cpu::set_thread_limit(0);
      EXPECT_TRUE(same_bits(serial, decode));
    }
    for (std::int64_t p : {0, 255, 256, 257, 511, 512, 599}) {
      const std::vector<double> want = reference(c, c.kind(layer), d, p);
      EXPECT_LT(rel_error(decode.data() + p * d.q_dim, want), 1e-5) << "position " << p;
      std::vector<double> v(vector.begin() + p * d.q_dim, vector.begin() + (p + 1) * d.q_dim);
      EXPECT_LT(rel_error(decode.data() + p * d.q_dim, v), 1e-5) << "position " << p;
    }
  }
}

// A split's rows in tiles whose maxima lie far apart, and rows whose
// scores are all -inf (a K element past f16's range, stored as inf, times a
// negative query element), on every attention path: the -inf rows, a whole
// split of them included, take no weight, and the rest match float64.
TEST(Attention, TilesFarApartAndMinusInfinityScoresMatchFloat64) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 16, 2, 128, 600, 32768);
  const std::int64_t n = 20000, p = n - 1, hd = c.head_dim;
  ASSERT_EQ(cpu::attend_split_rows(n), 512);
  Data d(c, n, 77);
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t e = 0; e < d.kv_dim; ++e) {
      float& k = d.k[static_cast<std::size_t>(j * d.kv_dim + e)];
      if (j % 700 < 90) k *= 12.0f;  // larger scores every 700 rows
      // Split [1024, 1536) whole and 40 rows elsewhere: score -inf.
      if (e % hd == 0 && ((j >= 1000 && j < 1600) || (j >= 7003 && j < 7043))) k = 1e6f;
    }
  for (std::int64_t h = 0; h < c.n_heads; ++h) {
    float& q0 = d.q[static_cast<std::size_t>(p * d.q_dim + h * hd)];
    q0 = -0.25f - std::fabs(q0);
  }
  const std::vector<double> want = reference(c, c.kind(1), d, p);
  const cpu::AttentionIsa saved = cpu::attention_isa();
  for (const auto isa : {cpu::AttentionIsa::kScalar, cpu::AttentionIsa::kAvx2, cpu::AttentionIsa::kAvx512}) {
    if (!cpu::set_attention_isa(isa)) continue;
    SCOPED_TRACE("attention path " + std::to_string(static_cast<int>(isa)));
    auto cache = make_cpu_cache(c);
    ASSERT_TRUE(cache.ok());
    ASSERT_TRUE((*cache)->store_batch(1, 0, n, d.krow(0), d.vrow(0)).ok());
    std::vector<float> out(static_cast<std::size_t>(d.q_dim), NAN);
    ASSERT_TRUE((*cache)->attend_decode(1, p, d.qrow(p), out.data()).ok());
    EXPECT_LT(rel_error(out.data(), want), 1e-5);
  }
  cpu::set_attention_isa(saved);
}

TEST(Attention, BadRequestsAreRefusedWithoutChange) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 4, 2, 16, 32, 64);
  Data d(c, 100, 3);
  auto cache = make_cpu_cache(c);
  ASSERT_TRUE(cache.ok());
  KvCache& k = **cache;
  ASSERT_TRUE(k.store_batch(0, 0, 40, d.krow(0), d.vrow(0)).ok());
  ASSERT_TRUE(k.store_batch(1, 0, 40, d.krow(0), d.vrow(0)).ok());
  std::vector<float> out(static_cast<std::size_t>(10 * d.q_dim));
  EXPECT_FALSE(k.attend_decode(0, 40, d.qrow(0), out.data()).ok());  // not stored yet
  EXPECT_FALSE(k.attend_decode(0, 5, d.qrow(0), out.data()).ok());   // window overwritten
  EXPECT_TRUE(k.attend_decode(0, 39, d.qrow(0), out.data()).ok());
  EXPECT_TRUE(k.attend_decode(1, 5, d.qrow(0), out.data()).ok());    // full plane keeps all
  EXPECT_FALSE(k.attend_decode(2, 5, d.qrow(0), out.data()).ok());
  EXPECT_FALSE(k.attend_decode(0, 39, nullptr, out.data()).ok());
  const Status skip = k.prefill(0, 41, 3, d.krow(41), d.vrow(41), d.qrow(41), out.data());
  EXPECT_EQ(skip.error().code, ErrorCode::kCacheDiscontinuity);
  const Status full = k.prefill(1, 40, 30, d.krow(40), d.vrow(40), d.qrow(40), out.data());
  EXPECT_EQ(full.error().code, ErrorCode::kCapacityExceeded);
  EXPECT_EQ(k.ring(0).next_position(), 40);
  EXPECT_EQ(k.ring(1).next_position(), 40);
}

// ---- Attention sinks (KvStore::set_attention_sinks) ----

// The worst over the heads of one head's relative error against float64.
double worst_head_error(const ModelConfig& c, LayerKind kind, const Data& d, std::int64_t p,
                        const float* got, const std::vector<float>& sinks) {
  const std::vector<double> want = reference(c, kind, d, p, sinks);
  double worst = 0;
  for (std::int64_t h = 0; h < c.n_heads; ++h) {
    double num = 0, den = 0;
    for (std::int64_t e = h * c.head_dim; e < (h + 1) * c.head_dim; ++e) {
      const double x = got[e], y = want[static_cast<std::size_t>(e)];
      if (std::isnan(x)) return INFINITY;
      num += (x - y) * (x - y);
      den += y * y;
    }
    worst = std::max(worst, std::sqrt(num / den));
  }
  return worst;
}

// Sinks spread over every regime: far above the scores (the sink takes
// nearly all the weight), near them, far below (no effect) and exactly 0.
std::vector<float> spread_sinks(std::int64_t n_heads) {
  const float pattern[] = {16.0f, 1.5f, -0.75f, 0.0f, -40.0f, 3.0f, 0.25f, -3.5f};
  std::vector<float> s(static_cast<std::size_t>(n_heads));
  for (std::int64_t h = 0; h < n_heads; ++h)
    s[static_cast<std::size_t>(h)] = pattern[h % 8] + 0.125f * static_cast<float>(h / 8);
  return s;
}

// Decode through several splits (a full layer past 512 rows) and a sliding
// window, on every path and under both numerics: the sinks' outputs match
// float64 head by head, prefill gives decode's bits, and they are not the
// outputs without sinks.
TEST(AttentionSinks, DecodeAndPrefillMatchFloat64OnEveryPath) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 16, 2, 128, 40, 4096);
  const std::int64_t n = 1300;
  ASSERT_GT(n, cpu::attend_split_rows(n));
  const Data d(c, n, 91);
  const std::vector<float> sinks = spread_sinks(c.n_heads);
  const std::int64_t probes[] = {0, 1, 39, 40, 511, 512, 1299};
  const cpu::AttentionIsa saved = cpu::attention_isa();
  for (const auto isa : {cpu::AttentionIsa::kScalar, cpu::AttentionIsa::kAvx2, cpu::AttentionIsa::kAvx512}) {
    if (!cpu::set_attention_isa(isa)) continue;
    for (const AttentionNumeric numeric : {AttentionNumeric::kF32, AttentionNumeric::kF16}) {
      for (std::int64_t layer : {0, 1}) {
        SCOPED_TRACE("path " + std::to_string(static_cast<int>(isa)) +
                     (numeric == AttentionNumeric::kF32 ? " f32" : " f16") + " layer " +
                     std::to_string(layer));
        const auto decoded = run_stream(c, layer, d, n, 1, {.attention = numeric}, sinks);
        EXPECT_TRUE(same_bits(run_stream(c, layer, d, n, 97, {.attention = numeric}, sinks), decoded));
        const auto plain = run_stream(c, layer, d, n, 97, {.attention = numeric});
        const double tolerance = numeric == AttentionNumeric::kF32 ? 1e-5 : 2e-3;
        for (const std::int64_t p : probes) {
          const float* got = decoded.data() + p * d.q_dim;
          EXPECT_LT(worst_head_error(c, c.kind(layer), d, p, got, sinks), tolerance) << "position " << p;
          EXPECT_LT(worst_head_error(c, c.kind(layer), d, p, plain.data() + p * d.q_dim, {}), tolerance)
              << "position " << p;
          // Head 0's sink (16) takes nearly all the weight: its outputs shrink.
          double with = 0, without = 0;
          for (std::int64_t e = 0; e < c.head_dim; ++e) {
            with += std::fabs(got[e]);
            without += std::fabs(plain[static_cast<std::size_t>(p * d.q_dim + e)]);
          }
          EXPECT_LT(with, 0.05 * without) << "position " << p;
        }
      }
    }
  }
  cpu::set_attention_isa(saved);
}

// Query heads per KV head that do not fill a vector (3, 6, 12) and head
// dims off the vector width, on every path: the sinks still match float64.
TEST(AttentionSinks, AwkwardGroupsMatchFloat64) {
  struct Shape { std::int64_t heads, kv_heads, head_dim; };
  const cpu::AttentionIsa saved = cpu::attention_isa();
  for (const Shape sh : {Shape{3, 1, 16}, Shape{12, 1, 32}, Shape{6, 2, 17}, Shape{24, 2, 64}}) {
    const ModelConfig c = make_hybrid_config("t", 2, 2, sh.heads, sh.kv_heads, sh.head_dim, 33, 1024);
    const std::int64_t n = 700;
    const Data d(c, n, 13 + static_cast<std::uint64_t>(sh.heads));
    const std::vector<float> sinks = spread_sinks(c.n_heads);
    for (const auto isa : {cpu::AttentionIsa::kScalar, cpu::AttentionIsa::kAvx2, cpu::AttentionIsa::kAvx512}) {
      if (!cpu::set_attention_isa(isa)) continue;
      for (std::int64_t layer : {0, 1}) {
        SCOPED_TRACE("heads " + std::to_string(sh.heads) + "/" + std::to_string(sh.kv_heads) + " head_dim " +
                     std::to_string(sh.head_dim) + " path " + std::to_string(static_cast<int>(isa)) + " layer " +
                     std::to_string(layer));
        const auto out = run_stream(c, layer, d, n, 64, {}, sinks);
        for (const std::int64_t p : {0, 32, 33, 255, 256, 699})
          EXPECT_LT(worst_head_error(c, c.kind(layer), d, p, out.data() + p * d.q_dim, sinks), 1e-5) << "position " << p;
      }
    }
  }
  cpu::set_attention_isa(saved);
}

// A sink near the largest finite float takes all the weight under both
// numerics: every output of its head is 0, none NaN (the f16 numeric's
// log2 units would overflow it to inf unclamped).
TEST(AttentionSinks, HugeFiniteSinksTakeAllTheWeight) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 6, 2, 32, 33, 1024);
  const std::int64_t n = 40;
  const Data d(c, n, 3);
  std::vector<float> sinks = spread_sinks(c.n_heads);
  sinks[0] = 3e38f;
  sinks[1] = -3e38f;
  for (const AttentionNumeric numeric : {AttentionNumeric::kF32, AttentionNumeric::kF16}) {
    SCOPED_TRACE(numeric == AttentionNumeric::kF32 ? "f32" : "f16");
    const auto out = run_stream(c, 1, d, n, 1, {.attention = numeric}, sinks);
    const auto plain = run_stream(c, 1, d, n, 1, {.attention = numeric});
    for (std::int64_t p = 0; p < n; ++p)
      for (std::int64_t e = 0; e < c.head_dim; ++e) {
        EXPECT_EQ(out[static_cast<std::size_t>(p * d.q_dim + e)], 0.0f) << "position " << p;
        // A sink far below the scores changes nothing.
        EXPECT_EQ(out[static_cast<std::size_t>(p * d.q_dim + c.head_dim + e)],
                  plain[static_cast<std::size_t>(p * d.q_dim + c.head_dim + e)]);
      }
  }
}

// Sinks set and then removed, or set on another layer only, leave a layer's
// bits those of a store that never had any.
TEST(AttentionSinks, RemovedOrElsewhereTheyChangeNoBits) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 8, 2, 64, 24, 1024);
  const std::int64_t n = 90;
  const Data d(c, n, 5);
  const std::vector<float> sinks = spread_sinks(c.n_heads);
  for (std::int64_t layer : {0, 1}) {
    const auto plain = run_stream(c, layer, d, n, 1);
    auto cache = make_cpu_cache(c);
    ASSERT_TRUE(cache.ok());
    KvStore& store = (*cache)->store();
    ASSERT_TRUE(store.set_attention_sinks(layer, sinks).ok());
    ASSERT_TRUE(store.set_attention_sinks(1 - layer, sinks).ok());
    EXPECT_EQ(store.attention_sinks(layer).size(), sinks.size());
    ASSERT_TRUE(store.set_attention_sinks(layer, {}).ok());
    EXPECT_TRUE(store.attention_sinks(layer).empty());
    EXPECT_EQ(store.attention_sinks(1 - layer).size(), sinks.size());
    std::vector<float> out(plain.size(), NAN);
    for (std::int64_t p = 0; p < n; ++p) {
      ASSERT_TRUE((*cache)->store_token(layer, p, d.krow(p), d.vrow(p)).ok());
      ASSERT_TRUE((*cache)->attend_decode(layer, p, d.qrow(p), out.data() + p * d.q_dim).ok());
    }
    EXPECT_TRUE(same_bits(out, plain)) << "layer " << layer;
  }
}

// A model that has sinks (gpt-oss's config) is never attended without
// them: decode and prefill of a layer whose sinks are not set are refused
// (kConfig, naming the layer) and change nothing; once set, that layer
// attends with them, and a store of the same geometry without the flag
// attends without any.
TEST(AttentionSinks, AModelWithSinksIsNotAttendedWithoutThem) {
  ModelConfig c = make_hybrid_config("sinks", 2, 2, 8, 2, 64, 24, 1024);
  c.attention_sinks = true;
  const std::int64_t n = 40;
  const Data d(c, n, 17);
  const std::vector<float> sinks = spread_sinks(c.n_heads);
  auto cache = make_cpu_cache(c);
  ASSERT_TRUE(cache.ok());
  KvCache& kv = **cache;
  ASSERT_TRUE(kv.store().set_attention_sinks(0, sinks).ok());
  std::vector<float> out(static_cast<std::size_t>(n * d.q_dim), 0.5f);
  for (std::int64_t p = 0; p < n; ++p) {
    ASSERT_TRUE(kv.store_token(0, p, d.krow(p), d.vrow(p)).ok());
    ASSERT_TRUE(kv.attend_decode(0, p, d.qrow(p), out.data() + p * d.q_dim).ok());
  }
  // Layer 1: its rows are stored, its attention refused both ways.
  for (std::int64_t p = 0; p < 3; ++p) ASSERT_TRUE(kv.store_token(1, p, d.krow(p), d.vrow(p)).ok());
  const std::vector<float> kept(out.begin(), out.begin() + d.q_dim);
  const Status decode = kv.attend_decode(1, 2, d.qrow(2), out.data());
  ASSERT_FALSE(decode.ok());
  EXPECT_EQ(decode.error().code, ErrorCode::kConfig) << decode.to_string();
  EXPECT_NE(decode.error().message.find("layer 1"), std::string::npos) << decode.to_string();
  EXPECT_NE(decode.error().message.find("set_attention_sinks"), std::string::npos) << decode.to_string();
  EXPECT_TRUE(std::equal(kept.begin(), kept.end(), out.begin()));
  KvStore& store = kv.store();
  const SeqSpan chunk{kv.seq(), 3, 2};
  const Status prefill = store.prefill(1, {&chunk, 1}, host_view(d.krow(3), 2, c.kv_dim()),
                                       host_view(d.vrow(3), 2, c.kv_dim()), host_view(d.qrow(3), 2, d.q_dim),
                                       host_view(out.data(), 2, d.q_dim));
  ASSERT_FALSE(prefill.ok());
  EXPECT_EQ(prefill.error().code, ErrorCode::kConfig) << prefill.to_string();
  EXPECT_EQ(store.ring(kv.seq(), 1)->next_position(), 3);
  EXPECT_TRUE(std::equal(kept.begin(), kept.end(), out.begin()));
  // Layer 0 attended with its sinks: the bits of a store without the flag
  // whose layer 0 has the same sinks, and not those of one without sinks.
  const ModelConfig plain_config = make_hybrid_config("sinks", 2, 2, 8, 2, 64, 24, 1024);
  EXPECT_TRUE(same_bits(out, run_stream(plain_config, 0, d, n, 1, {}, sinks)));
  EXPECT_FALSE(same_bits(out, run_stream(plain_config, 0, d, n, 1)));
}

// The f16 numeric on scores far past any model's (finite f16 K and an f32
// query): the tile step's exponent s c - m c is computed as fma(s, c, -m c)
// with m c rounded, whose rounding (up to an ulp of m c, 128 at 2^30) must
// not make the maximum's weight overflow f16 or vanish: the output stays
// the value of the row that takes all the weight, on every attention path.
// The large elements sit at one dimension (head_dim 3 and 64) or at half
// of them (head_dim 128, the CUDA kernel's case in
// CudaF16.HugeScoresKeepTheMaximumWeight).
TEST(Attention, F16NumericHugeScoresKeepTheMaximumWeight) {
  const cpu::AttentionIsa saved = cpu::attention_isa();
  for (const std::int64_t hd : {std::int64_t{3}, std::int64_t{64}, std::int64_t{128}}) {
    const std::int64_t first = hd == 128 ? 0 : 1 % hd, last = hd == 128 ? hd / 2 : first + 1;
    for (const auto isa : {cpu::AttentionIsa::kScalar, cpu::AttentionIsa::kAvx2, cpu::AttentionIsa::kAvx512}) {
      if (!cpu::set_attention_isa(isa)) continue;
      SCOPED_TRACE("head_dim " + std::to_string(hd) + ", attention path " + std::to_string(static_cast<int>(isa)));
      const ModelConfig c = make_hybrid_config("t", 1, 1, 2, 1, hd, 0, 64);
      auto cache = make_cpu_cache(c, {.attention = AttentionNumeric::kF16});
      ASSERT_TRUE(cache.ok());
      const std::int64_t n = 3;
      std::vector<float> k(static_cast<std::size_t>(n * hd), 0.5f), v(k.size());
      for (std::int64_t j = 0; j < n; ++j)
        for (std::int64_t d = 0; d < hd; ++d) v[static_cast<std::size_t>(j * hd + d)] = 0.25f * static_cast<float>(j + 1);
      for (std::int64_t d = first; d < last; ++d) k[static_cast<std::size_t>(hd + d)] = 32752.0f;  // row 1 takes all the weight
      ASSERT_TRUE((*cache)->store_batch(0, 0, n, k.data(), v.data()).ok());
      for (const float big : {32752.0f, 1e30f}) {
        std::vector<float> q(static_cast<std::size_t>(2 * hd), 0.5f), out(q.size(), NAN);
        for (std::int64_t d = first; d < last; ++d) {
          q[static_cast<std::size_t>(d)] = big;
          q[static_cast<std::size_t>(hd + d)] = big;
        }
        ASSERT_TRUE((*cache)->attend_decode(0, n - 1, q.data(), out.data()).ok());
        for (const float o : out) EXPECT_EQ(o, 0.5f) << "query element " << big;
      }
    }
  }
  cpu::set_attention_isa(saved);
}

TEST(AttentionSinks, BadSinksAreRefusedWithoutChange) {
  const ModelConfig c = make_hybrid_config("t", 2, 2, 8, 2, 64, 24, 1024);
  auto cache = make_cpu_cache(c);
  ASSERT_TRUE(cache.ok());
  KvStore& store = (*cache)->store();
  const std::vector<float> good = spread_sinks(c.n_heads);
  ASSERT_TRUE(store.set_attention_sinks(1, good).ok());
  std::vector<float> nan_one = good, inf_one = good, minus_inf_one = good;
  nan_one[3] = NAN;
  inf_one[7] = INFINITY;
  minus_inf_one[0] = -INFINITY;
  const std::vector<float> short_one(good.begin(), good.end() - 1);
  const std::vector<float> long_one(good.size() + 1, 0.5f);
  for (const std::vector<float>* bad :
       std::initializer_list<const std::vector<float>*>{&nan_one, &inf_one, &minus_inf_one, &short_one, &long_one}) {
    const Status s = store.set_attention_sinks(1, *bad);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kInvalidArgument) << s.to_string();
    ASSERT_EQ(store.attention_sinks(1).size(), good.size());
    EXPECT_TRUE(std::equal(good.begin(), good.end(), store.attention_sinks(1).begin()));
  }
  const Status nan_message = store.set_attention_sinks(1, nan_one);
  EXPECT_NE(nan_message.to_string().find("head 3"), std::string::npos) << nan_message.to_string();
  for (const std::int64_t layer : {std::int64_t{-1}, std::int64_t{2}, std::int64_t{1} << 40}) {
    EXPECT_EQ(store.set_attention_sinks(layer, good).error().code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(store.attention_sinks(layer).empty());
  }
  EXPECT_TRUE(store.attention_sinks(0).empty());
}

}  // namespace
}  // namespace kvring
