// kvring-bench: the CUDA backend's figures, each beside a ceiling measured
// in the same run (docs/PERFORMANCE.md).
//
//   kvring-bench [--json FILE] [--quick]
//                [--only store|decode|ring|prefill|batch|rings|ragged|step|memory]
//                [--numeric f32|f16] [--f16-stages 2|3] [--split-run N]
//                [--warp-splits rule|always|never] [--combine rule|no-cluster|last-arrival]
//                [--programmatic on|off] [--inline-items on|off]
//
// Ceilings: device-to-device copy (bytes read + written), a streaming read
// (the fastest of several read kernels), pinned host to device and device
// to host. Figures: store (one token into one layer and
// into all 52 layers: a loop of launches, a CUDA graph of them, one fused
// launch; prefill chunks of 512 and 4096 tokens into all 52 layers);
// decode attention on a full plane at 2048, 32768 and 131072 tokens and on
// a wrapped 2048-row sliding ring; snapshot out and restore in of a full
// muse-glimmer slot at 131072 tokens; prefill attention of a 512-token
// chunk at 4096, 32768 and 131072 tokens (no target); many sequences:
// batched decode (32 x 32768, 4 x 131072, 64 mixed lengths, 128 wrapped
// rings), a decode step's stores for 64 sequences beside an empty kernel,
// a ragged prefill store; one sequence's whole decode step at 131072 in a
// CUDA graph; the device memory of 64 x 8192 against 4 x 131072. Device events after
// warm-up, median of many runs, random data; decode and prefill runs start
// with a cold L2 unless named "warm" or "back to back": a 256 MiB buffer is
// read before each run, which evicts the L2 and leaves clean lines.
// Evicting it by a write instead leaves up to the L2's size of dirty lines,
// whose write-back the timed kernel then pays for; those figures are named
// "write-evicted L2".
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bench_io.h"
#include "kvring/config.h"
#include "cuda/launch_policy.h"
#include "kvring/cuda_store.h"

namespace {

using kvring::ConstView;
using kvring::MutView;
using kvring::SeqId;
using kvring::SeqQuery;
using kvring::SeqSpan;

// One sequence in a one-sequence CUDA store, with the single-sequence calls
// the figures time (each one store or attention call of the store's API).
class CudaCache {
 public:
  CudaCache(std::unique_ptr<kvring::KvStore> s, SeqId seq)
      : s_(std::move(s)), cuda_(dynamic_cast<kvring::CudaStore*>(s_.get())), seq_(seq) {}
  cudaStream_t stream() const { return cuda_->stream(); }
  kvring::Status synchronize() const { return s_->synchronize(); }
  kvring::Status reset() { return s_->reset_sequence(seq_); }
  kvring::Status truncate(std::int64_t tokens) { return s_->truncate_sequence(seq_, tokens); }
  kvring::RingState ring(std::int64_t l) const { return *s_->ring(seq_, l); }
  kvring::Status read_rows(std::int64_t l, std::int64_t first, std::int64_t n, std::uint16_t* k,
                           std::uint16_t* v) const {
    return s_->read_rows(seq_, l, first, n, k, v);
  }
  kvring::Status install(std::int64_t l, const kvring::RingState& r, const std::uint16_t* k,
                         const std::uint16_t* v) {
    return s_->install(seq_, l, r, k, v);
  }
  kvring::Status store_batch_device(std::int64_t l, std::int64_t start, std::int64_t n,
                                    const float* k, const float* v) {
    const SeqSpan span{seq_, start, n};
    return s_->store(l, std::span(&span, 1), kvring::device_view(k, n, kv()),
                     kvring::device_view(v, n, kv()));
  }
  kvring::Status store_token_device(std::int64_t l, std::int64_t pos, const float* k,
                                    const float* v) {
    return store_batch_device(l, pos, 1, k, v);
  }
  kvring::Status store_batch_all_layers_device(std::int64_t start, std::int64_t n,
                                               const float* k, const float* v) {
    const SeqSpan span{seq_, start, n};
    const std::int64_t rows = n * s_->n_layers();
    return s_->store_all_layers(std::span(&span, 1), kvring::device_view(k, rows, kv()),
                                kvring::device_view(v, rows, kv()));
  }
  kvring::Status store_token_all_layers_device(std::int64_t pos, const float* k, const float* v) {
    return store_batch_all_layers_device(pos, 1, k, v);
  }
  kvring::Status attend_decode_device(std::int64_t l, std::int64_t pos, const float* q,
                                      float* out) {
    const SeqQuery query{seq_, pos};
    return s_->attend_decode(l, std::span(&query, 1), kvring::device_view(q, 1, width()),
                             kvring::device_view(out, 1, width()));
  }
  kvring::Status prefill_device(std::int64_t l, std::int64_t start, std::int64_t n,
                                const float* k, const float* v, const float* q, float* out) {
    const SeqSpan span{seq_, start, n};
    return s_->prefill(l, std::span(&span, 1), kvring::device_view(k, n, kv()),
                       kvring::device_view(v, n, kv()), kvring::device_view(q, n, width()),
                       kvring::device_view(out, n, width()));
  }

 private:
  std::int64_t kv() const { return s_->config().kv_dim(); }
  std::int64_t width() const { return s_->config().n_heads * s_->config().head_dim; }
  std::unique_ptr<kvring::KvStore> s_;
  kvring::CudaStore* cuda_;
  SeqId seq_;
};

#define CHECK_CUDA(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "kvring-bench: %s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

void check(const kvring::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "kvring-bench: %s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

// Reads n 16-byte words (the L2 flush); the sink is written only on an
// impossible value, so nothing is written back.
__global__ void read_all(const uint4* p, std::int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// Reads n 16-byte words, U loads in flight a thread (the read ceiling's
// kernels); the sink as in read_all.
template <int U>
__global__ void read_stream(const uint4* p, std::int64_t n, unsigned* sink) {
  unsigned acc = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

__global__ void empty_kernel() {}

// Keeps the device busy for `ns` nanoseconds (by its global timer), so that
// the host's enqueue of the call timed after it overlaps device work, as it
// does in an engine, and the events time the call's device work alone.
__global__ void busy_for(std::uint64_t ns) {
  std::uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// The seeded draw of the mixed-length batch (splitmix64 of 20261201 + i);
// bench/sdpa_peer.py draws the same lengths.
std::uint64_t mixed_length_draw(std::uint64_t i) {
  std::uint64_t z = 20261201ull + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform(float* p, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

void fill(float* p, std::int64_t n, std::uint64_t seed, float scale = 1.0f) {
  fill_uniform<<<1024, 256>>>(p, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}

template <class T>
T* device_alloc(std::size_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

void free_device(std::initializer_list<void*> ptrs) {
  for (void* p : ptrs) CHECK_CUDA(cudaFree(p));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median microseconds of `enqueue` between two events on `stream`, after
// rounds of `warmup` untimed runs until `warm_ms` have passed (one round when
// 0); `before` (untimed, same stream) runs first each time. A call that can
// repeat without end, as a decode at a fixed position, warms up for 100 ms:
// calls in the first 25-40 ms after a store's memory is allocated can run
// slower than every later one, whatever the device does in between
// (docs/PERFORMANCE.md, "A warm-up of 100 ms" and "A warp a head").
double time_us(cudaStream_t stream, int warmup, int runs, const std::function<void()>& enqueue,
               const std::function<void()>& before = {}, double warm_ms = 0) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const auto warm_start = std::chrono::steady_clock::now();
  const std::chrono::duration<double, std::milli> warm_for(warm_ms);
  do {
    for (int i = 0; i < warmup; ++i) {
      if (before) before();
      enqueue();
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
  } while (warmup > 0 && std::chrono::steady_clock::now() - warm_start < warm_for);
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    if (before) before();
    CHECK_CUDA(cudaEventRecord(e0, stream));
    enqueue();
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(1000.0 * ms);
  }
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return median(t);
}

// Median microseconds of `body`'s work captured once into a CUDA graph on
// `stream` and replayed, each replay after `flush` where one is given.
double graph_us(cudaStream_t stream, int runs, const std::function<void()>& body,
                const std::function<void(cudaStream_t)>& flush = {}) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  body();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  const double us = time_us(stream, 5, runs, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); },
                            [&] {
                              if (flush) flush(stream);
                            });
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return us;
}

// Median microseconds of a synchronous host call, by the host clock.
double wall_us(int warmup, int runs, const std::function<void()>& call) {
  for (int i = 0; i < warmup; ++i) call();
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

// Median microseconds the host spends in `call` (an enqueue), each run
// followed by an untimed `sync`.
double enqueue_us(int runs, const std::function<void()>& call, const std::function<void()>& sync) {
  std::vector<double> t;
  for (int i = 0; i < runs + 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const auto t1 = std::chrono::steady_clock::now();
    sync();
    if (i >= 3) t.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return median(t);
}

struct Row {
  std::string name;
  double us = 0;           // median time
  double bytes = 0;        // bytes the figure counts (0: a latency)
  std::string ceiling;     // ceiling name ("" : none)
  double ceiling_gbs = 0;  // ceiling in GB/s
  std::string target;      // the issue's target, in words
  int met = -1;            // 1 met, 0 missed, -1 no target
  double gbs() const { return bytes > 0 ? bytes / us / 1e3 : 0; }
  double ratio() const { return ceiling_gbs > 0 && bytes > 0 ? gbs() / ceiling_gbs : 0; }
};

std::vector<Row> rows;

// Prints a row as it is measured; a row with a target gets its verdict
// from judge() once the row is complete.
void add(Row r) {
  rows.push_back(r);
  const Row& x = rows.back();
  std::printf("%-46s %10.2f us", x.name.c_str(), x.us);
  if (x.bytes > 0) std::printf(" %9.1f GB/s", x.gbs());
  if (x.ratio() > 0) std::printf("  %5.1f%% of %s", 100 * x.ratio(), x.ceiling.c_str());
  if (x.met >= 0) std::printf("  [%s: %s]", x.target.c_str(), x.met ? "met" : "MISSED");
  std::printf("\n");
  std::fflush(stdout);
}

// The verdict on the last row against its target, printed under it.
void judge(bool met) {
  Row& x = rows.back();
  x.met = met ? 1 : 0;
  std::printf("  [%s: %s]\n", x.target.c_str(), met ? "met" : "MISSED");
  std::fflush(stdout);
}

// The results as JSON, written whole to `path` at the end (bench_io.h).
void write_json(const std::string& path, const std::string& device, int sms) {
  char* text = nullptr;
  std::size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) {
    std::fprintf(stderr, "kvring-bench: out of memory for the JSON\n");
    std::exit(1);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::fprintf(f, "{\n  \"tool\": \"kvring-bench\",\n  \"date\": \"%s\",\n  \"device\": \"%s\",\n  \"sms\": %d,\n  \"results\": [\n",
               date, device.c_str(), sms);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "    {\"name\": \"%s\", \"median_us\": %.3f, \"bytes\": %.0f, \"gb_per_s\": %.2f, "
                 "\"ceiling\": \"%s\", \"ceiling_gb_per_s\": %.2f, \"ratio\": %.4f, \"target\": \"%s\", "
                 "\"met\": %s}%s\n",
                 r.name.c_str(), r.us, r.bytes, r.gbs(), r.ceiling.c_str(), r.ceiling_gbs, r.ratio(),
                 r.target.c_str(), r.met < 0 ? "null" : (r.met ? "true" : "false"),
                 i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  const std::string why = kvring::bench::write_whole(path, std::string(text, size));
  std::free(text);
  if (!why.empty()) {
    std::fprintf(stderr, "kvring-bench: %s\n", why.c_str());
    std::exit(1);
  }
}

// The launch policy of the stores: the device's, with --f16-stages forcing
// the f16 numeric's kernel, --split-run the runs of splits and --warp-splits
// which decodes take the warp-split kernel, --combine which combine paths
// attention may take (no clusters, or neither clusters nor resident grids),
// --programmatic off plain launches in place of programmatic dependents,
// --inline-items off a descriptor upload before every batched launch.
kvring::cuda::LaunchPolicy g_policy;

std::unique_ptr<CudaCache> make(const kvring::ModelConfig& cfg, std::int64_t context, std::int64_t slack = 0,
                                kvring::AttentionNumeric numeric = kvring::AttentionNumeric::kF32) {
  auto c = kvring::CudaStore::create(
      cfg, {.max_sequences = 1, .context = context, .slack = slack, .attention = numeric}, &g_policy);
  check(c.status(), "creating a store");
  auto seq = (*c)->add_sequence();
  check(seq.status(), "adding a sequence");
  return std::make_unique<CudaCache>(std::unique_ptr<kvring::KvStore>(std::move(*c)), *seq);
}

// A CUDA store holding counts.size() new sequences, and one span per
// sequence: from position 0, counts[i] rows.
std::pair<std::unique_ptr<kvring::KvStore>, std::vector<SeqSpan>> store_with(
    const kvring::ModelConfig& cfg, std::int64_t context, const std::vector<std::int64_t>& counts) {
  auto st = kvring::CudaStore::create(
      cfg, {.max_sequences = static_cast<std::int64_t>(counts.size()), .context = context}, &g_policy);
  check(st.status(), "creating a store");
  std::vector<SeqSpan> spans;
  for (const std::int64_t c : counts) {
    auto id = (*st)->add_sequence();
    check(id.status(), "adding a sequence");
    spans.push_back({*id, 0, c});
  }
  return {std::move(*st), std::move(spans)};
}

// Whether `only` is a comma-separated list of known parts, none empty.
bool known_parts(const std::string& only) {
  static const char* const kParts[] = {"store", "decode", "ring", "prefill", "batch", "rings", "ragged", "step", "memory"};
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = only.find(',', at);
    const std::string part = only.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (std::find(std::begin(kParts), std::end(kParts), part) == std::end(kParts)) return false;
    if (comma == std::string::npos) return true;
    at = comma + 1;
  }
}

// The help text, printed by --help (to stdout, exit 0) and after a bad
// argument (to stderr, exit 2).
void print_usage(std::FILE* out) {
  std::fputs(
      "usage: kvring-bench [--json FILE] [--quick] [--only store|decode|ring|prefill|batch|rings|ragged|step|memory]\n"
      "                    [--numeric f32|f16] [--f16-stages 2|3] [--split-run N]\n"
      "                    [--warp-splits rule|always|never] [--combine rule|no-cluster|last-arrival]\n"
      "                    [--programmatic on|off] [--inline-items on|off]\n"
      "  measures the CUDA backend's store, decode, ring and prefill kernels on\n"
      "  muse-glimmer's geometry (docs/PERFORMANCE.md)\n"
      "  --json FILE  also write the results as JSON to FILE\n"
      "  --quick      fewer repetitions\n"
      "  --only PARTS run these parts (comma-separated)\n"
      "  --numeric N  prefill figures under attention numeric N only (f32 or f16)\n"
      "  --f16-stages S  the f16 numeric's kernel of S stages (2 or 3), not the launch rule's\n"
      "  --split-run N   decode CTAs take runs of up to N splits (1-64), not the launch rule's\n"
      "  --warp-splits W decodes of at most 8192 rows on the warp-split kernel by the launch\n"
      "                  rule (where they combine by last arrival), always or never\n"
      "  --combine C     attention's combine paths: the device's (rule), no clusters, or\n"
      "                  last arrival only (neither clusters nor resident grids)\n"
      "  --programmatic P store and decode kernels as programmatic dependents (on, the\n"
      "                  device's rule where it has sm_90) or plain launches (off)\n"
      "  --inline-items I attention launches of up to 128 items carry them in their\n"
      "                  parameters (on) or upload them before the launch (off)\n"
      "exit status: 0 ok, 1 no GPU visible or a CUDA failure, 2 a usage error\n",
      out);
}

}  // namespace

int main(int argc, char** argv) {
  std::string json, only, numeric;
  bool quick = false;
  int f16_stages = 0;
  int split_run = 0;
  kvring::cuda::WarpSplits warp_splits = kvring::cuda::WarpSplits::kLastArrival;
  std::string combine = "rule";
  bool programmatic = true;
  bool inline_items = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
      if (!known_parts(only)) {
        std::fprintf(stderr, "kvring-bench: --only '%s' names no part, or an unknown one\n", only.c_str());
        print_usage(stderr);
        return 2;
      }
    } else if (a == "--numeric" && i + 1 < argc) {
      numeric = argv[++i];
      if (!kvring::parse_attention_numeric(numeric).ok()) {
        print_usage(stderr);
        return 2;
      }
    } else if (a == "--f16-stages" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "2" && v != "3") {
        print_usage(stderr);
        return 2;
      }
      f16_stages = std::stoi(v);
    } else if (a == "--split-run" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v.empty() || v.size() > 2 || v.find_first_not_of("0123456789") != std::string::npos ||
          std::stoi(v) < 1 || std::stoi(v) > 64) {
        print_usage(stderr);
        return 2;
      }
      split_run = std::stoi(v);
    } else if (a == "--warp-splits" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v == "rule") {
        warp_splits = kvring::cuda::WarpSplits::kLastArrival;
      } else if (v == "always") {
        warp_splits = kvring::cuda::WarpSplits::kAlways;
      } else if (v == "never") {
        warp_splits = kvring::cuda::WarpSplits::kNever;
      } else {
        print_usage(stderr);
        return 2;
      }
    } else if ((a == "--programmatic" || a == "--inline-items") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "on" && v != "off") {
        print_usage(stderr);
        return 2;
      }
      (a == "--programmatic" ? programmatic : inline_items) = v == "on";
    } else if (a == "--combine" && i + 1 < argc) {
      combine = argv[++i];
      if (combine != "rule" && combine != "no-cluster" && combine != "last-arrival") {
        print_usage(stderr);
        return 2;
      }
    } else if (a == "--help" || a == "-h") {
      print_usage(stdout);
      return 0;
    } else {
      print_usage(stderr);
      return 2;
    }
  }
  if (kvring::cuda_device_count() == 0) {
    std::fprintf(stderr, "kvring-bench: no GPU visible\n");
    return 1;
  }
  g_policy = kvring::cuda::device_launch_policy();
  g_policy.f16_stages = f16_stages;
  g_policy.split_run = split_run;
  g_policy.warp_splits = warp_splits;
  g_policy.programmatic = g_policy.programmatic && programmatic;
  g_policy.inline_items = inline_items;
  if (combine != "rule") {
    g_policy.hd128_cluster = g_policy.general_cluster = 1;
    if (combine == "last-arrival") g_policy.hd128_resident = 0;
  }
  // A path that cannot be written fails before anything is measured.
  if (!json.empty())
    if (const std::string why = kvring::bench::output_problem(json); !why.empty()) {
      std::fprintf(stderr, "kvring-bench: --json: %s\n", why.c_str());
      return 2;
    }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, %.1f GiB; kvring-bench%s\n\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / 1073741824.0, quick ? " --quick" : "");
  const int reps = quick ? 10 : 50;

  const kvring::ModelConfig muse = *kvring::preset_config("muse-glimmer");
  const std::int64_t L = muse.n_layers, kv = muse.kv_dim(), ctx = muse.max_context;
  const std::int64_t qn = muse.n_heads * muse.head_dim;

  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Writing this evicts the L2 (60 MB on an H200) before cold runs.
  const std::size_t flush_bytes = std::size_t{256} << 20;
  char* flush = device_alloc<char>(flush_bytes);
  unsigned* sink = device_alloc<unsigned>(1);
  CHECK_CUDA(cudaMemset(flush, 1, flush_bytes));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto read_flush = [&](cudaStream_t st) {
    read_all<<<sms * 8, 512, 0, st>>>(reinterpret_cast<const uint4*>(flush), flush_bytes / 16, sink);
    CHECK_CUDA(cudaGetLastError());
  };
  auto write_flush = [&](cudaStream_t st) { CHECK_CUDA(cudaMemsetAsync(flush, 0, flush_bytes, st)); };
  // 1 ms of device work, longer than any call's host enqueue.
  auto busy = [&](cudaStream_t st) {
    busy_for<<<1, 32, 0, st>>>(1000000);
    CHECK_CUDA(cudaGetLastError());
  };

  // ---- Ceilings ---------------------------------------------------------------
  const std::size_t copy_bytes = std::size_t{1} << 30;
  char* a = device_alloc<char>(copy_bytes);
  char* b = device_alloc<char>(copy_bytes);
  CHECK_CUDA(cudaMemset(a, 1, copy_bytes));
  const double d2d_us = time_us(s, 3, 20, [&] { CHECK_CUDA(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
  add({"ceiling: device-to-device copy 1 GiB", d2d_us, 2.0 * copy_bytes});
  const double d2d = rows.back().gbs();
  CHECK_CUDA(cudaFree(b));
  double read_gbs = 0;
  struct ReadKernel {
    const char* name;
    void (*kernel)(const uint4*, std::int64_t, unsigned*);
    int blocks_per_sm, threads;
  };
  ReadKernel best_read{};
  {
    // The read ceiling: the fastest of these read kernels over the copy's
    // 1 GiB source, each timed as the copy.
    const ReadKernel kernels[] = {{"1 load a thread, 8 x 512 an SM", read_stream<1>, 8, 512},
                                  {"4 loads a thread, 4 x 512 an SM", read_stream<4>, 4, 512},
                                  {"4 loads a thread, 2 x 1024 an SM", read_stream<4>, 2, 1024},
                                  {"8 loads a thread, 2 x 512 an SM", read_stream<8>, 2, 512},
                                  {"8 loads a thread, 4 x 256 an SM", read_stream<8>, 4, 256}};
    double best = 0;
    std::string best_name;
    for (const ReadKernel& k : kernels) {
      const double us = time_us(s, 3, 20, [&] {
        k.kernel<<<sms * k.blocks_per_sm, k.threads, 0, s>>>(reinterpret_cast<const uint4*>(a), copy_bytes / 16, sink);
        CHECK_CUDA(cudaGetLastError());
      });
      std::printf("  read 1 GiB, %s: %.2f us, %.1f GB/s\n", k.name, us, copy_bytes / us / 1e3);
      if (best == 0 || us < best) {
        best = us;
        best_name = k.name;
        best_read = k;
      }
    }
    add({"ceiling: device read 1 GiB (fastest kernel: " + best_name + ")", best, static_cast<double>(copy_bytes)});
    read_gbs = rows.back().gbs();
  }

  const std::size_t pin_bytes = std::size_t{256} << 20;
  void* pinned = nullptr;
  CHECK_CUDA(cudaHostAlloc(&pinned, pin_bytes, cudaHostAllocDefault));
  std::memset(pinned, 3, pin_bytes);
  add({"ceiling: pinned host-to-device 256 MiB",
       time_us(s, 2, 10, [&] { CHECK_CUDA(cudaMemcpyAsync(a, pinned, pin_bytes, cudaMemcpyHostToDevice, s)); }),
       static_cast<double>(pin_bytes)});
  const double h2d = rows.back().gbs();
  add({"ceiling: pinned device-to-host 256 MiB",
       time_us(s, 2, 10, [&] { CHECK_CUDA(cudaMemcpyAsync(pinned, a, pin_bytes, cudaMemcpyDeviceToHost, s)); }),
       static_cast<double>(pin_bytes)});
  const double d2h = rows.back().gbs();
  CHECK_CUDA(cudaFreeHost(pinned));
  CHECK_CUDA(cudaFree(a));

  // --only takes one part or a comma-separated list of parts.
  auto section = [&](const char* name) {
    return only.empty() || ("," + only + ",").find("," + std::string(name) + ",") != std::string::npos;
  };

  // ---- Stores -------------------------------------------------------------------
  if (section("store")) {
    auto c = make(muse, ctx);
    const cudaStream_t cs = c->stream();
    const std::int64_t max_chunk = 4096;
    // Distinct sources per layer: [L, 4096, kv] f32 each for K and V (436 MB
    // together), so no run reads its source from the L2.
    float* sk = device_alloc<float>(static_cast<std::size_t>(L * max_chunk * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(L * max_chunk * kv));
    fill(sk, L * max_chunk * kv, 1);
    fill(sv, L * max_chunk * kv, 2);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::int64_t pos = 0;
    add({"store 1 token, 1 layer (512 B K+V)",
         time_us(cs, 10, 200, [&] { check(c->store_token_device(0, pos, sk + (pos % 64) * kv, sv + (pos % 64) * kv), "store"); ++pos; })});
    check(c->reset(), "reset");
    pos = 0;
    auto store_all_loop = [&] {
      for (std::int64_t l = 0; l < L; ++l)
        check(c->store_token_device(l, pos, sk + l * kv, sv + l * kv), "store");
      ++pos;
    };
    add({"store 1 token, 52 layers: 52 launches", time_us(cs, 5, 100, store_all_loop)});
    // The same 52 launches captured once and replayed: a replay rewrites the
    // rows of the captured position (the graph holds fixed arguments).
    add({"store 1 token, 52 layers: CUDA graph", graph_us(cs, 200, store_all_loop)});
    // One fused launch: sources [L, kv].
    add({"store 1 token, 52 layers: one fused launch",
         time_us(cs, 10, 200, [&] { check(c->store_token_all_layers_device(pos, sk, sv), "store"); ++pos; })});

    for (std::int64_t chunk : {std::int64_t{512}, max_chunk}) {
      check(c->reset(), "reset");
      pos = 0;
      // Bytes moved: a sliding layer's ring keeps only its last `capacity`
      // rows of a chunk, so only those are read (f32) and written (f16).
      std::int64_t stored_rows = 0;
      for (std::int64_t l = 0; l < L; ++l)
        stored_rows += std::min(chunk, muse.plane_capacity(l, ctx));
      const double bytes = static_cast<double>(stored_rows * kv) * 2 * (4 + 2);
      const std::int64_t windows = max_chunk / chunk;
      int run = 0;
      auto store_chunk = [&] {
        // Layer l of run r reads window (r + l) % windows of its source.
        for (std::int64_t l = 0; l < L; ++l) {
          const std::int64_t off = (l * max_chunk + ((run + l) % windows) * chunk) * kv;
          check(c->store_batch_device(l, pos, chunk, sk + off, sv + off), "store");
        }
        pos += chunk;
        ++run;
      };
      const int chunk_runs = static_cast<int>(std::min<std::int64_t>(20, ctx / chunk - 4));
      const std::string name = "prefill store " + std::to_string(chunk) + " tokens x 52 layers";
      add({name + ": launches", time_us(cs, 2, chunk_runs, store_chunk), bytes, "D2D copy", d2d,
           chunk == max_chunk ? ">= 70% of copy" : "", -1});
      if (chunk == max_chunk) judge(rows.back().ratio() >= 0.70);
      add({name + ": CUDA graph", graph_us(cs, 20, store_chunk), bytes, "D2D copy", d2d,
           chunk == max_chunk ? ">= 70% of copy" : "", -1});
      if (chunk == max_chunk) judge(rows.back().ratio() >= 0.70);
      // Every layer's rows in one call: sources [L, chunk, kv], window run %
      // windows of the buffer.
      check(c->reset(), "reset");
      pos = 0;
      auto store_fused = [&] {
        const std::int64_t off = (run % windows) * L * chunk * kv;
        check(c->store_batch_all_layers_device(pos, chunk, sk + off, sv + off), "store");
        pos += chunk;
        ++run;
      };
      add({name + ": one fused call", time_us(cs, 2, chunk_runs, store_fused), bytes, "D2D copy", d2d,
           chunk == max_chunk ? ">= 70% of copy" : "", -1});
      if (chunk == max_chunk) judge(rows.back().ratio() >= 0.70);
    }
    CHECK_CUDA(cudaFree(sk));
    CHECK_CUDA(cudaFree(sv));
  }

  // ---- Decode on full planes, then snapshot and restore of the full slot --------
  if (section("decode")) {
    auto c = make(muse, ctx);
    const cudaStream_t cs = c->stream();
    float* sk = device_alloc<float>(static_cast<std::size_t>(ctx * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(ctx * kv));
    for (std::int64_t l = 0; l < L; ++l) {
      fill(sk, ctx * kv, 100 + static_cast<std::uint64_t>(l), 2.0f);
      fill(sv, ctx * kv, 200 + static_cast<std::uint64_t>(l), 2.0f);
      CHECK_CUDA(cudaDeviceSynchronize());
      check(c->store_batch_device(l, 0, ctx, sk, sv), "fill");
      check(c->synchronize(), "fill");
    }
    CHECK_CUDA(cudaFree(sk));
    CHECK_CUDA(cudaFree(sv));
    float* q = device_alloc<float>(static_cast<std::size_t>(qn));
    float* out = device_alloc<float>(static_cast<std::size_t>(qn));
    fill(q, qn, 7);
    CHECK_CUDA(cudaDeviceSynchronize());
    auto flush_c = [&] { read_flush(cs); };
    auto write_flush_c = [&] { write_flush(cs); };
    for (std::int64_t n : {std::int64_t{2048}, std::int64_t{32768}, ctx}) {
      int layer = 3;
      const bool target = n == ctx;
      add({"decode full plane, " + std::to_string(n) + " tokens",
           time_us(cs, 5, reps,
                   [&] {
                     check(c->attend_decode_device(layer, n - 1, q, out), "decode");
                     layer = layer + 4 < L ? layer + 4 : 3;  // the 13 full layers in turn
                   },
                   flush_c, 100),
           static_cast<double>(n) * 1024, "D2D copy", d2d, target ? ">= 83% of copy" : "", -1});
      if (target) judge(rows.back().ratio() >= 0.83);
    }
    {
      int layer = 3;
      add({"decode full plane, 131072 tokens, write-evicted L2",
           time_us(cs, 5, reps,
                   [&] {
                     check(c->attend_decode_device(layer, ctx - 1, q, out), "decode");
                     layer = layer + 4 < L ? layer + 4 : 3;
                   },
                   write_flush_c, 100),
           static_cast<double>(ctx) * 1024, "D2D copy", d2d});
    }
    {
      int layer = 3;
      add({"decode full plane, 131072 tokens, back to back", time_us(cs, 3, reps / 5 + 2, [&] {
             for (int i = 0; i < 13; ++i, layer = layer + 4 < L ? layer + 4 : 3)
               check(c->attend_decode_device(layer, ctx - 1, q, out), "decode");
           }) / 13.0,
           static_cast<double>(ctx) * 1024, "D2D copy", d2d});
    }

    // Snapshot every plane's live rows into pinned memory, then restore
    // them into a second cache.
    std::vector<std::size_t> offset;
    std::size_t total = 0;
    for (std::int64_t l = 0; l < L; ++l) {
      offset.push_back(total);
      total += static_cast<std::size_t>(c->ring(l).len() * kv);
    }
    std::uint16_t *hk = nullptr, *hv = nullptr;
    CHECK_CUDA(cudaHostAlloc(&hk, total * 2, cudaHostAllocDefault));
    CHECK_CUDA(cudaHostAlloc(&hv, total * 2, cudaHostAllocDefault));
    const double slot_bytes = 4.0 * static_cast<double>(total);
    auto snapshot = [&] {
      for (std::int64_t l = 0; l < L; ++l) {
        const auto& r = c->ring(l);
        check(c->read_rows(l, r.origin_logical(), r.len(), hk + offset[l], hv + offset[l]), "snapshot");
      }
    };
    add({"snapshot out, full slot at 131072 (pinned)", wall_us(1, quick ? 2 : 5, snapshot), slot_bytes,
         "pinned D2H", d2h, ">= 80% of pinned", -1});
    judge(rows.back().ratio() >= 0.80);
    auto r = make(muse, ctx);
    auto restore = [&] {
      for (std::int64_t l = 0; l < L; ++l)
        check(r->install(l, c->ring(l), hk + offset[l], hv + offset[l]), "restore");
    };
    add({"restore in, full slot at 131072 (pinned)", wall_us(1, quick ? 2 : 5, restore), slot_bytes,
         "pinned H2D", h2d, ">= 80% of pinned", -1});
    judge(rows.back().ratio() >= 0.80);
    // The restored slot decodes to the same bits.
    float* out2 = device_alloc<float>(static_cast<std::size_t>(qn));
    check(c->attend_decode_device(51, ctx - 1, q, out), "decode");
    check(r->attend_decode_device(51, ctx - 1, q, out2), "decode");
    check(c->synchronize(), "sync");
    check(r->synchronize(), "sync");
    std::vector<float> o1(static_cast<std::size_t>(qn)), o2(o1.size());
    CHECK_CUDA(cudaMemcpy(o1.data(), out, qn * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(o2.data(), out2, qn * 4, cudaMemcpyDeviceToHost));
    std::printf("  restored slot decodes to the same bits: %s\n",
                std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0 ? "yes" : "NO");
    CHECK_CUDA(cudaFreeHost(hk));
    CHECK_CUDA(cudaFreeHost(hv));
    CHECK_CUDA(cudaFree(out2));
    CHECK_CUDA(cudaFree(q));
    CHECK_CUDA(cudaFree(out));
  }

  // ---- Decode on a wrapped 2048-row sliding ring ---------------------------------
  if (section("ring")) {
    const std::int64_t n = 3000;  // origin_physical 952: the live rows wrap
    auto c = make(muse, 4096);
    const cudaStream_t cs = c->stream();
    float* sk = device_alloc<float>(static_cast<std::size_t>(n * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(n * kv));
    float* q = device_alloc<float>(static_cast<std::size_t>(qn));
    float* out = device_alloc<float>(static_cast<std::size_t>(qn));
    fill(sk, n * kv, 11, 2.0f);
    fill(sv, n * kv, 12, 2.0f);
    fill(q, qn, 13);
    CHECK_CUDA(cudaDeviceSynchronize());
    for (std::int64_t l = 0; l < L; ++l) check(c->store_batch_device(l, 0, n, sk, sv), "fill");
    check(c->synchronize(), "fill");
    std::printf("  sliding ring: len %lld, origin_physical %lld (wrapped)\n",
                static_cast<long long>(c->ring(0).len()), static_cast<long long>(c->ring(0).origin_physical()));
    int layer = 0;
    auto next_sliding = [&] {
      do layer = (layer + 1) % static_cast<int>(L);
      while (layer % 4 == 3);
    };
    auto flush_c = [&] { read_flush(cs); };
    add({"decode wrapped 2048-row sliding ring (cold L2)",
         time_us(cs, 5, reps * 4, [&] { check(c->attend_decode_device(layer, n - 1, q, out), "decode"); next_sliding(); }, flush_c,
                 100),
         2048.0 * 1024, "D2D copy", d2d, "< 10 us", -1});
    judge(rows.back().us < 10.0);
    add({"decode wrapped 2048-row ring, write-evicted L2",
         time_us(cs, 5, reps * 4, [&] { check(c->attend_decode_device(layer, n - 1, q, out), "decode"); next_sliding(); },
                 [&] { write_flush(cs); }, 100),
         2048.0 * 1024, "D2D copy", d2d});
    add({"decode wrapped 2048-row sliding ring (warm L2)",
         time_us(cs, 5, reps * 4, [&] { check(c->attend_decode_device(0, n - 1, q, out), "decode"); }),
         2048.0 * 1024, "D2D copy", d2d});
    const double per_layer = time_us(cs, 2, reps, [&] {
      for (std::int64_t l = 0; l < L; ++l)
        if (l % 4 != 3) check(c->attend_decode_device(l, n - 1, q, out), "decode");
    }) / 39.0;
    add({"decode 39 sliding rings back to back, per ring", per_layer, 2048.0 * 1024, "D2D copy", d2d});
    free_device({sk, sv, q, out});
  }

  // ---- Prefill attention: 512-token chunks, under each numeric ----------------
  // Full layers: each of the 13 holds n - 512 rows; one chunked prefill
  // (convert, attention over the plane and the chunk, store) per layer,
  // cold L2, the first as warm-up. Sliding layers: each ring holds 3000 rows
  // (wrapped), and the chunk's queries see 2048 rows each. Then a whole
  // 131072-token prompt in 512-token chunks through one full and one
  // sliding layer, once (host time included). Bytes: the rows once (n x
  // 1 KiB); FLOPs: 4 x head_dim x query heads per (query, visible row).
  if (section("prefill")) {
    const std::string& only_numeric = numeric;
    const std::int64_t chunk = 512;
    float* sk = device_alloc<float>(static_cast<std::size_t>(ctx * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(ctx * kv));
    float* q = device_alloc<float>(static_cast<std::size_t>(chunk * qn));
    float* out = device_alloc<float>(static_cast<std::size_t>(chunk * qn));
    fill(sk, ctx * kv, 21, 2.0f);
    fill(sv, ctx * kv, 22, 2.0f);
    fill(q, chunk * qn, 23);
    CHECK_CUDA(cudaDeviceSynchronize());
    const double flop_row = 4.0 * static_cast<double>(qn);  // per (query, visible row)
    auto tflops = [&](double flops, double us) { return flops / us / 1e6; };
    for (const auto numeric : {kvring::AttentionNumeric::kF32, kvring::AttentionNumeric::kF16}) {
      if (!only_numeric.empty() && only_numeric != kvring::attention_numeric_name(numeric)) continue;
      const std::string tag = std::string(" (") + kvring::attention_numeric_name(numeric) + ")";
      auto c = make(muse, ctx, 0, numeric);
      const cudaStream_t cs = c->stream();
      auto flush_c = [&] { read_flush(cs); };
      int full_layers = 0;
      for (std::int64_t l = 3; l < L; l += 4) ++full_layers;
      for (std::int64_t n : {std::int64_t{4096}, std::int64_t{32768}, ctx}) {
        check(c->reset(), "reset");
        const std::int64_t start = n - chunk;
        for (std::int64_t l = 3; l < L; l += 4) check(c->store_batch_device(l, 0, start, sk, sv), "fill");
        check(c->synchronize(), "fill");
        std::int64_t layer = 3;
        add({"prefill attention, 512 tokens at " + std::to_string(n) + tag,
             time_us(cs, 1, full_layers - 1,
                     [&] {
                       check(c->prefill_device(layer, start, chunk, sk + start * kv, sv + start * kv, q, out),
                             "prefill");
                       layer += 4;
                     },
                     flush_c),
             static_cast<double>(n) * 1024, "D2D copy", d2d});
        const double visible = static_cast<double>(chunk) * static_cast<double>(start) +
                               static_cast<double>(chunk) * (chunk + 1) / 2;
        std::printf("  %.1f TFLOP/s\n", tflops(visible * flop_row, rows.back().us));
      }
      // Sliding layers: rings wrapped at 3000 rows, a 512-token chunk on top.
      {
        check(c->reset(), "reset");
        const std::int64_t start = 3000;
        std::vector<std::int64_t> sliding;
        for (std::int64_t l = 0; l < L; ++l)
          if (l % 4 != 3) sliding.push_back(l);
        for (const std::int64_t l : sliding) check(c->store_batch_device(l, 0, start, sk, sv), "fill");
        check(c->synchronize(), "fill");
        std::size_t next = 0;
        add({"prefill attention, 512 tokens on a wrapped 2048 ring" + tag,
             time_us(cs, 1, static_cast<int>(std::min<std::size_t>(sliding.size(), 21)) - 1,
                     [&] {
                       check(c->prefill_device(sliding[next++], start, chunk, sk + start * kv, sv + start * kv, q,
                                               out),
                             "prefill");
                     },
                     flush_c),
             2048.0 * 1024, "D2D copy", d2d});
        std::printf("  %.1f TFLOP/s\n", tflops(512.0 * 2048 * flop_row, rows.back().us));
        // The same call's device work alone (captured once into a graph),
        // and the host's time to enqueue it, on layers not yet used.
        const std::int64_t graph_layer = sliding[next++];
        add({"prefill attention, 512 tokens on a wrapped 2048 ring, graph" + tag,
             graph_us(cs, reps,
                      [&] {
                        check(c->prefill_device(graph_layer, start, chunk, sk + start * kv, sv + start * kv, q,
                                                out),
                              "prefill");
                      },
                      read_flush),
             2048.0 * 1024, "D2D copy", d2d});
        add({"prefill attention, 512 tokens on a wrapped 2048 ring, host enqueue" + tag,
             enqueue_us(
                 static_cast<int>(std::min<std::size_t>(sliding.size() - next, 13)) - 3,
                 [&] {
                   check(c->prefill_device(sliding[next++], start, chunk, sk + start * kv, sv + start * kv, q,
                                           out),
                         "prefill");
                 },
                 [&] { check(c->synchronize(), "prefill"); })});
      }
      // A whole prompt through one full and one sliding layer.
      {
        check(c->reset(), "reset");
        check(c->synchronize(), "reset");
        const double us = time_us(cs, 0, 1, [&] {
          for (std::int64_t start = 0; start < ctx; start += chunk)
            for (const std::int64_t l : {std::int64_t{3}, std::int64_t{0}})
              check(c->prefill_device(l, start, chunk, sk + start * kv, sv + start * kv, q, out), "prefill");
        });
        add({"prefill attention, 131072-token prompt, one full + one sliding layer" + tag, us});
        double full_rows = 0, sliding_rows = 0;
        for (std::int64_t p = 0; p < ctx; ++p) {
          full_rows += static_cast<double>(p + 1);
          sliding_rows += static_cast<double>(std::min<std::int64_t>(p + 1, muse.sliding_window));
        }
        std::printf("  %.1f TFLOP/s (visible rows %.3g full, %.3g sliding)\n",
                    tflops((full_rows + sliding_rows) * flop_row, rows.back().us), full_rows, sliding_rows);
      }
    }
    free_device({sk, sv, q, out});
  }

  // ---- Many sequences: batched decode, ring batch, batched stores ---------------
  // Every figure here is one call of the store's batched API (one launch per
  // layer). Attention bytes: each sequence's visible rows x 1 KiB, read once.
  // "rings" and "ragged" run the ring batch or the ragged store alone (for a
  // profiler).
  if (section("batch") || section("rings") || section("ragged")) {
    const bool all = section("batch");
    const std::int64_t fill_chunk = 4096;
    float* sk = device_alloc<float>(static_cast<std::size_t>(fill_chunk * 64 * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(fill_chunk * 64 * kv));
    fill(sk, fill_chunk * 64 * kv, 31, 2.0f);
    fill(sv, fill_chunk * 64 * kv, 32, 2.0f);
    const std::int64_t src_rows = fill_chunk * 64;
    // A store of n sequences, `layer` filled to lens[i] rows (random rows,
    // sources rotated so sequences differ).
    auto filled = [&](std::int64_t context, const std::vector<std::int64_t>& lens, std::int64_t layer) {
      auto made = store_with(muse, context, lens);
      auto& st = made.first;
      std::vector<SeqId> ids;
      for (const SeqSpan& sp : made.second) ids.push_back(sp.seq);
      std::vector<std::int64_t> done(lens.size(), 0);
      std::int64_t offset = 0;
      for (bool more = true; more;) {
        more = false;
        std::vector<SeqSpan> spans;
        std::int64_t rows_in = 0;
        for (std::size_t i = 0; i < lens.size(); ++i) {
          const std::int64_t n = std::min(fill_chunk, lens[i] - done[i]);
          if (n <= 0) continue;
          if (rows_in + n > src_rows) {
            more = true;
            break;
          }
          spans.push_back({ids[i], done[i], n});
          done[i] += n;
          rows_in += n;
        }
        if (spans.empty()) break;
        const std::int64_t off = offset % (src_rows - rows_in + 1);
        offset += 7919;
        check(st->store(layer, spans, kvring::device_view(sk + off * kv, rows_in, kv),
                        kvring::device_view(sv + off * kv, rows_in, kv)),
              "fill");
        for (std::size_t i = 0; i < lens.size(); ++i) more = more || done[i] < lens[i];
      }
      check(st->synchronize(), "fill");
      return std::make_pair(std::move(st), ids);
    };
    // Decode of one query per sequence, each at its last stored position.
    auto decode_batch = [&](const std::string& name, std::int64_t context, const std::vector<std::int64_t>& lens,
                            std::int64_t layer, std::int64_t visible_cap, const std::string& target,
                            double need, bool with_step = false) {
      auto filled_store = filled(context, lens, layer);
      auto& st = filled_store.first;
      auto& ids = filled_store.second;
      const std::int64_t nq = static_cast<std::int64_t>(ids.size());
      std::vector<SeqQuery> qs;
      double bytes = 0;
      for (std::int64_t i = 0; i < nq; ++i) {
        qs.push_back({ids[static_cast<std::size_t>(i)], lens[static_cast<std::size_t>(i)] - 1});
        bytes += static_cast<double>(std::min(lens[static_cast<std::size_t>(i)], visible_cap)) * 1024;
      }
      float* q = device_alloc<float>(static_cast<std::size_t>(nq * qn));
      float* out = device_alloc<float>(static_cast<std::size_t>(nq * qn));
      fill(q, nq * qn, 33);
      CHECK_CUDA(cudaDeviceSynchronize());
      auto cuda = dynamic_cast<kvring::CudaStore*>(st.get());
      const cudaStream_t cs = cuda->stream();
      const auto call = [&] {
        check(st->attend_decode(layer, qs, kvring::device_view(q, nq, qn), kvring::device_view(out, nq, qn)),
              "decode");
      };
      // The store's first calls, before any warm-up.
      const double first_us = time_us(cs, 0, 10, call, [&] { read_flush(cs); });
      add({name, time_us(cs, 5, reps, call, [&] { read_flush(cs); }, 100), bytes, "D2D copy", d2d, target, -1});
      if (need > 0) judge(rows.back().ratio() >= need);
      const double batch_us = rows.back().us;
      std::printf("  %.1f%% of the read ceiling (%.1f GB/s)\n", 100 * rows.back().gbs() / read_gbs, read_gbs);
      {
        // The read ceiling at the batch's own size: the fastest read kernel
        // over as many bytes, timed as the batch (cold L2, the same runs),
        // so its launch and tail weigh as much as the batch's.
        const auto n = static_cast<std::size_t>(bytes);
        char* plain = device_alloc<char>(n);
        CHECK_CUDA(cudaMemset(plain, 1, n));
        const double plain_us = time_us(cs, 5, reps, [&] {
          best_read.kernel<<<sms * best_read.blocks_per_sm, best_read.threads, 0, cs>>>(
              reinterpret_cast<const uint4*>(plain), static_cast<std::int64_t>(n / 16), sink);
          CHECK_CUDA(cudaGetLastError());
        }, [&] { read_flush(cs); }, 100);
        std::printf("  a plain read of the batch's %zu B, cold: %.2f us (%.1f GB/s); the batch takes %.3fx it\n", n,
                    plain_us, bytes / plain_us / 1e3, batch_us / plain_us);
        CHECK_CUDA(cudaFree(plain));
      }
      std::printf("  the first 10 calls after the fill: %.2f us\n", first_us);
      std::printf("  host time in the call: %.2f us\n",
                  enqueue_us(20, call, [&] { CHECK_CUDA(cudaStreamSynchronize(cs)); }));
      // The same call without the cache flush before it, and ten calls back
      // to back (per call).
      std::printf("  warm L2: %.2f us; back to back: %.2f us a call\n", time_us(cs, 3, 20, call),
                  time_us(cs, 1, 10, [&] {
                    for (int i = 0; i < 10; ++i) call();
                  }) / 10);
      if (with_step) {
        // The batch's decode step on this layer: each sequence's next token
        // stored and attended, as one call of one-token prefills, and as a
        // store call then a decode call (each run one token further on).
        std::vector<SeqSpan> spans;
        for (std::int64_t i = 0; i < nq; ++i) spans.push_back({ids[static_cast<std::size_t>(i)], lens[static_cast<std::size_t>(i)], 1});
        std::int64_t run = 0;
        auto advance = [&] {
          for (std::size_t i = 0; i < spans.size(); ++i) {
            ++spans[i].start;
            qs[i].position = spans[i].start;
          }
          ++run;
        };
        auto src = [&](float* base) { return kvring::device_view(base + (run % 64) * nq * kv, nq, kv); };
        const double step_bytes = bytes + static_cast<double>(nq * kv) * 2 * (4 + 2);
        for (std::size_t i = 0; i < spans.size(); ++i) qs[i].position = spans[i].start;
        add({name + ", decode step as one-token prefills",
             time_us(cs, 5, reps,
                     [&] {
                       check(st->prefill(layer, spans, src(sk), src(sv), kvring::device_view(q, nq, qn),
                                         kvring::device_view(out, nq, qn)),
                             "prefill");
                       advance();
                     },
                     [&] { read_flush(cs); }),
             step_bytes, "D2D copy", d2d});
        add({name + ", decode step as store, then decode",
             time_us(cs, 5, reps,
                     [&] {
                       check(st->store(layer, spans, src(sk), src(sv)), "store");
                       check(st->attend_decode(layer, qs, kvring::device_view(q, nq, qn),
                                               kvring::device_view(out, nq, qn)),
                             "decode");
                       advance();
                     },
                     [&] { read_flush(cs); }),
             step_bytes, "D2D copy", d2d});
      }
      CHECK_CUDA(cudaFree(q));
      CHECK_CUDA(cudaFree(out));
    };
    // Rings wrapped: 3000 tokens in a 2048-row ring (origin_physical 952).
    // They go first: right after the 32 GB store of the mixed batch is
    // freed, their cold figure reads 6x their warm one until the device
    // has idled a while (docs/PERFORMANCE.md).
    if (all || section("rings"))
      decode_batch("batch decode 128 wrapped 2048-row rings", 4096, std::vector<std::int64_t>(128, 3000), 0, 2048,
                   ">= 70% of copy", 0.70, all);
    if (all) {
      decode_batch("batch decode 32 seqs x 32768, full layer", 32768, std::vector<std::int64_t>(32, 32768), 3,
                   1 << 30, ">= 85% of copy", 0.85);
      decode_batch("batch decode 4 seqs x 131072, full layer", ctx, std::vector<std::int64_t>(4, ctx), 3,
                   1 << 30, ">= 85% of copy", 0.85);
      // Lengths uniform in 1..32768, seeded (bench/sdpa_peer.py draws the same).
      std::vector<std::int64_t> lens;
      for (std::uint64_t i = 0; i < 64; ++i) lens.push_back(1 + static_cast<std::int64_t>(mixed_length_draw(i) % 32768));
      decode_batch("batch decode 64 seqs, lengths 1..32768, full", 32768, lens, 3, 1 << 30, ">= 75% of copy", 0.75);
    }

    // A decode step's stores: 64 sequences x one token x 52 layers, one call.
    if (all) {
      const std::int64_t n = 64;
      auto made = store_with(muse, 4096, std::vector<std::int64_t>(n, 1));
      auto& st = made.first;
      auto& spans = made.second;
      auto cuda = dynamic_cast<kvring::CudaStore*>(st.get());
      const cudaStream_t cs = cuda->stream();
      int run = 0;
      add({"empty kernel (launch floor)", time_us(cs, 10, 200, [&] {
             empty_kernel<<<1, 32, 0, cs>>>();
             CHECK_CUDA(cudaGetLastError());
           })});
      const double floor_us = rows.back().us;
      const double step_bytes = static_cast<double>(n * L * kv) * 2 * (4 + 2);
      auto step_store = [&] {
        const std::int64_t off = (run % 64) * n * L * kv;
        check(st->store_all_layers(spans, kvring::device_view(sk + off, n * L, kv),
                                   kvring::device_view(sv + off, n * L, kv)),
              "store");
        for (auto& sp : spans) ++sp.start;
        ++run;
      };
      add({"decode-step store 64 seqs x 1 token x 52 layers", time_us(cs, 10, 200, step_store), step_bytes,
           "D2D copy", d2d});
      std::printf("  decode-step store: %.2fx the launch floor\n", rows.back().us / floor_us);
      add({"decode-step store, device time (enqueued behind busy work)",
           time_us(cs, 10, 200, step_store, [&] { busy(cs); }), step_bytes, "D2D copy", d2d});
      std::printf("  decode-step store, device time: %.2fx the launch floor\n", rows.back().us / floor_us);
      std::printf("  host time in the call: %.2f us\n", enqueue_us(20, step_store, [&] {
                    CHECK_CUDA(cudaStreamSynchronize(cs));
                  }));
    }

    // A ragged prefill store: 4096 tokens over 5 sequences x 52 layers, one call.
    if (all || section("ragged")) {
      const std::vector<std::int64_t> counts = {1000, 700, 1200, 596, 600};
      const std::int64_t total = 4096;
      // Room for every timed call's rows (27 calls of up to 1200).
      auto made = store_with(muse, 65536, counts);
      auto& st = made.first;
      auto& spans = made.second;
      std::int64_t stored_rows = 0;
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t c : counts) stored_rows += std::min(c, muse.plane_capacity(l, 32768));
      const double bytes = static_cast<double>(stored_rows * kv) * 2 * (4 + 2);
      // Sources [L * 4096, kv] in two windows of the fill buffers (src_rows = 64 * 4096).
      auto cuda = dynamic_cast<kvring::CudaStore*>(st.get());
      const cudaStream_t cs = cuda->stream();
      int run = 0;
      auto ragged_store = [&] {
        const std::int64_t off = (run % 2) * (src_rows - L * total) * kv;
        check(st->store_all_layers(spans, kvring::device_view(sk + off, L * total, kv),
                                   kvring::device_view(sv + off, L * total, kv)),
              "store");
        for (std::size_t i = 0; i < spans.size(); ++i) spans[i].start += counts[i];
        ++run;
      };
      // The target is the call's device work, its host enqueue overlapping
      // earlier device work as the decode figures' does; the same call on an
      // idle device, host time inside, is reported beside it.
      add({"ragged prefill store 4096 tokens / 5 seqs x 52 layers", time_us(cs, 2, 20, ragged_store, [&] { busy(cs); }),
           bytes, "D2D copy", d2d, ">= 85% of copy", -1});
      judge(rows.back().ratio() >= 0.85);
      add({"ragged prefill store, on an idle device (host time inside)", time_us(cs, 2, 20, ragged_store), bytes,
           "D2D copy", d2d});
      std::printf("  host time in the call: %.2f us\n",
                  enqueue_us(5, ragged_store, [&] { CHECK_CUDA(cudaStreamSynchronize(cs)); }));
    }

    // Ragged prefill attention: several sequences' chunks in one call, each
    // chunk ending at row `end`, beside one sequence's chunk of the same
    // query rows; one full layer a call, timed over the full layers (each
    // filled first). Bytes: each chunk's visible rows x 1 KiB.
    auto ragged_prefill = [&](const std::string& name, const std::vector<std::int64_t>& chunks,
                              std::int64_t end) {
      std::vector<std::int64_t> before;
      std::int64_t q_rows = 0;
      for (const std::int64_t c : chunks) {
        before.push_back(end - c);
        q_rows += c;
      }
      auto made = store_with(muse, end, before);
      auto& st = made.first;
      std::vector<SeqSpan> fill_spans = made.second, chunk_spans;
      for (std::size_t i = 0; i < chunks.size(); ++i) chunk_spans.push_back({fill_spans[i].seq, before[i], chunks[i]});
      std::int64_t fill_rows = 0;
      for (const std::int64_t b : before) fill_rows += b;
      if (fill_rows > src_rows)
        check(kvring::invalid_argument("more rows than the fill buffers hold"), "ragged prefill");
      int full_layers = 0;
      for (std::int64_t l = 3; l < L; l += 4, ++full_layers)
        check(st->store(l, fill_spans, kvring::device_view(sk, fill_rows, kv), kvring::device_view(sv, fill_rows, kv)),
              "fill");
      float* q = device_alloc<float>(static_cast<std::size_t>(q_rows * qn));
      float* out = device_alloc<float>(static_cast<std::size_t>(q_rows * qn));
      fill(q, q_rows * qn, 35);
      CHECK_CUDA(cudaDeviceSynchronize());
      auto cuda = dynamic_cast<kvring::CudaStore*>(st.get());
      const cudaStream_t cs = cuda->stream();
      std::int64_t layer = 3;
      add({name,
           time_us(cs, 1, full_layers - 1,
                   [&] {
                     check(st->prefill(layer, chunk_spans, kvring::device_view(sk + fill_rows * kv, q_rows, kv),
                                       kvring::device_view(sv + fill_rows * kv, q_rows, kv),
                                       kvring::device_view(q, q_rows, qn), kvring::device_view(out, q_rows, qn)),
                           "prefill");
                     layer += 4;
                   },
                   [&] { read_flush(cs); }),
           static_cast<double>(end) * 1024 * static_cast<double>(chunks.size()), "D2D copy", d2d});
      free_device({q, out});
      return rows.back().us;
    };
    if (all) {
      const double one = ragged_prefill("prefill attention, one sequence's 512-token chunk at 32768", {512}, 32768);
      const double four = ragged_prefill("prefill attention, 4 sequences' 128-token chunks at 32768, one call",
                                         {128, 128, 128, 128}, 32768);
      const double mixed = ragged_prefill("prefill attention, chunks of 64, 192, 96, 160 at 32768, one call",
                                          {64, 192, 96, 160}, 32768);
      std::printf("  ragged prefill / one sequence, same query rows: %.3f (4 x 128), %.3f (mixed); target <= 1.15\n",
                  four / one, mixed / one);
    }
    CHECK_CUDA(cudaFree(sk));
    CHECK_CUDA(cudaFree(sv));
  }

  // ---- One sequence's whole decode step at 131072 in one CUDA graph ----------------
  // Per layer, a one-token prefill: the token's K/V stored and its
  // attention, one call and one launch; 52 layers captured once and
  // replayed (a replay rewrites the captured position). Bytes: each layer's
  // visible rows read once plus the stores' sources and rows. Also the
  // same step as a store call, then a decode call, per layer.
  if (section("step")) {
    // Slack 1: the step's token is rolled back between the two figures.
    auto c = make(muse, ctx, 1);
    const cudaStream_t cs = c->stream();
    float* sk = device_alloc<float>(static_cast<std::size_t>(ctx * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(ctx * kv));
    const std::int64_t pos = ctx - 1;
    for (std::int64_t l = 0; l < L; ++l) {
      fill(sk, ctx * kv, 300 + static_cast<std::uint64_t>(l), 2.0f);
      fill(sv, ctx * kv, 400 + static_cast<std::uint64_t>(l), 2.0f);
      CHECK_CUDA(cudaDeviceSynchronize());
      check(c->store_batch_device(l, 0, pos, sk, sv), "fill");
      check(c->synchronize(), "fill");
    }
    float* q = device_alloc<float>(static_cast<std::size_t>(L * qn));
    float* out = device_alloc<float>(static_cast<std::size_t>(L * qn));
    fill(q, L * qn, 41);
    CHECK_CUDA(cudaDeviceSynchronize());
    double bytes = 0;
    for (std::int64_t l = 0; l < L; ++l)
      bytes += static_cast<double>(std::min(pos + 1, muse.plane_capacity(l, ctx))) * 1024 + kv * 2 * (4 + 2);
    auto step = [&] {
      for (std::int64_t l = 0; l < L; ++l) {
        check(c->store_token_device(l, pos, sk + l * kv, sv + l * kv), "store");
        check(c->attend_decode_device(l, pos, q + l * qn, out + l * qn), "decode");
      }
    };
    auto graph_time = [&](const std::function<void()>& body) { return graph_us(cs, reps, body, read_flush); };
    auto step_prefill = [&] {
      for (std::int64_t l = 0; l < L; ++l)
        check(c->prefill_device(l, pos, 1, sk + l * kv, sv + l * kv, q + l * qn, out + l * qn), "prefill");
    };
    add({"decode step at 131072, 52 one-token prefills, graph", graph_time(step_prefill), bytes, "D2D copy", d2d,
         "<= 1.3x the bytes at copy", -1});
    judge(rows.back().ratio() >= 1 / 1.3);
    check(c->truncate(1), "truncate");
    add({"decode step at 131072, 52 x (store, then attend), graph", graph_time(step), bytes, "D2D copy", d2d});
    // The step's parts, each in a graph of its own (one node per call, in
    // the step's order), and a chain of empty kernels as the floor of a
    // graph node that waits for the one before it.
    auto part = [&](const std::string& name, bool stores, bool sliding, bool full) {
      double part_bytes = 0;
      for (std::int64_t l = 0; l < L; ++l) {
        const bool is_sliding = muse.kind(l) == kvring::LayerKind::kSlidingRope;
        if (stores) part_bytes += kv * 2 * (4 + 2);
        if ((is_sliding && sliding) || (!is_sliding && full))
          part_bytes += static_cast<double>(std::min(pos + 1, muse.plane_capacity(l, ctx))) * 1024;
      }
      add({name, graph_time([&] {
             for (std::int64_t l = 0; l < L; ++l) {
               const bool is_sliding = muse.kind(l) == kvring::LayerKind::kSlidingRope;
               if (stores) check(c->store_token_device(l, pos, sk + l * kv, sv + l * kv), "store");
               if ((is_sliding && sliding) || (!is_sliding && full))
                 check(c->attend_decode_device(l, pos, q + l * qn, out + l * qn), "decode");
             }
           }),
           part_bytes, "D2D copy", d2d});
    };
    // The stores alone first: the token stored by the steps above is
    // rolled back, and these stores leave it for the attention parts.
    check(c->truncate(1), "truncate");
    part("  of which: the 52 stores alone, graph", true, false, false);
    part("  of which: the 39 sliding attentions alone, graph", false, true, false);
    part("  of which: the 13 full attentions alone, graph", false, false, true);
    add({"  a chain of 104 empty kernels, graph", graph_time([&] {
           for (int i = 0; i < 104; ++i) empty_kernel<<<1, 32, 0, cs>>>();
           CHECK_CUDA(cudaGetLastError());
         })});
    std::printf("  per node: %.2f us\n", rows.back().us / 104);
    {
      const double sliding_us = time_us(cs, 5, reps, [&] {
        for (std::int64_t l = 0; l < L; ++l)
          if (muse.kind(l) == kvring::LayerKind::kSlidingRope) check(c->attend_decode_device(l, pos, q, out), "decode");
      }) / static_cast<double>(muse.count(kvring::LayerKind::kSlidingRope));
      add({"  of which: one sliding layer's attention (in a row)", sliding_us, 2048.0 * 1024, "D2D copy", d2d});
    }
    free_device({sk, sv, q, out});
  }

  // ---- Memory: 64 sequences of 8192 tokens against 4 of 131072 --------------------
  // Device memory each store takes at creation (cudaMemGetInfo), and the
  // full-attention blocks each holds once filled.
  if (section("memory")) {
    float* sk = device_alloc<float>(static_cast<std::size_t>(8192 * kv));
    float* sv = device_alloc<float>(static_cast<std::size_t>(8192 * kv));
    fill(sk, 8192 * kv, 51);
    fill(sv, 8192 * kv, 52);
    CHECK_CUDA(cudaDeviceSynchronize());
    const std::int64_t n_full = muse.count(kvring::LayerKind::kFullNope);
    std::int64_t full_bytes[2] = {0, 0};
    const std::int64_t shapes[2][2] = {{64, 8192}, {4, 131072}};
    for (int k = 0; k < 2; ++k) {
      const std::int64_t n = shapes[k][0], len = shapes[k][1];
      std::size_t free0 = 0, free1 = 0, total = 0;
      CHECK_CUDA(cudaMemGetInfo(&free0, &total));
      auto st = kvring::make_store(kvring::BackendKind::kCuda, muse, {.max_sequences = n, .context = len});
      check(st.status(), "creating a store");
      CHECK_CUDA(cudaMemGetInfo(&free1, &total));
      std::int64_t held = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        auto id = (*st)->add_sequence();
        check(id.status(), "adding a sequence");
        for (std::int64_t at = 0; at < len; at += 8192) {
          const SeqSpan span{*id, at, 8192};
          for (std::int64_t l = 0; l < L; ++l)
            check((*st)->store(l, std::span(&span, 1), kvring::device_view(sk, 8192, kv),
                               kvring::device_view(sv, 8192, kv)),
                  "fill");
        }
        held += *(*st)->blocks_held(*id);
      }
      check((*st)->synchronize(), "fill");
      full_bytes[k] = held * (*st)->block_bytes();
      const std::int64_t live = n * len * n_full * 1024;
      std::printf("  %3lld seqs x %6lld: store takes %.3f GiB of device memory at creation (%.3f GiB of planes: "
                  "pool %lld blocks of %lld B, rings), filled: %lld blocks = %lld B of full-attention rows "
                  "(live rows %lld B, over by %lld B = %.2f blocks per sequence per full layer)\n",
                  static_cast<long long>(n), static_cast<long long>(len), (free0 - free1) / 1073741824.0,
                  (*st)->allocated_bytes() / 1073741824.0, static_cast<long long>((*st)->pool_blocks()),
                  static_cast<long long>((*st)->block_bytes()), static_cast<long long>(held),
                  static_cast<long long>(full_bytes[k]), static_cast<long long>(live),
                  static_cast<long long>(full_bytes[k] - live),
                  static_cast<double>(full_bytes[k] - live) / (*st)->block_bytes() / (n * n_full));
    }
    std::printf("  full-attention bytes, 64 x 8192 vs 4 x 131072: %lld vs %lld (%s)\n",
                static_cast<long long>(full_bytes[0]), static_cast<long long>(full_bytes[1]),
                full_bytes[0] == full_bytes[1] ? "equal" : "DIFFER");
    CHECK_CUDA(cudaFree(sk));
    CHECK_CUDA(cudaFree(sv));
  }

  std::printf("\n%-46s %10s %12s %8s  %s\n", "figure", "median us", "GB/s", "ratio", "target");
  for (const Row& r : rows)
    std::printf("%-46s %10.2f %12.1f %7.1f%%  %s%s\n", r.name.c_str(), r.us, r.gbs(), 100 * r.ratio(),
                r.target.c_str(), r.met < 0 ? "" : (r.met ? " (met)" : " (MISSED)"));
  if (!json.empty()) write_json(json, prop.name, prop.multiProcessorCount);
  return 0;
}
