// The handoff's GPU side (device.h) on the CUDA runtime.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "cuda/digest.h"
#include "device.h"
#include "kvring/cuda_store.h"

namespace kvring::handoff::device {
namespace {

Error cuda_failed(const std::string& what, cudaError_t e) {
  (void)cudaGetLastError();
  return make_error(ErrorCode::kCuda, "handoff: " + what + " failed: " + cudaGetErrorName(e) + " (" +
                                          cudaGetErrorString(e) + ")");
}

#define HANDOFF_CUDA(what, expr)                                  \
  do {                                                            \
    if (const cudaError_t e_ = (expr); e_ != cudaSuccess) return cuda_failed((what), e_); \
  } while (0)

cudaError_t pinned_alloc(void** p, std::size_t n) { return cudaHostAlloc(p, n, cudaHostAllocDefault); }

// Device or pinned memory that grows on demand; growing drops the contents
// (callers grow a slot only once its previous use is over).
template <cudaError_t (*Alloc)(void**, std::size_t), cudaError_t (*Free)(void*)>
struct Buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (p) Free(p);
  }
  Status reserve(std::size_t n) {
    if (n <= bytes) return Status::Ok();
    if (p) Free(p);
    p = nullptr;
    bytes = 0;
    HANDOFF_CUDA("allocating " + std::to_string(n) + " B of staging", Alloc(&p, n));
    bytes = n;
    return Status::Ok();
  }
};
using DeviceMem = Buffer<cudaMalloc, cudaFree>;
using PinnedMem = Buffer<pinned_alloc, cudaFreeHost>;

// Rows [rows, kv_dim] of K then of V in one buffer, each 256-byte aligned
// (the copy kernels' vector path wants 16).
std::size_t v_offset(std::size_t plane_bytes) { return (plane_bytes + 255) / 256 * 256; }

class CudaStream : public Stream {
 public:
  ~CudaStream() override {
    if (s_) {
      cudaStreamSynchronize(s_);
      cudaStreamDestroy(s_);
    }
  }
  Status init() {
    HANDOFF_CUDA("cudaStreamCreate", cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return Status::Ok();
  }
  cudaStream_t get() const override { return s_; }
  Status synchronize() override {
    HANDOFF_CUDA("waiting for the handoff's device work", cudaStreamSynchronize(s_));
    return Status::Ok();
  }

 private:
  cudaStream_t s_ = nullptr;
};

class CudaDigester : public Digester {
 public:
  ~CudaDigester() override {
    if (event_) {
      cudaEventSynchronize(event_);
      cudaEventDestroy(event_);
    }
    if (sum_) cudaFree(sum_);
    if (host_) cudaFreeHost(host_);
  }
  Status init() {
    HANDOFF_CUDA("cudaMalloc of a digest", cudaMalloc(reinterpret_cast<void**>(&sum_), sizeof *sum_));
    HANDOFF_CUDA("cudaHostAlloc of a digest", cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof *host_, cudaHostAllocDefault));
    HANDOFF_CUDA("cudaEventCreate", cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    return Status::Ok();
  }
  Status start(const void* k, const void* v, std::size_t plane_bytes, cudaStream_t s) override {
    HANDOFF_CUDA("cudaMemsetAsync", cudaMemsetAsync(sum_, 0, sizeof *sum_, s));
    HANDOFF_CUDA("the digest kernel", cuda::launch_digest_words(k, plane_bytes, 1, sum_, s));
    HANDOFF_CUDA("the digest kernel", cuda::launch_digest_words(v, plane_bytes, 2, sum_, s));
    HANDOFF_CUDA("copying a digest", cudaMemcpyAsync(host_, sum_, sizeof *sum_, cudaMemcpyDeviceToHost, s));
    HANDOFF_CUDA("cudaEventRecord", cudaEventRecord(event_, s));
    started_ = true;
    return Status::Ok();
  }
  Result<std::uint64_t> wait() override {
    if (!started_) return make_error(ErrorCode::kInternal, "handoff: a digest waited for before it started");
    started_ = false;
    HANDOFF_CUDA("digesting rows on the GPU", cudaEventSynchronize(event_));
    return static_cast<std::uint64_t>(*host_);
  }

 private:
  unsigned long long* sum_ = nullptr;
  unsigned long long* host_ = nullptr;
  cudaEvent_t event_ = nullptr;
  bool started_ = false;
};

// Device memory the same-GPU transport allocated on the sender's stream and
// filled there; `ready` is recorded after the copies. It is freed in the
// order of the stream it was last made ready on (after the work enqueued
// there that reads it), or of the legacy stream after `ready`: no host wait.
class Block : public DeviceBytes {
 public:
  Block(void* p, std::size_t n, cudaEvent_t ready) : p_(p), n_(n), ready_(ready) {}
  ~Block() override {
    if (!waited_ && cudaStreamWaitEvent(last_, ready_, 0) != cudaSuccess) cudaEventSynchronize(ready_);
    if (cudaFreeAsync(p_, last_) != cudaSuccess) {
      (void)cudaGetLastError();
      cudaFree(p_);
    }
    cudaEventDestroy(ready_);
  }
  const void* data() const override { return p_; }
  std::size_t size() const override { return n_; }
  Status ready_on(cudaStream_t stream) override {
    HANDOFF_CUDA("cudaStreamWaitEvent", cudaStreamWaitEvent(stream, ready_, 0));
    last_ = stream;
    waited_ = true;
    return Status::Ok();
  }
  Status to_host(std::uint8_t* out) {
    HANDOFF_CUDA("waiting for a device message", cudaEventSynchronize(ready_));
    HANDOFF_CUDA("copying a device message to the host", cudaMemcpy(out, p_, n_, cudaMemcpyDeviceToHost));
    return Status::Ok();
  }

 private:
  void* p_;
  std::size_t n_;
  cudaEvent_t ready_;
  cudaStream_t last_ = nullptr;  // the legacy default stream until made ready elsewhere
  bool waited_ = false;
};

// Both sides' staging: a stream, and an event per slot recorded after the
// slot's last work. Declared after the buffers it guards, so it is destroyed
// first and waits for the work on them.
struct SlotStream {
  std::unique_ptr<Stream> stream;
  std::array<cudaEvent_t, 2> done{};
  SlotStream() = default;
  SlotStream(const SlotStream&) = delete;
  SlotStream& operator=(const SlotStream&) = delete;
  ~SlotStream() {
    if (stream) (void)stream->synchronize();
    for (cudaEvent_t e : done)
      if (e) cudaEventDestroy(e);
  }
  Status init() {
    auto s = Stream::create();
    if (!s) return s.error();
    stream = std::move(*s);
    for (cudaEvent_t& e : done) HANDOFF_CUDA("cudaEventCreate", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return Status::Ok();
  }
};

class CudaSourceSlots : public SourceSlots {
 public:
  CudaSourceSlots(const KvStore& store, std::int64_t max_rows) : store_(store), max_rows_(max_rows) {}
  Status init() {
    KVRING_RETURN_IF_ERROR(sync_.init());
    // Sized once for the largest message: no slot grows during a session.
    const std::size_t plane = static_cast<std::size_t>(max_rows_ * store_.config().kv_dim()) * 2;
    for (Slot& slot : slots_) {
      auto d = Digester::create();
      if (!d) return d.error();
      slot.digest = std::move(*d);
      KVRING_RETURN_IF_ERROR(slot.dev.reserve(v_offset(plane) + plane));
    }
    return Status::Ok();
  }

  Status prepare(int which, SeqId seq, std::int64_t layer, std::int64_t first, std::int64_t rows,
                 bool to_host) override {
    Slot& slot = slots_[static_cast<std::size_t>(which)];
    const cudaStream_t s = sync_.stream->get();
    const std::size_t plane = static_cast<std::size_t>(rows * store_.config().kv_dim()) * 2;
    const std::size_t at = v_offset(plane);
    if (plane + at > slot.dev.bytes || (to_host && plane * 2 > slot.pin.bytes)) {
      // Growing frees the old buffers: earlier work on them must be over.
      KVRING_RETURN_IF_ERROR(sync_.stream->synchronize());
      KVRING_RETURN_IF_ERROR(slot.dev.reserve(at + plane));
      const std::size_t most = static_cast<std::size_t>(max_rows_ * store_.config().kv_dim()) * 2;
      if (to_host) KVRING_RETURN_IF_ERROR(slot.pin.reserve(std::max(plane, most) * 2));
    }
    auto* k = static_cast<std::uint16_t*>(slot.dev.p);
    auto* v = reinterpret_cast<std::uint16_t*>(static_cast<char*>(slot.dev.p) + at);
    KVRING_RETURN_IF_ERROR(store_.read_rows(seq, layer, first, rows, k, v, MemorySpace::kDevice, s));
    KVRING_RETURN_IF_ERROR(slot.digest->start(k, v, plane, s));
    if (to_host) {
      char* pin = static_cast<char*>(slot.pin.p);
      HANDOFF_CUDA("copying rows to pinned memory", cudaMemcpyAsync(pin, k, plane, cudaMemcpyDeviceToHost, s));
      HANDOFF_CUDA("copying rows to pinned memory", cudaMemcpyAsync(pin + plane, v, plane, cudaMemcpyDeviceToHost, s));
    }
    HANDOFF_CUDA("cudaEventRecord", cudaEventRecord(sync_.done[static_cast<std::size_t>(which)], s));
    slot.plane = plane;
    slot.to_host = to_host;
    slot.k = k;
    slot.v = v;
    return Status::Ok();
  }

  Status take(int which, SourceRows* out) override {
    Slot& slot = slots_[static_cast<std::size_t>(which)];
    auto words = slot.digest->wait();
    if (!words) return words.error();
    HANDOFF_CUDA("staging rows", cudaEventSynchronize(sync_.done[static_cast<std::size_t>(which)]));
    out->digest_words = *words;
    if (slot.to_host) {
      out->k = slot.pin.p;
      out->v = static_cast<char*>(slot.pin.p) + slot.plane;
      out->kind = MemoryKind::kHost;
      out->stream = nullptr;
    } else {
      out->k = slot.k;
      out->v = slot.v;
      out->kind = MemoryKind::kCudaDevice;
      out->stream = sync_.stream->get();
    }
    return Status::Ok();
  }

 private:
  struct Slot {
    DeviceMem dev;
    PinnedMem pin;
    std::unique_ptr<Digester> digest;
    std::size_t plane = 0;
    bool to_host = false;
    const void* k = nullptr;
    const void* v = nullptr;
  };
  const KvStore& store_;
  std::int64_t max_rows_;
  std::array<Slot, 2> slots_;
  SlotStream sync_;
};

class CudaTargetSlots : public TargetSlots {
 public:
  Status init() { return sync_.init(); }

  Status put(KvStore& store, SeqId seq, std::int64_t layer, std::int64_t first, std::int64_t rows,
             const std::uint16_t* k, const std::uint16_t* v) override {
    const std::size_t which = next_;
    Slot& slot = slots_[which];
    next_ ^= 1;
    const cudaStream_t s = sync_.stream->get();
    // The slot's previous message is installed: its buffers are free.
    if (slot.used) HANDOFF_CUDA("installing rows", cudaEventSynchronize(sync_.done[which]));
    const std::size_t plane = static_cast<std::size_t>(rows * store.config().kv_dim()) * 2;
    const std::size_t at = v_offset(plane);
    KVRING_RETURN_IF_ERROR(slot.pin.reserve(at + plane));
    KVRING_RETURN_IF_ERROR(slot.dev.reserve(at + plane));
    char* pin = static_cast<char*>(slot.pin.p);
    std::memcpy(pin, k, plane);
    std::memcpy(pin + at, v, plane);
    HANDOFF_CUDA("copying rows to the GPU", cudaMemcpyAsync(slot.dev.p, pin, at + plane, cudaMemcpyHostToDevice, s));
    auto* dk = static_cast<const std::uint16_t*>(slot.dev.p);
    auto* dv = reinterpret_cast<const std::uint16_t*>(static_cast<const char*>(slot.dev.p) + at);
    KVRING_RETURN_IF_ERROR(store.install_rows(seq, layer, first, rows, dk, dv, MemorySpace::kDevice, s));
    HANDOFF_CUDA("cudaEventRecord", cudaEventRecord(sync_.done[which], s));
    slot.used = true;
    return Status::Ok();
  }
  Status finish() override { return sync_.stream->synchronize(); }

 private:
  struct Slot {
    DeviceMem dev;
    PinnedMem pin;
    bool used = false;
  };
  std::array<Slot, 2> slots_;
  std::size_t next_ = 0;
  SlotStream sync_;
};

}  // namespace

bool usable() { return cuda_device_count() > 0; }

Result<std::unique_ptr<DeviceBytes>> copy_parts(const std::vector<Part>& parts) {
  std::size_t total = 0;
  cudaStream_t s = parts.empty() ? nullptr : parts[0].stream;
  for (const Part& p : parts) {
    if (p.kind != MemoryKind::kCudaDevice || p.stream != s)
      return invalid_argument("handoff: a message's device parts come last and name one stream");
    total += p.size;
  }
  void* block = nullptr;
  HANDOFF_CUDA("cudaMallocAsync of " + std::to_string(total) + " B for a message",
               cudaMallocAsync(&block, std::max<std::size_t>(total, 1), s));
  cudaEvent_t ready = nullptr;
  if (const cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming); e != cudaSuccess) {
    cudaFreeAsync(block, s);
    return cuda_failed("cudaEventCreate", e);
  }
  std::size_t at = 0;
  cudaError_t e = cudaSuccess;
  for (const Part& p : parts) {
    if (e == cudaSuccess && p.size)
      e = cudaMemcpyAsync(static_cast<char*>(block) + at, p.data, p.size, cudaMemcpyDeviceToDevice, s);
    at += p.size;
  }
  // `ready` follows whatever was enqueued, so the block (which owns the
  // memory and the event from here on) is freed after it even on an error.
  const cudaError_t recorded = cudaEventRecord(ready, s);
  if (recorded != cudaSuccess) cudaStreamSynchronize(s);
  auto owned = std::make_unique<Block>(block, total, ready);
  if (e != cudaSuccess) return cuda_failed("a device-to-device message copy", e);
  if (recorded != cudaSuccess) return cuda_failed("cudaEventRecord", recorded);
  return std::unique_ptr<DeviceBytes>(std::move(owned));
}

Status append_to_host(DeviceBytes& bytes, std::vector<std::uint8_t>& out) {
  auto* block = dynamic_cast<Block*>(&bytes);
  if (block == nullptr) return make_error(ErrorCode::kInternal, "handoff: device bytes of another transport");
  const std::size_t at = out.size();
  out.resize(at + bytes.size());
  return block->to_host(out.data() + at);
}

Result<std::unique_ptr<Digester>> Digester::create() {
  auto d = std::make_unique<CudaDigester>();
  KVRING_RETURN_IF_ERROR(d->init());
  return std::unique_ptr<Digester>(std::move(d));
}

Result<std::unique_ptr<Stream>> Stream::create() {
  auto s = std::make_unique<CudaStream>();
  KVRING_RETURN_IF_ERROR(s->init());
  return std::unique_ptr<Stream>(std::move(s));
}

Result<std::unique_ptr<SourceSlots>> SourceSlots::create(const KvStore& store, std::int64_t max_rows) {
  if (store.backend() != BackendKind::kCuda)
    return make_error(ErrorCode::kInternal, "handoff: device staging for a store not on the GPU");
  auto s = std::make_unique<CudaSourceSlots>(store, max_rows);
  KVRING_RETURN_IF_ERROR(s->init());
  return std::unique_ptr<SourceSlots>(std::move(s));
}

Result<std::unique_ptr<TargetSlots>> TargetSlots::create() {
  auto s = std::make_unique<CudaTargetSlots>();
  KVRING_RETURN_IF_ERROR(s->init());
  return std::unique_ptr<TargetSlots>(std::move(s));
}

}  // namespace kvring::handoff::device
