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
#include "handoff_cli.h"
#include "run_pack.h"
#include "run_report.h"
#include "run_summary.h"
#include "core/text.h"

namespace kvring::cli {

namespace {

using Clock = std::chrono::steady_clock;


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


const std::set<std::string> kRunOptions = {
    "model", "config", "tokens", "prompt-tokens", "seed", "chunk", "hidden", "vocab", "backend",
    "context", "save", "resume", "store", "handoff-to", "handoff-schedule", "handoff-rate",
    "handoff-timeout", "handoff-message", "handoff-min-rate", "sequences", "attention"};

Result<RunOptions> parse(const std::vector<std::string>& argv) {
  auto a = Args::parse(argv, {"json", "no-progress"}, kRunOptions);
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
  if (!o.store.empty() && o.save.empty() && o.resume.empty())
    return invalid_argument("--store is the chunk store of --save or --resume; give one of them");
  if (a->has("attention")) {
    auto numeric = parse_attention_numeric(a->str("attention"));
    if (!numeric) return invalid_argument("--attention: " + numeric.error().message);
    o.attention = *numeric;
  }
  o.handoff_to = a->str("handoff-to");
  if (a->has("handoff-to")) {
    if (o.handoff_to.empty()) return invalid_argument("--handoff-to needs HOST:PORT or unix:PATH");
    for (const char* name : {"tokens", "save", "resume", "store", "attention"})
      if (a->has(name))
        return invalid_argument(std::string("--") + name + " does not go with --handoff-to (the receiver decodes)");
    o.handoff_schedule = a->str("handoff-schedule", o.handoff_schedule);
    if (a->has("handoff-rate")) {
      auto r = parse_positive_double("handoff-rate", a->str("handoff-rate"), false, kMaxRateGbS);
      if (!r) return r.error();
      o.handoff_rate_gb_s = *r;
    }
    if (a->has("handoff-timeout")) {
      auto r = parse_positive_double("handoff-timeout", a->str("handoff-timeout"), false);
      if (!r) return r.error();
      o.handoff_timeout_s = *r;
    }
    if (a->has("handoff-min-rate")) {
      auto r = parse_positive_double("handoff-min-rate", a->str("handoff-min-rate"), true, kMaxRateGbS);
      if (!r) return r.error();
      o.handoff_min_rate_gb_s = *r;
    }
    auto m = a->integer("handoff-message", o.handoff_message_kib, 1, 1 << 20);
    if (!m) return m.error();
    o.handoff_message_kib = *m;
    // The prompt alone sizes the session.
    auto p = a->integer("prompt-tokens", 256, 1, std::numeric_limits<std::int32_t>::max());
    if (!p) return p.error();
    o.tokens = *p;
  } else {
    for (const char* name :
         {"handoff-schedule", "handoff-rate", "handoff-timeout", "handoff-message", "handoff-min-rate"})
      if (a->has(name)) return invalid_argument(std::string("--") + name + " needs --handoff-to");
  }
  if (!o.resume.empty()) {
    // A resumed session is the saved one: what shaped it comes from the pack.
    for (const char* name : {"model", "config", "prompt-tokens", "seed", "chunk", "hidden", "vocab", "attention"})
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
  KVRING_RETURN_IF_ERROR(get("sequences", 0, 1, kMaxRunSequences, o.sequences));
  std::int64_t seed = 1;
  KVRING_RETURN_IF_ERROR(get("seed", 1, 0, std::numeric_limits<std::int64_t>::max(), seed));
  o.seed = static_cast<std::uint64_t>(seed);
  return o;
}

}  // namespace

int cmd_run(const std::vector<std::string>& argv) {
  if (wants_help(argv, kRunOptions)) return print_help("run");
  auto opts = parse(argv);
  if (!opts) return fail(opts.error());
  RunOptions& o = *opts;
  auto backend = parse_backend(o.backend);
  if (!backend) return fail(backend.error());
  if (o.sequences > 0) {
    if (!o.handoff_to.empty()) return fail("--handoff-to sends one session; it does not take --sequences");
    return run_many(o, *backend);
  }
  std::optional<Session> resumed;
  std::vector<std::int32_t> generated;
  if (!o.resume.empty()) {
    auto r = resume_run(o.resume, o.store, *backend, o.context);
    if (!r) return fail(r.error());
    o.model = r->record.options;
    o.seed = r->record.seed;
    o.prompt_tokens = r->record.prompt_tokens;
    o.chunk = r->record.chunk;
    o.attention = r->record.attention;
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
  // Under --handoff-to the prompt alone sizes the session (no --tokens),
  // and a handoff carries at most kMaxHandoffPrompt. A model of rings that
  // hold their window runs past the context.
  const std::int64_t limit = config->sequence_position_limit(context);
  if (o.tokens > limit && !o.handoff_to.empty())
    return fail("--prompt-tokens = " + std::to_string(o.tokens) + " exceeds " + cache_context_text(limit, context) +
                " of model '" + printable(config->name, false) + "'");
  if (o.tokens > handoff::kMaxHandoffPrompt && !o.handoff_to.empty())
    return fail("--prompt-tokens = " + std::to_string(o.tokens) + " exceeds the " +
                std::to_string(handoff::kMaxHandoffPrompt) + " a handoff carries");
  if (o.tokens > limit)
    return fail("--tokens = " + std::to_string(o.tokens) + (o.tokens_given ? "" : " (the default)") + " exceeds " +
                cache_context_text(limit, context) + " of model '" + printable(config->name, false) + "'" +
                (o.tokens_given ? "" : "; give --tokens"));
  if (!o.save.empty())
    if (Status s = check_save(o.save, 0, o.store); !s.ok()) return fail(s.error());
  std::optional<Session> fresh;
  if (!resumed) {
    auto model = create_run_model(*config, o.model);
    if (!model) return fail(model.error());
    auto cache = make_cache(*backend, *config, {.context = context, .attention = o.attention});
    if (!cache) return fail(cache.error());
    fresh.emplace(*model, std::move(*cache));
  }
  Session& session = resumed ? *resumed : *fresh;
  if (!o.handoff_to.empty())
    return run_handoff_send(session, *config,
                            {.to = o.handoff_to, .schedule = o.handoff_schedule, .rate_gb_s = o.handoff_rate_gb_s,
                             .timeout_s = o.handoff_timeout_s, .min_rate_gb_s = o.handoff_min_rate_gb_s,
                             .message_bytes = o.handoff_message_kib * 1024,
                             .prompt_tokens = o.prompt_tokens, .chunk = o.chunk,
                             .context = context, .seed = o.seed, .model = o.model, .json = o.json,
                             .progress = o.progress});

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
  std::string saved;
  if (!o.save.empty()) {
    RunRecord record{config->name,  config->rope_theta,     o.model,    o.seed,
                     o.prompt_tokens, o.chunk, session.last_logits(), o.attention};
    record.query_pre_attn_scalar = config->query_pre_attn_scalar;
    record.attention_sinks = config->attention_sinks;
    auto line = save_run(session, record, o.save, o.store);
    if (!line) return fail(line.error());
    saved = *line;
  }
  RunReport report;
  report.config = &*config;
  report.session = &session;
  report.prompt_tokens = o.prompt_tokens;
  report.seed = o.seed;
  report.chunk = o.chunk;
  report.model = o.model;
  report.context = context;
  report.generated = std::move(generated);
  report.prefill_s = prefill_s;
  report.decode_s = decode_s;
  report.prefilled = prefilled;
  report.decoded = static_cast<std::int64_t>(report.generated.size() - generated_before);
  report.json = o.json;
  report.saved = saved;
  return print_run_report(report);
}

int print_run_report(const RunReport& r) {
  const ModelConfig* config = r.config;
  const Session& session = *r.session;
  const std::vector<std::int32_t>& generated = r.generated;
  const double prefill_s = r.prefill_s, decode_s = r.decode_s;
  const auto& logits = session.last_logits();
  const std::string logits_sha = to_hex(sha256(logits.data(), logits.size() * sizeof(float)));

  const KvCache& c = session.cache();
  const PlaneUse use = plane_use(c.store(), c.seq());
  nlohmann::json j = summary_json(SummaryFields{
      config->name, config->fingerprint_hex(), c.backend(), session.position(), r.prompt_tokens,
      r.seed, r.chunk, r.model, r.context, generated, logits_sha, use, c.allocated_bytes(),
      prefill_s, decode_s, r.prefilled, r.decoded, c.store().options().attention});
  j["timing"].update(r.extra_timing);
  const std::string& saved = r.saved;
  if (r.json) {
    // ASCII only: a model name from a pack reaches the terminal as \uXXXX.
    std::printf("%s\n", j.dump(-1, ' ', /*ensure_ascii=*/true).c_str());
    return 0;
  }
  // A config's name is already printable (load_hf_config escapes its
  // path, backslashes too): escaped again it would double them.
  std::printf("kvring run: model %s on %s, %lld tokens (%lld prompt, %zu generated), chunk %lld, "
              "attention %s\n",
              printable(config->name, false).c_str(), backend_name(c.backend()),
              static_cast<long long>(session.position()), static_cast<long long>(r.prompt_tokens),
              generated.size(), static_cast<long long>(r.chunk),
              attention_numeric_name(c.store().options().attention));
  std::printf("  prefill      %8.1f tokens/s  (%.3f s)\n",
              j["timing"]["prefill_tokens_per_s"].get<double>(), prefill_s);
  std::printf("  decode       %8.1f tokens/s  (%.3f s)\n",
              j["timing"]["decode_tokens_per_s"].get<double>(), decode_s);
  std::printf("  cache in use sliding %s, full %s; allocated %s\n",
              format_bytes(use.sliding_bytes).c_str(), format_bytes(use.full_bytes).c_str(),
              format_bytes(c.allocated_bytes()).c_str());
  print_ring("sliding", use.sliding_layer, use.sliding_ring);
  print_ring("full", use.full_layer, use.full_ring);
  std::string gen;
  for (std::size_t i = 0; i < generated.size() && i < 16; ++i) {
    gen += ' ';
    gen += std::to_string(generated[i]);
  }
  if (generated.size() > 16) gen += " ...";
  std::printf("  generated   %s\n", gen.c_str());
  std::printf("  last logits sha256 %s\n", logits_sha.c_str());
  if (!saved.empty()) std::printf("  saved        %s\n", saved.c_str());
  for (const std::string& line : r.extra_lines) std::printf("  %s\n", line.c_str());
  return 0;
}

}  // namespace kvring::cli
