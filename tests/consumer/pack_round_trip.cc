// A sequence saved as a pack and restored into another store attends to the
// same bits; links the pack and handoff libraries with their dependencies.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kvring/backend.h"
#include "kvring/handoff.h"
#include "kvring/pack.h"
#include "kvring/snapshot.h"

using namespace kvring;

namespace {

int fail(const char* what, const Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
  return 1;
}

}  // namespace

int main() {
  // 3 layers (layer 2 full attention, the others a 16-token window).
  const ModelConfig model = make_hybrid_config("consumer", 3, 3, 4, 2, 32, 16, 1024);
  const std::int64_t kv_dim = model.kv_dim(), width = model.n_heads * model.head_dim;
  const std::int64_t tokens = 41;
  std::mt19937 rng(20261204);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> k(tokens * kv_dim), v(tokens * kv_dim), q(width);
  for (float& x : k) x = dist(rng);
  for (float& x : v) x = dist(rng);
  for (float& x : q) x = dist(rng);

  auto made = make_store(BackendKind::kCpu, model, {.max_sequences = 2});
  auto again = make_store(BackendKind::kCpu, model, {.max_sequences = 2});
  if (!made) return fail("make_store", made.error());
  if (!again) return fail("make_store", again.error());
  KvStore& src = **made;
  KvStore& dst = **again;
  const SeqId a = *src.add_sequence();
  const std::vector<SeqSpan> spans = {{a, 0, tokens}};
  for (std::int64_t layer = 0; layer < model.n_layers; ++layer) {
    Status s = src.store(layer, spans, host_view(k.data(), tokens, kv_dim),
                         host_view(v.data(), tokens, kv_dim));
    if (!s.ok()) return fail("store", s);
  }

  auto snapshot = take_snapshot(src, a);
  if (!snapshot) return fail("take_snapshot", snapshot.error());
  auto bytes = encode_pack(*snapshot);
  if (!bytes) return fail("encode_pack", bytes.error());
  auto source = memory_pack_source(bytes->data(), static_cast<std::int64_t>(bytes->size()));
  auto read = read_pack(*source);
  if (!read) return fail("read_pack", read.error());
  auto b = restore_new_sequence(*read, dst);
  if (!b) return fail("restore_new_sequence", b.error());

  for (std::int64_t layer = 0; layer < model.n_layers; ++layer) {
    const std::int64_t live = src.ring(a, layer)->len();
    std::vector<std::uint16_t> ka(live * kv_dim), va(live * kv_dim), kb(ka.size()), vb(va.size());
    const std::int64_t first = tokens - live;
    Status s = src.read_rows(a, layer, first, live, ka.data(), va.data());
    if (s.ok()) s = dst.read_rows(*b, layer, first, live, kb.data(), vb.data());
    if (!s.ok()) return fail("read_rows", s);
    if (ka != kb || va != vb) return std::fprintf(stderr, "layer %lld: rows differ\n", static_cast<long long>(layer)), 1;

    std::vector<float> out_a(width), out_b(width);
    const std::vector<SeqQuery> qa = {{a, tokens - 1}}, qb = {{*b, tokens - 1}};
    s = src.attend_decode(layer, qa, host_view(q.data(), 1, width), host_view(out_a.data(), 1, width));
    if (s.ok())
      s = dst.attend_decode(layer, qb, host_view(q.data(), 1, width), host_view(out_b.data(), 1, width));
    if (!s.ok()) return fail("attend_decode", s);
    if (std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)) != 0)
      return std::fprintf(stderr, "layer %lld: attention differs\n", static_cast<long long>(layer)), 1;
  }
  std::printf("pack of %zu bytes restored: %lld layers equal; UCX transport %s\n", bytes->size(),
              static_cast<long long>(model.n_layers), handoff::ucx_compiled() ? "built" : "not built");
  return 0;
}
