// kvring: the command-line tool.
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <signal.h>
#include <cstring>
#include <cstdio>
#include <iostream>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "args.h"
#include "commands.h"
#include "core/text.h"
#include "kvring/config.h"
#include "kvring/footprint.h"
#include "kvring/store.h"
#include "pack/file_io.h"

namespace kvring::cli {

int fail(const std::string& message) {
  // Messages quote paths and names as given: what could act on a terminal
  // is shown as \xHH (backslashes kept: a message may quote escaped text).
  std::fprintf(stderr, "kvring: %s\n", printable(message, /*escape_backslash=*/false).c_str());
  return kExitUsage;
}
int fail(const Error& e) { return fail(e.to_string()); }

bool wants_help(const std::vector<std::string>& argv, const std::set<std::string>& options) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--help" || a == "-h") return true;
    // The next argument is this option's value, unless it is an option.
    if (a.starts_with("--") && a.find('=') == std::string::npos && options.count(a.substr(2)) > 0 &&
        i + 1 < argv.size() && !argv[i + 1].starts_with("--"))
      ++i;
  }
  return false;
}

namespace {

constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

// Each command's help: `kvring COMMAND --help` prints its entry, `kvring
// --help` all of them.
struct CommandHelp {
  const char* name;
  const char* text;
};
const CommandHelp kHelp[] = {
    {"footprint", R"(  footprint  [--model NAME | --config FILE] [--context N] [--slots N] [--json]
             KV-cache bytes per token, per plane class, per slot and for N
             slots; without --context, a table for 2048, 32768 and 131072
             (those the model holds, then its maximum context where that is
             less than 131072)
  footprint  [--model NAME | --config FILE] --fit MEMORY --length L
             [--block-rows B] [--slack S] [--json]
             how many sequences of L tokens fit in MEMORY (bytes, or with a
             unit: 80GiB, 141GB, 79.5GiB): each holds its sliding rings and its full
             rows rounded up to whole blocks
)"},
    {"run", R"(  run        [--model NAME | --config FILE] [--tokens N] [--prompt-tokens P]
             [--seed S] [--chunk C] [--hidden H] [--vocab V] [--context N]
             [--backend cpu|cuda|auto] [--attention f32|f16] [--json]
             [--no-progress] [--save FILE] [--store STORE]
             a session of the reference model: prefill P seeded prompt tokens
             in chunks of C, then decode greedily to N tokens; prints speed,
             cache use, ring states and the SHA-256 of the last logits;
             --context sizes the store (default, or 0: the model's
             maximum context); --attention picks the store's attention numeric (default f32;
             f16: f16-rounded queries and weights on tensor cores, recorded
             in --save's pack); --save writes the session as a kvpack (thin
             over --store; a store that cannot be written is refused before
             the session runs)
  run        ... --sequences N
             N sessions in one store, prefilled and decoded in batches:
             sequence i uses seed S+i, prefills max(1, P-3i) tokens and runs
             to max(its prompt, T-2i) tokens (T: --tokens); one summary per
             sequence (its tokens, generated ids and last logits those of a
             solo run), then the aggregate tokens per second; --save F /
             --resume F use F with .i before its extension
  run        --resume FILE [--tokens N] [--store STORE] [--save FILE]
             [--context N] [--backend cpu|cuda|auto] [--sequences N]
             [--json] [--no-progress]
             continues a saved session to N tokens, bit for bit as if it had
             never stopped (--context: the resumed store's, default the
             saved one's; what shaped the session comes from the pack)
  run        ... --handoff-to HOST:PORT|unix:PATH
             [--handoff-schedule swa-first|paced] [--handoff-rate GB/s]
             [--handoff-timeout S] [--handoff-message KiB]
             [--handoff-min-rate GB/s]
             prefills the prompt and hands the session to `handoff serve`
             instead of decoding it (no --tokens: the receiver decodes);
             a receiver whose answers, from its acceptance on, add up past
             2 x the timeout + the payload at --handoff-min-rate (default
             0.000065536 GB/s, 64 KiB/s; 0: no bound) fails the send
)"},
    {"handoff plan", R"(  handoff plan [--model NAME | --config FILE] --tokens N
             [--schedule swa-first|paced] [--rate GB/s] [--chunk C]
             [--credits MiB] [--message MiB] [--prefill-tps T]
             [--context N] [--ack-latency-us U] [--json]
             the payload of an N-token prompt by layer class and the send
             schedule relative to prefill, with the bytes in flight over time;
             --context sizes the session's store (default: the model's),
             --ack-latency-us the receiver's answer time (default 50);
             rates whose plan would take past 1e12 s are refused
)"},
    {"handoff serve", R"(  handoff serve --listen HOST:PORT|unix:PATH --tokens N
             [--model NAME | --config FILE] [--backend cpu|cuda|auto]
             [--timeout S] [--credits MiB] [--max-mib M] [--max-keep S]
             [--min-rate GB/s] [--port-file F] [--json] [--no-progress]
             receives one session (UCX on HOST:PORT, or a Unix socket at
             PATH), decodes it greedily to N tokens and prints the summary
             of `run`; port 0 picks a free port (--port-file F gets it
             while serve listens);
             with --model/--config, a session of another geometry or
             score scale is refused;
             a session whose store, or the model its run names, would
             take more than M MiB (default half the memory this
             process may use, at most 65536) is refused, and one
             whose sender keeps the link alive with no rows for S seconds
             (default 300; 0: no limit), which must outlast the sender's
             prefill under swa-first, is ended;
             a session not done S + the timeout + its rows at --min-rate
             (default 0.000065536 GB/s, 64 KiB/s; 0, or --max-keep 0: no
             bound) after it was accepted is ended; --no-progress is taken
             as run takes it (serve prints no progress)
)"},
    {"config", R"(  config     [--model NAME | --config FILE]
             the geometry, layer kinds and fingerprint of a model
)"},
    {"pack inspect", R"(  pack inspect FILE
             a kvpack's header, per-plane ring metadata and chunk table
)"},
    {"pack verify", R"(  pack verify FILE [--store STORE]
             checks the manifest digest and every chunk's SHA-256; exits 1
             naming the first bad chunk (thin packs need their --store)
)"},
    {"store gc", R"(  store gc dir:PATH [--min-age SECONDS]
             removes the temporary files that killed saves left in a
             directory store: those no writer holds a lock on and not
             modified for SECONDS (default 600); directories moved aside
             from chunk names (.quarantine-*) are counted, never removed
)"},
    {"help", R"(  help       this text; COMMAND --help prints one command's help
)"},
};

const char* kStores = R"(
stores (STORE):
  dir:PATH   a directory (created if absent)
  redis://[[USER]:PASSWORD@]HOST[:PORT][?timeout_ms=N&deadline_ms=N]
             HOST a name, an IPv4 address or [IPv6]; PORT 6379 by default;
             timeout_ms bounds each wait for the server (default 5000),
             deadline_ms each opening of it (default 600000; a command
             opens it to check it, then for each pack it saves or reads);
             the password never appears in messages
)";

const char* kTail = R"(
exit status: 0 success; 1 verification failed (pack verify found a damaged,
missing or planted chunk or manifest); 2 a usage error, or an input that
cannot be used (a missing or malformed file, an unreachable, stalled or
unwritable store, a model or cache that cannot be built)

models: muse-glimmer (default), or --config path/to/config.json (Hugging Face
style: Gemma 3, Cohere 2, gpt-oss)
)";

void print_usage(std::FILE* out) {
  std::fputs("usage: kvring COMMAND [options]\n\ncommands:\n", out);
  for (const CommandHelp& h : kHelp) std::fputs(h.text, out);
  std::fputs(kStores, out);
  std::fputs(kTail, out);
}

void print_footprint(const ModelConfig& c, const Footprint& f) {
  std::printf("model %s: %lld layers (%lld sliding, %lld full), kv_dim %lld, window %lld\n",
              c.name.c_str(), static_cast<long long>(c.n_layers),
              static_cast<long long>(f.n_sliding), static_cast<long long>(f.n_full),
              static_cast<long long>(c.kv_dim()), static_cast<long long>(c.sliding_window));
  std::printf("context %s tokens, %lld slot%s\n", with_commas(f.context).c_str(),
              static_cast<long long>(f.slots), f.slots == 1 ? "" : "s");
  std::printf("  bytes per token      %s\n", format_bytes(f.bytes_per_token).c_str());
  std::printf("  sliding planes       %s  (%lld x %s rows)\n", format_bytes(f.sliding_bytes).c_str(),
              static_cast<long long>(f.n_sliding), with_commas(f.sliding_rows).c_str());
  std::printf("  full planes          %s  (%lld x %s rows)\n", format_bytes(f.full_bytes).c_str(),
              static_cast<long long>(f.n_full), with_commas(f.full_rows).c_str());
  std::printf("  one slot             %s\n", format_bytes(f.slot_bytes).c_str());
  std::printf("  %lld slot%s%*s%s\n", static_cast<long long>(f.slots), f.slots == 1 ? " " : "s",
              static_cast<int>(15 - std::to_string(f.slots).size()), "",
              format_bytes(f.total_bytes).c_str());
}

// One object: the model, then a row per context.
void print_footprint_json(const ModelConfig& c, const std::vector<Footprint>& rows) {
  nlohmann::json contexts = nlohmann::json::array();
  for (const Footprint& f : rows)
    contexts.push_back({{"context", f.context},
                        {"sliding_rows", f.sliding_rows},
                        {"full_rows", f.full_rows},
                        {"sliding_bytes", f.sliding_bytes},
                        {"full_bytes", f.full_bytes},
                        {"slot_bytes", f.slot_bytes},
                        {"total_bytes", f.total_bytes}});
  const nlohmann::json j = {{"model", c.name},
                            {"layers", c.n_layers},
                            {"sliding_layers", rows.front().n_sliding},
                            {"full_layers", rows.front().n_full},
                            {"bytes_per_token", rows.front().bytes_per_token},
                            {"slots", rows.front().slots},
                            {"contexts", std::move(contexts)}};
  std::printf("%s\n", j.dump().c_str());
}

}  // namespace

// kvring footprint --fit MEM --length L: how many sequences fit.
int footprint_fit(const ModelConfig& config, const Args& args) {
  if (!args.has("fit") || !args.has("length"))
    return fail("footprint: --fit MEMORY and --length TOKENS go together");
  auto memory = parse_bytes(args.str("fit"));
  if (!memory) return fail(memory.error());
  auto length = args.integer("length", 1, 1, config.max_context);
  if (!length) return fail(length.error());
  auto block_rows = args.integer("block-rows", 0, 16, 65536);
  if (!block_rows) return fail(block_rows.error());
  auto slack = args.integer("slack", 0, 0, config.sliding_window);
  if (!slack) return fail(slack.error());
  auto fit = fit_sequences(config, *length, *memory, *block_rows, *slack);
  if (!fit) return fail(fit.error());
  if (args.flag("json")) {
    // nlohmann escapes the model's name, which may be a config file's path.
    const nlohmann::json j = {{"model", config.name},
                              {"length", fit->length},
                              {"memory_bytes", fit->memory_bytes},
                              {"block_rows", fit->block_rows},
                              {"sliding_bytes", fit->sliding_bytes},
                              {"full_bytes", fit->full_bytes},
                              {"sequence_bytes", fit->sequence_bytes},
                              {"sequences", fit->sequences},
                              {"pool_blocks", fit->pool_blocks},
                              {"capped", fit->capped}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("model %s: %s sequences of %s tokens fit in %s\n", config.name.c_str(),
              with_commas(fit->sequences).c_str(), with_commas(fit->length).c_str(),
              format_bytes(fit->memory_bytes).c_str());
  if (fit->capped)
    std::printf("  (the memory holds more; a store holds at most %s sequences, %s pool blocks and 2^62 bytes)\n",
                with_commas(kMaxFootprintSlots).c_str(), with_commas(kMaxPoolBlocks).c_str());
  std::printf("  one sequence         %s\n", format_bytes(fit->sequence_bytes).c_str());
  std::printf("  sliding rings        %s\n", format_bytes(fit->sliding_bytes).c_str());
  std::printf("  full blocks          %s  (blocks of %lld rows)\n",
              format_bytes(fit->full_bytes).c_str(), static_cast<long long>(fit->block_rows));
  if (fit->sequences > 0)
    std::printf("  the store            max_sequences %s, pool_blocks %s (StoreOptions)\n",
                with_commas(fit->sequences).c_str(), with_commas(fit->pool_blocks).c_str());
  else
    std::printf("  no store: not one sequence fits\n");
  return 0;
}

int print_help(const std::string& command) {
  // "pack" prints "pack inspect" and "pack verify".
  auto names = [&](const CommandHelp& h) {
    const std::string name = h.name;
    return name == command || name.rfind(command + " ", 0) == 0;
  };
  // An unknown command is an argument error: nothing on stdout.
  if (std::none_of(std::begin(kHelp), std::end(kHelp), names)) return fail("no help for '" + command + "'");
  std::printf("usage: kvring %s [options]\n\n", command.c_str());
  for (const CommandHelp& h : kHelp)
    if (names(h)) std::fputs(h.text, stdout);
  // The stores' forms, for the commands that take a store.
  if (command == "run" || command == "pack" || command == "pack verify" || command == "store" ||
      command == "store gc")
    std::fputs(kStores, stdout);
  std::fputs(kTail, stdout);
  return 0;
}

int cmd_footprint(const std::vector<std::string>& argv) {
  static const std::set<std::string> kOptions = {"model", "config", "context", "slots",
                                                 "fit", "length", "block-rows", "slack"};
  if (wants_help(argv, kOptions)) return print_help("footprint");
  auto args = Args::parse(argv, {"json"}, kOptions);
  if (!args) return fail(args.error());
  if (!args->positional().empty()) return fail("footprint: unexpected argument '" + args->positional()[0] + "'");
  auto config = resolve_config(args->str("model"), args->str("config"));
  if (!config) return fail(config.error());
  // Each form takes its own options; one given to the other is refused,
  // not ignored.
  const bool fit = args->has("fit") || args->has("length");
  static constexpr const char* kTableOnly[] = {"context", "slots"};
  static constexpr const char* kFitOnly[] = {"block-rows", "slack"};
  for (const char* name : fit ? kTableOnly : kFitOnly)
    if (args->has(name))
      return fail(std::string("footprint: --") + name + (fit ? " does not go with --fit" : " goes with --fit"));
  if (fit) return footprint_fit(*config, *args);
  auto slots = args->integer("slots", 1, 1, kMaxFootprintSlots);
  if (!slots) return fail(slots.error());
  std::vector<std::int64_t> contexts;
  if (args->has("context")) {
    auto ctx = args->integer("context", 0, 1, config->max_context);
    if (!ctx) return fail(ctx.error().message + " (model '" + config->name + "' holds at most " +
                          std::to_string(config->max_context) + " positions)");
    contexts.push_back(*ctx);
  } else {
    for (std::int64_t c : {2048, 32768, 131072})
      if (c <= config->max_context) contexts.push_back(c);
    if (contexts.empty() || contexts.back() != config->max_context)
      if (config->max_context < 131072) contexts.push_back(config->max_context);
  }
  // Every row is computed before anything is printed: an error prints
  // nothing on stdout.
  std::vector<Footprint> rows;
  for (std::int64_t ctx : contexts) {
    auto f = compute_footprint(*config, ctx, *slots);
    if (!f) return fail(f.error());
    rows.push_back(*f);
  }
  if (args->flag("json")) {
    print_footprint_json(*config, rows);
    return 0;
  }
  if (rows.size() == 1) {
    print_footprint(*config, rows[0]);
    return 0;
  }
  std::printf("model %s: %lld layers, %s B per token; %lld slot%s\n", config->name.c_str(),
              static_cast<long long>(config->n_layers),
              with_commas(config->n_layers * config->kv_dim() * 4).c_str(),
              static_cast<long long>(*slots), *slots == 1 ? "" : "s");
  std::printf("%10s %18s %18s %18s %18s\n", "context", "sliding B", "full B", "slot B", "all slots B");
  for (const Footprint& f : rows)
    std::printf("%10s %18s %18s %18s %18s\n", with_commas(f.context).c_str(),
                with_commas(f.sliding_bytes).c_str(), with_commas(f.full_bytes).c_str(),
                with_commas(f.slot_bytes).c_str(), with_commas(f.total_bytes).c_str());
  for (const Footprint& f : rows)
    std::printf("%10s: slot %s; all slots %s\n", with_commas(f.context).c_str(),
                format_bytes(f.slot_bytes).c_str(), format_bytes(f.total_bytes).c_str());
  return 0;
}

int cmd_config(const std::vector<std::string>& argv) {
  static const std::set<std::string> kOptions = {"model", "config"};
  if (wants_help(argv, kOptions)) return print_help("config");
  auto args = Args::parse(argv, {}, kOptions);
  if (!args) return fail(args.error());
  if (!args->positional().empty()) return fail("config: unexpected argument '" + args->positional()[0] + "'");
  auto c = resolve_config(args->str("model"), args->str("config"));
  if (!c) return fail(c.error());
  std::printf("model        %s\n", c->name.c_str());
  std::printf("layers       %lld (%lld sliding, %lld full)\n",
              static_cast<long long>(c->n_layers),
              static_cast<long long>(c->count(LayerKind::kSlidingRope)),
              static_cast<long long>(c->count(LayerKind::kFullNope)));
  std::printf("heads        %lld query, %lld kv x %lld (kv_dim %lld)\n",
              static_cast<long long>(c->n_heads), static_cast<long long>(c->n_kv_heads),
              static_cast<long long>(c->head_dim), static_cast<long long>(c->kv_dim()));
  std::printf("scores       q . k / sqrt(%g)\n", c->score_scale_dim());
  if (c->attention_sinks) std::printf("sinks        a learned logit per head and layer (set_attention_sinks)\n");
  std::printf("window       %lld\nmax context  %lld\n", static_cast<long long>(c->sliding_window),
              static_cast<long long>(c->max_context));
  std::string kinds;
  for (LayerKind k : c->layer_kinds) kinds += k == LayerKind::kFullNope ? 'F' : 's';
  std::printf("kinds        %s\nfingerprint  %s\n", kinds.c_str(), c->fingerprint_hex().c_str());
  return 0;
}

}  // namespace kvring::cli

namespace {

int dispatch(int argc, char** argv) {
  using namespace kvring::cli;
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
  try {
    if (cmd == "footprint") return cmd_footprint(rest);
    if (cmd == "config") return cmd_config(rest);
    if (cmd == "run") return cmd_run(rest);
    if (cmd == "pack") return cmd_pack(rest);
    if (cmd == "handoff") return cmd_handoff(rest);
    if (cmd == "store") return cmd_store(rest);
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      // `kvring help COMMAND` is `kvring COMMAND --help`.
      if (cmd == "help" && wants_help(rest)) return print_help("help");
      if (!rest.empty()) {
        std::string topic = rest[0];
        for (std::size_t i = 1; i < rest.size(); ++i) topic += " " + rest[i];
        return print_help(topic);
      }
      print_usage(stdout);
      return 0;
    }
  } catch (const std::bad_alloc&) {
    return fail("out of host memory");
  } catch (const std::exception& e) {
    return fail(std::string("internal error: ") + e.what());
  }
  print_usage(stderr);
  return fail("unknown command '" + cmd + "'");
}

}  // namespace

// Async-signal-safe: open, read, close, unlink, signal and raise only.
extern "C" void end_on_signal(int sig) {
  kvring::pack_internal::remove_live_temporaries();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

int main(int argc, char** argv) {
  // A peer that hangs up (a chunk store's server, a handoff's, a reader of
  // stdout that exits) makes a write fail with EPIPE, not end the process
  // with SIGPIPE and no message: each write reports its failure, and
  // output that could not be written fails the command below.
  std::signal(SIGPIPE, SIG_IGN);
  // Likewise a write past the file size limit (ulimit -f) fails with EFBIG
  // and a message, and the writer removes its temporary, instead of the
  // process ending with SIGXFSZ part-way through a file.
  std::signal(SIGXFSZ, SIG_IGN);
  // An interrupt or a termination first removes the temporaries of the
  // files being written (an interrupted --save leaves no partial file
  // behind) and a listening serve's --port-file, then ends the tool as the
  // signal would; a signal the tool was started ignoring stays ignored.
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction now {};
    if (::sigaction(sig, nullptr, &now) == 0 && now.sa_handler == SIG_IGN) continue;
    struct sigaction on {};
    on.sa_handler = end_on_signal;
    sigemptyset(&on.sa_mask);
    ::sigaction(sig, &on, nullptr);
  }
  const int rc = dispatch(argc, argv);
  // errno from the first flush that fails (cout's flushes stdout too).
  errno = 0;
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    std::fprintf(stderr, "kvring: writing the output failed%s%s\n", errno != 0 ? ": " : "",
                 errno != 0 ? std::strerror(errno) : "");
    return rc != 0 ? rc : 2;
  }
  return rc;
}
