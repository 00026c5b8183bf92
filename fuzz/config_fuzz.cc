// libFuzzer target for the Hugging Face config parser (parse_hf_config).
// Built by scripts/fuzz.sh with clang -fsanitize=fuzzer,address,undefined;
// not part of the normal build.
//
// Every input is parsed as a config.json. The parser must return a config
// or an error, never throw or crash; a config it returns must pass
// validate() and have plane capacities and a footprint that stay inside
// 64-bit arithmetic at its maximum context.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "kvring/config.h"
#include "kvring/footprint.h"

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "config invariant broke: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvring;
  auto c = parse_hf_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!c.ok()) {
    if (c.error().message.empty()) broken("an error without a message");
    return 0;
  }
  if (!c->validate().ok()) broken("a parsed config does not validate");
  if (c->kv_dim() < 1 || c->kv_dim() > kMaxKvDim) broken("kv_dim outside its bound");
  for (std::int64_t l = 0; l < c->n_layers; ++l) {
    const std::int64_t cap = c->plane_capacity(l, c->max_context);
    if (cap < kMinPlaneRows || cap > std::max(kMinPlaneRows, kMaxContext)) broken("plane capacity out of range");
  }
  auto f = compute_footprint(*c, c->max_context, 1);
  if (!f.ok()) broken("no footprint for a valid config at its maximum context");
  (void)c->fingerprint();
  return 0;
}
