// Helpers shared by the CUDA tests: skipping without a GPU, device buffers,
// store images, and a seeded driver that runs sequences through a store in
// random batch compositions (with slot churn), recording every output.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "cuda/launch_policy.h"
#include "kvring/cuda_store.h"
#include "kvring/f16.h"
#include "kvring/store.h"
#include "test_util.h"

namespace kvring::testing {

#define KVRING_SKIP_WITHOUT_GPU() \
  if (::kvring::cuda_device_count() == 0) GTEST_SKIP() << "no GPU visible"

// Smaller problems for runs under compute-sanitizer (KVRING_TEST_QUICK=1).
inline bool quick() {
  const char* q = std::getenv("KVRING_TEST_QUICK");
  return q != nullptr && q[0] == '1';
}

// A device allocation for a test. Its upload and poison return once done:
// cudaMemcpy from pageable memory may return before its copy lands and
// cudaMemset before it runs, both on the legacy stream, which the stores'
// streams (non-blocking) do not wait for.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // After every stream's work: the store's streams do not wait for the
  // legacy default stream's copies, nor these for them.
  std::vector<T> download() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  // Every byte 0xff: as f32 a NaN, so an element nothing writes shows.
  void poison() {
    EXPECT_EQ(cudaMemset(p_, 0xff, n_ * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  T* get() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

// Leaves an error pending on this thread's runtime, as an engine's failed
// cudaMalloc whose error it handled but never read with cudaGetLastError.
inline void leave_pending_error() {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, std::size_t{1} << 60), cudaErrorMemoryAllocation);
}

// Read-only views of test buffers.
inline ConstView host_in(const float* p, std::int64_t rows, std::int64_t cols) {
  return host_view(p, rows, cols);
}
inline ConstView device_in(const float* p, std::int64_t rows, std::int64_t cols) {
  return device_view(p, rows, cols);
}

inline std::unique_ptr<KvStore> new_store(BackendKind kind, const ModelConfig& c,
                                          StoreOptions o) {
  auto r = make_store(kind, c, o);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? std::move(*r) : nullptr;
}

// A CUDA store whose attention launches under `policy` instead of the
// device's own.
inline std::unique_ptr<KvStore> new_cuda_store(const ModelConfig& c, StoreOptions o,
                                               const cuda::LaunchPolicy& policy) {
  auto r = CudaStore::create(c, o, &policy);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? std::unique_ptr<KvStore>(std::move(*r)) : nullptr;
}

// Every ring state and plane image of one sequence.
struct SeqImage {
  std::vector<RingState> rings;
  std::vector<std::vector<std::uint16_t>> k, v;
  bool operator==(const SeqImage&) const = default;
};
inline SeqImage seq_image(const KvStore& s, SeqId seq) {
  SeqImage im;
  for (std::int64_t l = 0; l < s.n_layers(); ++l) {
    auto r = s.ring(seq, l);
    EXPECT_TRUE(r.ok());
    im.rings.push_back(r.ok() ? *r : RingState{});
    const auto n = static_cast<std::size_t>(s.capacity(l) * s.config().kv_dim());
    im.k.emplace_back(n);
    im.v.emplace_back(n);
    const Status st = s.read_plane(seq, l, im.k.back().data(), im.v.back().data());
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
  return im;
}

// One sequence's inputs: K/V rows [n_layers][len][kv_dim] and queries
// [n_layers][len][n_heads * head_dim], seeded.
struct SeqInputs {
  std::int64_t len = 0;
  std::vector<float> k, v, q;
};
inline SeqInputs seq_inputs(const ModelConfig& c, std::int64_t len, std::uint64_t seed) {
  SeqInputs s;
  s.len = len;
  const auto kv = static_cast<std::size_t>(c.n_layers * len * c.kv_dim());
  const auto qn = static_cast<std::size_t>(c.n_layers * len * c.n_heads * c.head_dim);
  s.k = random_floats(kv, seed, 2.0f);
  s.v = random_floats(kv, seed + 1, 2.0f);
  s.q = random_floats(qn, seed + 2, 1.0f);
  return s;
}

// Outputs by (sequence, layer, position): one query's [n_heads * head_dim].
using Outputs = std::map<std::tuple<int, std::int64_t, std::int64_t>, std::vector<float>>;

// A plan of steps over sequences 0..n-1: in each step some sequences (in a
// random order) advance by a chunk (prefill) or by one stored token whose
// query is then decoded (store + attend_decode, the queries in random order).
struct Step {
  bool decode = false;
  std::vector<std::pair<int, std::int64_t>> chunks;  // (sequence, tokens)
};
inline std::vector<Step> random_plan(const std::vector<SeqInputs>& seqs, std::uint64_t seed,
                                     std::int64_t max_chunk) {
  std::mt19937_64 rng(seed);
  std::vector<std::int64_t> at(seqs.size(), 0);
  std::vector<Step> plan;
  for (;;) {
    std::vector<int> open;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (at[i] < seqs[i].len) open.push_back(static_cast<int>(i));
    if (open.empty()) break;
    std::shuffle(open.begin(), open.end(), rng);
    Step st;
    st.decode = rng() % 3 == 0;
    const std::size_t take = 1 + rng() % open.size();
    for (std::size_t j = 0; j < take; ++j) {
      const int i = open[j];
      const std::int64_t left = seqs[static_cast<std::size_t>(i)].len - at[static_cast<std::size_t>(i)];
      const std::int64_t n = st.decode ? 1 : std::min<std::int64_t>(left, 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(max_chunk)));
      st.chunks.emplace_back(i, n);
      at[static_cast<std::size_t>(i)] += n;
    }
    plan.push_back(st);
  }
  return plan;
}

// Runs `plan` on `store` for sequences already added as `ids`, every layer
// per step, with host or device views, on `stream`. Records outputs.
inline void run_plan(KvStore& store, const std::vector<SeqId>& ids,
                     const std::vector<SeqInputs>& seqs, const std::vector<Step>& plan,
                     Outputs& outs, bool device = false, cudaStream_t stream = nullptr,
                     std::vector<std::int64_t>* progress = nullptr) {
  const ModelConfig& c = store.config();
  const std::int64_t kv = c.kv_dim(), width = c.n_heads * c.head_dim;
  std::vector<std::int64_t> at_local(seqs.size(), 0);
  std::vector<std::int64_t>& at = progress ? *progress : at_local;
  if (at.size() < seqs.size()) at.resize(seqs.size(), 0);
  for (const Step& st : plan) {
    std::int64_t rows = 0;
    for (const auto& [i, n] : st.chunks) rows += n;
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      std::vector<float> k(static_cast<std::size_t>(rows * kv)), v(k.size()),
          q(static_cast<std::size_t>(rows * width)), out(q.size(), NAN);
      std::vector<SeqSpan> spans;
      std::vector<SeqQuery> queries;
      std::int64_t r = 0;
      for (const auto& [i, n] : st.chunks) {
        const SeqInputs& s = seqs[static_cast<std::size_t>(i)];
        const std::int64_t p0 = at[static_cast<std::size_t>(i)];
        std::memcpy(k.data() + r * kv, s.k.data() + (l * s.len + p0) * kv, static_cast<std::size_t>(n * kv) * 4);
        std::memcpy(v.data() + r * kv, s.v.data() + (l * s.len + p0) * kv, static_cast<std::size_t>(n * kv) * 4);
        std::memcpy(q.data() + r * width, s.q.data() + (l * s.len + p0) * width,
                    static_cast<std::size_t>(n * width) * 4);
        spans.push_back(SeqSpan{ids[static_cast<std::size_t>(i)], p0, n});
        queries.push_back(SeqQuery{ids[static_cast<std::size_t>(i)], p0});
        r += n;
      }
      Status status;
      if (!device) {
        const ConstView hk = host_in(k.data(), rows, kv), hv = host_in(v.data(), rows, kv),
                        hq = host_in(q.data(), rows, width);
        const MutView ho = host_view(out.data(), rows, width);
        if (st.decode) {
          status = store.store(l, spans, hk, hv);
          if (status.ok()) status = store.attend_decode(l, queries, hq, ho);
        } else {
          status = store.prefill(l, spans, hk, hv, hq, ho);
        }
      } else {
        // Device queries and outputs need rows of whole float4s: pad them.
        const std::int64_t ws = (width + 3) / 4 * 4;
        std::vector<float> qp(static_cast<std::size_t>(rows * ws), 0.0f);
        for (std::int64_t i = 0; i < rows; ++i)
          std::memcpy(qp.data() + i * ws, q.data() + i * width, static_cast<std::size_t>(width) * 4);
        DeviceArray<float> dk(k), dv(v), dq(qp), dout(qp.size());
        dout.poison();
        const ConstView ck = device_in(dk.get(), rows, kv), cv = device_in(dv.get(), rows, kv),
                        cq{dq.get(), MemorySpace::kDevice, DType::kF32, rows, width, ws};
        const MutView co{dout.get(), MemorySpace::kDevice, DType::kF32, rows, width, ws};
        if (st.decode) {
          status = store.store(l, spans, ck, cv, stream);
          if (status.ok()) status = store.attend_decode(l, queries, cq, co, stream);
        } else {
          status = store.prefill(l, spans, ck, cv, cq, co, stream);
        }
        if (status.ok()) status = store.synchronize(stream);
        const std::vector<float> padded = dout.download();
        for (std::int64_t i = 0; i < rows; ++i)
          std::memcpy(out.data() + i * width, padded.data() + i * ws, static_cast<std::size_t>(width) * 4);
      }
      ASSERT_TRUE(status.ok()) << status.to_string();
      r = 0;
      for (const auto& [i, n] : st.chunks) {
        for (std::int64_t j = 0; j < n; ++j) {
          const float* o = out.data() + (r + j) * width;
          outs[{i, l, at[static_cast<std::size_t>(i)] + j}] = std::vector<float>(o, o + width);
        }
        r += n;
      }
    }
    for (const auto& [i, n] : st.chunks) at[static_cast<std::size_t>(i)] += n;
  }
}

// The worst difference |x - y| / max(1, |y|) of `got` from `ref` over
// every output `ref` holds (how the CUDA tests compare with the CPU
// backend); +inf where `got` lacks an output or holds a value that is not
// finite.
inline double worst_difference(const Outputs& got, const Outputs& ref) {
  double worst = 0;
  for (const auto& [key, y] : ref) {
    const auto it = got.find(key);
    if (it == got.end() || it->second.size() != y.size()) return INFINITY;
    for (std::size_t e = 0; e < y.size(); ++e) {
      const double x = it->second[e];
      if (!std::isfinite(x)) return INFINITY;
      worst = std::max(worst, std::abs(x - y[e]) / std::max(1.0, std::abs(double(y[e]))));
    }
  }
  return worst;
}

// The live rows of one plane of a sequence in logical order (read_rows),
// K then V, [len * kv_dim] each.
inline std::pair<std::vector<std::uint16_t>, std::vector<std::uint16_t>> live_rows(const KvStore& s, SeqId seq,
                                                                                   std::int64_t layer) {
  const auto r = s.ring(seq, layer);
  EXPECT_TRUE(r.ok());
  if (!r.ok()) return {};
  const auto n = static_cast<std::size_t>(r->len() * s.config().kv_dim());
  std::vector<std::uint16_t> k(n), v(n);
  const Status st = s.read_rows(seq, layer, r->origin_logical(), r->len(), k.data(), v.data());
  EXPECT_TRUE(st.ok()) << st.to_string();
  return {std::move(k), std::move(v)};
}

// Adds and removes filler sequences (storing a few rows into every layer,
// so blocks are taken and freed out of order), then adds `n` sequences:
// they land in scattered slots with scattered blocks.
inline std::vector<SeqId> add_with_churn(KvStore& store, int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const ModelConfig& c = store.config();
  std::vector<SeqId> fillers;
  const int max = static_cast<int>(store.options().max_sequences);
  const int n_fill = std::max(0, std::min(max - n, 1 + static_cast<int>(rng() % 4)));
  for (int i = 0; i < n_fill + n && i < max; ++i) {
    auto s = store.add_sequence();
    EXPECT_TRUE(s.ok());
    if (!s.ok()) break;
    const std::int64_t rows = 1 + static_cast<std::int64_t>(rng() % 40);
    const auto x = random_floats(static_cast<std::size_t>(rows * c.kv_dim() * c.n_layers), rng());
    const SeqSpan span{*s, 0, rows};
    EXPECT_TRUE(store.store_all_layers(std::span(&span, 1), host_view(x.data(), rows * c.n_layers, c.kv_dim()),
                                       host_view(x.data(), rows * c.n_layers, c.kv_dim())).ok());
    fillers.push_back(*s);
  }
  std::shuffle(fillers.begin(), fillers.end(), rng);
  for (int i = 0; i < n && i < static_cast<int>(fillers.size()); ++i)
    EXPECT_TRUE(store.remove_sequence(fillers[static_cast<std::size_t>(i)]).ok());
  std::vector<SeqId> ids;
  for (int i = 0; i < n; ++i) {
    auto s = store.add_sequence();
    EXPECT_TRUE(s.ok()) << (s.ok() ? "" : s.error().to_string());
    if (s.ok()) ids.push_back(*s);
  }
  return ids;
}

}  // namespace kvring::testing
