// Loopback handoff of a muse-glimmer session beside the transport's own
// throughput, in one run (docs/PERFORMANCE.md, "Handoff").
//
//   kvring-handoff-bench [--tokens N] [--schedule paced|swa-first] [--perftest]
//
// A CPU cache of N-1 positions with seeded rows stands for a prefilled
// N-token session (the rows' values do not change what moves). A child
// process receives over UCX on 127.0.0.1 (port 0, told through a pipe):
//   raw      the same transport, the same message sizes and count, nothing
//            hashed, acknowledged or installed: the ceiling of this link
//   handoff  send_session -> receive_session into a detached target, every
//            message hashed on both sides: into a fresh CPU store (cold: each
//            page of the store is first touched by the install), and into a
//            store that has held a session of the same length before (warm:
//            the session's sequence removed, its rings and blocks reused, as
//            in a decode server that has run a while)
// With --perftest, ucx_perftest (ucx-utils) measures UCX's own stream
// bandwidth on loopback at the same message size in the same run.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "../tools/args.h"
#include "kvring/handoff.h"
#include "kvring/sha256.h"
#include "kvring/store.h"

using namespace kvring;
using namespace kvring::handoff;

namespace {

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kvring-handoff-bench: %s\n", what.c_str());
  std::exit(2);
}

// The seeded rows of the bench's sessions, one 512-row chunk of K and V.
constexpr std::int64_t kChunk = 512;
void chunk_rows(const ModelConfig& config, std::vector<float>& k, std::vector<float>& v) {
  k.resize(static_cast<std::size_t>(kChunk * config.kv_dim()));
  v.resize(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>((i * 2654435761u) % 1000) / 997.0f - 0.5f;
    v[i] = static_cast<float>((i * 40503u) % 1000) / 991.0f - 0.5f;
  }
}

// A CPU store at `context` that has held a session of rows_tokens positions
// on every layer: the sequence is removed again, its pages stay mapped.
std::unique_ptr<KvStore> warm_store(const ModelConfig& config, std::int64_t context,
                                    std::int64_t rows_tokens) {
  auto store = make_store(BackendKind::kCpu, config, {.max_sequences = 1, .context = context});
  if (!store) die(store.error().to_string());
  auto seq = (*store)->add_sequence();
  if (!seq) die(seq.error().to_string());
  std::vector<float> k, v;
  chunk_rows(config, k, v);
  for (std::int64_t at = 0; at < rows_tokens; at += kChunk) {
    const std::int64_t n = std::min(kChunk, rows_tokens - at);
    const SeqSpan span{*seq, at, n};
    for (std::int64_t l = 0; l < config.n_layers; ++l)
      if (Status s = (*store)->store(l, std::span(&span, 1), host_view(k.data(), n, config.kv_dim()),
                                     host_view(v.data(), n, config.kv_dim()));
          !s.ok())
        die(s.to_string());
  }
  if (Status s = (*store)->remove_sequence(*seq); !s.ok()) die(s.to_string());
  return std::move(*store);
}

enum class Receiver { kRaw, kCold, kWarm };

// Child: listens on port 0, writes the port, serves one link, writes a result line.
pid_t spawn_receiver(Receiver mode, const ModelConfig& config, std::int64_t context,
                     std::int64_t rows_tokens, int* port, int* result_fd) {
  const bool raw = mode == Receiver::kRaw;
  int to_parent[2];
  if (pipe(to_parent) != 0) die("pipe");
  const pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    close(to_parent[0]);
    std::unique_ptr<KvStore> store;
    if (mode == Receiver::kWarm) store = warm_store(config, context, rows_tokens);
    auto listener = ucx_listen("127.0.0.1:0");
    if (!listener) die(listener.error().to_string());
    const int p = (*listener)->port();
    if (write(to_parent[1], &p, sizeof p) != sizeof p) _exit(3);
    auto link = (*listener)->accept(deadline_in(30));
    if (!link) die(link.error().to_string());
    // A first exchange sets the link up; the clock starts after it.
    std::vector<std::uint8_t> hello;
    if (Status s = (*link)->recv_message(hello, deadline_in(30), 16); !s.ok()) die(s.to_string());
    if (Status s = (*link)->send_message(hello.data(), hello.size(), deadline_in(30)); !s.ok()) die(s.to_string());
    char line[256];
    if (raw) {
      std::vector<std::uint8_t> m;
      std::int64_t bytes = 0;
      double t0 = 0;
      for (;;) {
        if (Status s = (*link)->recv_message(m, deadline_in(30), std::size_t{1} << 30); !s.ok()) die(s.to_string());
        if (t0 == 0) t0 = now_s();
        if (m.size() == 1) break;
        bytes += static_cast<std::int64_t>(m.size());
      }
      const std::uint8_t ok = 1;
      (void)(*link)->send_message(&ok, 1, deadline_in(10));
      std::snprintf(line, sizeof line, "%lld %.6f", static_cast<long long>(bytes), now_s() - t0);
      // Wait for the sender to close before closing.
      (void)(*link)->recv_message(m, deadline_in(2), 16);
    } else {
      DetachedCacheTarget::Options options;
      options.store = store.get();  // null: a fresh store of the session's own
      DetachedCacheTarget target(options);
      auto r = receive_session(**link, target, {.timeout_s = 30});
      if (!r) die(r.error().to_string());
      std::snprintf(line, sizeof line, "%lld %.6f", static_cast<long long>(r->payload_bytes), r->seconds);
    }
    (*link)->close();
    if (write(to_parent[1], line, std::strlen(line) + 1) < 0) _exit(3);
    _exit(0);
  }
  close(to_parent[1]);
  if (read(to_parent[0], port, sizeof *port) != sizeof *port) die("the receiver did not start");
  *result_fd = to_parent[0];
  return pid;
}

std::pair<std::int64_t, double> finish_receiver(pid_t pid, int fd) {
  char line[256] = {};
  std::size_t got = 0;
  while (got < sizeof line - 1) {
    const ssize_t n = read(fd, line + got, sizeof line - 1 - got);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("the receiver failed");
  long long bytes = 0;
  double s = 0;
  if (std::sscanf(line, "%lld %lf", &bytes, &s) != 2) die("the receiver's result is unreadable");
  return {bytes, s};
}

// The first exchange (connection set-up), outside the timed part.
double hello(Transport& link) {
  const double t0 = now_s();
  const std::uint8_t h = 7;
  std::vector<std::uint8_t> reply;
  if (Status s = link.send_message(&h, 1, deadline_in(30)); !s.ok()) die(s.to_string());
  if (Status s = link.recv_message(reply, deadline_in(30), 16); !s.ok()) die(s.to_string());
  return now_s() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr const char* kUsage = "usage: kvring-handoff-bench [--tokens N] [--schedule paced|swa-first] [--perftest]\n";
  auto args = cli::Args::parse(std::vector<std::string>(argv + 1, argv + argc), {"perftest", "help"},
                               {"tokens", "schedule"});
  if (!args) die(args.error().message + "\n" + kUsage);
  if (args->flag("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!args->positional().empty()) die("unexpected argument '" + args->positional()[0] + "'\n" + kUsage);
  const ModelConfig config = *preset_config("muse-glimmer");
  auto tokens_arg = args->integer("tokens", 32768, 1, config.max_context);
  if (!tokens_arg) die(tokens_arg.error().message);
  const std::int64_t tokens = *tokens_arg;
  auto schedule_arg = parse_schedule(args->str("schedule", "paced"));
  if (!schedule_arg) die(schedule_arg.error().to_string());
  const Schedule schedule = *schedule_arg;
  const bool perftest = args->flag("perftest");
  if (!ucx_compiled()) die("this build has no UCX");
  PlanOptions po;
  po.schedule = schedule;
  po.context = tokens;
  auto timeline = plan_handoff(config, tokens, po);
  if (!timeline) die(timeline.error().to_string());
  const Payload& payload = timeline->payload;

  // The session: N-1 positions of seeded rows, stored in chunks of 512.
  auto cache = make_cpu_cache(config, {.context = tokens});
  if (!cache) die(cache.error().to_string());
  {
    std::vector<float> k, v;
    chunk_rows(config, k, v);
    for (std::int64_t at = 0; at < payload.rows_tokens; at += kChunk) {
      const std::int64_t n = std::min(kChunk, payload.rows_tokens - at);
      for (std::int64_t l = 0; l < config.n_layers; ++l)
        if (Status s = (*cache)->store_batch(l, at, n, k.data(), v.data()); !s.ok()) die(s.to_string());
    }
  }
  std::vector<std::int32_t> ids(static_cast<std::size_t>(payload.rows_tokens), 1);
  auto source = CacheSource::create(**cache, payload, ids, "bench");
  if (!source) die(source.error().to_string());

  std::printf("kvring-handoff-bench: muse-glimmer, a %lld-token prompt, payload %lld B in %zu messages (%s)\n",
              static_cast<long long>(tokens), static_cast<long long>(payload.payload_bytes),
              timeline->messages.size(), schedule_name(schedule));

  // SHA-256 alone over the payload: one side's hashing cost.
  {
    std::vector<std::uint8_t> buf(std::size_t{4} << 20, 0x5a);
    const double t0 = now_s();
    for (std::int64_t done = 0; done < payload.payload_bytes; done += static_cast<std::int64_t>(buf.size()))
      (void)sha256(buf.data(), buf.size());
    const double s = now_s() - t0;
    std::printf("  sha256        %.3f s  %.2f GB/s (one core)\n", s, payload.payload_bytes / s / 1e9);
  }

  // Raw: the transport alone, the same messages.
  {
    int port = 0, fd = -1;
    const pid_t pid = spawn_receiver(Receiver::kRaw, config, tokens, payload.rows_tokens, &port, &fd);
    auto link = ucx_connect("127.0.0.1:" + std::to_string(port), deadline_in(10));
    if (!link) die(link.error().to_string());
    const double setup = hello(**link);
    std::vector<std::uint8_t> buf(static_cast<std::size_t>(po.message_bytes) + 61, 0x33);
    const double t0 = now_s();
    for (const PlannedMessage& m : timeline->messages) {
      if (Status s = (*link)->send_message(buf.data(), static_cast<std::size_t>(m.bytes) + 61, deadline_in(30)); !s.ok())
        die(s.to_string());
    }
    const std::uint8_t end = 0;
    if (Status s = (*link)->send_message(&end, 1, deadline_in(30)); !s.ok()) die(s.to_string());
    std::vector<std::uint8_t> reply;
    if (Status s = (*link)->recv_message(reply, deadline_in(30), 16); !s.ok()) die(s.to_string());
    const double s = now_s() - t0;
    (*link)->close();
    auto [bytes, recv_s] = finish_receiver(pid, fd);
    std::printf("  raw transport %.3f s  %.2f GB/s (%lld B; the receiver's view %.3f s; link set-up %.3f s)\n", s,
                payload.payload_bytes / s / 1e9, static_cast<long long>(bytes), recv_s, setup);
  }

  // The handoff, into a fresh store and into a warm one.
  for (const Receiver mode : {Receiver::kCold, Receiver::kWarm}) {
    int port = 0, fd = -1;
    const pid_t pid = spawn_receiver(mode, config, tokens, payload.rows_tokens, &port, &fd);
    auto link = ucx_connect("127.0.0.1:" + std::to_string(port), deadline_in(60));
    if (!link) die(link.error().to_string());
    const double setup = hello(**link);
    auto r = send_session(**link, **source, *timeline, {.timeout_s = 30});
    if (!r) die(r.error().to_string());
    (*link)->close();
    auto [bytes, recv_s] = finish_receiver(pid, fd);
    std::printf("  handoff, %s %.3f s  %.2f GB/s (header to commit confirmed; %lld B verified and installed, "
                "the receiver's view %.3f s; peak unacknowledged %lld B of %lld B credits; link set-up %.3f s)\n",
                mode == Receiver::kCold ? "cold" : "warm", r->seconds, payload.payload_bytes / r->seconds / 1e9,
                static_cast<long long>(bytes), recv_s, static_cast<long long>(r->max_in_flight),
                static_cast<long long>(r->credit_bytes), setup);
  }

  if (perftest) {
    // UCX's own tool on loopback, stream bandwidth at the message size.
    const int port = 20000 + static_cast<int>(getpid() % 20000);
    const std::string size = std::to_string(po.message_bytes);
    const std::string server = "ucx_perftest -p " + std::to_string(port) + " >/dev/null 2>&1 &";
    const std::string client = "sleep 1; ucx_perftest 127.0.0.1 -p " + std::to_string(port) +
                               " -t stream_bw -s " + size + " -n 200 2>&1 | grep -E 'Final|bandwidth'";
    std::printf("  ucx_perftest  stream_bw -s %s -n 200 (MB/s columns: average, overall):\n", size.c_str());
    std::fflush(stdout);
    if (std::system(server.c_str()) != 0 || std::system(client.c_str()) != 0)
      std::printf("  ucx_perftest did not run (package ucx-utils)\n");
  }
  return 0;
}
