// The CUDA backend's cache: device planes, staging, the attention
// workspace, and the host and device-pointer entry points.
#include "kvring/cuda_cache.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels.h"

namespace kvring {
namespace {

Error cuda_error(const std::string& what, cudaError_t e) {
  return make_error(ErrorCode::kCuda, what + " failed: " + cudaGetErrorName(e) + " (" +
                                          cudaGetErrorString(e) + ")");
}

#define KVRING_CUDA_CHECK(what, expr)                     \
  do {                                                    \
    const cudaError_t kvring_e_ = (expr);                 \
    if (kvring_e_ != cudaSuccess) return cuda_error((what), kvring_e_); \
  } while (0)

constexpr std::size_t kAlign = 256;
// One staging slot; host copies move through two of them. Copies to or from
// pinned host memory skip the pinned slots and move in larger pieces (each
// DMA has a fixed start-up cost).
constexpr std::size_t kStageBytes = std::size_t{8} << 20;
constexpr std::size_t kDirectStageBytes = std::size_t{32} << 20;
// Attention workspace a launch may use; longer prefills are cut into
// several launches of fewer queries.
constexpr std::int64_t kWorkspaceBudget = std::int64_t{64} << 20;
constexpr int kMaxQueriesPerLaunch = 65535;  // grid.z

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool is_pinned(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

// Both ends of [p, p + bytes) in page-locked host memory: DMA straight there.
bool is_pinned_range(const void* p, std::size_t bytes) {
  return bytes > 0 && is_pinned(p) && is_pinned(static_cast<const char*>(p) + bytes - 1);
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Device memory that grows on demand; its contents do not survive growth.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  // At least `bytes`; zero-filled after growth when `zero`. Growth waits for
  // the device first: work in flight may still use the old buffer.
  Status reserve(std::size_t bytes, const char* what, cudaStream_t stream, bool zero = false) {
    if (bytes <= bytes_) return Status::Ok();
    KVRING_CUDA_CHECK("cudaDeviceSynchronize", cudaDeviceSynchronize());
    if (p_) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
    KVRING_CUDA_CHECK("cudaMalloc of " + std::to_string(bytes) + " bytes for " + what,
                      cudaMalloc(&p_, bytes));
    bytes_ = bytes;
    if (zero) {
      KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(p_, 0, bytes, stream));
      KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(stream));
    }
    return Status::Ok();
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  Status reserve(std::size_t bytes) {
    if (bytes <= bytes_) return Status::Ok();
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = 0;
    KVRING_CUDA_CHECK("cudaHostAlloc of " + std::to_string(bytes) + " bytes of staging",
                      cudaHostAlloc(&p_, bytes, cudaHostAllocDefault));
    bytes_ = bytes;
    return Status::Ok();
  }
  char* data() const { return static_cast<char*>(p_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

cuda::Shape shape_of(const ModelConfig& c) {
  return {static_cast<std::int32_t>(c.kv_dim()), static_cast<std::int32_t>(c.head_dim)};
}

// The largest multiple of row_bytes that fits `slot` bytes (at least one row).
std::size_t chunk_for(std::size_t row_bytes, std::size_t slot = kStageBytes) {
  return std::max<std::size_t>(1, slot / row_bytes) * row_bytes;
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

struct CudaCache::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t slot_done[2] = {nullptr, nullptr};
  void* arena = nullptr;  // every plane's K and V, kAlign-aligned
  std::vector<cuda::PlaneDev> planes;
  std::int64_t plane_bytes = 0;

  PinnedBuffer pinned[2];
  DeviceBuffer stage[2];
  DeviceBuffer q, out;               // host-API attention operands
  DeviceBuffer chunk_k, chunk_v;     // prefill chunk rows, f16
  DeviceBuffer workspace, counters;  // split partials; arrival counters
  // Resident-grid attention: tagged partials for up to tagged_ctas CTAs,
  // and the epoch of the last launch (kernels.h, AttendParams).
  DeviceBuffer tagged;
  int tagged_ctas = 0;
  std::uint32_t epoch = 0;

  ~Impl() {
    if (stream) cudaStreamSynchronize(stream);
    if (arena) cudaFree(arena);
    for (cudaEvent_t e : slot_done)
      if (e) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }

  // Makes the cache's device current (a no-op when it already is).
  Status activate() const {
    int current = -1;
    KVRING_CUDA_CHECK("cudaGetDevice", cudaGetDevice(&current));
    if (current != device) KVRING_CUDA_CHECK("cudaSetDevice", cudaSetDevice(device));
    return Status::Ok();
  }
  cudaStream_t pick(cudaStream_t s) const { return s ? s : stream; }

  // Syncs the stream after a failure so nothing in flight outlives the
  // buffers a caller may free; returns the failure.
  Status fail(Status s) {
    cudaStreamSynchronize(stream);
    cudaGetLastError();
    return s;
  }

  using Produce = std::function<Result<const void*>(int slot, std::size_t off, std::size_t n)>;
  using Consume = std::function<Status(int slot, const void* dev, std::size_t off, std::size_t n)>;

  // Device -> host in chunks of `chunk` bytes: `produce` enqueues whatever
  // makes bytes [off, off + n) ready at the device address it returns. A
  // pinned destination receives the DMA directly; otherwise two pinned
  // slots alternate so the host copies one while the device fills the other.
  Status download(void* host, std::size_t bytes, std::size_t chunk, const Produce& produce) {
    if (bytes == 0) return Status::Ok();
    char* dst = static_cast<char*>(host);
    const bool direct = is_pinned_range(host, bytes);
    const std::size_t n_chunks = (bytes + chunk - 1) / chunk;
    if (!direct)
      for (auto& p : pinned) KVRING_RETURN_IF_ERROR(p.reserve(std::min(chunk, bytes)));
    auto drain = [&](std::size_t c) -> Status {
      const int slot = static_cast<int>(c & 1);
      KVRING_CUDA_CHECK("cudaEventSynchronize", cudaEventSynchronize(slot_done[slot]));
      std::memcpy(dst + c * chunk, pinned[slot].data(), std::min(chunk, bytes - c * chunk));
      return Status::Ok();
    };
    for (std::size_t c = 0; c < n_chunks; ++c) {
      const int slot = static_cast<int>(c & 1);
      const std::size_t off = c * chunk, n = std::min(chunk, bytes - off);
      if (!direct && c >= 2) {
        Status s = drain(c - 2);
        if (!s.ok()) return fail(s);
      }
      auto src = produce(slot, off, n);
      if (!src) return fail(src.status());
      void* to = direct ? static_cast<void*>(dst + off) : pinned[slot].data();
      cudaError_t e = cudaMemcpyAsync(to, *src, n, cudaMemcpyDeviceToHost, stream);
      if (e == cudaSuccess) e = cudaEventRecord(slot_done[slot], stream);
      if (e != cudaSuccess) return fail(cuda_error("device-to-host copy", e));
    }
    if (!direct)
      for (std::size_t c = n_chunks >= 2 ? n_chunks - 2 : 0; c < n_chunks; ++c) {
        Status s = drain(c);
        if (!s.ok()) return fail(s);
      }
    KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(stream));
    return Status::Ok();
  }

  // Host -> device in chunks: each chunk lands at dev_dst + off, or in a
  // device staging slot when dev_dst is null, and `consume` (optional)
  // enqueues the work that uses it. Waits for the device before returning.
  Status upload(const void* host, std::size_t bytes, std::size_t chunk, void* dev_dst,
                const Consume& consume) {
    if (bytes == 0) return Status::Ok();
    const char* src = static_cast<const char*>(host);
    const bool direct = is_pinned_range(host, bytes);
    const std::size_t n_chunks = (bytes + chunk - 1) / chunk;
    if (!dev_dst)
      for (auto& d : stage)
        KVRING_RETURN_IF_ERROR(d.reserve(std::min(chunk, bytes), "staging", stream));
    if (!direct)
      for (auto& p : pinned) KVRING_RETURN_IF_ERROR(p.reserve(std::min(chunk, bytes)));
    for (std::size_t c = 0; c < n_chunks; ++c) {
      const int slot = static_cast<int>(c & 1);
      const std::size_t off = c * chunk, n = std::min(chunk, bytes - off);
      void* to = dev_dst ? static_cast<void*>(static_cast<char*>(dev_dst) + off)
                         : stage[slot].as<void>();
      const void* from = src + off;
      if (!direct) {
        // The slot's previous chunk has been copied to the device.
        cudaError_t e = cudaEventSynchronize(slot_done[slot]);
        if (e != cudaSuccess) return fail(cuda_error("cudaEventSynchronize", e));
        std::memcpy(pinned[slot].data(), src + off, n);
        from = pinned[slot].data();
      }
      cudaError_t e = cudaMemcpyAsync(to, from, n, cudaMemcpyHostToDevice, stream);
      if (e != cudaSuccess) return fail(cuda_error("host-to-device copy", e));
      if (consume) {
        Status s = consume(slot, to, off, n);
        if (!s.ok()) return fail(s);
      }
      e = cudaEventRecord(slot_done[slot], stream);
      if (e != cudaSuccess) return fail(cuda_error("cudaEventRecord", e));
    }
    KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(stream));
    return Status::Ok();
  }
};

CudaCache::CudaCache(ModelConfig config, std::int64_t context)
    : KvCache(std::move(config), context), impl_(std::make_unique<Impl>()) {}

CudaCache::~CudaCache() = default;

Result<std::unique_ptr<CudaCache>> CudaCache::create(const ModelConfig& config,
                                                     CacheOptions options) {
  KVRING_RETURN_IF_ERROR(config.validate());
  auto context = resolve_context(config, options.context);
  if (!context) return context.error();
  if (cuda_device_count() == 0)
    return make_error(ErrorCode::kUnsupported, "the CUDA backend needs a GPU; none is visible");
  std::unique_ptr<CudaCache> cache(new CudaCache(config, *context));
  Impl& im = *cache->impl_;
  KVRING_CUDA_CHECK("cudaGetDevice", cudaGetDevice(&im.device));
  KVRING_CUDA_CHECK("cudaStreamCreateWithFlags",
                    cudaStreamCreateWithFlags(&im.stream, cudaStreamNonBlocking));
  for (cudaEvent_t& e : im.slot_done)
    KVRING_CUDA_CHECK("cudaEventCreateWithFlags",
                      cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  // One allocation holds every plane: K then V per layer.
  std::size_t arena = 0;
  std::vector<std::size_t> offsets;
  for (std::int64_t l = 0; l < cache->n_layers(); ++l) {
    const auto bytes = static_cast<std::size_t>(cache->plane_bytes(l) / 2);
    offsets.push_back(arena);
    arena += align_up(bytes);
    offsets.push_back(arena);
    arena += align_up(bytes);
    im.plane_bytes += cache->plane_bytes(l);
  }
  cudaError_t e = cudaMalloc(&im.arena, arena);
  if (e != cudaSuccess) {
    im.arena = nullptr;
    cudaGetLastError();
    return cuda_error("allocating " + std::to_string(arena) + " bytes of device memory for the planes of a " +
                          std::to_string(*context) + "-position cache of '" + config.name + "'",
                      e);
  }
  char* base = static_cast<char*>(im.arena);
  for (std::int64_t l = 0; l < cache->n_layers(); ++l) {
    cuda::PlaneDev p;
    p.k = reinterpret_cast<std::uint16_t*>(base + offsets[static_cast<std::size_t>(2 * l)]);
    p.v = reinterpret_cast<std::uint16_t*>(base + offsets[static_cast<std::size_t>(2 * l + 1)]);
    p.capacity = cache->ring(l).capacity();
    p.layout = cache->layout(l);
    im.planes.push_back(p);
  }
  // Zero-filled on purpose: a wrapped row must never expose uninitialized
  // storage. Only a detached install skips it.
  if (options.zero_fill)
    KVRING_CUDA_CHECK("zero-filling the planes", cudaMemsetAsync(im.arena, 0, arena, im.stream));
  // Decode's workspace up front, so the first decode allocates nothing.
  const int n_heads = static_cast<int>(config.n_heads);
  const int n_kv = static_cast<int>(config.n_kv_heads);
  const int hd = static_cast<int>(config.head_dim);
  if (config.head_dim <= kCudaMaxHeadDim) {
    const auto ws = cuda::attend_workspace_floats(n_heads, n_kv, hd, cuda::kAttendMaxSplits);
    KVRING_RETURN_IF_ERROR(im.workspace.reserve(static_cast<std::size_t>(ws) * sizeof(float),
                                                "attention workspace", im.stream));
    KVRING_RETURN_IF_ERROR(im.counters.reserve(
        static_cast<std::size_t>(cuda::attend_grid(n_heads, n_kv, hd).items *
                                 cuda::attend_counters(cuda::kAttendMaxSplits)) *
            sizeof(unsigned),
        "attention counters", im.stream, true));
    // Resident grids are an optimisation: without room for their tagged
    // partials, attention takes the other combine paths.
    const int resident = cuda::attend_resident_ctas(hd);
    if (resident > 0) {
      if (im.tagged
              .reserve(static_cast<std::size_t>(resident *
                                                cuda::attend_tagged_words(n_heads, n_kv, hd)) *
                           sizeof(std::uint64_t),
                       "attention tagged partials", im.stream, true)
              .ok()) {
        im.tagged_ctas = resident;
      } else {
        (void)cudaGetLastError();
      }
    }
  }
  KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(im.stream));
  return cache;
}

Result<std::unique_ptr<KvCache>> make_cuda_cache(const ModelConfig& config, CacheOptions options) {
  auto c = CudaCache::create(config, options);
  if (!c) return c.error();
  return std::unique_ptr<KvCache>(std::move(*c));
}

std::int64_t CudaCache::allocated_bytes() const { return impl_->plane_bytes; }

std::int64_t CudaCache::workspace_bytes() const {
  const Impl& im = *impl_;
  std::size_t n = im.q.bytes() + im.out.bytes() + im.chunk_k.bytes() + im.chunk_v.bytes() +
                  im.workspace.bytes() + im.counters.bytes() + im.tagged.bytes();
  for (int s = 0; s < 2; ++s) n += im.stage[s].bytes() + im.pinned[s].bytes();
  return static_cast<std::int64_t>(n);
}

int CudaCache::device() const { return impl_->device; }
cudaStream_t CudaCache::stream() const { return impl_->stream; }

Status CudaCache::synchronize() const {
  KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(impl_->stream));
  return Status::Ok();
}

CudaCache::PlaneView CudaCache::plane_view(std::int64_t layer) const {
  if (!check_layer(layer).ok()) return {};
  const cuda::PlaneDev& p = impl_->planes[idx(layer)];
  return PlaneView{p.k, p.v, p.layout, p.capacity, config_.kv_dim(), config_.head_dim};
}

Status CudaCache::read_plane(std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (k == nullptr || v == nullptr) return invalid_argument("read_plane: null buffer");
  KVRING_RETURN_IF_ERROR(impl_->activate());
  const cuda::PlaneDev& p = impl_->planes[idx(layer)];
  const auto bytes = static_cast<std::size_t>(plane_bytes(layer) / 2);
  for (const auto& [dst, src] : {std::pair{k, p.k}, std::pair{v, p.v}})
    KVRING_RETURN_IF_ERROR(impl_->download(dst, bytes, kStageBytes,
                                           [src = src](int, std::size_t off, std::size_t) {
                                             return Result<const void*>(
                                                 reinterpret_cast<const char*>(src) + off);
                                           }));
  return Status::Ok();
}

Status CudaCache::clear_plane(std::int64_t layer) {
  KVRING_RETURN_IF_ERROR(impl_->activate());
  const cuda::PlaneDev& p = impl_->planes[idx(layer)];
  const auto bytes = static_cast<std::size_t>(plane_bytes(layer) / 2);
  KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(p.k, 0, bytes, impl_->stream));
  KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(p.v, 0, bytes, impl_->stream));
  KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(impl_->stream));
  return Status::Ok();
}

// ---- Stores ------------------------------------------------------------------

Status CudaCache::store_rows_device(std::int64_t layer, const BatchPlacement& placement,
                                    const float* k, const float* v, cudaStream_t stream) {
  const cuda::Shape shape = shape_of(config_);
  for (int s = 0; s < placement.n_spans; ++s) {
    const PhysicalSpan& span = placement.spans[static_cast<std::size_t>(s)];
    const std::int64_t src = span.source_first * config_.kv_dim();
    KVRING_CUDA_CHECK("store kernel launch",
                      cuda::launch_store_rows(impl_->planes[idx(layer)], shape, span.physical_first,
                                              span.rows, k + src, v + src, stream));
  }
  return Status::Ok();
}

Status CudaCache::write_token(std::int64_t layer, std::int64_t physical, const float* k,
                              const float* v) {
  BatchPlacement one;
  one.live_rows = 1;
  one.n_spans = 1;
  one.spans[0] = PhysicalSpan{physical, 0, 1};
  return write_batch(layer, one, 1, k, v);
}

Status CudaCache::write_batch(std::int64_t layer, const BatchPlacement& placement, std::int64_t,
                              const float* k, const float* v) {
  KVRING_RETURN_IF_ERROR(impl_->activate());
  const cuda::Shape shape = shape_of(config_);
  const std::size_t row_bytes = static_cast<std::size_t>(config_.kv_dim()) * sizeof(float);
  const cuda::PlaneDev& plane = impl_->planes[idx(layer)];
  for (int s = 0; s < placement.n_spans; ++s) {
    const PhysicalSpan& span = placement.spans[static_cast<std::size_t>(s)];
    // K, then V: each through the staging slots into its own plane buffer.
    for (const auto& [src, dst] : {std::pair{k, plane.k}, std::pair{v, plane.v}}) {
      cuda::PlaneDev one = plane;
      one.k = dst;
      one.v = nullptr;
      KVRING_RETURN_IF_ERROR(impl_->upload(
          src + span.source_first * config_.kv_dim(), static_cast<std::size_t>(span.rows) * row_bytes,
          chunk_for(row_bytes), nullptr,
          [&](int, const void* dev, std::size_t off, std::size_t n) -> Status {
            KVRING_CUDA_CHECK(
                "store kernel launch",
                cuda::launch_store_rows(one, shape,
                                        span.physical_first + static_cast<std::int64_t>(off / row_bytes),
                                        static_cast<std::int64_t>(n / row_bytes),
                                        static_cast<const float*>(dev), nullptr, impl_->stream));
            return Status::Ok();
          }));
    }
  }
  return Status::Ok();
}

Status CudaCache::store_token_device(std::int64_t layer, std::int64_t position, const float* k,
                                     const float* v, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (k == nullptr || v == nullptr) return invalid_argument("store_token_device: null buffer");
  RingState next = rings_[idx(layer)];
  auto physical = next.append(layer, position);
  if (!physical) return physical.error();
  KVRING_RETURN_IF_ERROR(impl_->activate());
  BatchPlacement one;
  one.live_rows = 1;
  one.n_spans = 1;
  one.spans[0] = PhysicalSpan{*physical, 0, 1};
  KVRING_RETURN_IF_ERROR(store_rows_device(layer, one, k, v, impl_->pick(stream)));
  rings_[idx(layer)] = next;
  return Status::Ok();
}

Status CudaCache::store_batch_device(std::int64_t layer, std::int64_t start, std::int64_t count,
                                     const float* k, const float* v, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (k == nullptr || v == nullptr) return invalid_argument("store_batch_device: null buffer");
  auto placement = rings_[idx(layer)].plan_batch(layer, start, count);
  if (!placement) return placement.error();
  KVRING_RETURN_IF_ERROR(impl_->activate());
  KVRING_RETURN_IF_ERROR(store_rows_device(layer, *placement, k, v, impl_->pick(stream)));
  rings_[idx(layer)].commit_batch(count);
  return Status::Ok();
}

Status CudaCache::store_token_all_layers_device(std::int64_t position, const float* k,
                                                const float* v, cudaStream_t stream) {
  if (k == nullptr || v == nullptr)
    return invalid_argument("store_token_all_layers_device: null buffer");
  // Every layer must accept the position before any changes.
  std::vector<RingState> next = rings_;
  std::vector<std::int64_t> physical(next.size());
  for (std::size_t l = 0; l < next.size(); ++l) {
    auto p = next[l].append(static_cast<std::int64_t>(l), position);
    if (!p) return p.error();
    physical[l] = *p;
  }
  KVRING_RETURN_IF_ERROR(impl_->activate());
  const cuda::Shape shape = shape_of(config_);
  for (std::size_t l0 = 0; l0 < next.size(); l0 += cuda::kMaxLayersPerStore) {
    cuda::LayerRows rows;
    rows.n = static_cast<int>(std::min<std::size_t>(cuda::kMaxLayersPerStore, next.size() - l0));
    for (int i = 0; i < rows.n; ++i) {
      rows.plane[i] = impl_->planes[l0 + static_cast<std::size_t>(i)];
      rows.physical[i] = physical[l0 + static_cast<std::size_t>(i)];
    }
    const std::int64_t off = static_cast<std::int64_t>(l0) * config_.kv_dim();
    KVRING_CUDA_CHECK("store kernel launch",
                      cuda::launch_store_token_layers(rows, shape, k + off, v + off,
                                                      impl_->pick(stream)));
  }
  rings_ = std::move(next);
  return Status::Ok();
}

Status CudaCache::store_batch_all_layers_device(std::int64_t start, std::int64_t count,
                                                const float* k, const float* v,
                                                cudaStream_t stream) {
  if (k == nullptr || v == nullptr)
    return invalid_argument("store_batch_all_layers_device: null buffer");
  const std::int64_t layers = n_layers();
  const std::int64_t kv = config_.kv_dim();
  // The sources hold layers * count * kv floats; their offsets must fit.
  if (count > std::numeric_limits<std::int64_t>::max() / 4 / (layers * kv))
    return invalid_argument("store_batch_all_layers_device: batch of " + std::to_string(count) +
                            " rows is too large");
  // Every layer must accept the batch before any changes.
  std::vector<BatchPlacement> plans(static_cast<std::size_t>(layers));
  for (std::int64_t l = 0; l < layers; ++l) {
    auto p = rings_[idx(l)].plan_batch(l, start, count);
    if (!p) return p.error();
    plans[idx(l)] = *p;
  }
  KVRING_RETURN_IF_ERROR(impl_->activate());
  const cuda::Shape shape = shape_of(config_);
  cuda::SpanRows spans;
  auto launch = [&]() -> Status {
    KVRING_CUDA_CHECK("store kernel launch", cuda::launch_store_spans(spans, shape, impl_->pick(stream)));
    spans.n = 0;
    return Status::Ok();
  };
  for (std::int64_t l = 0; l < layers; ++l) {
    const BatchPlacement& plan = plans[idx(l)];
    for (int s = 0; s < plan.n_spans; ++s) {
      const PhysicalSpan& span = plan.spans[static_cast<std::size_t>(s)];
      const std::int64_t src = (l * count + span.source_first) * kv;
      spans.plane[spans.n] = impl_->planes[idx(l)];
      spans.physical[spans.n] = span.physical_first;
      spans.rows[spans.n] = span.rows;
      spans.k[spans.n] = k + src;
      spans.v[spans.n] = v + src;
      if (++spans.n == cuda::kMaxSpansPerStore) KVRING_RETURN_IF_ERROR(launch());
    }
  }
  KVRING_RETURN_IF_ERROR(launch());
  for (std::int64_t l = 0; l < layers; ++l) rings_[idx(l)].commit_batch(count);
  return Status::Ok();
}

// ---- Snapshot copies -----------------------------------------------------------

namespace {

cuda::SpanMap span_map(const LiveSpans& spans) {
  cuda::SpanMap m;
  if (spans.n_spans >= 1) {
    m.physical[0] = spans.spans[0].physical_first;
    m.rows0 = spans.spans[0].rows;
  }
  if (spans.n_spans == 2) m.physical[1] = spans.spans[1].physical_first;
  return m;
}

std::int64_t span_rows(const LiveSpans& spans) {
  std::int64_t n = 0;
  for (int s = 0; s < spans.n_spans; ++s) n += spans.spans[static_cast<std::size_t>(s)].rows;
  return n;
}

// What copy_out and copy_in share: the rows' map and sizes, and the staging
// piece (larger when both host buffers are pinned and the DMA goes direct).
struct SnapshotCopy {
  cuda::Shape shape;
  cuda::SpanMap map;
  std::size_t row_bytes, bytes, chunk;
};

SnapshotCopy snapshot_copy(const ModelConfig& config, const LiveSpans& spans, const void* k,
                           const void* v) {
  SnapshotCopy c{shape_of(config), span_map(spans), static_cast<std::size_t>(config.kv_dim()) * 2,
                 0, 0};
  c.bytes = static_cast<std::size_t>(span_rows(spans)) * c.row_bytes;
  const bool direct = is_pinned_range(k, c.bytes) && is_pinned_range(v, c.bytes);
  c.chunk = chunk_for(c.row_bytes, direct ? kDirectStageBytes : kStageBytes);
  return c;
}

}  // namespace

Status CudaCache::copy_out(std::int64_t layer, const LiveSpans& spans, std::uint16_t* k,
                           std::uint16_t* v) const {
  KVRING_RETURN_IF_ERROR(impl_->activate());
  Impl& im = *impl_;
  const cuda::PlaneDev& plane = im.planes[idx(layer)];
  const auto [shape, map, row_bytes, bytes, chunk] = snapshot_copy(config_, spans, k, v);
  for (auto& d : im.stage)
    KVRING_RETURN_IF_ERROR(d.reserve(std::min(chunk, bytes), "staging", im.stream));
  for (const auto& [dst, src] : {std::pair{k, plane.k}, std::pair{v, plane.v}}) {
    KVRING_RETURN_IF_ERROR(im.download(
        dst, bytes, chunk, [&, src = src](int slot, std::size_t off, std::size_t n) -> Result<const void*> {
          std::uint16_t* out = im.stage[slot].as<std::uint16_t>();
          KVRING_CUDA_CHECK("gather kernel launch",
                            cuda::launch_gather_rows(src, plane.capacity, plane.layout, shape, map,
                                                     static_cast<std::int64_t>(off / row_bytes),
                                                     static_cast<std::int64_t>(n / row_bytes), out,
                                                     im.stream));
          return static_cast<const void*>(out);
        }));
  }
  return Status::Ok();
}

Status CudaCache::copy_in(std::int64_t layer, const LiveSpans& spans, const std::uint16_t* k,
                          const std::uint16_t* v) {
  KVRING_RETURN_IF_ERROR(impl_->activate());
  Impl& im = *impl_;
  const cuda::PlaneDev& plane = im.planes[idx(layer)];
  const auto [shape, map, row_bytes, bytes, chunk] = snapshot_copy(config_, spans, k, v);
  for (const auto& [src, dst] : {std::pair{k, plane.k}, std::pair{v, plane.v}}) {
    KVRING_RETURN_IF_ERROR(im.upload(
        src, bytes, chunk, nullptr,
        [&, dst = dst](int, const void* dev, std::size_t off, std::size_t n) -> Status {
          KVRING_CUDA_CHECK("scatter kernel launch",
                            cuda::launch_scatter_rows(dst, plane.capacity, plane.layout, shape, map,
                                                      static_cast<std::int64_t>(off / row_bytes),
                                                      static_cast<std::int64_t>(n / row_bytes),
                                                      static_cast<const std::uint16_t*>(dev),
                                                      im.stream));
          return Status::Ok();
        }));
  }
  return Status::Ok();
}

// ---- Attention -----------------------------------------------------------------

namespace {

Status check_head_dim(const ModelConfig& c) {
  if (c.head_dim > kCudaMaxHeadDim)
    return make_error(ErrorCode::kUnsupported,
                      "CUDA attention supports head_dim up to " + std::to_string(kCudaMaxHeadDim) +
                          "; model '" + c.name + "' has head_dim " + std::to_string(c.head_dim));
  return Status::Ok();
}

}  // namespace

Status CudaCache::attend_on_device(const AttendArgs& a, cudaStream_t stream) {
  Impl& im = *impl_;
  const int n_heads = static_cast<int>(config_.n_heads);
  const int n_kv = static_cast<int>(config_.n_kv_heads);
  const int hd = static_cast<int>(config_.head_dim);
  const bool sliding = config_.kind(a.layer) == LayerKind::kSlidingRope;
  const cuda::PlaneDev& plane = im.planes[idx(a.layer)];
  const std::int64_t q_stride = config_.n_heads * config_.head_dim;

  cuda::AttendParams P;
  P.plane_k = plane.k;
  P.plane_v = plane.v;
  P.capacity = plane.capacity;
  P.token_major = plane.layout == Layout::kTokenMajor ? 1 : 0;
  P.origin_logical = a.ring.origin_logical();
  P.origin_physical = a.ring.origin_physical();
  P.chunk_k = a.chunk_k;
  P.chunk_v = a.chunk_v;
  P.chunk_start = a.chunk_start;
  P.n_heads = n_heads;
  P.n_kv_heads = n_kv;
  P.head_dim = hd;
  P.kv_dim = static_cast<std::int32_t>(config_.kv_dim());
  P.window = sliding ? config_.sliding_window : 0;
  P.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(hd)));

  const std::int64_t per_query_max =
      cuda::attend_workspace_floats(n_heads, n_kv, hd, cuda::kAttendMaxSplits) *
      static_cast<std::int64_t>(sizeof(float));
  const std::int64_t batch =
      std::clamp<std::int64_t>(kWorkspaceBudget / per_query_max, 1, kMaxQueriesPerLaunch);
  const int items = cuda::attend_grid(n_heads, n_kv, hd).items;
  // A resident grid needs an epoch no earlier launch used. A launch
  // captured into a CUDA graph would replay with the epoch it was captured
  // with, so captured launches take the other combine paths.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVRING_CUDA_CHECK("cudaStreamIsCapturing", cudaStreamIsCapturing(stream, &capture));
  for (std::int64_t q0 = 0; q0 < a.n_queries; q0 += batch) {
    const std::int64_t nq = std::min(batch, a.n_queries - q0);
    int max_splits = 1;
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t p = a.first_position + q0 + i;
      const std::int64_t lo = visible_begin(config_, config_.kind(a.layer), p);
      max_splits = std::max(max_splits, static_cast<int>(cuda::attend_splits(p - lo + 1)));
    }
    if (max_splits > 1) {
      const std::int64_t floats = nq * cuda::attend_workspace_floats(n_heads, n_kv, hd, max_splits);
      KVRING_RETURN_IF_ERROR(im.workspace.reserve(static_cast<std::size_t>(floats) * sizeof(float),
                                                  "attention workspace", im.stream));
      KVRING_RETURN_IF_ERROR(im.counters.reserve(
          static_cast<std::size_t>(nq * items * cuda::attend_counters(max_splits)) * sizeof(unsigned),
          "attention counters", im.stream, true));
      const cuda::AttendGrid g = cuda::attend_grid(n_heads, n_kv, hd);
      P.ws_o = im.workspace.as<float>();
      P.ws_ml = P.ws_o + nq * g.items * cuda::attend_slots(max_splits) * g.heads_per_item * hd;
      P.counters = im.counters.as<unsigned>();
    }
    P.max_splits = max_splits;
    if (im.tagged_ctas > 0 && capture == cudaStreamCaptureStatusNone) {
      // A fresh epoch per launch; when the count wraps, the words are
      // zeroed (in stream order) so no old word can carry a reused epoch.
      std::uint32_t epoch = im.epoch + 1;
      if (const std::uint32_t next = cuda::testing_next_epoch(); next != 0) epoch = next;
      if (epoch == 0) {
        KVRING_CUDA_CHECK("cudaMemsetAsync",
                          cudaMemsetAsync(im.tagged.as<void>(), 0, im.tagged.bytes(), stream));
        epoch = 1;
      }
      im.epoch = epoch;
      P.tagged = im.tagged.as<std::uint64_t>();
      P.tagged_ctas = im.tagged_ctas;
      P.epoch = epoch;
    }
    P.first_position = a.first_position + q0;
    P.n_queries = static_cast<std::int32_t>(nq);
    P.q = a.q + q0 * q_stride;
    P.out = a.out + q0 * q_stride;
    KVRING_CUDA_CHECK("attention kernel launch", cuda::launch_attend(P, stream));
  }
  return Status::Ok();
}

Status CudaCache::attend(const AttendArgs& a) {
  KVRING_RETURN_IF_ERROR(check_head_dim(config_));
  KVRING_RETURN_IF_ERROR(impl_->activate());
  Impl& im = *impl_;
  const std::size_t q_bytes =
      static_cast<std::size_t>(a.n_queries * config_.n_heads * config_.head_dim) * sizeof(float);
  KVRING_RETURN_IF_ERROR(im.q.reserve(q_bytes, "attention queries", im.stream));
  KVRING_RETURN_IF_ERROR(im.out.reserve(q_bytes, "attention output", im.stream));
  AttendArgs dev = a;
  if (a.chunk_k != nullptr) {
    const std::int64_t rows = a.first_position + a.n_queries - a.chunk_start;
    const std::size_t bytes = static_cast<std::size_t>(rows * config_.kv_dim()) * 2;
    KVRING_RETURN_IF_ERROR(im.chunk_k.reserve(bytes, "prefill chunk", im.stream));
    KVRING_RETURN_IF_ERROR(im.chunk_v.reserve(bytes, "prefill chunk", im.stream));
    KVRING_RETURN_IF_ERROR(im.upload(a.chunk_k, bytes, kStageBytes, im.chunk_k.as<void>(), nullptr));
    KVRING_RETURN_IF_ERROR(im.upload(a.chunk_v, bytes, kStageBytes, im.chunk_v.as<void>(), nullptr));
    dev.chunk_k = im.chunk_k.as<std::uint16_t>();
    dev.chunk_v = im.chunk_v.as<std::uint16_t>();
  }
  KVRING_RETURN_IF_ERROR(im.upload(a.q, q_bytes, kStageBytes, im.q.as<void>(), nullptr));
  // Poison: an element the kernels fail to write reads back as NaN.
  KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(im.out.as<void>(), 0xff, q_bytes, im.stream));
  dev.q = im.q.as<float>();
  dev.out = im.out.as<float>();
  Status s = attend_on_device(dev, im.stream);
  if (!s.ok()) return im.fail(s);
  return im.download(a.out, q_bytes, kStageBytes, [&](int, std::size_t off, std::size_t) {
    return Result<const void*>(im.out.as<char>() + off);
  });
}

Status CudaCache::attend_decode_device(std::int64_t layer, std::int64_t position, const float* q,
                                       float* out, cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_decode(layer, position));
  if (q == nullptr || out == nullptr) return invalid_argument("attend_decode_device: null buffer");
  if (!aligned16(q) || !aligned16(out))
    return invalid_argument("attend_decode_device: q and out need 16-byte alignment");
  KVRING_RETURN_IF_ERROR(check_head_dim(config_));
  KVRING_RETURN_IF_ERROR(impl_->activate());
  return attend_on_device(
      AttendArgs{layer, ring(layer), position, 1, position + 1, nullptr, nullptr, q, out},
      impl_->pick(stream));
}

Status CudaCache::prefill_device(std::int64_t layer, std::int64_t start, std::int64_t count,
                                 const float* k, const float* v, const float* q, float* out,
                                 cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(check_layer(layer));
  if (k == nullptr || v == nullptr || q == nullptr || out == nullptr)
    return invalid_argument("prefill_device: null buffer");
  if (!aligned16(q) || !aligned16(out))
    return invalid_argument("prefill_device: q and out need 16-byte alignment");
  auto placement = check_prefill(layer, start, count);
  if (!placement) return placement.error();
  KVRING_RETURN_IF_ERROR(check_head_dim(config_));
  KVRING_RETURN_IF_ERROR(impl_->activate());
  Impl& im = *impl_;
  const cudaStream_t s = im.pick(stream);
  // The chunk's rows exactly as the store will hold them.
  const std::int64_t n = count * config_.kv_dim();
  KVRING_RETURN_IF_ERROR(im.chunk_k.reserve(static_cast<std::size_t>(n) * 2, "prefill chunk", im.stream));
  KVRING_RETURN_IF_ERROR(im.chunk_v.reserve(static_cast<std::size_t>(n) * 2, "prefill chunk", im.stream));
  KVRING_CUDA_CHECK("convert kernel launch",
                    cuda::launch_convert_f16(k, im.chunk_k.as<std::uint16_t>(), n, s));
  KVRING_CUDA_CHECK("convert kernel launch",
                    cuda::launch_convert_f16(v, im.chunk_v.as<std::uint16_t>(), n, s));
  KVRING_RETURN_IF_ERROR(attend_on_device(
      AttendArgs{layer, ring(layer), start, count, start, im.chunk_k.as<std::uint16_t>(),
                 im.chunk_v.as<std::uint16_t>(), q, out},
      s));
  KVRING_RETURN_IF_ERROR(store_rows_device(layer, *placement, k, v, s));
  rings_[idx(layer)].commit_batch(count);
  return Status::Ok();
}

}  // namespace kvring
