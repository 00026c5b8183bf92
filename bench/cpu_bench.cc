// kvring-cpu-bench: the CPU backend through the KvStore API, against a
// streaming read of the same bytes by the same threads, measured in the
// same run (docs/PERFORMANCE.md, "CPU backend").
//
//   kvring-cpu-bench [--runs N] [--warmup N] [--only decode|batch|store]
//                    [--no-peer] [--python PATH] [--peer-script PATH]
//                    [--peer-timeout S] [--json FILE]
//
// muse-glimmer geometry (16 query heads, 2 KV heads, head_dim 128, 52
// layers of which 13 full). It measures
//   - decode attention over one full layer holding 2048, 32768 and 131072
//     rows (one sequence, one query): bytes = rows x 1 KiB (K + V, f16);
//     and at 131072 rows under the f16 attention numeric;
//   - one attend_decode call with 8 queries, 8 sequences x 32768 rows;
//   - stores: a decode step of 64 sequences x 1 token x 52 layers
//     (store_all_layers), and a 4096-token prefill chunk x 52 layers, as
//     bytes written (f16 rows kept: a 2048-row sliding ring keeps 2048 of
//     the chunk's rows) over time;
//   - the ceiling of each figure: every thread of kvring's pool reading a
//     buffer of the same size, timed alternately with the figure;
//   - decodes of 4096 and 16384 rows with their rows already in cache
//     (each timed on its second run in a row, beside a read of its bytes
//     timed the same way), and from their difference the time 131072 rows
//     take at that rate, beside the 131072-row figure;
//   - the peer: PyTorch's CPU attention on the same shapes, through
//     bench/cpu_sdpa_peer.py, when the interpreter (--python, default
//     python3) can import torch (else skipped).
// Each figure is the median of --runs timed runs after --warmup untimed
// ones; a table goes to stdout, then one JSON line.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../tools/args.h"
#include "bench_io.h"
#include "cpu/attention_cpu.h"
#include "cpu/host_pages.h"
#include "cpu/parallel.h"
#include "kvring/store.h"

#ifndef KVRING_CPU_PEER_SCRIPT
#define KVRING_CPU_PEER_SCRIPT "bench/cpu_sdpa_peer.py"
#endif

namespace kvring {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kvring-cpu-bench: %s\n", what.c_str());
  std::exit(1);
}
void check(const Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}

constexpr const char* kUsage =
    "usage: kvring-cpu-bench [--runs N] [--warmup N] [--only decode|batch|store]\n"
    "                        [--no-peer] [--python PATH] [--peer-script PATH]\n"
    "                        [--peer-timeout S] [--json FILE]\n"
    "\n"
    "The CPU backend (muse-glimmer geometry) through the KvStore API: decode\n"
    "attention over a full layer of 2048, 32768 and 131072 rows (and 131072 under\n"
    "the f16 numeric), a batch of 8\n"
    "sequences x 32768 rows in one call, a decode step's store (64 sequences x\n"
    "52 layers) and a 4096-token prefill chunk's store, each beside a streaming\n"
    "read of the same number of bytes by the same threads, timed alternately;\n"
    "decodes of 4096 and 16384 rows already in cache, and what 131072 rows take\n"
    "at their rate;\n"
    "and PyTorch's CPU attention on the same shapes where torch is installed.\n"
    "\n"
    "  --runs N         timed runs per figure, median reported (default 31)\n"
    "  --warmup N       untimed runs first (default 3)\n"
    "  --only WHAT      decode, batch or store only\n"
    "  --no-peer        skip the PyTorch peer\n"
    "  --python PATH    the interpreter that runs the peer (default python3;\n"
    "                   skipped when it cannot import torch)\n"
    "  --peer-script P  the peer script (default: the source tree's\n"
    "                   bench/cpu_sdpa_peer.py)\n"
    "  --peer-timeout S the peer's time limit in seconds (default 1800); past\n"
    "                   it the peer is stopped and skipped\n"
    "  --json FILE      also write the JSON line to FILE (whole, at the end)\n";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Uniform in [-1, 1), never zero; splitmix64.
void random_floats(std::vector<float>& out, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (float& f : out) {
    x += 0x9e3779b97f4a7c15ULL;
    std::uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    f = static_cast<float>((z >> 40) | 1) / static_cast<float>(1 << 23) - 1.0f;
  }
}

// The ceiling: all of kvring's pool threads read `bytes` of `buf` in
// 256 KiB pieces (XOR of 64-bit words, which the compiler vectorizes).
struct ReadCeiling {
  // The same kind of memory as the store's planes (cpu::HostPages), so that
  // both streams see the same pages.
  cpu::HostPages pages;
  std::span<std::uint64_t> buf;
  volatile std::uint64_t sink = 0;
  explicit ReadCeiling(std::int64_t max_bytes)
      : pages(cpu::HostPages::allocate(static_cast<std::size_t>(max_bytes))),
        buf(static_cast<std::uint64_t*>(pages.data()), pages ? static_cast<std::size_t>(max_bytes / 8) : 0) {
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = i * 0x9e3779b97f4a7c15ULL;
  }
  double run(std::int64_t bytes) {
    constexpr std::int64_t kPiece = 256 << 10;
    const std::int64_t pieces = (bytes + kPiece - 1) / kPiece;
    std::vector<std::uint64_t> part(static_cast<std::size_t>(pieces));
    const auto t0 = Clock::now();
    cpu::parallel_for(pieces, bytes, [&](std::int64_t p) {
      const std::uint64_t* w = buf.data() + p * (kPiece / 8);
      const std::int64_t n = std::min(kPiece, bytes - p * kPiece) / 8;
      std::uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (std::int64_t i = 0; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; ++u) a[u] ^= w[i + u];
      part[static_cast<std::size_t>(p)] = a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
    });
    const double t = since(t0);
    for (std::uint64_t x : part) sink = sink ^ x;
    return t;
  }
};

struct Row {
  std::string name;
  std::int64_t bytes = 0;
  double seconds = 0;       // median
  double ceiling_s = 0;     // median of the interleaved reads of `bytes`
  double peer_s = -1;       // the peer's median, where measured
  std::string peer_name;    // its key in the peer's output
};

// A figure from its timed runs and the ceiling's, each the median.
Row make_row(const std::string& name, std::int64_t bytes, const std::vector<double>& t,
             const std::vector<double>& c) {
  Row row;
  row.name = name;
  row.bytes = bytes;
  row.seconds = median(t);
  row.ceiling_s = median(c);
  std::fprintf(stderr, "  %-44s %10.1f us  (ceiling %10.1f us)\n", name.c_str(), row.seconds * 1e6,
               row.ceiling_s * 1e6);
  return row;
}

// Times `op` and the ceiling alternately: warmup untimed rounds of both,
// then runs rounds; `between` (untimed) runs after each op.
template <class Op, class Between>
Row measure(const std::string& name, std::int64_t bytes, ReadCeiling& ceiling, int warmup, int runs,
            Op&& op, Between&& between) {
  std::vector<double> t, c;
  for (int r = 0; r < warmup + runs; ++r) {
    const double tc = ceiling.run(bytes);
    const auto t0 = Clock::now();
    op();
    const double to = since(t0);
    between();
    if (r >= warmup) {
      t.push_back(to);
      c.push_back(tc);
    }
  }
  return make_row(name, bytes, t, c);
}

// Times `op` with its bytes already in cache: each round runs the ceiling's
// read of `bytes` twice and `op` twice, and times the second of each.
template <class Op>
Row measure_in_cache(const std::string& name, std::int64_t bytes, ReadCeiling& ceiling, int warmup, int runs,
                     Op&& op) {
  std::vector<double> t, c;
  for (int r = 0; r < warmup + runs; ++r) {
    ceiling.run(bytes);
    const double tc = ceiling.run(bytes);
    op();
    const auto t0 = Clock::now();
    op();
    const double to = since(t0);
    if (r >= warmup) {
      t.push_back(to);
      c.push_back(tc);
    }
  }
  return make_row(name, bytes, t, c);
}

constexpr std::int64_t kChunk = 4096;
// The two decodes timed with their rows in cache (16 MiB at most).
constexpr std::int64_t kInCacheRows[2] = {4096, 16384};

// The name of the decode figure of `n` rows.
std::string decode_name(std::int64_t n, bool f16, bool in_cache) {
  return "decode, full layer, " + std::to_string(n) + " rows" + (f16 ? " (f16 numeric)" : in_cache ? ", in cache" : "");
}

// Stores `rows` rows of random K/V into one layer of sequences `seqs`
// (positions 0..rows-1), kChunk rows per call.
void fill_layer(KvStore& store, std::int64_t layer, const std::vector<SeqId>& seqs, std::int64_t rows,
                std::uint64_t seed) {
  const std::int64_t kv_dim = store.config().kv_dim();
  std::vector<float> k(static_cast<std::size_t>(kChunk * kv_dim)), v(k.size());
  for (std::size_t s = 0; s < seqs.size(); ++s)
    for (std::int64_t p = 0; p < rows; p += kChunk) {
      const std::int64_t n = std::min(kChunk, rows - p);
      random_floats(k, seed + s * 1000003 + static_cast<std::uint64_t>(p));
      random_floats(v, seed + s * 1000003 + static_cast<std::uint64_t>(p) + 1);
      const SeqSpan span{seqs[s], p, n};
      check(store.store(layer, {&span, 1}, host_view(k.data(), n, kv_dim),
                        host_view(v.data(), n, kv_dim)),
            "store");
    }
}

std::int64_t first_full_layer(const ModelConfig& c) {
  for (std::int64_t l = 0; l < c.n_layers; ++l)
    if (c.kind(l) == LayerKind::kFullNope) return l;
  die("the geometry has no full layer");
}

std::vector<Row> bench_decode(const ModelConfig& c, ReadCeiling& ceiling, int warmup, int runs) {
  std::vector<Row> rows;
  const std::int64_t layer = first_full_layer(c);
  const std::int64_t width = c.n_heads * c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(width)), out(q.size());
  random_floats(q, 7);
  // Under the default numeric at each size, under the f16 numeric at the
  // largest, and with the rows in cache at kInCacheRows.
  auto one = [&](std::int64_t n, AttentionNumeric numeric, bool in_cache) {
    StoreOptions o;
    o.context = n;
    o.attention = numeric;
    auto store = make_store(BackendKind::kCpu, c, o);
    check(store.status(), "make_store");
    auto seq = (*store)->add_sequence();
    check(seq.status(), "add_sequence");
    fill_layer(**store, layer, {*seq}, n, 100 + static_cast<std::uint64_t>(n));
    const SeqQuery query{*seq, n - 1};
    const bool f16 = numeric == AttentionNumeric::kF16;
    const std::string name = decode_name(n, f16, in_cache);
    auto decode = [&] {
      check((*store)->attend_decode(layer, {&query, 1}, host_view(q.data(), 1, width),
                                    host_view(out.data(), 1, width)),
            "attend_decode");
    };
    const std::int64_t bytes = n * c.kv_dim() * 2 * 2;
    if (in_cache) {
      rows.push_back(measure_in_cache(name, bytes, ceiling, warmup, runs, decode));
      return;
    }
    rows.push_back(measure(name, bytes, ceiling, warmup, runs, decode, [] {}));
    if (!f16) rows.back().peer_name = "decode_" + std::to_string(n);
  };
  for (std::int64_t n : {2048, 32768, 131072}) one(n, AttentionNumeric::kF32, false);
  one(131072, AttentionNumeric::kF16, false);
  for (std::int64_t n : {kInCacheRows[0], kInCacheRows[1]}) one(n, AttentionNumeric::kF32, true);
  return rows;
}

// The in-cache decodes' cost a row: their difference over the rows between
// them, which leaves each call's fixed costs out, and what 131072 rows take
// at that rate beside the 131072-row figure's time and ceiling. Where the
// cold decode runs near that rate its memory is not what limits it
// (docs/PERFORMANCE.md, "CPU backend"). Null where a row is missing or the
// difference is not positive.
json in_cache_rate(const std::vector<Row>& rows) {
  const Row *cold = nullptr, *small = nullptr, *large = nullptr;
  for (const Row& r : rows) {
    if (r.name == decode_name(131072, false, false)) cold = &r;
    if (r.name == decode_name(kInCacheRows[0], false, true)) small = &r;
    if (r.name == decode_name(kInCacheRows[1], false, true)) large = &r;
  }
  if (cold == nullptr || small == nullptr || large == nullptr || large->seconds <= small->seconds) return nullptr;
  const double per_row = (large->seconds - small->seconds) / static_cast<double>(kInCacheRows[1] - kInCacheRows[0]);
  const double at_131072 = per_row * 131072;
  return {{"ns_per_row", per_row * 1e9},
          {"us_at_131072", at_131072 * 1e6},
          {"ratio_at_131072", cold->ceiling_s / at_131072},
          {"cold_us_at_131072", cold->seconds * 1e6},
          {"ceiling_us_at_131072", cold->ceiling_s * 1e6}};
}

std::vector<Row> bench_batch(const ModelConfig& c, ReadCeiling& ceiling, int warmup, int runs) {
  const std::int64_t layer = first_full_layer(c), n = 32768, batch = 8;
  const std::int64_t width = c.n_heads * c.head_dim;
  StoreOptions o;
  o.context = n;
  o.max_sequences = batch;
  auto store = make_store(BackendKind::kCpu, c, o);
  check(store.status(), "make_store");
  std::vector<SeqId> seqs;
  std::vector<SeqQuery> queries;
  for (std::int64_t b = 0; b < batch; ++b) {
    auto s = (*store)->add_sequence();
    check(s.status(), "add_sequence");
    seqs.push_back(*s);
    queries.push_back({*s, n - 1});
  }
  fill_layer(**store, layer, seqs, n, 900);
  std::vector<float> q(static_cast<std::size_t>(batch * width)), out(q.size());
  random_floats(q, 8);
  Row r = measure(
      "decode, 8 sequences x 32768 rows, one call", batch * n * c.kv_dim() * 2 * 2, ceiling, warmup,
      runs,
      [&] {
        check((*store)->attend_decode(layer, queries, host_view(q.data(), batch, width),
                                      host_view(out.data(), batch, width)),
              "attend_decode");
      },
      [] {});
  r.peer_name = "batch_8x32768";
  return {r};
}

// Rows a chunk of `count` tokens leaves in a layer (a sliding ring keeps at
// most its capacity).
std::int64_t rows_kept(const KvStore& s, std::int64_t layer, std::int64_t count) {
  return s.layout(layer) == Layout::kTokenMajor ? std::min(count, s.capacity(layer)) : count;
}

std::vector<Row> bench_store(const ModelConfig& c, ReadCeiling& ceiling, int warmup, int runs) {
  std::vector<Row> rows;
  const std::int64_t kv_dim = c.kv_dim(), L = c.n_layers;
  {
    // A decode step: 64 sequences at position 1024, one token each into
    // every layer; rolled back (untimed) so every run writes the same rows.
    const std::int64_t seqs_n = 64, start = 1024;
    StoreOptions o;
    o.context = 4096;
    o.max_sequences = seqs_n;
    o.slack = 16;
    auto store = make_store(BackendKind::kCpu, c, o);
    check(store.status(), "make_store");
    std::vector<SeqSpan> prefix, step;
    for (std::int64_t s = 0; s < seqs_n; ++s) {
      auto id = (*store)->add_sequence();
      check(id.status(), "add_sequence");
      prefix.push_back({*id, 0, start});
      step.push_back({*id, start, 1});
    }
    {
      std::vector<float> k(static_cast<std::size_t>(L * start * kv_dim)), v(k.size());
      random_floats(k, 31);
      random_floats(v, 32);
      for (const SeqSpan& s : prefix)
        check((*store)->store_all_layers({&s, 1}, host_view(k.data(), L * start, kv_dim),
                                         host_view(v.data(), L * start, kv_dim)),
              "store_all_layers");
    }
    std::vector<float> k(static_cast<std::size_t>(L * seqs_n * kv_dim)), v(k.size());
    random_floats(k, 33);
    random_floats(v, 34);
    rows.push_back(measure(
        "store, decode step, 64 sequences x 52 layers", L * seqs_n * kv_dim * 2 * 2, ceiling,
        warmup, runs,
        [&] {
          check((*store)->store_all_layers(step, host_view(k.data(), L * seqs_n, kv_dim),
                                           host_view(v.data(), L * seqs_n, kv_dim)),
                "store_all_layers");
        },
        [&] {
          for (const SeqSpan& s : step) check((*store)->truncate_sequence(s.seq, 1), "truncate");
        }));
  }
  {
    // A 4096-token prefill chunk of one sequence into every layer; the
    // sequence is reset (untimed) between runs.
    StoreOptions o;
    o.context = kChunk;
    auto store = make_store(BackendKind::kCpu, c, o);
    check(store.status(), "make_store");
    auto id = (*store)->add_sequence();
    check(id.status(), "add_sequence");
    std::vector<float> k(static_cast<std::size_t>(L * kChunk * kv_dim)), v(k.size());
    random_floats(k, 41);
    random_floats(v, 42);
    std::int64_t kept = 0;
    for (std::int64_t l = 0; l < L; ++l) kept += rows_kept(**store, l, kChunk);
    const SeqSpan span{*id, 0, kChunk};
    rows.push_back(measure(
        "store, prefill chunk, 4096 tokens x 52 layers", kept * kv_dim * 2 * 2, ceiling, warmup,
        runs,
        [&] {
          check((*store)->store_all_layers({&span, 1}, host_view(k.data(), L * kChunk, kv_dim),
                                           host_view(v.data(), L * kChunk, kv_dim)),
                "store_all_layers");
        },
        [&] { check((*store)->reset_sequence(*id), "reset_sequence"); }));
  }
  return rows;
}

// The peer's JSON line ({"rows": {name: median seconds}, ...}), or null.
// It runs without a shell, under a deadline (bench_io.h).
json run_peer(const std::string& python, const std::string& script, int runs, unsigned threads,
              const std::string& only, double timeout_s) {
  const bench::ChildResult torch = bench::run_child({python, "-c", "import torch"}, 120, false);
  if (!torch.ok()) {
    std::fprintf(stderr, "peer: %s cannot import torch (%s); skipped\n", python.c_str(), torch.describe().c_str());
    return nullptr;
  }
  std::vector<std::string> argv = {python, script, "--runs", std::to_string(runs), "--threads", std::to_string(threads)};
  if (!only.empty()) argv.insert(argv.end(), {"--only", only});
  std::string shown;
  for (const std::string& a : argv) shown += (shown.empty() ? "" : " ") + a;
  std::fprintf(stderr, "peer: %s\n", shown.c_str());
  const bench::ChildResult r = bench::run_child(argv, timeout_s, true);
  if (!r.ok() || r.last_json.empty()) {
    std::fprintf(stderr, "peer: %s %s%s; skipped\n", script.c_str(), r.describe().c_str(),
                 r.ok() ? " with no JSON line" : "");
    return nullptr;
  }
  json j = json::parse(r.last_json, nullptr, false);
  if (!j.is_object() || !j.contains("rows") || !j["rows"].is_object()) {
    std::fprintf(stderr, "peer: %s printed no {\"rows\": {...}} object; skipped\n", script.c_str());
    return nullptr;
  }
  return j;
}

const char* isa_name(cpu::AttentionIsa isa) {
  switch (isa) {
    case cpu::AttentionIsa::kAvx512: return "avx512";
    case cpu::AttentionIsa::kAvx2: return "avx2";
    case cpu::AttentionIsa::kScalar: break;
  }
  return "scalar";
}

std::string cpu_model() {
  FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, "model name", 10) == 0) {
      const char* colon = std::strchr(line, ':');
      if (colon != nullptr) model = std::string(colon + 2, std::strcspn(colon + 2, "\n"));
      break;
    }
  std::fclose(f);
  return model;
}

int run(const std::vector<std::string>& argv) {
  auto args = cli::Args::parse(argv, {"help", "no-peer"},
                               {"runs", "warmup", "only", "python", "peer-script", "peer-timeout", "json"});
  if (!args) die(args.error().message + "\n" + kUsage);
  if (args->flag("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!args->positional().empty()) die("unexpected argument '" + args->positional()[0] + "'\n" + kUsage);
  auto runs = args->integer("runs", 31, 1, 100000);
  auto warmup = args->integer("warmup", 3, 0, 100000);
  if (!runs) die(runs.error().message);
  if (!warmup) die(warmup.error().message);
  const std::string only = args->str("only");
  if (!only.empty() && only != "decode" && only != "batch" && only != "store")
    die("--only must be decode, batch or store");
  auto peer_timeout = args->integer("peer-timeout", 1800, 1, 86400);
  if (!peer_timeout) die(peer_timeout.error().message);
  // A JSON path that cannot be written, and a peer script that is not
  // there, fail before anything is measured; the file itself is written
  // whole at the end, so a failed run leaves what was there.
  if (args->has("json"))
    if (const std::string why = bench::output_problem(args->str("json")); !why.empty()) die("--json: " + why);
  const bool with_peer = !args->flag("no-peer") && only != "store";
  const std::string peer_script = args->str("peer-script", KVRING_CPU_PEER_SCRIPT);
  if (with_peer && ::access(peer_script.c_str(), R_OK) != 0)
    die("--peer-script: cannot read " + peer_script + ": " + std::strerror(errno) + " (--no-peer skips the peer)");
  auto config = preset_config("muse-glimmer");
  check(config.status(), "preset_config");

  const unsigned threads = cpu::worker_count();
  std::fprintf(stderr, "kvring-cpu-bench: %s, %u threads, %s path, median of %d runs\n",
               cpu_model().c_str(), threads,
               isa_name(cpu::attention_isa()),
               static_cast<int>(*runs));
  ReadCeiling ceiling(std::int64_t{256} << 20);
  if (ceiling.buf.empty()) die("out of memory for the read ceiling's 256 MiB");
  const int w = static_cast<int>(*warmup), r = static_cast<int>(*runs);
  std::vector<Row> rows;
  auto add = [&](std::vector<Row> more) { rows.insert(rows.end(), more.begin(), more.end()); };
  if (only.empty() || only == "decode") add(bench_decode(*config, ceiling, w, r));
  if (only.empty() || only == "batch") add(bench_batch(*config, ceiling, w, r));
  if (only.empty() || only == "store") add(bench_store(*config, ceiling, w, r));

  json peer = nullptr;
  if (with_peer)
    peer = run_peer(args->str("python", "python3"), peer_script, r, threads, only, static_cast<double>(*peer_timeout));
  for (Row& row : rows) {
    if (!peer.is_object() || !peer.at("rows").contains(row.peer_name)) continue;
    const json& v = peer.at("rows").at(row.peer_name);
    if (v.is_number() && v.get<double>() > 0 && std::isfinite(v.get<double>()))
      row.peer_s = v.get<double>();
    else
      std::fprintf(stderr, "peer: %s is %s, not a time in seconds; left out\n", row.peer_name.c_str(), v.dump().c_str());
  }

  std::printf("| figure | median | GB/s | ceiling (read, same run) | ratio | peer | peer / kvring |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  json jrows = json::array();
  for (const Row& row : rows) {
    const double gb = static_cast<double>(row.bytes) / row.seconds / 1e9;
    const double cgb = static_cast<double>(row.bytes) / row.ceiling_s / 1e9;
    char peer_s[64] = "", speed[64] = "";
    if (row.peer_s > 0) {
      std::snprintf(peer_s, sizeof peer_s, "%.1f us", row.peer_s * 1e6);
      std::snprintf(speed, sizeof speed, "%.2fx", row.peer_s / row.seconds);
    }
    std::printf("| %s | %.1f us | %.2f | %.2f GB/s | %.1f%% | %s | %s |\n", row.name.c_str(),
                row.seconds * 1e6, gb, cgb, 100.0 * row.ceiling_s / row.seconds, peer_s, speed);
    json j = {{"name", row.name},         {"bytes", row.bytes},
              {"median_us", row.seconds * 1e6}, {"gbps", gb},
              {"ceiling_us", row.ceiling_s * 1e6}, {"ceiling_gbps", cgb},
              {"ratio", row.ceiling_s / row.seconds}};
    if (row.peer_s > 0) j["peer_us"] = row.peer_s * 1e6;
    jrows.push_back(j);
  }
  const json rate = in_cache_rate(rows);
  if (rate.is_object())
    std::printf("decodes in cache: %.2f ns a row; 131072 rows at that rate %.1f us (%.1f%% of its read "
                "ceiling), measured cold %.1f us\n",
                rate.at("ns_per_row").get<double>(), rate.at("us_at_131072").get<double>(),
                100.0 * rate.at("ratio_at_131072").get<double>(), rate.at("cold_us_at_131072").get<double>());
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  json out = {{"bench", "kvring-cpu-bench"},
              {"time", stamp},
              {"cpu", cpu_model()},
              {"threads", threads},
              {"isa", isa_name(cpu::attention_isa())},
              {"runs", r},
              {"rows", jrows}};
  if (peer.is_object()) out["peer"] = peer;
  if (rate.is_object()) out["decode_in_cache_rate"] = rate;
  const std::string line = out.dump();
  std::printf("%s\n", line.c_str());
  if (args->has("json"))
    if (const std::string why = bench::write_whole(args->str("json"), line + "\n"); !why.empty()) die(why);
  return 0;
}

}  // namespace
}  // namespace kvring

int main(int argc, char** argv) { return kvring::run(std::vector<std::string>(argv + 1, argv + argc)); }
