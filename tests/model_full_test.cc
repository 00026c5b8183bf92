// The exactness gate of tests/cuda_model_test.cc on the CPU backend: the
// reference model with muse-glimmer's full geometry (52 layers, 16 query
// heads over 2 KV heads of 128, window 2048) gives the same logits and
// stored K/V, bit for bit, whether tokens arrive one at a time or in prefill
// chunks of 7 and 512, at positions 2047, 2048 and 2049 (the last position
// the sliding ring holds unwrapped, the first wrap, the one after). Minutes
// on two cores: its own executable, labelled "slow".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kvring/model.h"
#include "test_util.h"

namespace kvring {
namespace {

constexpr std::int64_t kContext = 2560;

using testing::same_bits;

TEST(ExactnessGate, MuseGlimmerFullGeometryAt2047To2049) {
  const ModelConfig glimmer = *preset_config("muse-glimmer");
  const ModelOptions options{.hidden = 64, .vocab = 97, .mlp = 0, .seed = 11};
  auto model = ReferenceModel::create(glimmer, options);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  const std::int64_t vocab = options.vocab;
  const std::vector<std::int64_t> gates = {2047, 2048, 2049};
  const std::int64_t end = gates.back() + 1;
  const auto tokens = seeded_tokens(end, vocab, 78);

  // One token at a time, the planes kept at each gate position.
  auto dec = make_cpu_cache(glimmer, {.context = kContext});
  ASSERT_TRUE(dec.ok());
  std::vector<float> dec_logits(static_cast<std::size_t>(end * vocab), NAN);
  std::vector<testing::CacheImage> dec_planes;
  for (std::int64_t p = 0; p < end; ++p) {
    ASSERT_TRUE((*model)->forward(**dec, p, tokens.data() + p, 1, dec_logits.data() + p * vocab).ok());
    if (std::find(gates.begin(), gates.end(), p) != gates.end()) dec_planes.push_back(testing::image(**dec));
  }
  for (std::size_t i = 0; i < dec_logits.size(); ++i) ASSERT_TRUE(std::isfinite(dec_logits[i])) << i;
  // The sliding rings wrapped at 2048: the gate crosses the edge.
  EXPECT_EQ((*dec)->ring(0).capacity(), 2048);
  EXPECT_EQ((*dec)->ring(0).origin_logical(), 2);

  for (std::size_t gi = 0; gi < gates.size(); ++gi) {
    const std::int64_t p = gates[gi];
    for (std::int64_t chunk : {7, 512}) {
      SCOPED_TRACE("position " + std::to_string(p) + " chunk " + std::to_string(chunk));
      // Chunks that end exactly at p (the first takes the remainder).
      auto pre = make_cpu_cache(glimmer, {.context = kContext});
      ASSERT_TRUE(pre.ok());
      std::vector<float> logits(static_cast<std::size_t>((p + 1) * vocab), NAN);
      std::int64_t at = 0;
      for (std::int64_t n = (p + 1) % chunk ? (p + 1) % chunk : chunk; at <= p; n = chunk) {
        ASSERT_TRUE((*model)->forward(**pre, at, tokens.data() + at, n, logits.data() + at * vocab).ok());
        at += n;
      }
      for (std::int64_t q = 0; q <= p; ++q)
        ASSERT_TRUE(same_bits(logits.data() + q * vocab, dec_logits.data() + q * vocab,
                              static_cast<std::size_t>(vocab)))
            << "logits differ at position " << q;
      ASSERT_TRUE(testing::image(**pre) == dec_planes[gi]) << "stored K/V differ";
    }
  }
}

}  // namespace
}  // namespace kvring
