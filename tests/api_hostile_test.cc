// The library's own API and config parser given what an engine could pass
// by mistake: deeply nested config.json values, a window past any context,
// layers that do not exist, ring states whose end overflows, misaligned host
// views, views past any address space, outputs that overlap, decodes at
// negative positions, and a context below a full plane's minimum.
// Each is a clear error or a right answer, never undefined behaviour.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kvring/backend.h"
#include "kvring/config.h"
#include "kvring/f16.h"
#include "kvring/ring.h"
#include "kvring/store.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::small_config;

// A CPU store of small_config(32, 256, 4) holding one new sequence.
class ApiHostileStore : public ::testing::Test {
 protected:
  void SetUp() override {
    auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = 1, .context = 256});
    ASSERT_TRUE(made.ok()) << made.error().to_string();
    store = std::move(*made);
    seq = *store->add_sequence();
  }
  const ModelConfig cfg = small_config(32, 256, 4);
  std::unique_ptr<KvStore> store;
  SeqId seq{};
};

std::string nested(std::int64_t depth) {
  return std::string(static_cast<std::size_t>(depth), '[') + std::string(static_cast<std::size_t>(depth), ']');
}

void expect_config_error(const std::string& json, const std::string& part) {
  auto c = parse_hf_config(json);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find(part), std::string::npos) << c.error().to_string();
  EXPECT_LT(c.error().message.size(), 400u) << "the message quotes the whole value";
}

// An error names a nested value by its kind and size: printing it whole
// recursed once per level. Nesting past a config's bound is refused before
// the text is parsed (a parse takes tens of bytes for each nested byte).
TEST(ApiHostile, DeeplyNestedConfigValuesAreNamedNotPrinted) {
  expect_config_error("{\"num_hidden_layers\":" + nested(100000) + "}",
                      "arrays and objects nested 100001 deep; a config nests at most 32");
  expect_config_error("{\"a\":\"" + std::string(100, '[') + "\",\"num_hidden_layers\":" + nested(32) + "}",
                      "nested 33 deep");
  const std::string deep = nested(30);
  expect_config_error("{\"num_hidden_layers\":" + deep + "}", "must be an integer, got an array of 1 elements");
  expect_config_error(
      "{\"num_hidden_layers\":2,\"num_attention_heads\":2,\"head_dim\":8,\"max_position_embeddings\":64,"
      "\"layer_types\":[" + deep + ",\"full_attention\"]}",
      "layer_types[0] = an array of 1 elements is not a known layer type");
  expect_config_error(
      "{\"num_hidden_layers\":2,\"num_attention_heads\":2,\"head_dim\":8,\"max_position_embeddings\":64,"
      "\"rope_theta\":\"" + std::string(1000, 'x') + "\"}",
      "must be a positive number");
}

// A window is bounded even where no layer slides: ring sizes are derived
// from it (and the rollback slack, which may reach the window).
TEST(ApiHostile, AWindowPastAnyContextIsRefusedWithoutSlidingLayers) {
  const std::string json =
      "{\"num_hidden_layers\":2,\"num_attention_heads\":2,\"head_dim\":8,\"max_position_embeddings\":64,"
      "\"sliding_window\":9223372036854775807,\"sliding_window_pattern\":1}";
  expect_config_error(json, "sliding_window");
  auto fine = parse_hf_config(
      "{\"num_hidden_layers\":2,\"num_attention_heads\":2,\"head_dim\":8,\"max_position_embeddings\":64,"
      "\"sliding_window\":4096,\"sliding_window_pattern\":1}");
  ASSERT_TRUE(fine.ok()) << fine.error().to_string();
  EXPECT_EQ(fine->count(LayerKind::kSlidingRope), 0);
}

TEST(ApiHostile, LayerQueriesOutsideTheModelAnswerWithoutReadingPastIt) {
  auto made = make_store(BackendKind::kCpu, small_config(32, 256, 4), {.max_sequences = 1, .context = 256});
  ASSERT_TRUE(made.ok());
  const KvStore& s = **made;
  EXPECT_GT(s.position_limit(3), 0);
  for (const std::int64_t layer : {std::int64_t{-1}, std::int64_t{4}, std::int64_t{1} << 40,
                                   std::numeric_limits<std::int64_t>::min()}) {
    EXPECT_EQ(s.position_limit(layer), 0) << layer;
    EXPECT_EQ(s.capacity(layer), 0) << layer;
  }
}

// Positions stay below 2^62, so a ring's end never overflows; a state
// recorded elsewhere (a snapshot, a handoff header) is held to it.
TEST(ApiHostile, RingStatesWhoseEndOverflowsAreRefused) {
  const std::int64_t cap = 64;
  const std::int64_t limit = std::int64_t{1} << 62;
  auto at_limit = RingState::from_parts(cap, true, cap, limit - cap, (limit - cap) % cap);
  ASSERT_TRUE(at_limit.ok()) << at_limit.error().to_string();
  EXPECT_EQ(at_limit->next_position(), limit);
  for (const std::int64_t origin : {limit - cap + 1, std::numeric_limits<std::int64_t>::max() - 1}) {
    auto r = RingState::from_parts(cap, true, cap, origin, origin % cap);
    ASSERT_FALSE(r.ok()) << origin;
    EXPECT_NE(r.error().message.find("past 2^62"), std::string::npos) << r.error().to_string();
  }
}

// The CPU backend reads f32 views as floats: data that is not aligned to
// its elements is refused, as on CUDA.
TEST_F(ApiHostileStore, MisalignedF32ViewsAreRefusedOnTheCpu) {
  KvStore& s = *store;
  const std::int64_t kv = cfg.kv_dim(), qd = cfg.n_heads * cfg.head_dim;
  std::vector<float> buf(static_cast<std::size_t>(4 * qd + 8), 0.25f);
  auto* odd = reinterpret_cast<float*>(reinterpret_cast<char*>(buf.data()) + 2);
  const SeqSpan span{seq, 0, 2};
  const Status stored = s.store(0, {&span, 1}, host_view(odd, 2, kv), host_view(buf.data(), 2, kv));
  ASSERT_FALSE(stored.ok());
  EXPECT_NE(stored.error().message.find("not aligned to its f32 elements"), std::string::npos)
      << stored.error().to_string();
  EXPECT_EQ(s.ring(seq, 0)->len(), 0);

  ASSERT_TRUE(s.store_all_layers({&span, 1}, host_view(buf.data(), 2 * cfg.n_layers, kv),
                                 host_view(buf.data(), 2 * cfg.n_layers, kv)).ok());
  std::vector<float> out(static_cast<std::size_t>(qd + 8));
  auto* odd_out = reinterpret_cast<float*>(reinterpret_cast<char*>(out.data()) + 1);
  const SeqQuery query{seq, 1};
  const Status attended = s.attend_decode(0, {&query, 1}, host_view(buf.data(), 1, qd), host_view(odd_out, 1, qd));
  ASSERT_FALSE(attended.ok());
  EXPECT_NE(attended.error().message.find("not aligned"), std::string::npos) << attended.error().to_string();
}

// A decode at a negative position is refused as one, on every layer kind,
// and the output is left as it was.
TEST_F(ApiHostileStore, DecodesAtNegativePositionsAreRefusedAsSuch) {
  KvStore& s = *store;
  const std::int64_t kv = cfg.kv_dim(), qd = cfg.n_heads * cfg.head_dim;
  const auto x = testing::random_floats(static_cast<std::size_t>(cfg.n_layers * 2 * kv), 5);
  const SeqSpan span{seq, 0, 2};
  ASSERT_TRUE(s.store_all_layers({&span, 1}, host_view(x.data(), 2 * cfg.n_layers, kv),
                                 host_view(x.data(), 2 * cfg.n_layers, kv)).ok());
  const auto q = testing::random_floats(static_cast<std::size_t>(qd), 6);
  std::vector<float> out(static_cast<std::size_t>(qd), 7.0f);
  for (std::int64_t layer = 0; layer < cfg.n_layers; ++layer)
    for (const std::int64_t p : {std::int64_t{-1}, std::int64_t{-2049}, std::numeric_limits<std::int64_t>::min()}) {
      const SeqQuery query{seq, p};
      const Status r = s.attend_decode(layer, {&query, 1}, host_view(q.data(), 1, qd), host_view(out.data(), 1, qd));
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
      EXPECT_NE(r.error().message.find("decode at position " + std::to_string(p) + ": positions start at 0"),
                std::string::npos)
          << r.error().to_string();
    }
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }));
}

// A view whose rows would span more memory than any machine maps is refused
// before a row is read (its stride passes the overflow check), and the
// store is unchanged.
TEST_F(ApiHostileStore, ViewsPastAnyAddressSpaceAreRefused) {
  KvStore& s = *store;
  const std::int64_t kv = cfg.kv_dim();
  std::vector<float> buf(static_cast<std::size_t>(4 * kv), 0.5f);
  const SeqSpan span{seq, 0, 4};
  for (const std::int64_t stride : {std::numeric_limits<std::int64_t>::max() / 32, std::int64_t{1} << 43}) {
    SCOPED_TRACE(stride);
    const ConstView wild{buf.data(), MemorySpace::kHost, DType::kF32, 4, kv, stride};
    const Status st = s.store(0, {&span, 1}, wild, host_view(buf.data(), 4, kv));
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(st.error().message.find("more than any memory holds"), std::string::npos) << st.error().to_string();
    EXPECT_EQ(s.ring(seq, 0)->len(), 0);
  }
  ASSERT_TRUE(s.store(0, {&span, 1}, host_view(buf.data(), 4, kv), host_view(buf.data(), 4, kv)).ok());
}

// 16-bit views are read byte-wise on the CPU: at an odd address they give
// the bits they give aligned.
TEST(ApiHostile, SixteenBitViewsAtOddAddressesReadAsAligned) {
  const ModelConfig cfg = small_config(32, 256, 4);
  const std::int64_t kv = cfg.kv_dim(), qd = cfg.n_heads * cfg.head_dim, rows = 5;
  const auto x = testing::random_floats(static_cast<std::size_t>(rows * qd), 17);
  for (const DType dtype : {DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    // The same 16-bit values at an even and at an odd address.
    std::vector<std::uint16_t> bits(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      std::uint32_t u;
      std::memcpy(&u, &x[i], 4);
      bits[i] = dtype == DType::kF16 ? f32_to_f16(x[i]) : static_cast<std::uint16_t>(u >> 16);
    }
    std::vector<unsigned char> odd(bits.size() * 2 + 1);
    std::memcpy(odd.data() + 1, bits.data(), bits.size() * 2);
    std::vector<std::vector<float>> outs;
    for (const void* data : {static_cast<const void*>(bits.data()), static_cast<const void*>(odd.data() + 1)}) {
      auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = 1, .context = 256});
      ASSERT_TRUE(made.ok());
      KvStore& s = **made;
      const SeqId seq = *s.add_sequence();
      const SeqSpan span{seq, 0, rows};
      const ConstView kview{data, MemorySpace::kHost, dtype, rows, kv, qd};
      const ConstView qview{data, MemorySpace::kHost, dtype, rows, qd, qd};
      std::vector<float> out(static_cast<std::size_t>(rows * qd));
      const Status st = s.prefill(0, {&span, 1}, kview, kview, qview, host_view(out.data(), rows, qd));
      ASSERT_TRUE(st.ok()) << st.to_string();
      outs.push_back(out);
    }
    EXPECT_TRUE(outs[0] == outs[1]);
    EXPECT_NE(outs[0][0], 0.0f);
  }
}

// Row buffers at an odd address get the bytes aligned ones get, from
// read_rows and from read_plane, of a sliding and of a full layer.
TEST_F(ApiHostileStore, RowBuffersAtOddAddressesReadAsAligned) {
  KvStore& s = *store;
  const std::int64_t kv = cfg.kv_dim(), rows = 40;
  const auto x = testing::random_floats(static_cast<std::size_t>(cfg.n_layers * rows * kv), 5);
  for (std::int64_t p = 0; p < rows; ++p) {
    const SeqSpan span{seq, p, 1};
    const float* row = x.data() + p * cfg.n_layers * kv;
    ASSERT_TRUE(s.store_all_layers({&span, 1}, host_view(row, cfg.n_layers, kv), host_view(row, cfg.n_layers, kv)).ok());
  }
  for (const std::int64_t layer : {std::int64_t{0}, std::int64_t{3}}) {
    SCOPED_TRACE(layer);
    ASSERT_EQ(cfg.kind(layer), layer == 0 ? LayerKind::kSlidingRope : LayerKind::kFullNope);
    const auto n = static_cast<std::size_t>(s.capacity(layer) * kv);
    std::vector<std::uint16_t> k(n), v(n);
    std::vector<unsigned char> odd(4 * n + 2);
    auto* ok = reinterpret_cast<std::uint16_t*>(odd.data() + 1);
    auto* ov = reinterpret_cast<std::uint16_t*>(odd.data() + 1 + 2 * n);
    ASSERT_TRUE(s.read_plane(seq, layer, k.data(), v.data()).ok());
    ASSERT_TRUE(s.read_plane(seq, layer, ok, ov).ok());
    EXPECT_EQ(std::memcmp(odd.data() + 1, k.data(), 2 * n), 0);
    EXPECT_EQ(std::memcmp(odd.data() + 1 + 2 * n, v.data(), 2 * n), 0);
    ASSERT_TRUE(s.read_rows(seq, layer, rows - 8, 8, k.data(), v.data()).ok());
    ASSERT_TRUE(s.read_rows(seq, layer, rows - 8, 8, ok, ov).ok());
    EXPECT_EQ(std::memcmp(odd.data() + 1, k.data(), static_cast<std::size_t>(16 * kv)), 0);
    EXPECT_NE(std::count(k.begin(), k.begin() + 8 * kv, std::uint16_t{0}), 8 * kv);
  }
}

// Both outputs of a read would overwrite each other.
TEST_F(ApiHostileStore, ReadsRefuseOverlappingOutputs) {
  KvStore& s = *store;
  const std::int64_t kv = cfg.kv_dim();
  const auto x = testing::random_floats(static_cast<std::size_t>(cfg.n_layers * 2 * kv), 3);
  const SeqSpan span{seq, 0, 2};
  ASSERT_TRUE(s.store_all_layers({&span, 1}, host_view(x.data(), 2 * cfg.n_layers, kv),
                                 host_view(x.data(), 2 * cfg.n_layers, kv)).ok());
  std::vector<std::uint16_t> buf(static_cast<std::size_t>(4 * 256 * kv));
  for (const std::int64_t shift : {std::int64_t{0}, std::int64_t{1}, 2 * kv - 1}) {
    const Status r = s.read_rows(seq, 3, 0, 2, buf.data(), buf.data() + shift);
    ASSERT_FALSE(r.ok()) << shift;
    EXPECT_NE(r.error().message.find("the k and v buffers overlap"), std::string::npos) << r.error().to_string();
  }
  EXPECT_TRUE(s.read_rows(seq, 3, 0, 2, buf.data(), buf.data() + 2 * kv).ok());
  const Status p = s.read_plane(seq, 0, buf.data(), buf.data() + 10);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message.find("overlap"), std::string::npos) << p.error().to_string();
  EXPECT_TRUE(s.read_plane(seq, 0, buf.data(), buf.data() + s.capacity(0) * kv).ok());
}

// Below 32 tokens of context a full plane still holds 32 rows; the count of
// blocks a store takes follows the plane, not the context.
TEST(ApiHostile, BlocksToStoreCountsWhatAShortContextsPlanesTake) {
  const ModelConfig cfg = small_config(32, 256, 8);
  auto made = make_store(BackendKind::kCpu, cfg, {.max_sequences = 1, .context = 16, .block_rows = 16});
  ASSERT_TRUE(made.ok());
  KvStore& s = **made;
  const SeqId seq = *s.add_sequence();
  const std::int64_t kv = cfg.kv_dim();
  ASSERT_EQ(s.capacity(3), 32);
  const SeqSpan span{seq, 0, 30};
  const auto n = s.blocks_to_store({&span, 1});
  ASSERT_TRUE(n.ok());
  const auto x = testing::random_floats(static_cast<std::size_t>(30 * kv), 5);
  const std::int64_t before = s.free_blocks();
  for (const std::int64_t layer : {3, 7})
    ASSERT_TRUE(s.store(layer, {&span, 1}, host_view(x.data(), 30, kv), host_view(x.data(), 30, kv)).ok());
  EXPECT_EQ(*n, before - s.free_blocks());
  EXPECT_EQ(*n, 4);
}

// A store at the limits of slots and layers (2^20 sequences of 1024
// sliding layers, planes mapped lazily) costs bookkeeping for the slots its
// sequences take, not max_sequences x n_layers bytes up front (1 GiB); a
// slot's rings are still known written, copied and cleared as before (a
// small store, whose planes a test may touch whole).
TEST(ApiHostile, SlotBookkeepingGrowsWithTheSequencesNotTheLimit) {
  const float k = 0.5f, v = 0.25f, q = 1.0f;
  {
    const ModelConfig c = make_hybrid_config("wide", 1024, 0, 1, 1, 1, 1, 1);
    const std::int64_t before = testing::proc_status_bytes("VmRSS");
    auto made = make_store(BackendKind::kCpu, c, {.max_sequences = std::int64_t{1} << 20});
    ASSERT_TRUE(made.ok()) << made.error().to_string();
    const std::int64_t after = testing::proc_status_bytes("VmRSS");
    if (before > 0 && after > 0) {
      EXPECT_LT(after - before, std::int64_t{512} << 20);
    }
    auto a = (*made)->add_sequence();
    ASSERT_TRUE(a.ok());
    const SeqSpan span{*a, 0, 1};
    ASSERT_TRUE((*made)->store(1023, {&span, 1}, host_view(&k, 1, 1), host_view(&v, 1, 1)).ok());
    float out = 0;
    const SeqQuery query{*a, 0};
    ASSERT_TRUE((*made)->attend_decode(1023, {&query, 1}, host_view(&q, 1, 1), host_view(&out, 1, 1)).ok());
    EXPECT_EQ(out, 0.25f);
  }
  const ModelConfig c = make_hybrid_config("narrow", 6, 0, 1, 1, 1, 1, 1);
  auto made = make_store(BackendKind::kCpu, c, {.max_sequences = 3});
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  KvStore& s = **made;
  auto a = s.add_sequence();
  ASSERT_TRUE(a.ok());
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const SeqSpan span{*a, 0, 1};
    ASSERT_TRUE(s.store(l, {&span, 1}, host_view(&k, 1, 1), host_view(&v, 1, 1)).ok());
  }
  auto b = s.fork_sequence(*a);
  ASSERT_TRUE(b.ok());
  float out = 0;
  const SeqQuery query{*b, 0};
  ASSERT_TRUE(s.attend_decode(5, {&query, 1}, host_view(&q, 1, 1), host_view(&out, 1, 1)).ok());
  EXPECT_EQ(out, 0.25f);
  // The slot a removed sequence leaves is cleared for the next.
  ASSERT_TRUE(s.remove_sequence(*a).ok());
  auto d = s.add_sequence();
  ASSERT_TRUE(d.ok());
  std::vector<std::uint16_t> pk(static_cast<std::size_t>(s.capacity(0))), pv(pk.size());
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    ASSERT_TRUE(s.read_plane(*d, l, pk.data(), pv.data()).ok());
    EXPECT_TRUE(std::all_of(pk.begin(), pk.end(), [](std::uint16_t x) { return x == 0; })) << "layer " << l;
    EXPECT_TRUE(std::all_of(pv.begin(), pv.end(), [](std::uint16_t x) { return x == 0; })) << "layer " << l;
  }
}

}  // namespace
}  // namespace kvring
