// kvring run: a session of the reference model over a kvring cache.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "args.h"
#include "commands.h"
#include "kvring/backend.h"
#include "kvring/footprint.h"
#include "kvring/model.h"
#include "kvring/sha256.h"
#include "run_pack.h"
#include "text.h"

namespace kvring::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct RunOptions {
  std::string model_name, config_path, backend = "auto";
  std::string save, resume, store;  // kvpack files and the chunk store
  bool tokens_given = false;
  std::int64_t tokens = 320, prompt_tokens = -1, chunk = 128, context = 0;
  std::uint64_t seed = 1;
  ModelOptions model;
  bool json = false, progress = true;
};

class Progress {
 public:
  Progress(bool enabled, std::int64_t total) : enabled_(enabled && isatty(2)), total_(total) {}
  void update(std::int64_t done, const char* phase) {
    if (!enabled_) return;
    const int width = 30;
    const int filled = static_cast<int>(width * done / std::max<std::int64_t>(1, total_));
    std::fprintf(stderr, "\r%-8s [%.*s%*s] %lld/%lld", phase, filled,
                 "##############################", width - filled, "",
                 static_cast<long long>(done), static_cast<long long>(total_));
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_) std::fprintf(stderr, "\r%*s\r", 60, "");
  }

 private:
  bool enabled_;
  std::int64_t total_;
};

nlohmann::json ring_json(const RingState& r, std::int64_t layer) {
  return {{"layer", layer},           {"capacity", r.capacity()},
          {"len", r.len()},           {"origin_logical", r.origin_logical()},
          {"origin_physical", r.origin_physical()}};
}

Result<RunOptions> parse(const std::vector<std::string>& argv) {
  auto a = Args::parse(argv, {"json", "no-progress"},
                       {"model", "config", "tokens", "prompt-tokens", "seed", "chunk", "hidden",
                        "vocab", "backend", "context", "save", "resume", "store"});
  if (!a) return a.error();
  if (!a->positional().empty())
    return invalid_argument("run: unexpected argument '" + a->positional()[0] + "'");
  RunOptions o;
  o.model_name = a->str("model");
  o.config_path = a->str("config");
  o.backend = a->str("backend", "auto");
  o.json = a->flag("json");
  o.progress = !a->flag("no-progress") && !o.json;
  o.tokens_given = a->has("tokens");
  o.save = a->str("save");
  o.resume = a->str("resume");
  o.store = a->str("store");
  if (a->has("store") && o.store.empty()) return invalid_argument("--store needs a value");
  if (!o.store.empty() && o.save.empty() && o.resume.empty())
    return invalid_argument("--store is the chunk store of --save or --resume; give one of them");
  if (!o.resume.empty()) {
    // A resumed session is the saved one: what shaped it comes from the pack.
    for (const char* name : {"model", "config", "prompt-tokens", "seed", "chunk", "hidden", "vocab"})
      if (a->has(name))
        return invalid_argument(std::string("--") + name + " comes from the pack on --resume and cannot be changed");
  }
  const std::int64_t max = std::numeric_limits<std::int32_t>::max();
  auto get = [&](const char* name, std::int64_t fallback, std::int64_t lo, std::int64_t hi,
                 std::int64_t& out) -> Status {
    auto v = a->integer(name, fallback, lo, hi);
    if (!v) return v.error();
    out = *v;
    return Status::Ok();
  };
  KVRING_RETURN_IF_ERROR(get("tokens", o.tokens, 1, max, o.tokens));
  KVRING_RETURN_IF_ERROR(get("prompt-tokens", std::min<std::int64_t>(o.tokens, 256), 1, max,
                             o.prompt_tokens));
  if (o.prompt_tokens > o.tokens)
    return invalid_argument("--prompt-tokens = " + std::to_string(o.prompt_tokens) +
                            " exceeds --tokens = " + std::to_string(o.tokens));
  KVRING_RETURN_IF_ERROR(get("chunk", o.chunk, 1, max, o.chunk));
  KVRING_RETURN_IF_ERROR(get("hidden", o.model.hidden, 1, kMaxRunHidden, o.model.hidden));
  KVRING_RETURN_IF_ERROR(get("vocab", o.model.vocab, 2, kMaxRunVocab, o.model.vocab));
  KVRING_RETURN_IF_ERROR(get("context", 0, 0, max, o.context));
  std::int64_t seed = 1;
  KVRING_RETURN_IF_ERROR(get("seed", 1, 0, std::numeric_limits<std::int64_t>::max(), seed));
  o.seed = static_cast<std::uint64_t>(seed);
  if (!o.save.empty()) {
    // Refuse an unwritable destination before the session runs, not after.
    std::error_code ec;
    const std::filesystem::path path(o.save);
    if (std::filesystem::is_directory(path, ec))
      return invalid_argument("--save " + o.save + " is a directory");
    const std::filesystem::path parent = path.has_parent_path() ? path.parent_path() : ".";
    if (!std::filesystem::is_directory(parent, ec))
      return invalid_argument("--save " + o.save + ": directory " + parent.string() + " does not exist");
  }
  return o;
}

}  // namespace

int cmd_run(const std::vector<std::string>& argv) {
  auto opts = parse(argv);
  if (!opts) return fail(opts.error());
  RunOptions& o = *opts;
  auto backend = parse_backend(o.backend);
  if (!backend) return fail(backend.error());
  std::optional<Session> resumed;
  std::vector<std::int32_t> generated;
  if (!o.resume.empty()) {
    auto r = resume_run(o.resume, o.store, *backend, o.context);
    if (!r) return fail(r.error());
    o.model = r->record.options;
    o.seed = r->record.seed;
    o.prompt_tokens = r->record.prompt_tokens;
    o.chunk = r->record.chunk;
    resumed.emplace(std::move(r->session));
    const auto& held = resumed->tokens();
    if (!o.tokens_given) o.tokens = resumed->position();
    if (o.tokens < resumed->position())
      return fail("--tokens = " + std::to_string(o.tokens) + " is below the " +
                  std::to_string(resumed->position()) + " tokens " + o.resume + " holds");
    generated.assign(held.begin() + std::min<std::int64_t>(o.prompt_tokens, resumed->position()), held.end());
  }
  auto config = resumed ? Result<ModelConfig>(resumed->model().config())
                        : resolve_config(o.model_name, o.config_path);
  if (!config) return fail(config.error());
  const std::int64_t context =
      resumed ? resumed->cache().context() : (o.context == 0 ? config->max_context : o.context);
  if (context > config->max_context)
    return fail("--context = " + std::to_string(context) + " exceeds the model's maximum " +
                std::to_string(config->max_context));
  if (o.tokens > context)
    return fail("--tokens = " + std::to_string(o.tokens) + " exceeds the cache context " +
                std::to_string(context) + " of model '" + printable(config->name) + "'");
  std::optional<Session> fresh;
  if (!resumed) {
    auto model = ReferenceModel::create(*config, o.model);
    if (!model) return fail(model.error());
    auto cache = make_cache(*backend, *config, {.context = context});
    if (!cache) return fail(cache.error());
    fresh.emplace(*model, std::move(*cache));
  }
  Session& session = resumed ? *resumed : *fresh;

  Progress progress(o.progress, o.tokens);
  const auto prompt = resumed ? std::vector<std::int32_t>() : seeded_tokens(o.prompt_tokens, o.model.vocab, o.seed);
  // A resumed session has fed its prompt already: nothing to prefill.
  const std::int64_t prefilled = std::max<std::int64_t>(0, o.prompt_tokens - session.position());
  const auto t0 = Clock::now();
  for (std::int64_t at = session.position(); at < o.prompt_tokens;) {
    const std::int64_t n = std::min(o.chunk, o.prompt_tokens - at);
    std::vector<std::int32_t> part(prompt.begin() + at, prompt.begin() + at + n);
    if (Status s = session.feed(part, o.chunk); !s.ok()) return fail(s.error());
    at += n;
    progress.update(at, "prefill");
  }
  const auto t1 = Clock::now();
  const std::size_t generated_before = generated.size();
  while (session.position() < o.tokens) {
    auto t = session.step();
    if (!t) return fail(t.error());
    generated.push_back(*t);
    progress.update(session.position(), "decode");
  }
  const auto t2 = Clock::now();
  progress.finish();

  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const auto& logits = session.last_logits();
  const std::string logits_sha = to_hex(sha256(logits.data(), logits.size() * sizeof(float)));

  // Bytes of live rows per plane class, and one ring of each class.
  const KvCache& c = session.cache();
  std::int64_t sliding_live = 0, full_live = 0, sliding_layer = -1, full_layer = -1;
  for (std::int64_t l = 0; l < c.n_layers(); ++l) {
    const std::int64_t bytes = c.ring(l).len() * config->kv_dim() * 4;
    if (config->kind(l) == LayerKind::kSlidingRope) {
      sliding_live += bytes;
      if (sliding_layer < 0) sliding_layer = l;
    } else {
      full_live += bytes;
      if (full_layer < 0) full_layer = l;
    }
  }

  nlohmann::json j;
  j["model"] = config->name;
  j["fingerprint"] = config->fingerprint_hex();
  j["backend"] = backend_name(c.backend());
  j["tokens"] = session.position();
  j["prompt_tokens"] = o.prompt_tokens;
  j["seed"] = o.seed;
  j["chunk"] = o.chunk;
  j["hidden"] = o.model.hidden;
  j["vocab"] = o.model.vocab;
  j["context"] = context;
  j["generated"] = generated;
  j["logits_sha256"] = logits_sha;
  j["cache"] = {{"sliding_bytes_in_use", sliding_live},
                {"full_bytes_in_use", full_live},
                {"allocated_bytes", c.allocated_bytes()}};
  j["rings"] = nlohmann::json::object();
  if (sliding_layer >= 0) j["rings"]["sliding"] = ring_json(c.ring(sliding_layer), sliding_layer);
  if (full_layer >= 0) j["rings"]["full"] = ring_json(c.ring(full_layer), full_layer);
  // Timings vary run to run; everything outside "timing" is deterministic.
  j["timing"] = {{"prefill_s", prefill_s},
                 {"decode_s", decode_s},
                 {"prefill_tokens_per_s", prefill_s > 0 ? prefilled / prefill_s : 0.0},
                 {"decode_tokens_per_s",
                  decode_s > 0 ? static_cast<double>(generated.size() - generated_before) / decode_s : 0.0}};
  std::string saved;
  if (!o.save.empty()) {
    auto line = save_run(session, RunRecord{config->name, config->rope_theta, o.model, o.seed,
                                            o.prompt_tokens, o.chunk, session.last_logits()},
                         o.save, o.store);
    if (!line) return fail(line.error());
    saved = *line;
  }
  if (o.json) {
    // ASCII only: a model name from a pack reaches the terminal as \uXXXX.
    std::printf("%s\n", j.dump(-1, ' ', /*ensure_ascii=*/true).c_str());
    return 0;
  }
  std::printf("kvring run: model %s on %s, %lld tokens (%lld prompt, %zu generated), chunk %lld\n",
              printable(config->name).c_str(), backend_name(c.backend()),
              static_cast<long long>(session.position()), static_cast<long long>(o.prompt_tokens),
              generated.size(), static_cast<long long>(o.chunk));
  std::printf("  prefill      %8.1f tokens/s  (%.3f s)\n",
              j["timing"]["prefill_tokens_per_s"].get<double>(), prefill_s);
  std::printf("  decode       %8.1f tokens/s  (%.3f s)\n",
              j["timing"]["decode_tokens_per_s"].get<double>(), decode_s);
  std::printf("  cache in use sliding %s, full %s; allocated %s\n",
              format_bytes(sliding_live).c_str(), format_bytes(full_live).c_str(),
              format_bytes(c.allocated_bytes()).c_str());
  auto print_ring = [&](const char* name, std::int64_t layer) {
    if (layer < 0) return;
    const RingState& r = c.ring(layer);
    std::printf("  ring %-7s layer %lld: capacity %lld, len %lld, origin logical %lld, physical %lld\n",
                name, static_cast<long long>(layer), static_cast<long long>(r.capacity()),
                static_cast<long long>(r.len()), static_cast<long long>(r.origin_logical()),
                static_cast<long long>(r.origin_physical()));
  };
  print_ring("sliding", sliding_layer);
  print_ring("full", full_layer);
  std::string gen;
  for (std::size_t i = 0; i < generated.size() && i < 16; ++i) gen += " " + std::to_string(generated[i]);
  if (generated.size() > 16) gen += " ...";
  std::printf("  generated   %s\n", gen.c_str());
  std::printf("  last logits sha256 %s\n", logits_sha.c_str());
  if (!saved.empty()) std::printf("  saved        %s\n", saved.c_str());
  return 0;
}

}  // namespace kvring::cli
