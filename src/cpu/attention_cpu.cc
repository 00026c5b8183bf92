#include "attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVRING_ATTEND_X86 1
#else
#define KVRING_ATTEND_X86 0
#endif

#include "core/f16_rows.h"
#include "core/log2_units.h"
#include "kvring/f16.h"
#include "kvring/store.h"
#include "parallel.h"

namespace kvring::cpu {

namespace {

// Splits: at most kMaxSplits per query, each a multiple of kSplitQuantum
// rows. Enough tasks to feed many cores from one sequence's 2 KV heads,
// and each large enough that a task's start and its partial are small
// against its rows.
constexpr std::int64_t kSplitQuantum = 256;
constexpr std::int64_t kMaxSplits = 64;
// V rows a task accumulates per pass over a block of output dimensions:
// their bytes (16 KiB a head) stay in L1 while each block runs over them,
// and each block's accumulators are loaded and stored once a tile.
constexpr std::int64_t kTileRows = 64;
// Rows between a V row being read by a tile's first pass and the row it
// prefetches into L1 (the rest of the tile, then the next tile's first
// rows): a window, not the whole next tile, so that L1 holds the tile the
// other passes read again.
constexpr std::int64_t kNearRows = 16;
// Bytes of split partials one parallel pass holds; longer prefills run in
// several passes (task grouping never changes a bit, only memory).
constexpr std::size_t kPartialBudget = std::size_t{8} << 20;

// Exact f16 -> f32 for every bit pattern.
const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (std::uint32_t i = 0; i < 65536; ++i) t[i] = f16_to_f32(static_cast<std::uint16_t>(i));
    return t;
  }();
  return table.data();
}

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// The power-of-two scale of a query head under the f16 numeric: 2^k with
// the head's largest magnitude times 2^k in [2^14, 2^15), k in [-126, 126].
float f16_query_scale(float amax, float& down) {
  const int e = static_cast<int>((std::bit_cast<std::uint32_t>(amax) >> 23) & 0xffu) - 126;
  const int shift = std::min(std::max(15 - e, -126), 126);
  down = std::bit_cast<float>(static_cast<std::uint32_t>(127 - shift) << 23);
  return std::bit_cast<float>(static_cast<std::uint32_t>(127 + shift) << 23);
}

float f16_round(float x) { return f16_to_f32(f32_to_f16(x)); }

// Combines n split partials (stride floats apart, each m[Gp], l[Gp],
// o[G * hd]) in split order into out ([G * hd], normalized). With sinks
// (G logits), head t's maximum also takes sinks[t], and its sum starts at
// exp(sinks[t] - maximum) before the splits' terms.
struct CombineJob {
  const float* partials;
  std::int64_t n, stride, G, Gp, hd;
  float* out;
  const float* sinks = nullptr;
};

// Rows the next pass reads, prefetched while this pass computes. A scores
// pass takes every one of rows[0, n), spread over its groups
// (prefetch_group); an accumulate's row j takes rows[j] while j < n: the
// next rows a tile reads.
struct Ahead {
  const std::uint16_t* const* rows = nullptr;
  std::int64_t n = 0;
};

// A row's 64-byte lines into every cache level.
[[gnu::always_inline]] inline void prefetch_row(const std::uint16_t* p, std::int64_t hd) {
  for (std::int64_t b = 0; b < hd * 2; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
}

[[gnu::always_inline]] inline void prefetch_ahead(const Ahead& a, std::int64_t j, std::int64_t hd) {
  if (j < a.n) prefetch_row(a.rows[j], hd);
}

// The arithmetic of one path. A split of the f32 numeric runs: scores of
// every row (s[t] = scale * q_t . k for the G heads, lanes [G, Gp) set to
// 0) and each tile's weights (for_each_tile; per head lane: the tile's
// maximum m_i, each score replaced by exp(s - m_i), l_i their sum in row
// order), then the split's m = max m_i, each tile's factor f_i =
// exp(m_i - m), l = the sum of l_i f_i in tile order, and accumulate over
// the tiles (o[t][d] += (w[j][t] f_i[t]) * v_j[d], rows in order); the
// last split to finish combines.
struct Kernels {
  void (*scores)(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd, float scale,
                 const std::uint16_t* const* kp, std::int64_t n, float* sc, Ahead ahead);
  // scores, then each tile's weights: tm[i * Gp + t] = m_i, tl[...] = l_i.
  void (*scores_weights)(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd, float scale,
                         const std::uint16_t* const* kp, std::int64_t n, float* sc, float* tm, float* tl,
                         Ahead ahead);
  // The split's m and l from its tiles' (tm replaced by the factors f_i).
  void (*tile_factors)(float* tm, const float* tl, std::int64_t tiles, std::int64_t Gp, float* m, float* l);
  // w[j][t] *= f[t] for n rows: a tile's weights times its factors.
  void (*scale_weights)(float* w, std::int64_t n, std::int64_t Gp, const float* f);
  // The f16 numeric's step over one tile of n rows (docs/DESIGN.md,
  // "Attention numerics"), per head lane t of Gp: m the running maximum of
  // the scores, mc = m c[t], l the weights' sum; alpha[t] the factor that
  // rescales the head's outputs, and sc's scores replaced by the weights
  // f16(exp2(fma(s, c, -mc))).
  void (*weights_f16)(float* sc, std::int64_t n, std::int64_t Gp, const float* c, float* m,
                      float* mc, float* l, float* alpha);
  void (*accumulate)(const std::uint16_t* const* vp, std::int64_t n, const float* w,
                     std::int64_t G, std::int64_t Gp, std::int64_t hd, float* o, Ahead ahead);
  void (*combine)(const CombineJob& c);
};

// ---- The scalar path -------------------------------------------------------

float dot_f32(const float* a, const float* b, std::int64_t n) {
  // Eight interleaved partial sums combined in a fixed tree: a fixed order
  // that the compiler can keep in vector registers.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[d + u] * b[d + u];
  for (int u = 0; d < n; ++d, ++u) acc[u] += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void score_row_scalar(const float* q, std::int64_t G, std::int64_t hd, float scale,
                      const std::uint16_t* k, float* s) {
  const float* table = f16_table();
  thread_local std::vector<float> row;
  row.resize(static_cast<std::size_t>(hd));
  for (std::int64_t d = 0; d < hd; ++d) row[static_cast<std::size_t>(d)] = table[k[d]];
  for (std::int64_t t = 0; t < G; ++t) s[t] = dot_f32(q + t * hd, row.data(), hd) * scale;
  for (std::int64_t t = G; t < round_up(G, 8); ++t) s[t] = 0.0f;
}

// Rows ahead of the one being scored, in its stream, that the scores
// prefetch.
constexpr std::int64_t kPrefetchRows = 16;

// Streams of K rows a scores pass reads at once.
constexpr std::int64_t kStreams = 3;

// A scores pass in stream order: of its groups = n / kStreams groups,
// group g takes rows g, g + groups and g + 2 groups, one from each third
// of the pass, and the pass's last n % kStreams rows come after the groups.
// One stream at a time leaves a core's memory idle between its demands;
// three keep more lines in flight (docs/PERFORMANCE.md, "Three streams of
// K"). A row's scores never depend on the rows scored beside it.
//
// Group g's prefetches: each stream's row kPrefetchRows ahead, and its
// share of the rows the next pass reads (entries g, g + groups, g + 2
// groups of ahead.rows, and on the last group every entry past those), so
// that they arrive during this pass.
[[gnu::always_inline]] inline void prefetch_group(const std::uint16_t* const* kp, std::int64_t hd,
                                                  const Ahead& ahead, std::int64_t g, std::int64_t groups) {
  for (std::int64_t r = 0; r < kStreams; ++r)
    if (g + kPrefetchRows < groups) prefetch_row(kp[r * groups + g + kPrefetchRows], hd);
  for (std::int64_t i = g; i < ahead.n && i < kStreams * groups; i += groups) prefetch_row(ahead.rows[i], hd);
  if (g == groups - 1)
    for (std::int64_t i = kStreams * groups; i < ahead.n; ++i) prefetch_row(ahead.rows[i], hd);
}

// Scores of rows [0, n) into sc ([n][Gp]) by a per-row function, in stream
// order.
template <void (*Row)(const float*, std::int64_t, std::int64_t, float, const std::uint16_t*, float*)>
void scores_by_row(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd, float scale,
                   const std::uint16_t* const* kp, std::int64_t n, float* sc, Ahead ahead) {
  const std::int64_t groups = n / kStreams;
  for (std::int64_t g = 0; g < groups; ++g) {
    prefetch_group(kp, hd, ahead, g, groups);
    for (std::int64_t r = 0; r < kStreams; ++r) {
      const std::int64_t i = r * groups + g;
      Row(q, G, hd, scale, kp[i], sc + i * Gp);
    }
  }
  for (std::int64_t j = kStreams * groups; j < n; ++j) {
    if (groups == 0) prefetch_ahead(ahead, j, hd);
    Row(q, G, hd, scale, kp[j], sc + j * Gp);
  }
}

// Rows of a split whose weights share one reference, each scored in its
// own stream (kWeightTileRows of one stream, or the pass's last
// n % kStreams rows): the scores pass finishes a tile's scores together,
// and computes its weights while they are in L1. Each is also one tile of
// the accumulate, so none exceeds kTileRows.
constexpr std::int64_t kWeightTileRows = kTileRows;

// The tiles of a split of n rows in logical order: each stream's rows in
// runs of kWeightTileRows, then the last n % kStreams rows.
template <class F>
void for_each_tile(std::int64_t n, F&& f) {
  const std::int64_t groups = n / kStreams;
  for (std::int64_t r = 0; groups > 0 && r < kStreams; ++r)
    for (std::int64_t t0 = r * groups; t0 < (r + 1) * groups; t0 += kWeightTileRows)
      f(t0, std::min(kWeightTileRows, (r + 1) * groups - t0));
  if (kStreams * groups < n) f(kStreams * groups, n - kStreams * groups);
}

std::int64_t tile_count(std::int64_t n) {
  const std::int64_t groups = n / kStreams;
  return kStreams * ((groups + kWeightTileRows - 1) / kWeightTileRows) + (kStreams * groups < n ? 1 : 0);
}

// A scores pass, then each tile's weights (for_each_tile's order) by
// Weights: per tile and head lane, tm the tile's maximum and tl its
// weights' sum.
template <void (*Scores)(const float*, std::int64_t, std::int64_t, std::int64_t, float,
                         const std::uint16_t* const*, std::int64_t, float*, Ahead),
          void (*Weights)(float*, std::int64_t, std::int64_t, float*, float*)>
void scores_then_weights(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd, float scale,
                         const std::uint16_t* const* kp, std::int64_t n, float* sc, float* tm, float* tl,
                         Ahead ahead) {
  Scores(q, G, Gp, hd, scale, kp, n, sc, ahead);
  std::int64_t i = 0;
  for_each_tile(n, [&](std::int64_t t0, std::int64_t rows) {
    Weights(sc + t0 * Gp, rows, Gp, tm + i * Gp, tl + i * Gp);
    ++i;
  });
}

// Per lane t of Gp: m[t] the maximum of x[i][t] over n entries, each
// entry replaced by exp(x - m) (exp(x) where m is -inf, so that entries of
// -inf take 0, not exp(nan)), and l[t] the sum of the new entries, each
// times c[i][t] where c is given, in entry order.
void exp_against_max_scalar(float* x, const float* c, std::int64_t n, std::int64_t Gp, float* m, float* l) {
  for (std::int64_t t = 0; t < Gp; ++t) {
    float mx = -INFINITY;
    for (std::int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i * Gp + t]);
    const float shift = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) {
      const float e = std::exp(x[i * Gp + t] - shift);
      x[i * Gp + t] = e;
      sum += c != nullptr ? c[i * Gp + t] * e : e;
    }
    m[t] = mx;
    l[t] = sum;
  }
}

void weights_scalar(float* sc, std::int64_t n, std::int64_t Gp, float* m, float* l) {
  exp_against_max_scalar(sc, nullptr, n, Gp, m, l);
}

void tile_factors_scalar(float* tm, const float* tl, std::int64_t tiles, std::int64_t Gp, float* m,
                         float* l) {
  exp_against_max_scalar(tm, tl, tiles, Gp, m, l);
}

void scale_weights_scalar(float* w, std::int64_t n, std::int64_t Gp, const float* f) {
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t t = 0; t < Gp; ++t) w[j * Gp + t] *= f[t];
}

// The f16 numeric's m c: the product rounded toward -inf (the GPU
// kernel's __fmul_rd), so that fma(m, c, -m c) >= 0 and the maximum's
// exponent is exactly 0 once taken as at most 0. Exact wherever |m c| is
// past about 2^-100; below, the residual underflows, and every exponent
// there is within 2^-100 of 0, its weight the f16 1 either way.
float max_product(float m, float c) {
  const float p = m * c;
  return std::fma(m, c, -p) < 0.0f ? std::nextafter(p, -INFINITY) : p;
}

void weights_f16_scalar(float* sc, std::int64_t n, std::int64_t Gp, const float* c, float* m,
                        float* mc, float* l, float* alpha) {
  for (std::int64_t t = 0; t < Gp; ++t) {
    float mx = -INFINITY;
    for (std::int64_t j = 0; j < n; ++j) mx = std::fmax(mx, sc[j * Gp + t]);
    const float m_new = std::fmax(m[t], mx);
    const float mc_new = max_product(m_new, c[t]);
    alpha[t] = m_new == m[t] ? 1.0f : std::exp2(mc[t] - mc_new);
    // With nothing seen yet (m_new = -inf) every weight is exp2(-inf) = 0.
    const float shift = m_new == -INFINITY ? 0.0f : -mc_new;
    float sum = 0.0f;
    for (std::int64_t j = 0; j < n; ++j) {
      // s c - m c is at most 0 (NaN kept), and 0 for the tile's maximum
      // (max_product): the rounding of m c (up to an ulp, past 1 once
      // |m c| > 2^24) must not make the maximum's weight overflow f16 or
      // vanish, nor any weight pass 1.
      float e = std::fma(sc[j * Gp + t], c[t], shift);
      if (e > 0.0f) e = 0.0f;
      const float w = f16_round(std::exp2(e));
      sc[j * Gp + t] = w;
      sum += w;
    }
    l[t] = l[t] * alpha[t] + sum;
    m[t] = m_new;
    mc[t] = mc_new;
  }
}

void accumulate_scalar(const std::uint16_t* const* vp, std::int64_t n, const float* w,
                       std::int64_t G, std::int64_t Gp, std::int64_t hd, float* o, Ahead ahead) {
  const float* table = f16_table();
  for (std::int64_t j = 0; j < n; ++j) {
    prefetch_ahead(ahead, j, hd);
    for (std::int64_t t = 0; t < G; ++t) {
      const float wt = w[j * Gp + t];
      float* ot = o + t * hd;
      for (std::int64_t d = 0; d < hd; ++d) ot[d] += wt * table[vp[j][d]];
    }
  }
}

void combine_scalar(const CombineJob& C) {
  const std::int64_t hd = C.hd;
  for (std::int64_t t = 0; t < C.G; ++t) {
    float mx = -INFINITY;
    for (std::int64_t s = 0; s < C.n; ++s) mx = std::max(mx, C.partials[s * C.stride + t]);
    float l = 0.0f;
    if (C.sinks != nullptr) {
      mx = std::max(mx, C.sinks[t]);
      l = std::exp(C.sinks[t] - mx);
    }
    float* out = C.out + t * hd;
    std::fill(out, out + hd, 0.0f);
    for (std::int64_t s = 0; s < C.n; ++s) {
      const float* p = C.partials + s * C.stride;
      const float w = std::exp(p[t] - mx);
      l += w * p[C.Gp + t];
      const float* o = p + 2 * C.Gp + t * hd;
      for (std::int64_t d = 0; d < hd; ++d) out[d] += w * o[d];
    }
    const float inv = 1.0f / l;
    for (std::int64_t d = 0; d < hd; ++d) out[d] *= inv;
  }
}

constexpr Kernels kScalarKernels{scores_by_row<score_row_scalar>,
                                 scores_then_weights<scores_by_row<score_row_scalar>, weights_scalar>,
                                 tile_factors_scalar, scale_weights_scalar, weights_f16_scalar,
                                 accumulate_scalar, combine_scalar};

// ---- The vector paths: AVX2 (with FMA and F16C) and AVX-512 ----------------
// Lane u of a head's dot product sums dimensions u, u + W, ... by FMA (W =
// 8 or 16 lanes); the lanes add in a fixed tree. Each output element
// accumulates its rows in logical order by FMA. exp is one polynomial
// (Cephes' expf, within 2 ulp), the same for every lane. The combine and
// the f16 numeric's weights are the AVX2 code on both paths; the AVX-512
// weights are its arithmetic on two rows to a register (weights_avx512).

#if KVRING_ATTEND_X86

#define KVRING_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVRING_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

KVRING_AVX2 inline __m256 load_f16x8(const std::uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KVRING_AVX2 inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// exp8's and exp16's constants: one set, so the two widths give a lane the
// same bits.
struct ExpConstants {
  static constexpr float kClamp = 88.3762626647949f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  // The polynomial's coefficients, highest degree first.
  static constexpr float kPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

KVRING_AVX2 inline __m256 exp8(__m256 x) {
  using C = ExpConstants;
  x = _mm256_min_ps(x, _mm256_set1_ps(C::kClamp));
  x = _mm256_max_ps(x, _mm256_set1_ps(-C::kClamp));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(C::kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(C::kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(C::kLn2Lo), x);
  __m256 y = _mm256_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(C::kPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  // 2^fx; fx = -127 (x at the lower clamp) gives 0.
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The heads [0, G) in blocks of 8, 4, 2, 1; a head's arithmetic does not
// depend on its block.
template <class F>
inline void for_head_blocks(std::int64_t G, F&& f) {
  std::int64_t t = 0;
  for (; t + 8 <= G; t += 8) f(std::integral_constant<int, 8>{}, t);
  for (; t + 4 <= G; t += 4) f(std::integral_constant<int, 4>{}, t);
  for (; t + 2 <= G; t += 2) f(std::integral_constant<int, 2>{}, t);
  for (; t < G; ++t) f(std::integral_constant<int, 1>{}, t);
}

template <int NB>
KVRING_AVX2 inline void dots_avx2(const float* q, std::int64_t hd, const std::uint16_t* k,
                                  float scale, float* s) {
  __m256 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
  for (std::int64_t d = 0; d < hd; d += 8) {
    const __m256 kv = load_f16x8(k + d);
    for (int b = 0; b < NB; ++b)
      acc[b] = _mm256_fmadd_ps(_mm256_loadu_ps(q + b * hd + d), kv, acc[b]);
  }
  for (int b = 0; b < NB; ++b) s[b] = hsum8(acc[b]) * scale;
}

template <int NB>
KVRING_AVX2 inline void accumulate_avx2_block(const std::uint16_t* const* vp, std::int64_t n,
                                              const float* w, std::int64_t Gp, std::int64_t hd,
                                              float* o) {
  for (std::int64_t d = 0; d < hd; d += 8) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_loadu_ps(o + b * hd + d);
    for (std::int64_t j = 0; j < n; ++j) {
      const __m256 vv = load_f16x8(vp[j] + d);
      for (int b = 0; b < NB; ++b)
        acc[b] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j * Gp + b), vv, acc[b]);
    }
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(o + b * hd + d, acc[b]);
  }
}

// The lane sums of a0..a7 as one vector, by a fixed tree: hadd pairs, then
// pairs of pairs, then the two 128-bit halves.
KVRING_AVX2 inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                  __m256 a5, __m256 a6, __m256 a7) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// Eight heads at once, their accumulators in registers (the common case:
// 8 query heads a KV head).
KVRING_AVX2 inline void dots8_avx2(const float* q, std::int64_t hd, const std::uint16_t* k,
                                   float scale, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (std::int64_t d = 0; d < hd; d += 8) {
    const __m256 kv = load_f16x8(k + d);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + hd + d), kv, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * hd + d), kv, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * hd + d), kv, a3);
    a4 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 4 * hd + d), kv, a4);
    a5 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 5 * hd + d), kv, a5);
    a6 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 6 * hd + d), kv, a6);
    a7 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 7 * hd + d), kv, a7);
  }
  _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
}

KVRING_AVX2 void score_row_avx2(const float* q, std::int64_t G, std::int64_t hd, float scale,
                                const std::uint16_t* k, float* s) {
  for (std::int64_t t = G; t < round_up(G, 8); ++t) s[t] = 0.0f;
  std::int64_t t = 0;
  for (; t + 8 <= G; t += 8) dots8_avx2(q + t * hd, hd, k, scale, s + t);
  for_head_blocks(G - t, [&](auto nb, std::int64_t u) KVRING_AVX2 {
    dots_avx2<decltype(nb)::value>(q + (t + u) * hd, hd, k, scale, s + t + u);
  });
}

// A maximum as the reference its weights subtract: 0 where it is -inf
// (every score -inf), whose weights are then exp(-inf) = 0, not exp(nan).
KVRING_AVX2 inline __m256 finite_shift(__m256 mx) {
  return _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}

// exp_against_max_scalar's steps for 8 lanes at once, with exp8 for exp
// and an FMA for each entry times c.
KVRING_AVX2 void exp_against_max_avx2(float* x, const float* c, std::int64_t n, std::int64_t Gp, float* m,
                                      float* l) {
  for (std::int64_t t = 0; t < Gp; t += 8) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (std::int64_t i = 0; i < n; ++i) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + i * Gp + t));
    const __m256 shift = finite_shift(mx);
    __m256 sum = _mm256_setzero_ps();
    for (std::int64_t i = 0; i < n; ++i) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i * Gp + t), shift));
      _mm256_storeu_ps(x + i * Gp + t, e);
      sum = c != nullptr ? _mm256_fmadd_ps(_mm256_loadu_ps(c + i * Gp + t), e, sum) : _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(m + t, mx);
    _mm256_storeu_ps(l + t, sum);
  }
}

KVRING_AVX2 void weights_avx2(float* sc, std::int64_t n, std::int64_t Gp, float* m, float* l) {
  exp_against_max_avx2(sc, nullptr, n, Gp, m, l);
}

KVRING_AVX2 void tile_factors_avx2(float* tm, const float* tl, std::int64_t tiles, std::int64_t Gp, float* m,
                                   float* l) {
  exp_against_max_avx2(tm, tl, tiles, Gp, m, l);
}

KVRING_AVX2 void scale_weights_avx2(float* w, std::int64_t n, std::int64_t Gp, const float* f) {
  for (std::int64_t t = 0; t < Gp; t += 8) {
    const __m256 ft = _mm256_loadu_ps(f + t);
    for (std::int64_t j = 0; j < n; ++j)
      _mm256_storeu_ps(w + j * Gp + t, _mm256_mul_ps(_mm256_loadu_ps(w + j * Gp + t), ft));
  }
}

// 2^x to about 2 ulp: 2^round(x) times a degree-6 polynomial in the
// fraction (in [-1/2, 1/2]); x at or below -127 (and -inf) gives 0.
KVRING_AVX2 inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(127.0f));
  const __m256 fi = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, fi);
  __m256 y = _mm256_set1_ps(1.5403530393381606e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3333558146428443e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.6181291076284772e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.5504108664821580e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.4022650695910071e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.9314718055994531e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// max_product for 8 lanes: where m c rounded to nearest lies above the
// product, the float one step toward -inf (bits - 1 above 0, + 1 below,
// the smallest negative subnormal at 0).
KVRING_AVX2 inline __m256 max_product8(__m256 m, __m256 c) {
  const __m256 p = _mm256_mul_ps(m, c);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 above = _mm256_cmp_ps(_mm256_fmsub_ps(m, c, p), zero, _CMP_LT_OQ);
  const __m256i bits = _mm256_castps_si256(p), one = _mm256_set1_epi32(1);
  __m256i down = _mm256_blendv_epi8(_mm256_add_epi32(bits, one), _mm256_sub_epi32(bits, one),
                                    _mm256_castps_si256(_mm256_cmp_ps(p, zero, _CMP_GT_OQ)));
  down = _mm256_blendv_epi8(down, _mm256_set1_epi32(static_cast<int>(0x80000001u)),
                            _mm256_castps_si256(_mm256_cmp_ps(p, zero, _CMP_EQ_OQ)));
  return _mm256_blendv_ps(p, _mm256_castsi256_ps(down), above);
}

// weights_f16_scalar's step for 8 head lanes at once, with exp2_8 for exp2.
KVRING_AVX2 void weights_f16_avx2(float* sc, std::int64_t n, std::int64_t Gp, const float* c, float* m,
                                  float* mc, float* l, float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  for (std::int64_t t = 0; t < Gp; t += 8) {
    __m256 mx = neg_inf;
    for (std::int64_t j = 0; j < n; ++j) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + j * Gp + t));
    const __m256 ct = _mm256_loadu_ps(c + t), m_old = _mm256_loadu_ps(m + t);
    const __m256 m_new = _mm256_max_ps(m_old, mx);
    const __m256 mc_new = max_product8(m_new, ct);
    const __m256 kept = _mm256_cmp_ps(m_new, m_old, _CMP_EQ_OQ);
    const __m256 a = _mm256_blendv_ps(exp2_8(_mm256_sub_ps(_mm256_loadu_ps(mc + t), mc_new)),
                                      _mm256_set1_ps(1.0f), kept);
    const __m256 empty = _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ);
    const __m256 shift = _mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), mc_new), _mm256_setzero_ps(), empty);
    __m256 sum = _mm256_setzero_ps();
    // As weights_f16_scalar: the exponent at most 0 (0 at the maximum).
    const __m256 zero = _mm256_setzero_ps();
    for (std::int64_t j = 0; j < n; ++j) {
      const __m256 s = _mm256_loadu_ps(sc + j * Gp + t);
      __m256 x = _mm256_fmadd_ps(s, ct, shift);
      x = _mm256_min_ps(zero, x);  // 0 where x > 0; x where it is NaN
      const __m256 e = exp2_8(x);
      const __m256 w = _mm256_cvtph_ps(_mm256_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm256_storeu_ps(sc + j * Gp + t, w);
      sum = _mm256_add_ps(sum, w);
    }
    _mm256_storeu_ps(alpha + t, a);
    _mm256_storeu_ps(l + t, _mm256_fmadd_ps(_mm256_loadu_ps(l + t), a, sum));
    _mm256_storeu_ps(m + t, m_new);
    _mm256_storeu_ps(mc + t, mc_new);
  }
}

KVRING_AVX2 void accumulate_avx2(const std::uint16_t* const* vp, std::int64_t n, const float* w,
                                 std::int64_t G, std::int64_t Gp, std::int64_t hd, float* o,
                                 Ahead ahead) {
  for (std::int64_t j = 0; j < ahead.n; ++j) prefetch_row(ahead.rows[j], hd);
  for_head_blocks(G, [&](auto nb, std::int64_t t) KVRING_AVX2 {
    accumulate_avx2_block<decltype(nb)::value>(vp, n, w + t, Gp, hd, o + t * hd);
  });
}

KVRING_AVX2 void combine_avx2(const CombineJob& C) {
  const std::int64_t hd = C.hd;
  alignas(32) float ws[8];
  for (std::int64_t t0 = 0; t0 < C.Gp; t0 += 8) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (std::int64_t s = 0; s < C.n; ++s)
      mx = _mm256_max_ps(mx, _mm256_loadu_ps(C.partials + s * C.stride + t0));
    __m256 l = _mm256_setzero_ps();
    const std::int64_t heads = std::min<std::int64_t>(8, C.G - t0);
    if (C.sinks != nullptr) {
      // Lanes past the group's heads take -inf: no maximum, no output.
      alignas(32) float sk[8];
      for (std::int64_t b = 0; b < 8; ++b) sk[b] = b < heads ? C.sinks[t0 + b] : -INFINITY;
      mx = _mm256_max_ps(mx, _mm256_load_ps(sk));
      l = exp8(_mm256_sub_ps(_mm256_load_ps(sk), mx));
    }
    std::fill(C.out + t0 * hd, C.out + (t0 + heads) * hd, 0.0f);
    for (std::int64_t s = 0; s < C.n; ++s) {
      const float* p = C.partials + s * C.stride;
      const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t0), mx));
      l = _mm256_fmadd_ps(w, _mm256_loadu_ps(p + C.Gp + t0), l);
      _mm256_store_ps(ws, w);
      for (std::int64_t b = 0; b < heads; ++b) {
        const __m256 wb = _mm256_set1_ps(ws[b]);
        const float* o = p + 2 * C.Gp + (t0 + b) * hd;
        float* out = C.out + (t0 + b) * hd;
        for (std::int64_t d = 0; d < hd; d += 8)
          _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wb, _mm256_loadu_ps(o + d),
                                                    _mm256_loadu_ps(out + d)));
      }
    }
    alignas(32) float inv[8];
    _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), l));
    for (std::int64_t b = 0; b < heads; ++b) {
      const __m256 ib = _mm256_set1_ps(inv[b]);
      float* out = C.out + (t0 + b) * hd;
      for (std::int64_t d = 0; d < hd; d += 8)
        _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(out + d), ib));
    }
  }
}

// GCC 12's AVX-512 intrinsics pass an undefined vector (a self-initialized
// variable) as the unused merge source, which -W(maybe-)uninitialized
// reports wherever they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
KVRING_AVX512 inline __m512 load_f16x16(const std::uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

KVRING_AVX512 inline __m256 fold16(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

template <int NB>
KVRING_AVX512 inline void dots_avx512(const float* q, std::int64_t hd, const std::uint16_t* k,
                                      float scale, float* s) {
  __m512 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
  for (std::int64_t d = 0; d < hd; d += 16) {
    const __m512 kv = load_f16x16(k + d);
    for (int b = 0; b < NB; ++b)
      acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(q + b * hd + d), kv, acc[b]);
  }
  for (int b = 0; b < NB; ++b) s[b] = hsum8(fold16(acc[b])) * scale;
}

// o[b * hd + 16 c + i] += w[j * Gp + b] * V[j][16 c + i] for 8 heads b
// and C chunks of 16 dimensions, rows in order.
template <int C>
KVRING_AVX512 inline void accumulate8_avx512(const std::uint16_t* const* vp, std::int64_t n,
                                             const float* w, std::int64_t Gp, std::int64_t hd,
                                             float* o, std::int64_t d, Ahead ahead) {
  o += d;
  __m512 x[C][8];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) x[c][b] = _mm512_loadu_ps(o + b * hd + 16 * c);
  for (std::int64_t j = 0; j < n; ++j) {
    prefetch_ahead(ahead, j, hd);
    __m512 v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) v[c] = load_f16x16(vp[j] + d + 16 * c);
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      const __m512 wb = _mm512_set1_ps(w[j * Gp + b]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) x[c][b] = _mm512_fmadd_ps(wb, v[c], x[c][b]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) _mm512_storeu_ps(o + b * hd + 16 * c, x[c][b]);
}

template <int NB>
KVRING_AVX512 inline void accumulate_avx512_block(const std::uint16_t* const* vp, std::int64_t n,
                                                  const float* w, std::int64_t Gp,
                                                  std::int64_t hd, float* o, Ahead ahead) {
  std::int64_t d = 0;
  if constexpr (NB == 8) {
    // 48 dimensions at a time (then 32): each weight's broadcast feeds
    // three (two) FMAs; 24 accumulators stay in registers. The first block
    // prefetches the next rows.
    for (; d + 48 <= hd; d += 48, ahead = {}) accumulate8_avx512<3>(vp, n, w, Gp, hd, o, d, ahead);
    for (; d + 32 <= hd; d += 32, ahead = {}) accumulate8_avx512<2>(vp, n, w, Gp, hd, o, d, ahead);
  }
  for (std::int64_t j = 0; j < ahead.n; ++j) prefetch_row(ahead.rows[j], hd);
  for (; d < hd; d += 16) {
    __m512 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm512_loadu_ps(o + b * hd + d);
    for (std::int64_t j = 0; j < n; ++j) {
      const __m512 vv = load_f16x16(vp[j] + d);
      for (int b = 0; b < NB; ++b)
        acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(w[j * Gp + b]), vv, acc[b]);
    }
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(o + b * hd + d, acc[b]);
  }
}


KVRING_AVX512 inline void dots8_avx512(const float* q, std::int64_t hd, const std::uint16_t* k,
                                       float scale, float* s) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (std::int64_t d = 0; d < hd; d += 16) {
    const __m512 kv = load_f16x16(k + d);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), kv, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + hd + d), kv, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 2 * hd + d), kv, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 3 * hd + d), kv, a3);
    a4 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 4 * hd + d), kv, a4);
    a5 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 5 * hd + d), kv, a5);
    a6 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 6 * hd + d), kv, a6);
    a7 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 7 * hd + d), kv, a7);
  }
  _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(fold16(a0), fold16(a1), fold16(a2), fold16(a3),
                                            fold16(a4), fold16(a5), fold16(a6), fold16(a7)),
                                    _mm256_set1_ps(scale)));
}

KVRING_AVX512 void score_row_avx512(const float* q, std::int64_t G, std::int64_t hd, float scale,
                                    const std::uint16_t* k, float* s) {
  for (std::int64_t t = G; t < round_up(G, 8); ++t) s[t] = 0.0f;
  std::int64_t t = 0;
  for (; t + 8 <= G; t += 8) dots8_avx512(q + t * hd, hd, k, scale, s + t);
  for_head_blocks(G - t, [&](auto nb, std::int64_t u) KVRING_AVX512 {
    dots_avx512<decltype(nb)::value>(q + (t + u) * hd, hd, k, scale, s + t + u);
  });
}

// One row's 8 head sums from their accumulators a[0..7], in the order of
// hsum8x8(fold16(a[0]), ..., fold16(a[7])): lane u + lane u + 8, then
// pairs, then pairs of pairs, then the two halves. Whole-register shuffles
// reduce two accumulators (then four, then eight) per add, where fold16 and
// hadd reduce one or two.
KVRING_AVX512 inline __m256 hsum16x8(const __m512* a) {
  __m512 y[4];  // y[i]: a[2i]'s folded lanes, then a[2i + 1]'s
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  const __m512 p0 = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512 p1 = _mm512_add_ps(_mm512_shuffle_ps(y[2], y[3], 0x88), _mm512_shuffle_ps(y[2], y[3], 0xDD));
  // 128-bit lane 0: heads 0, 2, 4, 6's first halves; lane 1 their second
  // halves; lanes 2 and 3 the same for heads 1, 3, 5, 7.
  const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(p0, p1, 0x88), _mm512_shuffle_ps(p0, p1, 0xDD));
  const __m512 sums = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, 0xB1));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}

// R rows at a time for 8 heads, row r at kp[r] scored into s[r]: each
// row's arithmetic is dots8_avx512's; each query load serves the R rows.
template <int R>
KVRING_AVX512 inline void dots8xR_avx512(const float* q, std::int64_t hd,
                                         const std::uint16_t* const* kp, float scale,
                                         float* const* s) {
  __m512 a[R][8];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int h = 0; h < 8; ++h) a[r][h] = _mm512_setzero_ps();
  for (std::int64_t d = 0; d < hd; d += 16) {
    __m512 kv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) kv[r] = load_f16x16(kp[r] + d);
#pragma GCC unroll 8
    for (int h = 0; h < 8; ++h) {
      __m512 qh = _mm512_loadu_ps(q + h * hd + d);
      // One load of the query for the R rows (the compiler would fold a
      // load into each FMA, and loads are what this loop runs out of).
      asm("" : "+v"(qh));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][h] = _mm512_fmadd_ps(qh, kv[r], a[r][h]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(s[r], _mm256_mul_ps(hsum16x8(a[r]), sc));
}

// Group g of a scores pass (rows g, g + groups, g + 2 groups), 8 heads at
// a time.
KVRING_AVX512 inline void scores_group_avx512(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd,
                                              float scale, const std::uint16_t* const* kp, float* sc,
                                              const Ahead& ahead, std::int64_t g, std::int64_t groups) {
  prefetch_group(kp, hd, ahead, g, groups);
  const std::uint16_t* k[kStreams];
  for (std::int64_t r = 0; r < kStreams; ++r) k[r] = kp[r * groups + g];
  for (std::int64_t t = 0; t < G; t += 8) {
    float* out[kStreams];
    for (std::int64_t r = 0; r < kStreams; ++r) out[r] = sc + (r * groups + g) * Gp + t;
    dots8xR_avx512<kStreams>(q + t * hd, hd, k, scale, out);
  }
}

// Three rows at a time in stream order (prefetch_group) where the heads
// come in blocks of 8, each query load serving the three rows; else row by
// row in the same order.
KVRING_AVX512 void scores_avx512(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd,
                                 float scale, const std::uint16_t* const* kp, std::int64_t n,
                                 float* sc, Ahead ahead) {
  const std::int64_t groups = n / kStreams;
  if (G % 8 != 0 || groups == 0) {
    scores_by_row<score_row_avx512>(q, G, Gp, hd, scale, kp, n, sc, ahead);
    return;
  }
  for (std::int64_t g = 0; g < groups; ++g) scores_group_avx512(q, G, Gp, hd, scale, kp, sc, ahead, g, groups);
  for (std::int64_t j = kStreams * groups; j < n; ++j) score_row_avx512(q, G, hd, scale, kp[j], sc + j * Gp);
}

KVRING_AVX512 void accumulate_avx512(const std::uint16_t* const* vp, std::int64_t n,
                                     const float* w, std::int64_t G, std::int64_t Gp,
                                     std::int64_t hd, float* o, Ahead ahead) {
  for_head_blocks(G, [&](auto nb, std::int64_t t) KVRING_AVX512 {
    accumulate_avx512_block<decltype(nb)::value>(vp, n, w + t, Gp, hd, o + t * hd, ahead);
    ahead = {};
  });
}

// exp8's arithmetic on 16 lanes: the same operations, lane for lane.
KVRING_AVX512 inline __m512 exp16(__m512 x) {
  using C = ExpConstants;
  x = _mm512_min_ps(x, _mm512_set1_ps(C::kClamp));
  x = _mm512_max_ps(x, _mm512_set1_ps(-C::kClamp));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(C::kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(C::kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(C::kLn2Lo), x);
  __m512 y = _mm512_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(C::kPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// weights_avx512's steps on 8 head lanes (Gp == 8), two rows to a
// register: the maximum of n rows at sc; the weights of row pairs [p0, p1)
// added to sum (row 2p's, then row 2p + 1's); the odd last row's.
KVRING_AVX512 inline __m256 tile_max_avx512(const float* sc, std::int64_t n) {
  const std::int64_t pairs = n / 2;
  __m512 mx2 = _mm512_set1_ps(-INFINITY);
  for (std::int64_t j = 0; j < pairs; ++j) mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(sc + 16 * j));
  __m256 mx = _mm256_max_ps(_mm512_castps512_ps256(mx2),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mx2), 1)));
  if (n % 2 != 0) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + 16 * pairs));
  return mx;
}

KVRING_AVX512 inline __m512 twice(__m256 a) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(a)));
}

KVRING_AVX512 inline __m256 weight_pairs_avx512(float* sc, std::int64_t p0, std::int64_t p1, __m512 shift2,
                                                __m256 sum) {
  for (std::int64_t j = p0; j < p1; ++j) {
    const __m512 w = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + 16 * j), shift2));
    _mm512_storeu_ps(sc + 16 * j, w);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(w));
    sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
  }
  return sum;
}

KVRING_AVX512 inline __m256 weight_last_avx512(float* sc, std::int64_t n, __m256 shift, __m256 sum) {
  if (n % 2 == 0) return sum;
  const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + 8 * (n - 1)), shift));
  _mm256_storeu_ps(sc + 8 * (n - 1), w);
  return _mm256_add_ps(sum, w);
}

// weights_avx2's result for 8 head lanes (Gp == 8): the maximum is the
// same whatever the order; the weights are exp8's, lane for lane; the sum
// adds row j's weight, then row j + 1's.
KVRING_AVX512 void weights_avx512(float* sc, std::int64_t n, std::int64_t Gp, float* m, float* l) {
  if (Gp != 8) {
    weights_avx2(sc, n, Gp, m, l);
    return;
  }
  const __m256 mx = tile_max_avx512(sc, n);
  const __m256 shift = finite_shift(mx);
  __m256 sum = weight_pairs_avx512(sc, 0, n / 2, twice(shift), _mm256_setzero_ps());
  sum = weight_last_avx512(sc, n, shift, sum);
  _mm256_storeu_ps(m, mx);
  _mm256_storeu_ps(l, sum);
}

// w[j][t] *= f[t] for n rows of Gp lanes (the same products on every path).
KVRING_AVX512 void scale_weights_avx512(float* w, std::int64_t n, std::int64_t Gp, const float* f) {
  if (Gp != 8) {
    scale_weights_avx2(w, n, Gp, f);
    return;
  }
  const __m256 f8 = _mm256_loadu_ps(f);
  const __m512 f16 = twice(f8);
  std::int64_t j = 0;
  for (; j + 2 <= n; j += 2) _mm512_storeu_ps(w + 8 * j, _mm512_mul_ps(_mm512_loadu_ps(w + 8 * j), f16));
  if (j < n) _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(w + 8 * j), f8));
}

// scores_avx512, then weights_avx512 on each tile, as scores_then_weights.
// Where the rows go three at a time for 8 heads, the weights of a run of
// groups' three tiles are computed during the next run's groups, two row
// pairs a group, so that the exponentials overlap the pass's reads; the
// last run's follow the pass.
KVRING_AVX512 void scores_weights_avx512(const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd,
                                         float scale, const std::uint16_t* const* kp, std::int64_t n,
                                         float* sc, float* tm, float* tl, Ahead ahead) {
  const std::int64_t groups = n / kStreams;
  if (G != 8 || groups == 0) {
    scores_then_weights<scores_avx512, weights_avx512>(q, G, Gp, hd, scale, kp, n, sc, tm, tl, ahead);
    return;
  }
  const std::int64_t per_stream = (groups + kWeightTileRows - 1) / kWeightTileRows;
  // The pending run's tiles: rows at w[r], their maxima, shifts and sums;
  // pairs each; (r, p) the next pair; i0 the first tile's index.
  float* w[kStreams] = {};
  __m256 mx[kStreams], shift[kStreams], sum[kStreams];
  std::int64_t rows = 0, pairs = 0, r = kStreams, p = 0, i0 = 0;
  auto step = [&]() KVRING_AVX512 {
    sum[r] = weight_pairs_avx512(w[r], p, p + 1, twice(shift[r]), sum[r]);
    if (++p == pairs) ++r, p = 0;
  };
  auto finish = [&]() KVRING_AVX512 {
    if (rows == 0) return;
    while (r < kStreams && pairs > 0) step();
    for (std::int64_t u = 0; u < kStreams; ++u) {
      const std::int64_t i = u * per_stream + i0;
      _mm256_storeu_ps(tm + i * Gp, mx[u]);
      _mm256_storeu_ps(tl + i * Gp, weight_last_avx512(w[u], rows, shift[u], sum[u]));
    }
  };
  for (std::int64_t g0 = 0; g0 < groups; g0 += kWeightTileRows) {
    const std::int64_t g1 = std::min(groups, g0 + kWeightTileRows);
    for (std::int64_t g = g0; g < g1; ++g) {
      scores_group_avx512(q, G, Gp, hd, scale, kp, sc, ahead, g, groups);
      if (r < kStreams) step();
      if (r < kStreams) step();
    }
    finish();
    rows = g1 - g0;
    pairs = rows / 2;
    r = pairs > 0 ? 0 : kStreams;
    p = 0;
    i0 = g0 / kWeightTileRows;
    for (std::int64_t u = 0; u < kStreams; ++u) {
      w[u] = sc + (u * groups + g0) * Gp;
      mx[u] = tile_max_avx512(w[u], rows);
      shift[u] = finite_shift(mx[u]);
      sum[u] = _mm256_setzero_ps();
    }
  }
  finish();
  const std::int64_t j0 = kStreams * groups;
  if (j0 == n) return;
  for (std::int64_t j = j0; j < n; ++j) score_row_avx512(q, G, hd, scale, kp[j], sc + j * Gp);
  const std::int64_t i = kStreams * per_stream;
  weights_avx512(sc + j0 * Gp, n - j0, Gp, tm + i * Gp, tl + i * Gp);
}

#pragma GCC diagnostic pop

constexpr Kernels kAvx2Kernels{scores_by_row<score_row_avx2>,
                               scores_then_weights<scores_by_row<score_row_avx2>, weights_avx2>,
                               tile_factors_avx2, scale_weights_avx2, weights_f16_avx2, accumulate_avx2,
                               combine_avx2};
constexpr Kernels kAvx512Kernels{scores_avx512, scores_weights_avx512, tile_factors_avx2, scale_weights_avx512,
                                 weights_f16_avx2, accumulate_avx512, combine_avx2};

bool cpu_has(AttentionIsa isa) {
  if (isa == AttentionIsa::kScalar) return true;
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && detail::cpu_has_f16c();
  if (isa == AttentionIsa::kAvx2) return avx2;
  return avx2 && __builtin_cpu_supports("avx512f");
}

#else

bool cpu_has(AttentionIsa isa) { return isa == AttentionIsa::kScalar; }

#endif  // KVRING_ATTEND_X86

AttentionIsa best_isa() {
  for (AttentionIsa isa : {AttentionIsa::kAvx512, AttentionIsa::kAvx2})
    if (cpu_has(isa)) return isa;
  return AttentionIsa::kScalar;
}

std::atomic<AttentionIsa> g_isa{best_isa()};

// The kernels for this machine's path and a head_dim.
const Kernels& kernels_for(AttentionIsa isa, std::int64_t hd) {
#if KVRING_ATTEND_X86
  if (isa == AttentionIsa::kAvx512 && hd % 16 == 0) return kAvx512Kernels;
  if (isa != AttentionIsa::kScalar && hd % 8 == 0) return kAvx2Kernels;
#else
  (void)isa;
  (void)hd;
#endif
  return kScalarKernels;
}

// One split: rows [0, n) (pointers to f16 head rows, in logical order) for
// the G query heads of one KV head, queries at q + t * hd. Writes the
// split's partial: m[Gp], l[Gp] and o[G * hd] (not normalized).
void run_split(const Kernels& K, const float* q, std::int64_t G, std::int64_t Gp, std::int64_t hd,
               float scale, std::int64_t n, const std::uint16_t* const* kp,
               const std::uint16_t* const* vp, float* m, float* l, float* o, float* sc) {
  float* const tm = sc + n * Gp;
  const std::int64_t tiles = tile_count(n);
  K.scores_weights(q, G, Gp, hd, scale, kp, n, sc, tm, tm + tiles * Gp, Ahead{vp, n});
  K.tile_factors(tm, tm + tiles * Gp, tiles, Gp, m, l);
  std::fill(o, o + G * hd, 0.0f);
  const float* f = tm;
  for_each_tile(n, [&](std::int64_t t0, std::int64_t tile_rows) {
    K.scale_weights(sc + t0 * Gp, tile_rows, Gp, f);
    f += Gp;
    // The scores pass brought every V row of the split into the caches; the
    // tile's rows ahead come into L1.
    const Ahead next{vp + t0 + kNearRows, std::max<std::int64_t>(0, std::min(tile_rows, n - t0 - kNearRows))};
    K.accumulate(vp + t0, tile_rows, sc + t0 * Gp, G, Gp, hd, o, next);
  });
}

// Pointers to the f16 rows of KV head g at logical positions [a, b): rows
// before chunk_start from the plane (walked in physical runs, so no
// division per row), the rest from the chunk.
void gather_rows(const PlaneView& plane, const RingState& ring, std::int64_t chunk_start,
                 const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, std::int64_t g,
                 std::int64_t a, std::int64_t b, const std::uint16_t** kp,
                 const std::uint16_t** vp) {
  const std::int64_t hd = plane.head_dim;
  const std::int64_t plane_end = std::min(b, chunk_start);
  std::int64_t pos = a;
  while (pos < plane_end) {
    const std::int64_t phys = ring.physical(pos);
    const bool token_major = plane.layout == Layout::kTokenMajor;
    const std::int64_t run = std::min(plane_end - pos, token_major
                                                           ? plane.capacity - phys
                                                           : plane.block_rows - phys % plane.block_rows);
    const std::int64_t stride = token_major ? plane.kv_dim : hd;
    const std::int64_t off = head_row_offset(plane, phys, g);
    for (std::int64_t r = 0; r < run; ++r, ++kp, ++vp) {
      *kp = plane.k + off + r * stride;
      *vp = plane.v + off + r * stride;
    }
    pos += run;
  }
  for (; pos < b; ++pos, ++kp, ++vp) {
    const std::int64_t off = (pos - chunk_start) * plane.kv_dim + g * hd;
    *kp = chunk_k + off;
    *vp = chunk_v + off;
  }
}

}  // namespace

std::int64_t attend_split_rows(std::int64_t rows) {
  return std::max(kSplitQuantum, round_up((rows + kMaxSplits - 1) / kMaxSplits, kSplitQuantum));
}

AttentionIsa attention_isa() { return g_isa.load(); }

bool set_attention_isa(AttentionIsa isa) {
  if (!cpu_has(isa)) return false;
  g_isa.store(isa);
  return true;
}

void attend(const PlaneView& plane, const RingState& ring, const AttentionShape& shape,
            std::int64_t first_position, std::int64_t n_queries, std::int64_t chunk_start,
            const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, const float* q,
            std::int64_t q_stride, float* out, std::int64_t out_stride) {
  if (n_queries <= 0) return;
  const std::int64_t hd = shape.head_dim;
  const std::int64_t G = shape.n_heads / shape.n_kv_heads;
  const std::int64_t Gp = round_up(G, 8);
  const std::int64_t n_kv = shape.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.scale_dim));
  const Kernels& K = kernels_for(attention_isa(), hd);
  // One split's partial: m[Gp], l[Gp], o[G * hd].
  const std::int64_t stride = 2 * Gp + G * hd;

  auto range = [&](std::int64_t i, std::int64_t& lo, std::int64_t& rows) {
    const std::int64_t p = first_position + i;
    lo = shape.window > 0 ? std::max<std::int64_t>(0, p - shape.window + 1) : 0;
    rows = p - lo + 1;
  };

  thread_local std::vector<float> partials;
  std::vector<std::int64_t> base;  // per query of a pass: its first task
  for (std::int64_t i0 = 0; i0 < n_queries;) {
    // A pass: queries [i0, i1) whose partials fit the budget (one at least).
    base.clear();
    std::int64_t tasks = 0, work = 0, i1 = i0;
    while (i1 < n_queries) {
      std::int64_t lo, rows;
      range(i1, lo, rows);
      const std::int64_t splits = (rows + attend_split_rows(rows) - 1) / attend_split_rows(rows);
      const std::int64_t more = n_kv * splits;
      if (i1 > i0 && static_cast<std::size_t>((tasks + more) * stride) * sizeof(float) > kPartialBudget)
        break;
      base.push_back(tasks);
      tasks += more;
      work += rows * shape.n_heads * hd * 2;
      ++i1;
    }
    base.push_back(tasks);
    if (partials.size() < static_cast<std::size_t>(tasks * stride))
      partials.resize(static_cast<std::size_t>(tasks * stride));
    float* const part = partials.data();
    const std::int64_t n_items = (i1 - i0) * n_kv;
    std::unique_ptr<std::atomic<std::int64_t>[]> arrived(new std::atomic<std::int64_t>[n_items]());

    parallel_for(tasks, work, [&](std::int64_t task) {
      const std::int64_t qi = std::upper_bound(base.begin(), base.end(), task) - base.begin() - 1;
      const std::int64_t i = i0 + qi;
      std::int64_t lo, rows;
      range(i, lo, rows);
      const std::int64_t split_rows = attend_split_rows(rows);
      const std::int64_t splits = (rows + split_rows - 1) / split_rows;
      const std::int64_t g = (task - base[static_cast<std::size_t>(qi)]) / splits;
      const std::int64_t s = (task - base[static_cast<std::size_t>(qi)]) % splits;
      const std::int64_t a = lo + s * split_rows;
      const std::int64_t n = std::min(split_rows, rows - s * split_rows);

      thread_local std::vector<const std::uint16_t*> kp, vp;
      thread_local std::vector<float> scratch;
      kp.resize(static_cast<std::size_t>(n));
      vp.resize(static_cast<std::size_t>(n));
      scratch.resize(static_cast<std::size_t>((n + 2 * tile_count(n)) * Gp));
      gather_rows(plane, ring, chunk_start, chunk_k, chunk_v, g, a, a + n, kp.data(), vp.data());

      float* mine = part + task * stride;
      run_split(K, q + i * q_stride + g * G * hd, G, Gp, hd, scale, n, kp.data(), vp.data(), mine,
                mine + Gp, mine + 2 * Gp, scratch.data());

      // The last split of (query, KV head) to finish combines them all, in
      // split order.
      if (splits > 1) {
        auto& count = arrived[static_cast<std::size_t>(qi * n_kv + g)];
        if (count.fetch_add(1, std::memory_order_acq_rel) != splits - 1) return;
      }
      K.combine({part + (base[static_cast<std::size_t>(qi)] + g * splits) * stride, splits, stride,
                 G, Gp, hd, out + i * out_stride + g * G * hd,
                 shape.sinks != nullptr ? shape.sinks + g * G : nullptr});
    });
    i0 = i1;
  }
}

void attend_f16(const PlaneView& plane, const RingState& ring, const AttentionShape& shape,
                std::int64_t first_position, std::int64_t n_queries, std::int64_t chunk_start,
                const std::uint16_t* chunk_k, const std::uint16_t* chunk_v, const float* q,
                std::int64_t q_stride, float* out, std::int64_t out_stride) {
  if (n_queries <= 0) return;
  const std::int64_t hd = shape.head_dim;
  const std::int64_t G = shape.n_heads / shape.n_kv_heads;
  const std::int64_t Gp = round_up(G, 8);
  const std::int64_t n_kv = shape.n_kv_heads;
  const float scale_log2 = detail::score_scale_log2(shape.scale_dim);
  const Kernels& K = kernels_for(attention_isa(), hd);
  const std::int64_t work = n_queries * shape.n_heads * hd * 2 *
                            (shape.window > 0 ? shape.window : first_position + n_queries);
  // A task is one (query, KV head): its G heads through every split, the
  // splits' partials combined in split order.
  parallel_for(n_queries * n_kv, work, [&](std::int64_t task) {
    const std::int64_t i = task / n_kv, g = task % n_kv;
    const std::int64_t p = first_position + i;
    const std::int64_t lo = shape.window > 0 ? std::max<std::int64_t>(0, p - shape.window + 1) : 0;
    const std::int64_t rows = p - lo + 1;
    thread_local std::vector<const std::uint16_t*> kp, vp;
    // q16: the heads' scaled f16 queries [G][hd]; per head lane c, m, mc,
    // l, alpha; sc a tile's scores then weights [tile row][Gp]; part per
    // split and head m c, l, o[hd]; o a split's outputs [G][hd].
    thread_local std::vector<float> q16, lanes, sc, part, o;
    kp.resize(static_cast<std::size_t>(rows));
    vp.resize(static_cast<std::size_t>(rows));
    gather_rows(plane, ring, chunk_start, chunk_k, chunk_v, g, lo, p + 1, kp.data(), vp.data());
    const std::int64_t s0 = lo / kF16AttendSplitRows, s1 = p / kF16AttendSplitRows;
    const std::int64_t n_splits = s1 - s0 + 1;
    q16.resize(static_cast<std::size_t>(G * hd));
    lanes.assign(static_cast<std::size_t>(5 * Gp), 0.0f);
    sc.resize(static_cast<std::size_t>(kF16AttendTile * Gp));
    part.resize(static_cast<std::size_t>(n_splits * G * (hd + 2)));
    o.resize(static_cast<std::size_t>(G * hd));
    float* const c = lanes.data();
    float* const m = c + Gp;
    float* const mc = m + Gp;
    float* const l = mc + Gp;
    float* const alpha = l + Gp;
    for (std::int64_t t = 0; t < G; ++t) {
      const float* qh = q + i * q_stride + (g * G + t) * hd;
      float amax = 0.0f;
      for (std::int64_t d = 0; d < hd; ++d) amax = std::fmax(amax, std::fabs(qh[d]));
      float down = 0.0f;
      const float up = f16_query_scale(amax, down);
      for (std::int64_t d = 0; d < hd; ++d) q16[static_cast<std::size_t>(t * hd + d)] = f16_round(qh[d] * up);
      c[t] = down * scale_log2;
    }
    for (std::int64_t s = s0; s <= s1; ++s) {
      const std::int64_t a = std::max(s * kF16AttendSplitRows, lo);
      const std::int64_t b = std::min((s + 1) * kF16AttendSplitRows, p + 1);
      std::fill(m, m + Gp, -INFINITY);
      std::fill(mc, mc + Gp, -INFINITY);
      std::fill(l, l + Gp, 0.0f);
      std::fill(o.begin(), o.end(), 0.0f);
      for (std::int64_t t0 = a / kF16AttendTile * kF16AttendTile; t0 < b; t0 += kF16AttendTile) {
        const std::int64_t r0 = std::max(t0, a), n = std::min(t0 + kF16AttendTile, b) - r0;
        // The dot products are exact scores (scale 1); the step, then the
        // outputs rescaled and the weights times V added.
        // The scores prefetch the tile's V rows, the products the next
        // tile's K rows.
        const std::int64_t next = std::min(std::max<std::int64_t>(0, b - r0 - n), kF16AttendTile);
        K.scores(q16.data(), G, Gp, hd, 1.0f, kp.data() + (r0 - lo), n, sc.data(),
                 Ahead{vp.data() + (r0 - lo), n});
        K.weights_f16(sc.data(), n, Gp, c, m, mc, l, alpha);
        for (std::int64_t t = 0; t < G; ++t)
          if (alpha[t] != 1.0f)
            for (std::int64_t d = 0; d < hd; ++d) o[static_cast<std::size_t>(t * hd + d)] *= alpha[t];
        K.accumulate(vp.data() + (r0 - lo), n, sc.data(), G, Gp, hd, o.data(),
                     Ahead{kp.data() + (r0 - lo) + n, next});
      }
      for (std::int64_t t = 0; t < G; ++t) {
        float* ps = part.data() + ((s - s0) * G + t) * (hd + 2);
        ps[0] = mc[t];
        ps[1] = l[t];
        std::copy(o.begin() + t * hd, o.begin() + (t + 1) * hd, ps + 2);
      }
    }
    for (std::int64_t t = 0; t < G; ++t) {
      float M = -INFINITY;
      for (std::int64_t s = 0; s < n_splits; ++s)
        M = std::fmax(M, part[static_cast<std::size_t>((s * G + t) * (hd + 2))]);
      float L = 0.0f;
      if (shape.sinks != nullptr) {
        // The sink in the partials' units: log2 of the scaled scores.
        const float sink = detail::sink_log2(shape.sinks[g * G + t]);
        M = std::fmax(M, sink);
        L = std::exp2(sink - M);
      }
      float* acc = o.data();
      std::fill(acc, acc + hd, 0.0f);
      for (std::int64_t s = 0; s < n_splits; ++s) {
        const float* ps = part.data() + (s * G + t) * (hd + 2);
        const float w = ps[0] == -INFINITY ? 0.0f : std::exp2(ps[0] - M);
        L += ps[1] * w;
        for (std::int64_t d = 0; d < hd; ++d) acc[d] += ps[2 + d] * w;
      }
      float* oh = out + i * out_stride + (g * G + t) * hd;
      for (std::int64_t d = 0; d < hd; ++d) {
        const float r = acc[d] / L;
        oh[d] = r == 0.0f ? 0.0f : r;
      }
    }
  });
}

}  // namespace kvring::cpu
