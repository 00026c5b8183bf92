// kvring handoff plan | serve, and the sending side of `kvring run --handoff-to`.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "args.h"
#include "commands.h"
#include "core/file_read.h"
#include "core/json_tree.h"
#include "handoff_cli.h"
#include "kvring/backend.h"
#include "kvring/footprint.h"
#include "kvring/handoff.h"
#include "pack/file_io.h"
#include "run_pack.h"
#include "run_report.h"

namespace kvring::cli {

namespace {

using handoff::Clock;
constexpr std::int64_t kMiB = std::int64_t{1} << 20;
constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();
// The metadata key that carries the prompt's last token, which the receiver
// feeds itself.
constexpr const char* kNextTokenKey = "handoff_next_token";

std::string pct(std::int64_t part, std::int64_t whole) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f%%", whole ? 100.0 * part / whole : 0.0);
  return b;
}

const std::set<std::string> kPlanOptions = {"model", "config", "tokens", "schedule", "rate", "chunk",
                                            "credits", "message", "prefill-tps", "context", "ack-latency-us"};

int cmd_plan(const std::vector<std::string>& argv) {
  auto a = Args::parse(argv, {"json"}, kPlanOptions);
  if (!a) return fail(a.error());
  if (!a->positional().empty()) return fail("handoff plan: unexpected argument '" + a->positional()[0] + "'");
  if (!a->has("tokens")) return fail("handoff plan needs --tokens N (the prompt length)");
  auto config = resolve_config(a->str("model"), a->str("config"));
  if (!config) return fail(config.error());
  handoff::PlanOptions po;
  auto schedule = handoff::parse_schedule(a->str("schedule", "paced"));
  if (!schedule) return fail(schedule.error());
  po.schedule = *schedule;
  auto tokens = a->integer("tokens", 0, 1, kIntMax);
  if (!tokens) return fail(tokens.error());
  auto chunk = a->integer("chunk", po.chunk_tokens, 1, kIntMax);
  if (!chunk) return fail(chunk.error());
  po.chunk_tokens = *chunk;
  auto credits = a->integer("credits", po.credit_bytes / kMiB, 1, 1 << 20);
  if (!credits) return fail(credits.error());
  po.credit_bytes = *credits * kMiB;
  auto message = a->integer("message", po.message_bytes / kMiB, 1, 1024);
  if (!message) return fail(message.error());
  po.message_bytes = *message * kMiB;
  auto context = a->integer("context", 0, 0, kIntMax);
  if (!context) return fail(context.error());
  po.context = *context;
  if (a->has("rate")) {
    auto r = parse_positive_double("rate", a->str("rate"), false, kMaxRateGbS);
    if (!r) return fail(r.error());
    po.rate_bytes_per_s = *r * 1e9;
  }
  if (a->has("prefill-tps")) {
    auto r = parse_positive_double("prefill-tps", a->str("prefill-tps"), false, kMaxTokensPerS);
    if (!r) return fail(r.error());
    po.prefill_tokens_per_s = *r;
  }
  if (a->has("ack-latency-us")) {
    auto r = parse_positive_double("ack-latency-us", a->str("ack-latency-us"), true, kMaxAckLatencyUs);
    if (!r) return fail(r.error());
    po.ack_latency_s = *r * 1e-6;
  }
  auto t = handoff::plan_handoff(*config, *tokens, po);
  if (!t) return fail(t.error());
  const handoff::Payload& p = t->payload;
  // Bytes in flight after every send and acknowledgement.
  std::vector<std::pair<double, std::int64_t>> events;
  for (const auto& m : t->messages) {
    events.emplace_back(m.start_s, m.bytes);
    events.emplace_back(m.ack_s, -m.bytes);
  }
  std::sort(events.begin(), events.end());
  if (a->flag("json")) {
    nlohmann::json j;
    j["model"] = config->name;
    j["fingerprint"] = config->fingerprint_hex();
    j["prompt_tokens"] = p.prompt_tokens;
    j["rows_tokens"] = p.rows_tokens;
    j["context"] = p.context;
    j["row_bytes"] = p.row_bytes;
    j["payload_bytes"] = p.payload_bytes;
    j["full_bytes"] = p.full_bytes;
    j["sliding_bytes"] = p.sliding_bytes;
    j["schedule"] = handoff::schedule_name(po.schedule);
    j["rate_bytes_per_s"] = po.rate_bytes_per_s;
    j["credit_bytes"] = po.credit_bytes;
    j["message_bytes"] = po.message_bytes;
    j["chunk_tokens"] = po.chunk_tokens;
    j["prefill_tokens_per_s"] = po.prefill_tokens_per_s;
    j["ack_latency_s"] = po.ack_latency_s;
    j["prefill_end_s"] = t->prefill_end_s;
    j["done_s"] = t->done_s;
    j["busy_s"] = t->busy_s;
    j["max_in_flight"] = t->max_in_flight;
    j["max_idle_while_ready_s"] = t->max_idle_while_ready_s;
    j["layers"] = nlohmann::json::array();
    for (const auto& l : p.layers)
      j["layers"].push_back({{"layer", l.layer}, {"kind", layer_kind_name(l.kind)}, {"rows", l.rows}, {"bytes", l.bytes}});
    // The messages and the bytes in flight (up to kMaxPlannedMessages and
    // twice that) are written an element at a time: as one JSON tree they
    // took about seven times the text they print. The object's keys come
    // in the order dump() gives them (sorted), so the text is the same.
    j["messages"] = nullptr;
    j["in_flight"] = nullptr;
    std::fputc('{', stdout);
    bool first_key = true;
    for (const auto& [key, value] : j.items()) {
      if (!first_key) std::fputc(',', stdout);
      first_key = false;
      std::fputs(nlohmann::json(key).dump().append(":").c_str(), stdout);
      if (key == "messages") {
        std::fputc('[', stdout);
        for (std::size_t i = 0; i < t->messages.size(); ++i) {
          const auto& m = t->messages[i];
          const nlohmann::json e = {{"layer", m.layer},     {"first_row", m.first_row}, {"rows", m.rows},
                                    {"bytes", m.bytes},     {"final_s", m.final_s},     {"release_s", m.release_s},
                                    {"start_s", m.start_s}, {"end_s", m.end_s},         {"ack_s", m.ack_s}};
          std::fputs(e.dump().insert(0, i == 0 ? "" : ",").c_str(), stdout);
        }
        std::fputc(']', stdout);
      } else if (key == "in_flight") {
        std::fputc('[', stdout);
        std::int64_t f = 0;
        for (std::size_t i = 0; i < events.size(); ++i) {
          const nlohmann::json e = {events[i].first, f += events[i].second};
          std::fputs(e.dump().insert(0, i == 0 ? "" : ",").c_str(), stdout);
        }
        std::fputc(']', stdout);
      } else {
        std::fputs(value.dump().c_str(), stdout);
      }
    }
    std::fputs("}\n", stdout);
    return 0;
  }
  const std::int64_t n_full = config->count(LayerKind::kFullNope), n_sliding = config->count(LayerKind::kSlidingRope);
  std::printf("kvring handoff plan: model %s, a %s-token prompt (rows of %s tokens travel), schedule %s\n",
              config->name.c_str(), with_commas(p.prompt_tokens).c_str(), with_commas(p.rows_tokens).c_str(),
              handoff::schedule_name(po.schedule));
  std::printf("  payload        %s B\n", with_commas(p.payload_bytes).c_str());
  std::printf("  full           %s B (%s): %lld layers x %s rows x %s B\n", with_commas(p.full_bytes).c_str(),
              pct(p.full_bytes, p.payload_bytes).c_str(), static_cast<long long>(n_full),
              with_commas(p.rows_tokens).c_str(), with_commas(p.row_bytes).c_str());
  std::int64_t sliding_rows = 0;
  for (const auto& l : p.layers)
    if (l.kind == LayerKind::kSlidingRope) sliding_rows = l.rows;
  std::printf("  sliding        %s B (%s): %lld rings x %s rows x %s B\n", with_commas(p.sliding_bytes).c_str(),
              pct(p.sliding_bytes, p.payload_bytes).c_str(), static_cast<long long>(n_sliding),
              with_commas(sliding_rows).c_str(), with_commas(p.row_bytes).c_str());
  std::printf("  messages       %zu of at most %s B; credits %s B; rate %.3g GB/s\n", t->messages.size(),
              with_commas(po.message_bytes).c_str(), with_commas(po.credit_bytes).c_str(), po.rate_bytes_per_s / 1e9);
  std::printf("  prefill        %.3f s modelled (%g tokens/s, chunks of %lld, %lld steps of chunk x layer)\n",
              t->prefill_end_s, po.prefill_tokens_per_s, static_cast<long long>(po.chunk_tokens),
              static_cast<long long>(t->n_steps));
  std::printf("  link           busy %.3f s; last credit back at %.3f s (%.3f s after prefill)\n", t->busy_s,
              t->done_s, t->done_s - t->prefill_end_s);
  std::printf("  in flight      peak %s B of %s B credits; longest idle while data was ready %.1f us\n",
              with_commas(t->max_in_flight).c_str(), with_commas(po.credit_bytes).c_str(),
              t->max_idle_while_ready_s * 1e6);
  // Sixteen slices of time: released and sent bytes, and the peak in flight.
  const int slices = 16;
  const double span = std::max(t->done_s, 1e-9);
  std::printf("  %10s %10s %16s %16s %16s\n", "from s", "to s", "released B", "sent B", "peak in flight B");
  std::size_t e = 0;
  std::int64_t flight = 0;
  for (int s = 0; s < slices; ++s) {
    const double lo = span * s / slices, hi = span * (s + 1) / slices;
    std::int64_t released = 0, sent = 0, peak = flight;
    for (const auto& m : t->messages) {
      if (m.release_s >= lo && (m.release_s < hi || (s == slices - 1 && m.release_s <= hi))) released += m.bytes;
      // Bytes on the wire in this slice, pro rata.
      const double a0 = std::max(lo, m.start_s), a1 = std::min(hi, m.end_s);
      if (a1 > a0 && m.end_s > m.start_s) sent += static_cast<std::int64_t>(m.bytes * (a1 - a0) / (m.end_s - m.start_s));
      else if (m.end_s == m.start_s && m.start_s >= lo && m.start_s < hi) sent += m.bytes;
    }
    for (; e < events.size() && (events[e].first < hi || s == slices - 1); ++e) {
      flight += events[e].second;
      peak = std::max(peak, flight);
    }
    std::printf("  %10.4f %10.4f %16s %16s %16s\n", lo, hi, with_commas(released).c_str(), with_commas(sent).c_str(),
                with_commas(peak).c_str());
  }
  return 0;
}

// What serve needs of a session before it takes any row, from its header
// alone: a run record it can decode with, the prompt's last token, and
// --tokens within the prompt and, where its sequence stops there, the
// session's context.
struct ServedSession {
  RunRecord record;
  std::int32_t next_token = 0;
};
Result<ServedSession> check_served(const Snapshot& header, std::int64_t tokens, std::int64_t max_bytes) {
  auto record = decode_run_record(header.metadata, "the handed-off session");
  if (!record) return record.error();
  JsonTree tree;  // decode_run_record parsed the same text
  tree.parse(header.metadata);
  const nlohmann::json& meta = tree.root();
  if (!meta.is_object() || !meta.contains(kNextTokenKey) || !meta[kNextTokenKey].is_number_integer())
    return invalid_argument("the handed-off session does not name the prompt's last token");
  const auto next = meta[kNextTokenKey].get<std::int64_t>();
  if (next < 0 || next >= record->options.vocab)
    return invalid_argument("the handed-off session's last prompt token " + std::to_string(next) +
                            " is outside its vocabulary [0, " + std::to_string(record->options.vocab) + ")");
  if (record->prompt_tokens != header.token_count + 1)
    return invalid_argument("the handed-off session holds " + std::to_string(header.token_count) +
                            " positions of a " + std::to_string(record->prompt_tokens) + "-token prompt");
  if (tokens < record->prompt_tokens)
    return invalid_argument("--tokens = " + std::to_string(tokens) + " is below the prompt's " +
                            std::to_string(record->prompt_tokens) + " tokens");
  if (const std::int64_t limit = header.config.sequence_position_limit(header.context); tokens > limit)
    return invalid_argument("--tokens = " + std::to_string(tokens) + " exceeds " +
                            cache_context_text(limit, header.context) + " of the session");
  // The session is decoded with its token ids (Session::resume takes one a
  // position), as a saved run is (resume_run): checked here, not after
  // every row arrived and the sender heard DONE.
  if (static_cast<std::int64_t>(header.token_ids.size()) != header.token_count)
    return invalid_argument("the handed-off session holds " + std::to_string(header.token_count) + " positions and " +
                            std::to_string(header.token_ids.size()) + " token ids");
  for (std::size_t i = 0; i < header.token_ids.size(); ++i)
    if (header.token_ids[i] < 0 || header.token_ids[i] >= record->options.vocab)
      return invalid_argument("the handed-off session's token id " + std::to_string(header.token_ids[i]) +
                              " at position " + std::to_string(i) + " is outside its vocabulary [0, " +
                              std::to_string(record->options.vocab) + ")");
  // The model serve builds to decode is the sender's choice (hidden, vocab,
  // mlp): refused at the header where it could not be built, and bounded by
  // the receiver's --max-mib like the store, before any row is taken.
  if (Status s = check_run_model(header.config, record->options); !s.ok())
    return make_error(s.error().code, "the handed-off run's reference model cannot be built here: " + s.error().message);
  if (const double weights = ReferenceModel::weight_bytes(header.config, record->options);
      weights > static_cast<double>(max_bytes))
    return make_error(ErrorCode::kCapacityExceeded,
                      "the handed-off run's reference model (hidden " + std::to_string(record->options.hidden) +
                          ", vocab " + std::to_string(record->options.vocab) + ") takes " +
                          std::to_string(static_cast<std::int64_t>(weights)) + " B, above this receiver's limit of " +
                          std::to_string(max_bytes) + " B (--max-mib)");
  return ServedSession{std::move(*record), static_cast<std::int32_t>(next)};
}

// A target that refuses at begin() a session serve could not decode, so the
// sender hears why before a row moves, and passes the rest through.
class ServeTarget final : public handoff::HandoffTarget {
 public:
  // `expect`: serve's --model/--config, if given.
  ServeTarget(handoff::DetachedCacheTarget& inner, std::int64_t tokens, std::optional<ModelConfig> expect,
              std::int64_t max_bytes)
      : inner_(inner), tokens_(tokens), expect_(std::move(expect)), max_bytes_(max_bytes) {}
  Status begin(const Snapshot& header) override {
    auto served = check_served(header, tokens_, max_bytes_);
    if (!served) return served.error();
    // The cache attends with the run's score scale, which the geometry in
    // the header does not carry; the usual scale is named as head_dim (the
    // same bits). A receiver told its model refuses a run of another scale
    // whose geometry matches (another geometry is refused as such below).
    Snapshot scaled = header;
    const double run_scale = served->record.query_pre_attn_scalar;
    scaled.config.query_pre_attn_scalar = run_scale > 0 ? run_scale : static_cast<double>(header.config.head_dim);
    scaled.config.attention_sinks = served->record.attention_sinks;
    if (expect_ && expect_->fingerprint() == header.config.fingerprint() &&
        expect_->score_scale_dim() != scaled.config.query_pre_attn_scalar) {
      char why[160];
      std::snprintf(why, sizeof why, "the handed-off run scores q . k / sqrt(%.17g), this receiver's model q . k / sqrt(%.17g)",
                    scaled.config.query_pre_attn_scalar, expect_->score_scale_dim());
      return invalid_argument(why);
    }
    if (expect_ && expect_->fingerprint() == header.config.fingerprint() &&
        expect_->attention_sinks != scaled.config.attention_sinks)
      return invalid_argument(std::string("the handed-off run attends ") +
                              (scaled.config.attention_sinks ? "with" : "without") +
                              " attention sinks, this receiver's model " +
                              (expect_->attention_sinks ? "with" : "without"));
    KVRING_RETURN_IF_ERROR(inner_.begin(scaled));
    served_ = std::move(*served);
    return Status::Ok();
  }
  Status put_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows, const std::uint8_t* k,
                  const std::uint8_t* v) override {
    return inner_.put_rows(layer, first_row, rows, k, v);
  }
  bool accepts_device() const override { return inner_.accepts_device(); }
  Status put_device_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows, const void* k,
                         const void* v, cudaStream_t stream) override {
    return inner_.put_device_rows(layer, first_row, rows, k, v, stream);
  }
  Status commit() override { return inner_.commit(); }
  void abort() override { inner_.abort(); }
  // After begin() took the session.
  const ServedSession& served() const { return *served_; }

 private:
  handoff::DetachedCacheTarget& inner_;
  std::int64_t tokens_;
  std::optional<ModelConfig> expect_;
  std::int64_t max_bytes_;
  std::optional<ServedSession> served_;
};

// The receiver: one session, decoded greedily to --tokens.
const std::set<std::string> kServeOptions = {"listen", "tokens", "backend", "model", "config", "timeout",
                                             "credits", "max-mib", "max-keep", "min-rate", "port-file"};

int cmd_serve(const std::vector<std::string>& argv) {
  auto a = Args::parse(argv, {"json", "no-progress"}, kServeOptions);
  if (!a) return fail(a.error());
  if (!a->positional().empty()) return fail("handoff serve: unexpected argument '" + a->positional()[0] + "'");
  if (!a->has("listen"))
    return fail("handoff serve needs --listen HOST:PORT (port 0: any free port) or --listen unix:PATH");
  if (!a->has("tokens")) return fail("handoff serve needs --tokens N (the length to decode to)");
  auto tokens = a->integer("tokens", 0, 1, kIntMax);
  if (!tokens) return fail(tokens.error());
  auto backend = parse_backend(a->str("backend", "auto"));
  if (!backend) return fail(backend.error());
  // Refused before listening: a sender would prefill for nothing.
  if (*backend == BackendKind::kCuda && !cuda_device_available())
    return fail(cuda_compiled() ? "--backend cuda: the CUDA backend needs a GPU; none is visible"
                                : "--backend cuda: this build has no CUDA backend (nvcc was not found)");
  double timeout_s = 30;
  if (a->has("timeout")) {
    auto t = parse_positive_double("timeout", a->str("timeout"), false);
    if (!t) return fail(t.error());
    timeout_s = *t;
  }
  auto credits = a->integer("credits", 64, 1, 1 << 20);
  if (!credits) return fail(credits.error());
  handoff::ReceiveOptions ro;
  if (a->has("max-keep")) {
    auto k = parse_positive_double("max-keep", a->str("max-keep"), true);
    if (!k) return fail(k.error());
    ro.max_keep_s = *k;
  }
  if (a->has("min-rate")) {
    auto r = parse_positive_double("min-rate", a->str("min-rate"), true, kMaxRateGbS);
    if (!r) return fail(r.error());
    ro.min_bytes_per_s = *r * 1e9;
  }
  handoff::DetachedCacheTarget::Options to;
  to.backend = *backend;
  auto max_mib =
      a->integer("max-mib", serve_default_max_mib(file_internal::memory_limit_bytes()), 1, std::int64_t{1} << 30);
  if (!max_mib) return fail(max_mib.error());
  to.max_row_bytes = *max_mib * kMiB;
  if (a->has("model") || a->has("config")) {
    auto c = resolve_config(a->str("model"), a->str("config"));
    if (!c) return fail(c.error());
    to.expect = *c;
  }
  // unix:PATH: a Unix socket; otherwise HOST:PORT over UCX.
  const std::string listen = a->str("listen");
  const bool unix_socket = listen.rfind("unix:", 0) == 0;
  if (unix_socket && a->has("port-file")) return fail("--port-file goes with --listen HOST:PORT, not unix:PATH");
  std::unique_ptr<handoff::UnixListener> unix_listener;
  std::unique_ptr<handoff::UcxListener> ucx_listener;
  std::string where;
  if (unix_socket) {
    auto l = handoff::unix_listen(listen.substr(5));
    if (!l) return fail(l.error());
    unix_listener = std::move(*l);
    where = listen;
  } else {
    auto l = handoff::ucx_listen(listen);
    if (!l) return fail(l.error());
    ucx_listener = std::move(*l);
    where = handoff::parse_host_port(listen)->first + ":" + std::to_string(ucx_listener->port());
  }
  std::string port_text;  // what --port-file holds while serve listens
  int port_file_slot = -1;
  const struct Unlist {
    int& slot;
    ~Unlist() { pack_internal::untrack_temporary(slot); }
  } unlist{port_file_slot};
  if (a->has("port-file")) {
    // Written whole under a fresh temporary name, then renamed over a
    // regular file or nothing (never a device, a FIFO or a directory, and
    // never through a link): a reader never sees half a number, and a
    // failure leaves no temporary behind.
    // Listed before it is renamed into place, so that a signal ending
    // serve removes it too (while it still holds the port).
    const std::string path = a->str("port-file");
    port_text = std::to_string(ucx_listener->port()) + "\n";
    auto f = pack_internal::AtomicFile::create(path, {});
    Status st = f.ok() ? (*f)->write_at(0, {reinterpret_cast<const std::uint8_t*>(port_text.data()),
                                            port_text.size()})
                       : f.error();
    if (st.ok()) port_file_slot = pack_internal::track_file_holding(path, port_text);
    if (st.ok()) st = (*f)->commit(false);
    if (!st.ok()) return fail("cannot write --port-file " + path + ": " + st.error().message);
  }
  if (!a->flag("json")) std::fprintf(stderr, "kvring handoff serve: listening on %s\n", where.c_str());
  auto link = unix_listener ? unix_listener->accept(handoff::deadline_in(timeout_s))
                            : ucx_listener->accept(handoff::deadline_in(timeout_s));
  // The port file names a port only while serve listens: once a sender
  // came, or none did in time, it goes (unless another process has
  // written it since).
  if (a->has("port-file")) {
    pack_internal::untrack_temporary(std::exchange(port_file_slot, -1));
    pack_internal::remove_file_holding(a->str("port-file"), port_text);
  }
  if (!link) return fail("handoff on " + where + " failed, nothing installed: " + link.error().to_string());
  handoff::DetachedCacheTarget target(to);
  ServeTarget serve_target(target, *tokens, to.expect, to.max_row_bytes);
  ro.timeout_s = timeout_s;
  ro.credit_bytes = *credits * kMiB;
  const auto t0 = Clock::now();
  auto received = handoff::receive_session(**link, serve_target, ro);
  (*link)->close();
  if (!received) return fail("handoff from " + (*link)->describe() + " failed, nothing installed: " + received.error().to_string());
  const Snapshot& header = target.header();
  const RunRecord* record = &serve_target.served().record;
  const std::int32_t next_token = serve_target.served().next_token;
  ModelConfig config = header.config;
  config.name = record->model;
  config.rope_theta = record->rope_theta;
  config.query_pre_attn_scalar = record->query_pre_attn_scalar;
  config.attention_sinks = record->attention_sinks;
  auto cache = target.take();
  const std::int64_t context = cache->context();
  auto model = create_run_model(config, record->options);
  if (!model) return fail(model.error());
  auto session = Session::resume(*model, std::move(cache), header.token_ids,
                                 std::vector<float>(static_cast<std::size_t>(record->options.vocab), 0.0f));
  if (!session) return fail(session.error());
  // The prompt's last token: the decode side's first step.
  if (Status s = session->feed({next_token}, 1); !s.ok()) return fail(s.error());
  const auto t1 = Clock::now();
  std::vector<std::int32_t> generated;
  while (session->position() < *tokens) {
    auto t = session->step();
    if (!t) return fail(t.error());
    generated.push_back(*t);
  }
  const auto t2 = Clock::now();
  RunReport report;
  report.config = &config;
  report.session = &*session;
  report.prompt_tokens = record->prompt_tokens;
  report.seed = record->seed;
  report.chunk = record->chunk;
  report.model = record->options;
  report.context = context;
  report.generated = std::move(generated);
  report.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  report.decode_s = std::chrono::duration<double>(t2 - t1).count();
  report.prefilled = 1;
  report.decoded = static_cast<std::int64_t>(report.generated.size());
  report.json = a->flag("json");
  report.extra_timing = {{"handoff_s", received->seconds},
                         {"handoff_bytes", received->payload_bytes},
                         {"handoff_messages", received->messages}};
  char line[200];
  std::snprintf(line, sizeof line, "handoff     %s in %lld messages from %s, %.3f s (%.2f GB/s), verified",
                format_bytes(received->payload_bytes).c_str(), static_cast<long long>(received->messages),
                (*link)->describe().c_str(), received->seconds,
                received->seconds > 0 ? received->payload_bytes / received->seconds / 1e9 : 0.0);
  report.extra_lines.push_back(line);
  return print_run_report(report);
}

}  // namespace

Result<double> parse_positive_double(const std::string& option, const std::string& value, bool allow_zero,
                                     double most) {
  // Decimal only, as the integer options: no hexadecimal, no leading
  // blanks, the same in every locale.
  double v = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v, std::chars_format::general);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size() || !std::isfinite(v) || v < 0 ||
      (!allow_zero && v == 0))
    return invalid_argument("--" + option + " must be a " + (allow_zero ? "non-negative" : "positive") +
                            " number, got '" + value + "'");
  if (v > most) {
    char bound[32];
    std::snprintf(bound, sizeof bound, "%g", most);
    return invalid_argument("--" + option + " = " + value + " is past its bound of " + bound);
  }
  return v;
}

int run_handoff_send(Session& session, const ModelConfig& config, const HandoffSendOptions& o) {
  if (session.position() != 0) return fail("--handoff-to needs a fresh session");
  auto schedule = handoff::parse_schedule(o.schedule);
  if (!schedule) return fail(schedule.error());
  handoff::PlanOptions po;
  po.schedule = *schedule;
  po.context = session.cache().context();
  po.chunk_tokens = o.chunk;
  po.message_bytes = std::max(o.message_bytes, config.kv_dim() * 4);
  po.credit_bytes = std::max(po.credit_bytes, po.message_bytes);
  if (o.rate_gb_s > 0) po.rate_bytes_per_s = o.rate_gb_s * 1e9;
  auto timeline = handoff::plan_handoff(config, o.prompt_tokens, po);
  if (!timeline) return fail(timeline.error());
  const auto prompt = seeded_tokens(o.prompt_tokens, o.model.vocab, o.seed);
  const std::int64_t rows_tokens = o.prompt_tokens - 1;

  Snapshot header;
  header.config = config;
  header.context = session.cache().context();
  header.token_count = rows_tokens;
  header.token_ids.assign(prompt.begin(), prompt.begin() + rows_tokens);
  RunRecord record{config.name, config.rope_theta, o.model, o.seed, o.prompt_tokens, o.chunk, {}};
  record.query_pre_attn_scalar = config.query_pre_attn_scalar;
  record.attention_sinks = config.attention_sinks;
  auto meta = nlohmann::json::parse(encode_run_record(record));
  meta[kNextTokenKey] = prompt.back();
  header.metadata = meta.dump();
  for (const auto& lp : timeline->payload.layers) {
    PlaneSnapshot p;
    p.kind = lp.kind;
    p.layout = layout_for(lp.kind);
    p.ring = lp.ring;
    header.planes.push_back(std::move(p));
  }
  auto link = o.to.rfind("unix:", 0) == 0 ? handoff::unix_connect(o.to.substr(5), handoff::deadline_in(o.timeout_s))
                                           : handoff::ucx_connect(o.to, handoff::deadline_in(o.timeout_s));
  if (!link) return fail(link.error());
  handoff::PrefillSource source(session.cache(), *timeline, std::move(header));
  handoff::SendOptions so;
  so.timeout_s = o.timeout_s;
  so.rate_bytes_per_s = o.rate_gb_s * 1e9;
  so.min_bytes_per_s = o.min_rate_gb_s * 1e9;
  std::optional<Result<handoff::SendReport>> sent;
  std::atomic<bool> sender_done{false};
  std::thread sender([&] {
    sent.emplace(handoff::send_session(**link, source, *timeline, so));
    sender_done = true;
  });
  // Prefill the payload's tokens; each chunk's rows are staged as they become final.
  const std::int64_t L = config.n_layers;
  const auto t0 = Clock::now();
  Status prefill;
  std::int64_t chunks = 0;
  for (std::int64_t at = 0; at < rows_tokens && !sender_done;) {
    const std::int64_t n = std::min(o.chunk, rows_tokens - at);
    std::vector<std::int32_t> part(prompt.begin() + at, prompt.begin() + at + n);
    prefill = session.feed(part, o.chunk);
    if (!prefill.ok()) break;
    at += n;
    ++chunks;
    if (at < rows_tokens) {
      prefill = source.stage_final(chunks * L);
      if (!prefill.ok()) break;
    }
  }
  const auto t1 = Clock::now();
  source.finish(prefill);
  sender.join();
  (*link)->close();
  if (!prefill.ok()) return fail(prefill.error());
  if (!sent->ok())
    return fail("handoff to " + o.to + " failed: " + sent->error().to_string() + " (the session's " +
                std::to_string(session.position()) + " prefilled tokens are not kept)");
  const handoff::SendReport& r = **sent;
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  if (o.json) {
    nlohmann::json j;
    j["model"] = config.name;
    j["fingerprint"] = config.fingerprint_hex();
    j["prompt_tokens"] = o.prompt_tokens;
    j["handoff_to"] = o.to;
    j["schedule"] = handoff::schedule_name(*schedule);
    j["payload_bytes"] = r.payload_bytes;
    j["messages"] = r.messages;
    j["timing"] = {{"prefill_s", prefill_s},
                   {"handoff_s", r.seconds},
                   {"max_in_flight", r.max_in_flight},
                   {"staged_bytes_peak", source.staged_bytes_peak()}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("kvring run: model %s, %lld prompt tokens prefilled (%lld sent as rows) and handed to %s\n",
              config.name.c_str(), static_cast<long long>(o.prompt_tokens), static_cast<long long>(rows_tokens),
              o.to.c_str());
  std::printf("  prefill      %.3f s\n", prefill_s);
  std::printf("  handoff      %s in %lld messages (%s), %.3f s from header to commit; peak in flight %s of %s credits\n",
              format_bytes(r.payload_bytes).c_str(), static_cast<long long>(r.messages),
              handoff::schedule_name(*schedule), r.seconds, format_bytes(r.max_in_flight).c_str(),
              format_bytes(r.credit_bytes).c_str());
  return 0;
}

int cmd_handoff(const std::vector<std::string>& argv) {
  const bool plan = !argv.empty() && argv[0] == "plan";
  const bool serve = !argv.empty() && argv[0] == "serve";
  if (wants_help(argv, plan ? kPlanOptions : serve ? kServeOptions : std::set<std::string>{}))
    return print_help(plan || serve ? "handoff " + argv[0] : "handoff");
  if (argv.empty()) return fail("handoff needs a subcommand: plan or serve");
  const std::vector<std::string> rest(argv.begin() + 1, argv.end());
  if (argv[0] == "plan") return cmd_plan(rest);
  if (argv[0] == "serve") return cmd_serve(rest);
  return fail("unknown handoff subcommand '" + argv[0] + "' (plan or serve)");
}

}  // namespace kvring::cli
