// The CUDA backend of KvStore: device rings and pool, the block-table
// mirror, descriptor uploads, the attention workspace, host staging, and
// every hook of the base class.
#include "kvring/cuda_store.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "allocation.h"
#include "core/log2_units.h"
#include "core/view_rows.h"
#include "device_scope.h"
#include "kernels.h"
#include "launch_policy.h"

#ifndef KVRING_CUDA_TARGETS
#define KVRING_CUDA_TARGETS "sm_90a"
#endif

namespace kvring {
namespace {

Error cuda_error(const std::string& what, cudaError_t e) {
  return make_error(ErrorCode::kCuda, what + " failed: " + cudaGetErrorName(e) + " (" +
                                          cudaGetErrorString(e) + ")");
}

#define KVRING_CUDA_CHECK(what, expr)                                   \
  do {                                                                  \
    const cudaError_t kvring_e_ = (expr);                               \
    if (kvring_e_ != cudaSuccess) {                                     \
      (void)cudaGetLastError();                                         \
      return cuda_error((what), kvring_e_);                             \
    }                                                                   \
  } while (0)

// Every method that calls CUDA opens a DeviceScope on the store's device
// first (device_scope.h).
using cuda::DeviceScope;

// Host staging moves through pieces of this size (snapshot copies).
constexpr std::size_t kStageBytes = std::size_t{8} << 20;
// Attention workspace beyond what a decode of every slot needs, so that
// prefills of a few thousand queries with many splits run in one launch.
constexpr std::int64_t kWorkspaceBudget = std::int64_t{64} << 20;
constexpr std::int64_t kMaxQueriesPerLaunch = 65535;  // grid.z
// Bytes of f16-numeric partials one launch may take (attend_f16), but
// where one tile of queries takes more: a launch holds a tile at least.
constexpr std::int64_t kF16WorkspaceBudget = std::int64_t{512} << 20;

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }
// Rows the store kernels may read 16 bytes at a time: an aligned start and
// a stride of whole 16-byte units.
bool vector_source(const ConstView& x) {
  return aligned16(x.data) && (x.row_stride * dtype_bytes(x.dtype)) % 16 == 0;
}

// The rows a query at p sees under `window` (0: full attention), and the
// split bound of queries [p0, p1] (attend_splits_most): a launch's
// workspace takes attend_slots of it for each of them.
std::int64_t rows_seen(std::int64_t window, std::int64_t p) { return window > 0 ? std::min(p + 1, window) : p + 1; }
int splits_most(std::int64_t window, std::int64_t p0, std::int64_t p1) {
  return static_cast<int>(cuda::attend_splits_most(rows_seen(window, p0), rows_seen(window, p1)));
}

std::int32_t dtype_code(DType d) {
  return d == DType::kF32 ? 0 : d == DType::kF16 ? 1 : 2;
}

// Device memory that grows on demand (host-path staging only, whose calls
// wait for the device before returning); its contents do not survive growth.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  Status reserve(std::size_t bytes, const char* what) {
    if (bytes <= bytes_) return Status::Ok();
    if (p_) KVRING_CUDA_CHECK("cudaFree of staging", cudaFree(p_));
    p_ = nullptr;
    bytes_ = 0;
    KVRING_CUDA_CHECK("cudaMalloc of " + std::to_string(bytes) + " bytes for " + what,
                      cudaMalloc(&p_, bytes));
    bytes_ = bytes;
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
    if (p_) KVRING_CUDA_CHECK("cudaFreeHost of staging", cudaFreeHost(p_));
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

}  // namespace

Status cuda::capability_status(int device, const char* name, int major, int minor, bool runs) {
  if (runs) return Status::Ok();
  return make_error(ErrorCode::kUnsupported,
                    "GPU " + std::to_string(device) + " (" + name + ") has compute capability " +
                        std::to_string(major) + "." + std::to_string(minor) +
                        "; this build of kvring has kernels only for " KVRING_CUDA_TARGETS
                        " (rebuild with KVRING_CUDA_GENCODE for this GPU)");
}

Status cuda::f16_numeric_status(int major, int minor, const char* targets) {
  if (major == 9 && minor == 0 && std::string_view(targets).find("90a") != std::string_view::npos)
    return Status::Ok();
  return make_error(ErrorCode::kUnsupported,
                    "the f16 attention numeric on the GPU needs compute capability 9.0 and a build for "
                    "sm_90a (its kernels are wgmma); this GPU has " + std::to_string(major) + "." +
                        std::to_string(minor) + " and this build's targets are " + targets);
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

struct CudaStore::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  // Calls on one store come one at a time, but read_rows and install of
  // different layers may run concurrently: every hook holds this lock.
  std::recursive_mutex mu;

  // Storage: per sliding layer K and V [slots][ring_rows][kv_dim]; the pool
  // [blocks][kv_heads][block_rows][head_dim] for K and for V; the mirror
  // of every block table [slots][n_full][max_blocks] int32, max_blocks
  // the most entries a table can hold: a full plane's blocks at the
  // context, and never more than the pool has (a table's entries are
  // distinct blocks of the pool).
  std::vector<std::uint16_t*> ring_k, ring_v;
  std::uint16_t* pool_k = nullptr;
  std::uint16_t* pool_v = nullptr;
  std::int32_t* tables = nullptr;
  std::int64_t ring_elems = 0, block_elems = 0, max_blocks = 0, n_full = 0;
  cuda::Shape shape;
  cuda::PoolGeometry pool;
  // set_ring_rows' launch parameters (under mu).
  cuda::FillLaunch fill;

  // Attention: the launch policy, workspace slots (attend_slot_floats
  // floats each, o then ml), arrival counters (zero between launches),
  // tagged partials (two halves of tagged_half words, then the resident
  // clock; kernels.h, ResidentClock).
  cuda::LaunchPolicy policy;
  float* ws = nullptr;
  std::int64_t ws_slots = 0;
  unsigned* counters = nullptr;
  std::int64_t slot_floats = 0;
  std::uint64_t* tagged = nullptr;
  std::int64_t tagged_half = 0;
  std::int64_t tagged_bytes = 0;
  int tagged_ctas = 0;

  // Descriptor buffers: pinned host memory and its device twin, reusable
  // once the event recorded after the last work that read it completed.
  struct Chunk {
    char* host = nullptr;
    char* dev = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
    bool busy = false;
    bool permanent = false;  // captured into a graph, or its event failed: never reused
    std::uint64_t released = 0;  // release_chunk's count when it last ran
  };
  std::vector<Chunk> chunks;
  std::uint64_t releases = 0;

  // The order of the store's work across streams: `last_id` is the
  // previous hook's stream, by the runtime's stream id (unique for the
  // process's life, where a destroyed stream's handle may name a new one),
  // and `chain` an event recorded after its work.
  unsigned long long last_id = 0;
  bool chained = false;
  cudaEvent_t chain = nullptr;

  // The stream-ordered scratch of attention calls (the prefill chunk's f16
  // rows, f16-numeric partials): a pool of the store's that keeps what it
  // has mapped between calls, so that a call reuses memory rather than
  // mapping it anew after each synchronization; released with the store.
  // Null where the device has no pools: the device's default pool.
  cudaMemPool_t scratch = nullptr;

  // Descriptors of the call being enqueued, kept between calls so that a
  // step allocates nothing.
  std::vector<cuda::StoreSpan> span_scratch;
  std::vector<std::int32_t> id_scratch;
  // The parameters of a store launch that carries its descriptors (30 KiB,
  // kept between calls).
  std::unique_ptr<cuda::StoreInline> inline_store;
  std::vector<cuda::AttendQueryItem> item_scratch;
  std::vector<cuda::F16Tile> f16_tiles;

  // The layers' attention sinks in log2 units, [n_layers][n_heads] (made
  // at the first set_attention_sinks; -inf where a layer has none).
  float* sinks = nullptr;

  // Host-view staging (those calls wait before returning).
  PinnedBuffer pin;
  DeviceBuffer stage_k, stage_v, stage_q, stage_out, stage_rows;

  // Runs inside ~CudaStore's DeviceScope, which also covers the members'
  // own frees (the staging buffers) after this body.
  ~Impl() {
    if (stream) cudaStreamSynchronize(stream);
    cudaDeviceSynchronize();
    for (auto* p : ring_k) cudaFree(p);
    for (auto* p : ring_v) cudaFree(p);
    cudaFree(pool_k);
    cudaFree(pool_v);
    cudaFree(tables);
    cudaFree(ws);
    cudaFree(counters);
    cudaFree(tagged);
    cudaFree(sinks);
    for (Chunk& c : chunks) {
      cudaFreeHost(c.host);
      cudaFree(c.dev);
      if (c.done) cudaEventDestroy(c.done);
    }
    if (chain) cudaEventDestroy(chain);
    if (stream) cudaStreamDestroy(stream);
    if (scratch) cudaMemPoolDestroy(scratch);
  }

  cudaStream_t pick(cudaStream_t s) const { return s ? s : stream; }

  // `bytes` of scratch, stream-ordered on `s`; freed with cudaFreeAsync.
  Status take_scratch(void** p, std::size_t bytes, const char* what, cudaStream_t s) {
    const cudaError_t e = scratch != nullptr ? cudaMallocFromPoolAsync(p, bytes, scratch, s)
                                             : cudaMallocAsync(p, bytes, s);
    if (e == cudaSuccess) return Status::Ok();
    *p = nullptr;
    (void)cudaGetLastError();
    return cuda_error(std::string("allocating ") + std::to_string(bytes) + " bytes of " + what, e);
  }

  static bool capturing(cudaStream_t s) {
    cudaStreamCaptureStatus c = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &c) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return c != cudaStreamCaptureStatusNone;
  }

  // A caller's stream belongs to the store's device: work enqueued on
  // another device's stream fails at its launch, after the call began to
  // change the store. The legacy and per-thread handles name the current
  // device, the store's during a call. A stream being captured is not
  // asked (the query ends its capture); its graph's launch fails instead.
  Status check_stream(cudaStream_t s) const {
#if CUDART_VERSION >= 12080
    if (s == stream || s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return Status::Ok();
    int d = -1;
    if (const cudaError_t e = cudaStreamGetDevice(s, &d); e != cudaSuccess) {
      (void)cudaGetLastError();
      return invalid_argument(std::string("the stream given is not a CUDA stream this process can use (") +
                              cudaGetErrorString(e) + ")");
    }
    if (d != device)
      return invalid_argument("the stream given belongs to GPU " + std::to_string(d) + "; the store is on GPU " +
                              std::to_string(device));
#else
    (void)s;
#endif
    return Status::Ok();
  }

  // Before enqueuing on `s`: a caller's stream is checked, and work of the
  // previous hook on another stream comes first (a device-side wait).
  Status enter(cudaStream_t s) {
    const bool captured = capturing(s);
    if (!captured) KVRING_RETURN_IF_ERROR(check_stream(s));
    if (!chained || captured) return Status::Ok();
    unsigned long long id = 0;
    KVRING_CUDA_CHECK("cudaStreamGetId", cudaStreamGetId(s, &id));
    if (id != last_id) KVRING_CUDA_CHECK("cudaStreamWaitEvent", cudaStreamWaitEvent(s, chain, 0));
    return Status::Ok();
  }
  // After enqueuing on `s`.
  Status leave(cudaStream_t s) {
    if (capturing(s)) return Status::Ok();
    KVRING_CUDA_CHECK("cudaStreamGetId", cudaStreamGetId(s, &last_id));
    KVRING_CUDA_CHECK("cudaEventRecord", cudaEventRecord(chain, s));
    chained = true;
    return Status::Ok();
  }

  Result<Chunk*> new_chunk(std::size_t bytes) {
    Chunk c;
    c.bytes = std::max(bytes, cuda::kDescriptorChunkBytes);
    KVRING_CUDA_CHECK("cudaHostAlloc of descriptors",
                      cudaHostAlloc(reinterpret_cast<void**>(&c.host), c.bytes, cudaHostAllocDefault));
    if (cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&c.dev), c.bytes); e != cudaSuccess) {
      (void)cudaGetLastError();
      cudaFreeHost(c.host);
      return cuda_error("cudaMalloc of descriptors", e);
    }
    if (cudaError_t e = cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming); e != cudaSuccess) {
      (void)cudaGetLastError();
      cudaFreeHost(c.host);
      cudaFree(c.dev);
      return cuda_error("cudaEventCreate", e);
    }
    chunks.push_back(c);
    return &chunks.back();
  }

  // A descriptor buffer of at least `bytes` that no enqueued work still
  // reads. A new one is made when all are busy; only when that fails (the
  // device's memory is spent) does it wait for a busy one, so that a
  // rollback's mirror restore after an out-of-memory failure still lands.
  Result<Chunk*> take_chunk(std::size_t bytes, cudaStream_t s) {
    const bool capture = capturing(s);
    if (!capture) {
      for (Chunk& c : chunks) {
        if (c.permanent || c.bytes < bytes) continue;
        if (c.busy) {
          const cudaError_t e = cudaEventQuery(c.done);
          if (e == cudaErrorNotReady) continue;
          if (e != cudaSuccess) {
            (void)cudaGetLastError();
            c.permanent = true;
            continue;
          }
        }
        c.busy = false;
        return &c;
      }
    }
    auto c = new_chunk(bytes);
    if (c) {
      (*c)->permanent = capture;
      return *c;
    }
    // The busy buffer released first: work on one stream finishes in the
    // order it was enqueued, so its wait is the shortest.
    while (!capture) {
      Chunk* oldest = nullptr;
      for (Chunk& b : chunks)
        if (!b.permanent && b.bytes >= bytes && b.busy && (oldest == nullptr || b.released < oldest->released))
          oldest = &b;
      if (oldest == nullptr) break;
      if (cudaEventSynchronize(oldest->done) == cudaSuccess) {
        oldest->busy = false;
        return oldest;
      }
      // An event that reports an error is never waited on again.
      (void)cudaGetLastError();
      oldest->permanent = true;
    }
    return c.error();
  }
  // The chunk's host part [0, bytes) to its device part, on `s`.
  Status upload_chunk(const Chunk& c, std::size_t bytes, cudaStream_t s) {
    KVRING_CUDA_CHECK("descriptor upload",
                      cudaMemcpyAsync(c.dev, c.host, bytes, cudaMemcpyHostToDevice, s));
    return Status::Ok();
  }
  // Work that reads the chunk is enqueued on `s`: called for every chunk a
  // call took (none: nothing) once anything that reads it may have been
  // enqueued, whether or not the call failed after that. Its error becomes
  // the call's where the call has none yet.
  void release_chunk(Chunk* c, cudaStream_t s, Status& st) {
    if (c == nullptr || c->permanent) return;
    c->busy = true;
    c->released = ++releases;
    if (cudaError_t e = cudaEventRecord(c->done, s); e != cudaSuccess) {
      // Without its event nothing tells when the enqueued work is done.
      (void)cudaGetLastError();
      c->permanent = true;
      if (st.ok()) st = cuda_error("cudaEventRecord", e);
    }
  }

  // A host view as a device view of the same dtype (packed rows), copied
  // through pinned memory; waits for the copy.
  Result<ConstView> stage(const ConstView& v, DeviceBuffer& buf, cudaStream_t s) {
    if (v.space == MemorySpace::kDevice || v.rows == 0) return v;
    const std::size_t row = static_cast<std::size_t>(v.cols * dtype_bytes(v.dtype));
    const std::size_t bytes = row * static_cast<std::size_t>(v.rows);
    KVRING_RETURN_IF_ERROR(pin.reserve(bytes));
    KVRING_RETURN_IF_ERROR(buf.reserve(bytes, "host-view staging"));
    const auto* src = static_cast<const char*>(v.data);
    const std::size_t stride = static_cast<std::size_t>(v.row_stride * dtype_bytes(v.dtype));
    for (std::int64_t r = 0; r < v.rows; ++r)
      std::memcpy(pin.data() + static_cast<std::size_t>(r) * row, src + static_cast<std::size_t>(r) * stride, row);
    KVRING_CUDA_CHECK("host-to-device copy",
                      cudaMemcpyAsync(buf.as<void>(), pin.data(), bytes, cudaMemcpyHostToDevice, s));
    KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(s));
    return ConstView{buf.as<void>(), MemorySpace::kDevice, v.dtype, v.rows, v.cols, v.cols};
  }

  // One buffer (which 0: K, 1: V) of a sequence's plane: its slot's ring,
  // or the pool read through the plane's mirrored block table.
  cuda::PlaneBuf plane_buf(const KvStore::PlaneRef& plane, std::int64_t fi, int which) const {
    cuda::PlaneBuf buf;
    if (fi < 0) {
      buf.base = (which == 0 ? ring_k : ring_v)[static_cast<std::size_t>(plane.layer)] +
                 plane.slot * ring_elems;
    } else {
      buf.base = which == 0 ? pool_k : pool_v;
      buf.table = tables + (plane.slot * n_full + fi) * max_blocks;
    }
    return buf;
  }

  // Rows of a plane to (gather) or from packed f16 [rows, kv_dim] rows.
  // Device rows: one gather or scatter kernel per buffer straight between
  // the plane and the caller's rows, enqueued on the caller's stream, no
  // wait. Host rows: through device and pinned staging in pieces on the
  // store's stream, waiting for each.
  Status move_rows(const KvStore::PlaneRef& plane, std::int64_t fi, const LiveSpans& spans,
                   std::uint16_t* k, std::uint16_t* v, MemorySpace space, cudaStream_t stream,
                   bool gather) {
    const std::lock_guard<std::recursive_mutex> lock(mu);
    const bool device_rows = space == MemorySpace::kDevice;
    const cudaStream_t s = device_rows ? pick(stream) : this->stream;
    const DeviceScope scope(device);
    KVRING_CUDA_CHECK("making the store's device current", scope.error());
    KVRING_RETURN_IF_ERROR(enter(s));
    const std::size_t row_bytes = static_cast<std::size_t>(shape.kv_dim) * 2;
    const std::int64_t rows = span_rows(spans);
    const cuda::SpanMap map = span_map(spans);
    auto launch = [&](const cuda::PlaneBuf& buf, std::int64_t r0, std::int64_t n, std::uint16_t* rows_at) {
      return gather ? cuda::launch_gather_rows(buf, shape, pool, map, r0, n, rows_at, s)
                    : cuda::launch_scatter_rows(buf, shape, pool, map, r0, n, rows_at, s);
    };
    if (device_rows) {
      for (int which = 0; which < 2; ++which) {
        const cudaError_t e = launch(plane_buf(plane, fi, which), 0, rows, which == 0 ? k : v);
        if (e != cudaSuccess) return fail(cuda_error("row copy", e), s);
      }
      return leave(s);
    }
    const std::int64_t piece = std::max<std::int64_t>(1, static_cast<std::int64_t>(kStageBytes / row_bytes));
    const std::size_t bytes = static_cast<std::size_t>(std::min(rows, piece)) * row_bytes;
    KVRING_RETURN_IF_ERROR(stage_rows.reserve(std::max<std::size_t>(bytes, 16), "snapshot staging"));
    // Host rows move through device staging in pieces, copied straight to
    // or from the caller's memory (at the pinned rate when it is pinned);
    // stream order keeps each piece's copy and its gather or scatter in
    // turn. One wait at the end: the caller's rows are written (or read)
    // before the call returns.
    for (int which = 0; which < 2; ++which) {
      const cuda::PlaneBuf buf = plane_buf(plane, fi, which);
      std::uint16_t* host = which == 0 ? k : v;
      for (std::int64_t r0 = 0; r0 < rows; r0 += piece) {
        const std::int64_t n = std::min(piece, rows - r0);
        const std::size_t nb = static_cast<std::size_t>(n) * row_bytes;
        std::uint16_t* staged = stage_rows.as<std::uint16_t>();
        std::uint16_t* at = host + r0 * shape.kv_dim;
        cudaError_t e = cudaSuccess;
        if (gather) {
          e = launch(buf, r0, n, staged);
          if (e == cudaSuccess) e = cudaMemcpyAsync(at, staged, nb, cudaMemcpyDeviceToHost, s);
        } else {
          e = cudaMemcpyAsync(staged, at, nb, cudaMemcpyHostToDevice, s);
          if (e == cudaSuccess) e = launch(buf, r0, n, staged);
        }
        if (e != cudaSuccess) return fail(cuda_error("snapshot copy", e), s);
      }
    }
    if (const cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess)
      return fail(cuda_error("snapshot copy", e), s);
    return leave(s);
  }

  // Waits for `s` after a failure, so nothing in flight outlives buffers
  // the caller may free; returns the failure.
  Status fail(Status st, cudaStream_t s) {
    cudaStreamSynchronize(s);
    (void)cudaGetLastError();
    return st;
  }
};

CudaStore::CudaStore(ModelConfig config, StoreOptions resolved)
    : KvStore(std::move(config), resolved), impl_(std::make_unique<Impl>()) {}

CudaStore::~CudaStore() {
  if (!impl_) return;
  const DeviceScope scope(impl_->device);
  impl_.reset();
}

int CudaStore::device() const { return impl_->device; }
cudaStream_t CudaStore::stream() const { return impl_->stream; }

std::int64_t CudaStore::workspace_bytes() const {
  const Impl& im = *impl_;
  std::int64_t n = im.ws_slots * im.slot_floats * 4 + im.tagged_bytes +
                   im.max_blocks * im.n_full * options_.max_sequences * 4;
  const auto items = cuda::attend_grid(static_cast<int>(config_.n_heads),
                                       static_cast<int>(config_.n_kv_heads),
                                       static_cast<int>(config_.head_dim)).items;
  n += im.ws_slots * items * 4;
  for (const auto& c : im.chunks) n += static_cast<std::int64_t>(c.bytes);
  if (im.sinks != nullptr) n += config_.n_layers * config_.n_heads * 4;
  for (const DeviceBuffer* b : {&im.stage_k, &im.stage_v, &im.stage_q, &im.stage_out, &im.stage_rows})
    n += static_cast<std::int64_t>(b->bytes());
  std::uint64_t kept = 0;
  if (im.scratch != nullptr) {
    if (cudaMemPoolGetAttribute(im.scratch, cudaMemPoolAttrReservedMemCurrent, &kept) == cudaSuccess)
      n += static_cast<std::int64_t>(kept);
    else
      (void)cudaGetLastError();
  }
  return n;
}

Status CudaStore::release_scratch() {
  Impl& im = *impl_;
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  if (im.scratch == nullptr) return Status::Ok();
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  // It synchronizes the store's own stream. The caller's streams are not
  // touched (the last may since have been destroyed): `chain` was recorded
  // outside any capture, and waiting for it is allowed during a capture in
  // relaxed mode, the mode the store's captures take.
  if (Impl::capturing(im.stream))
    return invalid_argument("release_scratch: the store's stream is being captured into a graph; "
                            "call it outside the capture");
  // Scratch freed on a stream returns to the pool when that stream reaches
  // the free: the store's last work, which `chain` follows.
  if (im.chained) KVRING_CUDA_CHECK("cudaEventSynchronize", cudaEventSynchronize(im.chain));
  KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(im.stream));
  KVRING_CUDA_CHECK("cudaMemPoolTrimTo", cudaMemPoolTrimTo(im.scratch, 0));
  return Status::Ok();
}

// The device's copy of a layer's sinks, in the kernels' log2 units as the
// CPU backend takes them (detail::sink_log2); a layer without sinks holds
// -inf, which adds nothing to a divisor (a graph captured while it had
// sinks still reads them).
// The copy goes on the store's stream after its earlier work and is waited
// for, so on an error the device holds what the host does: the array is
// made and filled whole or not kept, and a row whose copy failed part-way
// is put back.
Status CudaStore::sinks_changed(std::int64_t layer, std::span<const float> sinks) {
  Impl& im = *impl_;
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  if (sinks.empty() && im.sinks == nullptr) return Status::Ok();
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  if (Impl::capturing(im.stream))
    return invalid_argument("set_attention_sinks: the store's stream is being captured into a graph; "
                            "call it outside the capture");
  const std::int64_t heads = config_.n_heads;
  auto row_of = [&](std::span<const float> values) {
    std::vector<float> row(static_cast<std::size_t>(heads), -INFINITY);
    for (std::size_t h = 0; h < values.size(); ++h)
      row[h] = detail::sink_log2(values[h]);
    return row;
  };
  // Pageable sources: each copy is waited for before its vector goes.
  auto copy = [&](float* dst, const std::vector<float>& src) -> Status {
    cudaError_t e = cudaMemcpyAsync(dst, src.data(), src.size() * 4, cudaMemcpyHostToDevice, im.stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(im.stream);
    if (e == cudaSuccess) return Status::Ok();
    (void)cudaGetLastError();
    return cuda_error("copying the attention sinks to the device", e);
  };
  KVRING_RETURN_IF_ERROR(im.enter(im.stream));
  if (im.sinks == nullptr) {
    const std::size_t all = static_cast<std::size_t>(config_.n_layers * heads);
    float* made = nullptr;
    if (const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&made), all * 4); e != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_error("cudaMalloc of the attention sinks", e);
    }
    if (Status st = copy(made, std::vector<float>(all, -INFINITY)); !st.ok()) {
      cudaFree(made);
      return st;
    }
    im.sinks = made;
  }
  float* const dst = im.sinks + layer * heads;
  Status st = copy(dst, row_of(sinks));
  if (st.ok()) st = im.leave(im.stream);
  if (!st.ok()) (void)copy(dst, row_of(attention_sinks(layer)));  // the layer's sinks stay as they were
  return st;
}

Result<std::unique_ptr<CudaStore>> CudaStore::create(const ModelConfig& config,
                                                     StoreOptions options,
                                                     const cuda::LaunchPolicy* policy) {
  auto o = resolve_store_options(config, options);
  if (!o) return o.error();
  if (cuda_device_count() == 0)
    return make_error(ErrorCode::kUnsupported, "the CUDA backend needs a GPU; none is visible");
  int device = 0;
  KVRING_CUDA_CHECK("cudaGetDevice", cudaGetDevice(&device));
  cudaDeviceProp prop{};
  KVRING_CUDA_CHECK("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, device));
  KVRING_RETURN_IF_ERROR(
      cuda::capability_status(device, prop.name, prop.major, prop.minor, cuda::kernels_run_here()));

  if (o->attention == AttentionNumeric::kF16)
    KVRING_RETURN_IF_ERROR(cuda::f16_numeric_status(prop.major, prop.minor, KVRING_CUDA_TARGETS));
  if (o->attention == AttentionNumeric::kF16 &&
      (config.head_dim != cuda::kTensorHeadDim ||
       config.n_heads / config.n_kv_heads > cuda::kF16Rows))
    return make_error(ErrorCode::kUnsupported,
                      "the f16 attention numeric on the GPU needs head_dim " +
                          std::to_string(cuda::kTensorHeadDim) + " and at most " +
                          std::to_string(cuda::kF16Rows) + " query heads per KV head; model '" +
                          config.name + "' has head_dim " + std::to_string(config.head_dim) +
                          " and " + std::to_string(config.n_heads / config.n_kv_heads));

  std::unique_ptr<CudaStore> store(new CudaStore(config, *o));
  Impl& im = *store->impl_;
  im.device = device;
  im.policy = policy != nullptr ? *policy : cuda::device_launch_policy();
  KVRING_CUDA_CHECK("cudaStreamCreateWithFlags",
                    cudaStreamCreateWithFlags(&im.stream, cudaStreamNonBlocking));
  KVRING_CUDA_CHECK("cudaEventCreateWithFlags",
                    cudaEventCreateWithFlags(&im.chain, cudaEventDisableTiming));
  {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    std::uint64_t keep = UINT64_MAX;
    if (cudaMemPoolCreate(&im.scratch, &props) != cudaSuccess ||
        cudaMemPoolSetAttribute(im.scratch, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) {
      (void)cudaGetLastError();
      if (im.scratch) cudaMemPoolDestroy(im.scratch);
      im.scratch = nullptr;
    }
  }
  const std::int64_t kv_dim = config.kv_dim();
  const std::int64_t slots = o->max_sequences;
  im.shape = {static_cast<std::int32_t>(kv_dim), static_cast<std::int32_t>(config.head_dim)};
  int shift = 0;
  while ((std::int64_t{1} << shift) < o->block_rows) ++shift;
  im.pool = {shift, kv_dim << shift};
  im.ring_elems = store->ring_rows() * kv_dim;
  im.block_elems = o->block_rows * kv_dim;
  im.max_blocks = std::min(store->max_blocks_per_plane(), store->pool_blocks());
  im.n_full = store->n_full();

  auto alloc = [&](auto** p, std::int64_t bytes, const std::string& what) -> Status {
    const auto n = static_cast<std::size_t>(std::max<std::int64_t>(bytes, 16));
    if (cudaError_t e = cudaMalloc(reinterpret_cast<void**>(p), n); e != cudaSuccess) {
      *p = nullptr;
      (void)cudaGetLastError();
      return cuda_error("allocating " + std::to_string(n) + " bytes of device memory for " + what +
                            " of a store of '" + config.name + "'",
                        e);
    }
    // Zero-filled on purpose: no row ever exposes uninitialized storage.
    // Only a detached install skips it.
    if (o->zero_fill) KVRING_CUDA_CHECK("zero-filling", cudaMemsetAsync(*p, 0, n, im.stream));
    return Status::Ok();
  };
  for (std::int64_t l = 0; l < config.n_layers; ++l) {
    std::uint16_t* k = nullptr;
    std::uint16_t* v = nullptr;
    if (store->full_index(l) < 0) {
      const std::int64_t bytes = slots * im.ring_elems * 2;
      Status st = alloc(&k, bytes, "sliding rings");
      if (st.ok()) st = alloc(&v, bytes, "sliding rings");
      if (!st.ok()) {
        // alloc keeps an allocation whose zero fill failed.
        cudaFree(k);
        cudaFree(v);
        return st.error();
      }
    }
    im.ring_k.push_back(k);
    im.ring_v.push_back(v);
  }
  KVRING_RETURN_IF_ERROR(alloc(&im.pool_k, store->pool_blocks() * im.block_elems * 2, "the block pool"));
  KVRING_RETURN_IF_ERROR(alloc(&im.pool_v, store->pool_blocks() * im.block_elems * 2, "the block pool"));
  const std::int64_t table_bytes = slots * im.n_full * im.max_blocks * 4;
  KVRING_RETURN_IF_ERROR(alloc(&im.tables, table_bytes, "the block tables"));
  KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(im.tables, 0, static_cast<std::size_t>(std::max<std::int64_t>(table_bytes, 16)), im.stream));

  // The attention workspace, sized here once: a decode of every slot at
  // the most splits fits, and at least kWorkspaceBudget bytes.
  if (config.head_dim <= kCudaMaxHeadDim) {
    const int n_heads = static_cast<int>(config.n_heads);
    const int n_kv = static_cast<int>(config.n_kv_heads);
    const int hd = static_cast<int>(config.head_dim);
    im.slot_floats = cuda::attend_slot_floats(n_heads, n_kv, hd);
    im.ws_slots = std::max<std::int64_t>(slots * cuda::attend_slots(cuda::kAttendMaxSplits),
                                         kWorkspaceBudget / (im.slot_floats * 4));
    KVRING_RETURN_IF_ERROR(alloc(&im.ws, im.ws_slots * im.slot_floats * 4, "the attention workspace"));
    const std::int64_t items = cuda::attend_grid(n_heads, n_kv, hd).items;
    // Counters of a query never outnumber its slots.
    const std::int64_t counter_bytes = im.ws_slots * items * 4;
    KVRING_RETURN_IF_ERROR(alloc(&im.counters, counter_bytes, "attention counters"));
    KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(im.counters, 0, static_cast<std::size_t>(counter_bytes), im.stream));
    // Resident grids are an optimisation: without room for their tagged
    // partials, attention takes the other combine paths.
    // Both halves of the tagged words start zero, and the clock at the
    // policy's first epoch in the first half.
    const int resident = im.policy.resident_limit(hd);
    if (resident > 0) {
      const std::int64_t half = resident * cuda::attend_tagged_words(n_heads, n_kv, hd);
      const std::int64_t bytes = 2 * half * 8 + static_cast<std::int64_t>(sizeof(cuda::ResidentClock));
      const cuda::ResidentClock clock{im.policy.first_epoch == 0 ? 1 : im.policy.first_epoch, 0, 0};
      if (cudaMalloc(reinterpret_cast<void**>(&im.tagged), static_cast<std::size_t>(bytes)) == cudaSuccess &&
          cudaMemsetAsync(im.tagged, 0, static_cast<std::size_t>(2 * half * 8), im.stream) == cudaSuccess &&
          cudaMemcpyAsync(im.tagged + 2 * half, &clock, sizeof(clock), cudaMemcpyHostToDevice, im.stream) ==
              cudaSuccess &&
          cudaStreamSynchronize(im.stream) == cudaSuccess) {
        im.tagged_ctas = resident;
        im.tagged_half = half;
        im.tagged_bytes = bytes;
      } else {
        (void)cudaGetLastError();
        cudaFree(im.tagged);
        im.tagged = nullptr;
      }
    }
  }
  for (int i = 0; i < cuda::kInitialDescriptorChunks; ++i) {
    auto c = im.new_chunk(cuda::kDescriptorChunkBytes);
    if (!c) return c.error();
  }
  KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(im.stream));
  return store;
}

Result<std::unique_ptr<KvStore>> make_cuda_store(const ModelConfig& config, StoreOptions options) {
  auto s = CudaStore::create(config, options);
  if (!s) return s.error();
  return std::unique_ptr<KvStore>(std::move(*s));
}

Status CudaStore::synchronize(cudaStream_t stream) const {
  const DeviceScope scope(impl_->device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(impl_->pick(stream)));
  return Status::Ok();
}

// ---- Views ---------------------------------------------------------------------

Status CudaStore::check_view(const char* what, MemorySpace space, DType dtype,
                             const void* data, std::uint64_t bytes) const {
  if (data == nullptr) return Status::Ok();
  const std::string name(what);
  const auto addr = reinterpret_cast<std::uintptr_t>(data);
  if (addr % static_cast<std::uintptr_t>(dtype_bytes(dtype)) != 0)
    return invalid_argument(name + " is not aligned to its " + dtype_name(dtype) + " elements");
  const DeviceScope scope(impl_->device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, data) != cudaSuccess) {
    (void)cudaGetLastError();
    a.type = cudaMemoryTypeUnregistered;
  }
  // Host views are read and written by the CPU: device memory there would
  // fault in the staging copies.
  if (space == MemorySpace::kHost) {
    if (a.type == cudaMemoryTypeDevice)
      return invalid_argument(name + " is marked host memory but is a device allocation");
    return Status::Ok();
  }
  const bool query = name == "q" || name == "out";
  if (query && dtype != DType::kF32)
    return make_error(ErrorCode::kUnsupported,
                      name + " in device memory is " + dtype_name(dtype) +
                          "; the CUDA backend reads device queries as f32 only");
  if (query && !aligned16(data))
    return invalid_argument(name + " in device memory needs 16-byte alignment");
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return invalid_argument(name + " is marked device memory but is not a device allocation");
  if (a.type == cudaMemoryTypeDevice && a.device != impl_->device)
    return invalid_argument(name + " lives on GPU " + std::to_string(a.device) +
                            "; the store is on GPU " + std::to_string(impl_->device));
  // A kernel that ran past the memory would fault and leave the GPU's
  // context unusable: a view longer than the allocations that hold it is
  // refused here (cuda::mapped_bytes). Where the driver cannot say, it is
  // not; nor is managed memory, whose ranges the driver does not report.
  if (bytes > 0 && a.type == cudaMemoryTypeDevice) {
    const std::optional<std::uint64_t> held = cuda::mapped_bytes(data, bytes);
    if (held && *held < bytes)
      return invalid_argument(name + " in device memory spans " + std::to_string(bytes) +
                              " bytes from its address; the allocation that holds it ends " +
                              std::to_string(*held) + " bytes from there");
  }
  return Status::Ok();
}

// ---- Stores --------------------------------------------------------------------

Status CudaStore::write_rows(std::span<const TableChange> changes,
                             std::span<const RowWrite> writes, const ConstView& k,
                             const ConstView& v, cudaStream_t stream) {
  Impl& im = *impl_;
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  const cudaStream_t s = im.pick(stream);
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_RETURN_IF_ERROR(im.enter(s));
  const bool host = k.space == MemorySpace::kHost || v.space == MemorySpace::kHost;
  auto dk = im.stage(k, im.stage_k, s);
  if (!dk) return im.fail(dk.status(), s);
  auto dv = im.stage(v, im.stage_v, s);
  if (!dv) return im.fail(dv.status(), s);

  std::size_t n_table_writes = 0;
  for (const TableChange& c : changes) n_table_writes += static_cast<std::size_t>(std::max<std::int64_t>(c.count, 0));
  // With table writes in the launch, a full plane's span reads its blocks
  // from the launch's own list (`ids`, the host table's entries from the
  // span's first block on), not from the mirror the launch is changing.
  const bool own_blocks = n_table_writes > 0;
  std::vector<cuda::StoreSpan>& spans = im.span_scratch;
  std::vector<std::int32_t>& ids = im.id_scratch;
  spans.clear();
  ids.clear();
  std::int64_t rows = 0;
  for (const RowWrite& w : writes) {
    const std::int64_t fi = full_index(w.plane.layer);
    cuda::StoreSpan base{};
    if (fi < 0) {
      base.k = im.ring_k[static_cast<std::size_t>(w.plane.layer)] + w.plane.slot * im.ring_elems;
      base.v = im.ring_v[static_cast<std::size_t>(w.plane.layer)] + w.plane.slot * im.ring_elems;
      base.table = nullptr;
    } else {
      base.k = im.pool_k;
      base.v = im.pool_v;
      base.table = im.tables + (w.plane.slot * im.n_full + fi) * im.max_blocks;
    }
    for (int i = 0; i < w.placement.n_spans; ++i) {
      const PhysicalSpan& p = w.placement.spans[static_cast<std::size_t>(i)];
      if (p.rows <= 0) continue;
      cuda::StoreSpan sp = base;
      sp.physical_first = p.physical_first;
      sp.src_row = w.source_row + p.source_first;
      sp.first_row = rows;
      if (fi >= 0 && own_blocks) {
        const std::int64_t b0 = p.physical_first >> im.pool.block_shift;
        const std::int64_t b1 = (p.physical_first + p.rows - 1) >> im.pool.block_shift;
        if (b1 >= w.plane.n_blocks)
          return im.fail(make_error(ErrorCode::kInternal, "a store's rows lie past the plane's blocks"), s);
        sp.first_id = static_cast<std::int64_t>(ids.size());
        sp.physical_first -= b0 << im.pool.block_shift;
        ids.insert(ids.end(), w.plane.blocks + b0, w.plane.blocks + b1 + 1);
      }
      rows += p.rows;
      spans.push_back(sp);
    }
  }
  if (spans.empty() && n_table_writes == 0) return Status::Ok();
  // The kernel finds a row's span by a 32-bit search.
  if (spans.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    return im.fail(make_error(ErrorCode::kUnsupported, "a store of " + std::to_string(spans.size()) +
                                                           " spans in one call; the CUDA store takes at most 2^31 - 1"),
                   s);
  cuda::StoreLaunch L;
  L.n_spans = static_cast<std::int32_t>(spans.size());
  L.total_rows = rows;
  L.k = {dk->data, dk->row_stride, dtype_code(dk->dtype)};
  L.v = {dv->data, dv->row_stride, dtype_code(dv->dtype)};
  L.shape = im.shape;
  L.pool = im.pool;
  L.vector = vector_source(*dk) && vector_source(*dv);
  L.n_table_writes = static_cast<std::int64_t>(n_table_writes);
  L.tables = im.tables;
  // The descriptors: one span and no table writes travel in the launch's
  // parameters as they are; up to kStoreInlineBytes of spans, table
  // writes and block lists travel in them too; more go up in one
  // descriptor buffer.
  const std::size_t span_bytes = spans.size() * sizeof(cuda::StoreSpan);
  const std::size_t write_bytes = n_table_writes * sizeof(cuda::TableWrite);
  const std::size_t bytes = span_bytes + write_bytes + ids.size() * sizeof(std::int32_t);
  auto pack = [&](char* at) {
    std::memcpy(at, spans.data(), span_bytes);
    auto* tw = reinterpret_cast<cuda::TableWrite*>(at + span_bytes);
    for (const TableChange& c : changes) {
      const std::int64_t row = (c.slot * im.n_full + c.full_index) * im.max_blocks;
      for (std::int64_t i = c.first; i < c.first + c.count; ++i) *tw++ = {row + i, c.table[i], 0};
    }
    std::memcpy(at + span_bytes + write_bytes, ids.data(), ids.size() * sizeof(std::int32_t));
  };
  Impl::Chunk* chunk = nullptr;
  Status st = Status::Ok();
  cudaError_t e = cudaSuccess;
  if (spans.size() == 1 && n_table_writes == 0) {
    L.single = spans[0];
    rows_written_ = true;
    e = cuda::launch_store_spans(L, im.policy.programmatic, s);
  } else if (bytes <= cuda::kStoreInlineBytes) {
    if (!im.inline_store) im.inline_store = std::make_unique<cuda::StoreInline>();
    cuda::StoreInline& p = *im.inline_store;
    p.a = L;
    p.writes_at = static_cast<std::int64_t>(span_bytes);
    p.ids_at = static_cast<std::int64_t>(span_bytes + write_bytes);
    pack(reinterpret_cast<char*>(p.bytes));
    rows_written_ = true;
    e = cuda::launch_store_inline(p, im.policy.programmatic, s);
  } else {
    auto c = im.take_chunk(bytes, s);
    if (!c) return im.fail(c.status(), s);
    chunk = *c;
    pack(chunk->host);
    st = im.upload_chunk(*chunk, bytes, s);
    L.spans = reinterpret_cast<const cuda::StoreSpan*>(chunk->dev);
    L.table_writes = reinterpret_cast<const cuda::TableWrite*>(chunk->dev + span_bytes);
    L.block_ids = reinterpret_cast<const std::int32_t*>(chunk->dev + span_bytes + write_bytes);
    if (st.ok()) {
      rows_written_ = true;
      e = cuda::launch_store_spans(L, im.policy.programmatic, s);
    }
  }
  if (st.ok() && e != cudaSuccess) st = cuda_error("store kernel launch", e);
  im.release_chunk(chunk, s, st);
  if (st.ok()) st = im.leave(s);
  if (!st.ok()) return im.fail(st, s);
  if (host) KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(s));
  return Status::Ok();
}

// ---- Attention -------------------------------------------------------------------

Status CudaStore::check_attention(const ConstView& q, const MutView& out) const {
  if (config_.head_dim > kCudaMaxHeadDim)
    return make_error(ErrorCode::kUnsupported,
                      "CUDA attention supports head_dim up to " + std::to_string(kCudaMaxHeadDim) +
                          "; model '" + config_.name + "' has head_dim " +
                          std::to_string(config_.head_dim));
  // Device queries and outputs are read and written as float4 rows.
  if (q.space == MemorySpace::kDevice && q.row_stride % 4 != 0)
    return invalid_argument("q in device memory: row stride " + std::to_string(q.row_stride) +
                            " is not a multiple of 4 floats (16-byte rows)");
  if (out.space == MemorySpace::kDevice && out.row_stride % 4 != 0)
    return invalid_argument("out in device memory: row stride " + std::to_string(out.row_stride) +
                            " is not a multiple of 4 floats (16-byte rows)");
  // The launches address a query by its row as a 32-bit index.
  if (q.rows > std::numeric_limits<std::int32_t>::max())
    return make_error(ErrorCode::kUnsupported,
                      "CUDA attention takes at most " + std::to_string(std::numeric_limits<std::int32_t>::max()) +
                          " query rows a call; this one has " + std::to_string(q.rows));
  return Status::Ok();
}

Status CudaStore::attend(const AttendBatch& b) {
  Impl& im = *impl_;
  const ConstView& q = *b.q;
  const MutView& out = *b.out;
  const std::int64_t width = config_.n_heads * config_.head_dim;
  KVRING_RETURN_IF_ERROR(check_attention(q, out));
  std::int64_t n_queries = 0;
  for (const AttendItem& it : b.items) {
    if (it.q_row != n_queries || (b.chunk_k != nullptr && it.chunk_row != n_queries))
      return make_error(ErrorCode::kInternal, "attention items are not in row order");
    n_queries += it.n_queries;
  }
  if (n_queries == 0) return Status::Ok();
  // The f16 numeric's tiles name their first split as a 32-bit index;
  // refused before any device work.
  if (options_.attention == AttentionNumeric::kF16) {
    constexpr std::int64_t kLimit = (std::int64_t{std::numeric_limits<std::int32_t>::max()} + 1) * kF16AttendSplitRows;
    for (const AttendItem& it : b.items)
      if (it.first_position + it.n_queries - 1 >= kLimit)
        return make_error(ErrorCode::kUnsupported, "the f16 numeric's CUDA attention takes positions below " +
                                                       std::to_string(kLimit) + "; this call reaches " +
                                                       std::to_string(it.first_position + it.n_queries - 1));
  }

  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  const cudaStream_t s = im.pick(b.stream);
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_RETURN_IF_ERROR(im.enter(s));
  const bool host_out = out.space == MemorySpace::kHost;
  bool host = host_out || q.space == MemorySpace::kHost;

  // Every failure from here on waits for the stream (Impl::fail), so that
  // no copy or kernel still reads or writes the caller's rows after it.
  const std::size_t staged_bytes = static_cast<std::size_t>(n_queries * width) * 4;
  // Queries: device f32 rows, or host rows staged as f32.
  const float* dq = static_cast<const float*>(q.data);
  std::int64_t q_stride = q.row_stride;
  float* dout = static_cast<float*>(out.data);
  std::int64_t out_stride = out.row_stride;
  const Status staged = [&]() -> Status {
    if (q.space == MemorySpace::kHost) {
      KVRING_RETURN_IF_ERROR(im.pin.reserve(staged_bytes));
      KVRING_RETURN_IF_ERROR(im.stage_q.reserve(staged_bytes, "attention queries"));
      for (std::int64_t r = 0; r < n_queries; ++r)
        detail::row_to_f32(q, r, reinterpret_cast<float*>(im.pin.data()) + r * width);
      KVRING_CUDA_CHECK("host-to-device copy", cudaMemcpyAsync(im.stage_q.as<void>(), im.pin.data(), staged_bytes,
                                                               cudaMemcpyHostToDevice, s));
      KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(s));
      dq = im.stage_q.as<float>();
      q_stride = width;
    }
    if (host_out) {
      KVRING_RETURN_IF_ERROR(im.stage_out.reserve(staged_bytes, "attention output"));
      // Poison: an element the kernels fail to write reads back as NaN.
      KVRING_CUDA_CHECK("cudaMemsetAsync", cudaMemsetAsync(im.stage_out.as<void>(), 0xff, staged_bytes, s));
      dout = im.stage_out.as<float>();
      out_stride = width;
    }
    return Status::Ok();
  }();
  if (!staged.ok()) return im.fail(staged, s);

  // The chunk's rows exactly as the store will hold them (f16), in
  // stream-ordered scratch.
  std::uint16_t* chunk = nullptr;
  const std::int64_t kv_dim = config_.kv_dim();
  Status st = Status::Ok();
  if (b.chunk_k != nullptr && !b.store_chunk) {
    host = host || b.chunk_k->space == MemorySpace::kHost || b.chunk_v->space == MemorySpace::kHost;
    auto ck = im.stage(*b.chunk_k, im.stage_k, s);
    if (!ck) return im.fail(ck.status(), s);
    auto cv = im.stage(*b.chunk_v, im.stage_v, s);
    if (!cv) return im.fail(cv.status(), s);
    const std::size_t elems = static_cast<std::size_t>(ck->rows * kv_dim);
    if (Status a = im.take_scratch(reinterpret_cast<void**>(&chunk), elems * 4, "the prefill chunk's rows", s);
        !a.ok())
      return im.fail(a, s);
    const cudaError_t e = cuda::launch_convert_kv(
        {ck->data, ck->row_stride, dtype_code(ck->dtype)}, {cv->data, cv->row_stride, dtype_code(cv->dtype)},
        ck->rows, static_cast<std::int32_t>(kv_dim), vector_source(*ck) && vector_source(*cv), chunk, s);
    if (e != cudaSuccess) st = cuda_error("convert kernel launch", e);
  }

  if (options_.attention == AttentionNumeric::kF16) {
    if (st.ok()) st = attend_f16(b, dq, q_stride, dout, out_stride, chunk, s);
  } else if (st.ok()) {
    st = attend_f32(b, dq, q_stride, dout, out_stride, chunk, s);
  }
  if (chunk != nullptr) {
    const cudaError_t e = cudaFreeAsync(chunk, s);
    if (e != cudaSuccess && st.ok()) st = cuda_error("cudaFreeAsync", e);
  }
  if (st.ok()) st = im.leave(s);
  if (!st.ok()) return im.fail(st, s);
  if (host_out) {
    const Status copied = [&]() -> Status {
      KVRING_RETURN_IF_ERROR(im.pin.reserve(staged_bytes));
      KVRING_CUDA_CHECK("device-to-host copy",
                        cudaMemcpyAsync(im.pin.data(), dout, staged_bytes, cudaMemcpyDeviceToHost, s));
      KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(s));
      return Status::Ok();
    }();
    if (!copied.ok()) return im.fail(copied, s);
    for (std::int64_t r = 0; r < n_queries; ++r)
      std::memcpy(static_cast<float*>(out.data) + r * out.row_stride,
                  reinterpret_cast<const float*>(im.pin.data()) + r * width,
                  static_cast<std::size_t>(width) * 4);
  } else if (host) {
    KVRING_CUDA_CHECK("cudaStreamSynchronize", cudaStreamSynchronize(s));
  }
  return Status::Ok();
}

Status CudaStore::attend_and_store(const AttendBatch& b, std::span<const RowWrite> writes) {
  // One launch when every chunk is one row, the query at that row, in
  // device memory, under the f32 numeric's kernels (attend_f16's kernels
  // read chunks from f16 scratch only). Queries and outputs in device
  // memory too: a host output's staging comes after the launch, and a
  // failure there must find the rows not yet stored.
  bool one_launch = options_.attention == AttentionNumeric::kF32 && b.chunk_k->space == MemorySpace::kDevice &&
                    b.chunk_v->space == MemorySpace::kDevice && b.q->space == MemorySpace::kDevice &&
                    b.out->space == MemorySpace::kDevice &&
                    b.chunk_k->rows == static_cast<std::int64_t>(b.items.size());
  // And when the queries fit one launch (attend_f32 cuts launches where
  // the queries or their workspace slots would not fit): a failed later
  // launch would leave an earlier one's rows stored in a store the call
  // rolls back.
  const std::int64_t window = full_index(b.layer) >= 0 ? 0 : config_.sliding_window;
  std::int64_t slots = 0;
  for (const AttendItem& it : b.items) {
    one_launch = one_launch && it.n_queries == 1 && it.chunk_start == it.first_position;
    slots += cuda::attend_slots(splits_most(window, it.first_position, it.first_position));
  }
  one_launch = one_launch && static_cast<std::int64_t>(b.items.size()) <= kMaxQueriesPerLaunch &&
               slots <= impl_->ws_slots;
  if (!one_launch) return KvStore::attend_and_store(b, writes);
  AttendBatch own = b;
  own.store_chunk = true;
  return attend(own);
}

void CudaStore::plane_of(const AttendBatch& b, const AttendItem& it, cuda::AttendQueryItem& d) const {
  const Impl& im = *impl_;
  const std::int64_t full = full_index(b.layer);
  if (full >= 0) {
    d.k = im.pool_k;
    d.v = im.pool_v;
    d.table = im.tables + (it.plane.slot * im.n_full + full) * im.max_blocks;
  } else {
    d.k = im.ring_k[static_cast<std::size_t>(b.layer)] + it.plane.slot * im.ring_elems;
    d.v = im.ring_v[static_cast<std::size_t>(b.layer)] + it.plane.slot * im.ring_elems;
    d.table = nullptr;
  }
  d.shift = it.ring.origin_physical() - it.ring.origin_logical();
  d.capacity = it.ring.capacity();
  // A launch that stores its chunks reads their rows from the plane.
  d.chunk_start = b.store_chunk ? std::numeric_limits<std::int64_t>::max() : it.chunk_start;
  d.chunk_row = it.chunk_row;
}

void CudaStore::first_blocks(const AttendBatch& b, cudaStream_t s, cuda::AttendParams& P) const {
  const std::int64_t fi = full_index(b.layer);
  const AttendItem& it = b.items[0];
  if (!impl_->policy.first_blocks || fi < 0 || it.n_queries != 1 || config_.head_dim != cuda::kTensorHeadDim)
    return;
  cudaStreamCaptureStatus c = cudaStreamCaptureStatusActive;
  if (cudaStreamIsCapturing(s, &c) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (c != cudaStreamCaptureStatusNone) return;
  // A full plane's query at p sees rows [0, p]: split i starts at logical
  // row i x split_rows.
  const std::int64_t n = it.first_position + 1;
  const std::int64_t split_rows = cuda::attend_split_rows(n), splits = cuda::attend_splits(n);
  for (std::int64_t i = 0; i < splits; ++i) {
    const std::int32_t block = block_at(it.plane.slot, fi, it.ring.physical(i * split_rows));
    if (block < 0) return;
    P.first_blocks[i] = block;
  }
  P.first_blocks_n = static_cast<std::int32_t>(splits);
}

void CudaStore::launch_params(const AttendBatch& b, const float* dq, std::int64_t q_stride, float* dout,
                              std::int64_t out_stride, const std::uint16_t* chunk, std::int64_t q0,
                              std::int64_t n, cuda::AttendParams& P) const {
  const std::int64_t kv_dim = config_.kv_dim();
  const bool full = full_index(b.layer) >= 0;
  P.full = full ? 1 : 0;
  P.pool = impl_->pool;
  if (chunk != nullptr) {
    P.chunk_k = chunk;
    P.chunk_v = chunk + b.chunk_k->rows * kv_dim;
  }
  if (b.store_chunk) {
    const ConstView& k = *b.chunk_k;
    const ConstView& v = *b.chunk_v;
    P.own_rows = 1;
    P.own_k = {k.data, k.row_stride, dtype_code(k.dtype)};
    P.own_v = {v.data, v.row_stride, dtype_code(v.dtype)};
    P.own_vec = config_.head_dim % 8 == 0 && vector_source(k) && vector_source(v) ? 1 : 0;
  }
  P.q = dq + q0 * q_stride;
  P.out = dout + q0 * out_stride;
  P.q_stride = q_stride;
  P.out_stride = out_stride;
  P.n_queries = static_cast<std::int32_t>(n);
  P.n_heads = static_cast<std::int32_t>(config_.n_heads);
  P.n_kv_heads = static_cast<std::int32_t>(config_.n_kv_heads);
  P.head_dim = static_cast<std::int32_t>(config_.head_dim);
  P.kv_dim = static_cast<std::int32_t>(kv_dim);
  P.window = full ? 0 : config_.sliding_window;
  P.scale_log2 = detail::score_scale_log2(config_.score_scale_dim());
  if (!attention_sinks(b.layer).empty()) P.sinks = impl_->sinks + b.layer * config_.n_heads;
}

// The f32 numeric's launches (kernels.h, "Attention").
Status CudaStore::attend_f32(const AttendBatch& b, const float* dq, std::int64_t q_stride,
                             float* dout, std::int64_t out_stride, const std::uint16_t* chunk,
                             cudaStream_t s) {
  Impl& im = *impl_;
  Status st = Status::Ok();
  // Items, cut where one launch's queries or workspace would not fit, then
  // grouped into launches.
  const bool full = full_index(b.layer) >= 0;
  const std::int64_t window = full ? 0 : config_.sliding_window;
  std::vector<cuda::AttendQueryItem>& items = im.item_scratch;
  items.clear();
  for (const AttendItem& it : b.items) {
    cuda::AttendQueryItem d{};
    plane_of(b, it, d);
    // Split counts are not monotonic in the rows seen (kernels.h): the
    // item's bound is the most of any of its queries.
    const int most = splits_most(window, it.first_position, it.first_position + it.n_queries - 1);
    const std::int64_t per_query =
        std::min<std::int64_t>(kMaxQueriesPerLaunch,
                               im.ws_slots / cuda::attend_slots(most));
    for (std::int64_t i0 = 0; i0 < it.n_queries; i0 += per_query) {
      cuda::AttendQueryItem part = d;
      part.first_position = it.first_position + i0;
      part.n_queries = static_cast<std::int32_t>(std::min(per_query, it.n_queries - i0));
      part.q_first = static_cast<std::int32_t>(it.q_row + i0);  // rebased per launch below
      part.max_splits = splits_most(window, part.first_position, part.first_position + part.n_queries - 1);
      items.push_back(part);
    }
  }
  struct Launch {
    std::size_t first, count;
    std::int64_t q0, queries, slots, most_rows;
    int max_splits, least_splits;
  };
  std::vector<Launch> launches;
  for (std::size_t i = 0; i < items.size(); ++i) {
    cuda::AttendQueryItem& it = items[i];
    const std::int64_t need = static_cast<std::int64_t>(it.n_queries) * cuda::attend_slots(it.max_splits);
    if (launches.empty() || launches.back().queries + it.n_queries > kMaxQueriesPerLaunch ||
        launches.back().slots + need > im.ws_slots)
      launches.push_back(Launch{i, 0, it.q_first, 0, 0, 0, 1, cuda::kAttendMaxSplits});
    Launch& L = launches.back();
    const std::int64_t global_q = it.q_first;
    it.q_first = static_cast<std::int32_t>(global_q - L.q0);
    it.ws_slot = L.slots;
    // A query's counters start at its first slot: counters never outnumber
    // slots, so they never overlap.
    it.ws_counter = L.slots;
    L.slots += need;
    L.queries += it.n_queries;
    L.count += 1;
    L.max_splits = std::max(L.max_splits, static_cast<int>(it.max_splits));
    L.most_rows = std::max(L.most_rows, rows_seen(window, it.first_position + it.n_queries - 1));
    L.least_splits = std::min(L.least_splits, static_cast<int>(cuda::attend_splits_least(
        rows_seen(window, it.first_position), rows_seen(window, it.first_position + it.n_queries - 1))));
  }
  // The items' counters use ws_counter * gridDim.y + item * counters: a
  // query's slots hold at least as many entries.
  if (b.store_chunk && launches.size() > 1)
    return make_error(ErrorCode::kInternal, "a launch that stores its rows was cut in two");

  // One item travels in the launch's parameters as P.single; several in
  // the launch's parameters too where the policy says so and no launch has
  // more than kAttendInlineItems (docs/CUDA.md, "Items in the launch"),
  // else through one descriptor upload.
  bool in_launch = im.policy.inline_items;
  for (const Launch& L : launches) in_launch = in_launch && L.count <= cuda::kAttendInlineItems;
  Impl::Chunk* desc = nullptr;
  if (st.ok() && items.size() > 1 && !in_launch) {
    const std::size_t bytes = items.size() * sizeof(cuda::AttendQueryItem);
    auto c = im.take_chunk(bytes, s);
    if (!c) {
      st = c.status();
    } else {
      desc = *c;
      std::memcpy(desc->host, items.data(), bytes);
      st = im.upload_chunk(*desc, bytes, s);
    }
  }
  for (const Launch& L : launches) {
    if (!st.ok()) break;
    cuda::AttendParams P;
    const cuda::AttendQueryItem* inline_items = nullptr;
    if (desc != nullptr)
      P.items = reinterpret_cast<const cuda::AttendQueryItem*>(desc->dev) + L.first;
    else if (L.count > 1)
      inline_items = &items[L.first];
    else
      P.single = items[L.first];
    if (launches.size() == 1 && b.items.size() == 1) first_blocks(b, s, P);
    P.n_items = static_cast<std::int32_t>(L.count);
    launch_params(b, dq, q_stride, dout, out_stride, chunk, L.q0, L.queries, P);
    P.ws_o = im.ws;
    P.ws_ml = im.ws + im.ws_slots * (im.slot_floats / (config_.head_dim + 2) * config_.head_dim);
    P.counters = im.counters;
    P.max_splits = L.max_splits;
    P.most_rows = L.most_rows;
    P.least_splits = L.least_splits;
    // A resident grid takes its epoch from the clock on the device, so it
    // may be captured into a CUDA graph: each replay takes a new one.
    if (im.tagged_ctas > 0) {
      P.tagged = im.tagged;
      P.tagged_half = im.tagged_half;
      P.tagged_ctas = im.tagged_ctas;
      P.clock = reinterpret_cast<cuda::ResidentClock*>(im.tagged + 2 * im.tagged_half);
    }
    // A launch that stores its chunks may write rows from here on; an
    // error before it (a device switch, a descriptor chunk, an upload)
    // changed no ring.
    if (b.store_chunk) rows_written_ = true;
    const cudaError_t e = cuda::launch_attend(P, im.policy, s, inline_items);
    if (e != cudaSuccess) st = cuda_error("attention kernel launch", e);
  }
  im.release_chunk(desc, s, st);
  return st;
}

// The f16 numeric's launches: tiles of consecutive queries of one item, a
// workspace of one partial per (query, split, head) taken stream-ordered
// for the call, and the kernel and its combine per launch (kernels.h, "The
// f16 numeric"). A call of one item uploads nothing: the kernels derive
// its tiles from the item.
Status CudaStore::attend_f16(const AttendBatch& b, const float* dq, std::int64_t q_stride,
                             float* dout, std::int64_t out_stride, const std::uint16_t* chunk,
                             cudaStream_t s) {
  Impl& im = *impl_;
  const bool full = full_index(b.layer) >= 0;
  const std::int64_t window = full ? 0 : config_.sliding_window;
  const std::int64_t R = kF16AttendSplitRows;
  auto lo_of = [&](std::int64_t p) { return window > 0 ? std::max<std::int64_t>(0, p - window + 1) : 0; };
  auto splits_of = [&](std::int64_t p) { return p / R - lo_of(p) / R + 1; };
  const int group = static_cast<int>(config_.n_heads / config_.n_kv_heads);
  const int per_tile = cuda::f16_tile_queries(group);
  const std::int64_t part_bytes = config_.n_heads * cuda::kF16PartFloats * 4;

  std::vector<cuda::AttendQueryItem>& items = im.item_scratch;
  items.clear();
  std::vector<cuda::F16Tile>& tiles = im.f16_tiles;
  tiles.clear();
  // The most splits of any query (the workspace's stride) and of any tile
  // (the grid).
  std::int64_t query_splits = 1;
  for (const AttendItem& it : b.items) {
    cuda::AttendQueryItem d{};
    plane_of(b, it, d);
    d.first_position = it.first_position;
    d.q_first = static_cast<std::int32_t>(it.q_row);
    d.n_queries = static_cast<std::int32_t>(it.n_queries);
    for (std::int64_t i0 = 0; i0 < it.n_queries; i0 += per_tile) {
      cuda::F16Tile t{};
      t.position = it.first_position + i0;
      t.item = static_cast<std::int32_t>(items.size());
      t.q_first = static_cast<std::int32_t>(it.q_row + i0);
      t.n_queries = static_cast<std::int32_t>(std::min<std::int64_t>(per_tile, it.n_queries - i0));
      t.first_split = static_cast<std::int32_t>(lo_of(t.position) / R);
      tiles.push_back(t);
    }
    for (std::int64_t i = 0; i < it.n_queries; ++i)
      query_splits = std::max(query_splits, splits_of(it.first_position + i));
    items.push_back(d);
  }
  // Launches of whole tiles whose partials fit kF16WorkspaceBudget (one
  // tile at least), at most 65535 tiles each.
  struct Launch {
    std::size_t first, count;
    std::int64_t q0, queries;
    int max_splits;
    std::int64_t ctas;
  };
  std::vector<Launch> launches;
  const std::int64_t per_query = query_splits * part_bytes;
  std::int64_t most_queries = 0;
  for (std::size_t i = 0; i < tiles.size(); ++i) {
    cuda::F16Tile& t = tiles[i];
    if (launches.empty() || launches.back().count >= 65535 ||
        (launches.back().queries + t.n_queries) * per_query > kF16WorkspaceBudget)
      launches.push_back(Launch{i, 0, t.q_first, 0, 1, 0});
    Launch& L = launches.back();
    t.q_first -= static_cast<std::int32_t>(L.q0);
    L.count += 1;
    L.queries += t.n_queries;
    const int splits = static_cast<int>((t.position + t.n_queries - 1) / R - t.first_split + 1);
    L.max_splits = std::max(L.max_splits, splits);
    L.ctas += splits * config_.n_kv_heads;
    most_queries = std::max(most_queries, L.queries);
  }

  // Items, then tiles, in one descriptor upload, where there is more than
  // one item.
  const bool single = items.size() == 1;
  const std::size_t item_bytes = items.size() * sizeof(cuda::AttendQueryItem);
  const std::size_t tile_bytes = tiles.size() * sizeof(cuda::F16Tile);
  Impl::Chunk* desc = nullptr;
  Status st = Status::Ok();
  if (!single) {
    auto c = im.take_chunk(item_bytes + tile_bytes, s);
    if (!c) return c.status();
    desc = *c;
    std::memcpy(desc->host, items.data(), item_bytes);
    std::memcpy(desc->host + item_bytes, tiles.data(), tile_bytes);
    st = im.upload_chunk(*desc, item_bytes + tile_bytes, s);
  }
  float* ws = nullptr;
  if (st.ok() && query_splits > 1) {
    st = im.take_scratch(reinterpret_cast<void**>(&ws), static_cast<std::size_t>(most_queries * per_query),
                         "the attention workspace", s);
  }
  for (const Launch& L : launches) {
    if (!st.ok()) break;
    cuda::F16Params F;
    cuda::AttendParams& P = F.P;
    if (single) {
      P.single = items[0];
      P.single.q_first -= static_cast<std::int32_t>(L.q0);
      F.first_tile = static_cast<std::int32_t>(L.first);
    } else {
      P.items = reinterpret_cast<const cuda::AttendQueryItem*>(desc->dev);
      F.tiles = reinterpret_cast<const cuda::F16Tile*>(desc->dev + item_bytes) + L.first;
    }
    P.n_items = static_cast<std::int32_t>(items.size());
    launch_params(b, dq, q_stride, dout, out_stride, chunk, L.q0, L.queries, P);
    F.n_tiles = static_cast<std::int32_t>(L.count);
    F.ctas = L.ctas;
    F.max_splits = L.max_splits;
    F.ws = ws;
    F.query_splits = static_cast<std::int32_t>(query_splits);
    const cudaError_t e = cuda::launch_attend_f16(F, im.policy, s);
    if (e != cudaSuccess) st = cuda_error("attention kernel launch", e);
  }
  if (ws != nullptr) {
    const cudaError_t e = cudaFreeAsync(ws, s);
    if (e != cudaSuccess && st.ok()) st = cuda_error("cudaFreeAsync", e);
  }
  im.release_chunk(desc, s, st);
  return st;
}

// ---- Snapshot copies and plane housekeeping ----------------------------------------


Status CudaStore::copy_out(const PlaneRef& plane, const LiveSpans& spans, std::uint16_t* k,
                           std::uint16_t* v, MemorySpace space, cudaStream_t stream) const {
  return impl_->move_rows(plane, full_index(plane.layer), spans, k, v, space, stream, true);
}

Status CudaStore::copy_in(const PlaneRef& plane, const LiveSpans& spans, const std::uint16_t* k,
                          const std::uint16_t* v, MemorySpace space, cudaStream_t stream) {
  // move_rows only reads the rows when it scatters.
  return impl_->move_rows(plane, full_index(plane.layer), spans, const_cast<std::uint16_t*>(k),
                          const_cast<std::uint16_t*>(v), space, stream, false);
}

Status CudaStore::read_ring(std::int32_t slot, std::int64_t layer, std::uint16_t* k,
                            std::uint16_t* v) const {
  Impl& im = *impl_;
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  const cudaStream_t s = im.stream;
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_RETURN_IF_ERROR(im.enter(s));
  const std::size_t bytes = static_cast<std::size_t>(im.ring_elems) * 2;
  const auto l = static_cast<std::size_t>(layer);
  cudaError_t e = cudaMemcpyAsync(k, im.ring_k[l] + slot * im.ring_elems, bytes,
                                  cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(v, im.ring_v[l] + slot * im.ring_elems, bytes, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) return im.fail(cuda_error("reading a ring", e), s);
  return im.leave(s);
}

Status CudaStore::set_ring_rows(std::span<const RingRows> rows, cudaStream_t stream) {
  Impl& im = *impl_;
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  const cudaStream_t s = im.pick(stream);
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_RETURN_IF_ERROR(im.enter(s));
  const std::int64_t kv_dim = config_.kv_dim();
  // K's and V's rows of each range are a segment each; one launch takes
  // cuda::kFillSegments of them. A failure after the first launch waits
  // for it (fail): nothing of this call lands after it returned its error.
  cuda::FillLaunch* launch = &im.fill;
  launch->n = 0;
  cudaError_t e = cudaSuccess;
  for (const RingRows& r : rows) {
    const auto l = static_cast<std::size_t>(r.layer);
    const std::int64_t at = r.begin * kv_dim;
    for (std::uint16_t* ring : {im.ring_k[l], im.ring_v[l]}) {
      launch->segments[launch->n++] = cuda::FillSegment{ring + r.to * im.ring_elems + at,
                                                         r.from < 0 ? nullptr : ring + r.from * im.ring_elems + at,
                                                         (r.end - r.begin) * kv_dim};
      if (launch->n == cuda::kFillSegments) {
        if (e == cudaSuccess) e = cuda::launch_fill_segments(*launch, s);
        launch->n = 0;
      }
    }
  }
  if (e == cudaSuccess) e = cuda::launch_fill_segments(*launch, s);
  if (e != cudaSuccess) return im.fail(cuda_error("setting rings' rows", e), s);
  return im.leave(s);
}

Status CudaStore::copy_block(std::int32_t from, std::int32_t to, cudaStream_t stream) {
  Impl& im = *impl_;
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  const cudaStream_t s = im.pick(stream);
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_RETURN_IF_ERROR(im.enter(s));
  const std::size_t bytes = static_cast<std::size_t>(im.block_elems) * 2;
  cudaError_t e = cudaSuccess;
  for (auto* pool : {im.pool_k, im.pool_v})
    if (e == cudaSuccess)
      e = cudaMemcpyAsync(pool + to * im.block_elems, pool + from * im.block_elems, bytes, cudaMemcpyDeviceToDevice,
                          s);
  if (e != cudaSuccess) return im.fail(cuda_error("copying a block", e), s);
  return im.leave(s);
}

Status CudaStore::tables_changed(std::span<const TableChange> changes, cudaStream_t stream) {
  Impl& im = *impl_;
  std::size_t entries = 0;
  for (const TableChange& c : changes) entries += static_cast<std::size_t>(std::max<std::int64_t>(c.count, 0));
  if (entries == 0) return Status::Ok();
  const std::lock_guard<std::recursive_mutex> lock(im.mu);
  const cudaStream_t s = im.pick(stream);
  const DeviceScope scope(im.device);
  KVRING_CUDA_CHECK("making the store's device current", scope.error());
  KVRING_RETURN_IF_ERROR(im.enter(s));
  // Every entry of every change goes up in one copy and lands in the
  // mirror with one launch: a batched operation changes many tables. When
  // no descriptor buffer that large can be had (the device's memory spent),
  // they go in pieces of kDescriptorChunkBytes, each through a buffer
  // take_chunk finds or waits for, in stream order.
  std::size_t piece = entries;
  auto chunk = im.take_chunk(entries * sizeof(cuda::TableWrite), s);
  if (!chunk && entries * sizeof(cuda::TableWrite) > cuda::kDescriptorChunkBytes) {
    piece = cuda::kDescriptorChunkBytes / sizeof(cuda::TableWrite);
    chunk = im.take_chunk(cuda::kDescriptorChunkBytes, s);
  }
  std::size_t next_change = 0;
  std::int64_t next_entry = changes.empty() ? 0 : changes[0].first;
  Status st = Status::Ok();
  for (std::size_t sent = 0; st.ok() && sent < entries;) {
    if (sent > 0) chunk = im.take_chunk(piece * sizeof(cuda::TableWrite), s);
    if (!chunk) {
      st = chunk.status();
      break;
    }
    const std::size_t n = std::min(piece, entries - sent);
    auto* w = reinterpret_cast<cuda::TableWrite*>((*chunk)->host);
    for (std::size_t k = 0; k < n;) {
      const TableChange& c = changes[next_change];
      if (c.count <= 0 || next_entry >= c.first + c.count) {
        ++next_change;
        if (next_change < changes.size()) next_entry = changes[next_change].first;
        continue;
      }
      const std::int64_t row = (c.slot * im.n_full + c.full_index) * im.max_blocks;
      *w++ = {row + next_entry, c.table[next_entry], 0};
      ++next_entry;
      ++k;
    }
    st = im.upload_chunk(**chunk, n * sizeof(cuda::TableWrite), s);
    if (st.ok()) {
      const cudaError_t e = cuda::launch_table_writes(reinterpret_cast<const cuda::TableWrite*>((*chunk)->dev),
                                                      static_cast<std::int64_t>(n), im.tables, s);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        st = cuda_error("block table upload", e);
      }
    }
    im.release_chunk(*chunk, s, st);
    sent += n;
  }
  if (st.ok()) st = im.leave(s);
  if (!st.ok()) return im.fail(st, s);
  return Status::Ok();
}

}  // namespace kvring
