// The handoff's GPU side (device.h) on the CUDA runtime.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "cuda/device_scope.h"
#include "cuda/digest.h"
#include "cuda_call.h"
#include "device.h"
#include "kvring/cuda_store.h"

namespace kvring::handoff::device {
namespace {

Error cuda_failed(const std::string& what, cudaError_t e) { return device::cuda_failed("handoff", what, e); }
#define HANDOFF_CUDA(what, expr) HANDOFF_CUDA_CALL("handoff", (what), (expr))

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
class Block : public OwnBytes {
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
  Status to_host(std::uint8_t* out) override {
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

// The receiver's GPU buffers of a peer link. A buffer is busy from copy()
// until the bytes it backs are dropped; `consumed` (on the receiver's GPU)
// is then recorded after the receiver's reads, and the next copy into the
// buffer waits for it on the sender's stream. `ready` (on the sender's GPU)
// follows each copy.
class PeerSlots final : public PeerCopier, public std::enable_shared_from_this<PeerSlots> {
 public:
  static constexpr std::size_t kSlots = 4;
  PeerSlots(int sender_gpu, int receiver_gpu) : send_(sender_gpu), recv_(receiver_gpu) {}
  ~PeerSlots() override {
    for (Slot& slot : slots_) {
      if (slot.consumed_pending) cudaEventSynchronize(slot.consumed);
      if (slot.ready) {
        cudaEventSynchronize(slot.ready);
        cudaEventDestroy(slot.ready);
      }
      if (slot.consumed) cudaEventDestroy(slot.consumed);
      if (slot.p) {
        const cuda::DeviceScope on(recv_);
        cudaFree(slot.p);
      }
    }
  }
  Status init() {
    for (Slot& slot : slots_) {
      {
        const cuda::DeviceScope on(send_);
        HANDOFF_CUDA("selecting the sender's GPU", on.error());
        HANDOFF_CUDA("cudaEventCreate", cudaEventCreateWithFlags(&slot.ready, cudaEventDisableTiming));
      }
      const cuda::DeviceScope on(recv_);
      HANDOFF_CUDA("selecting the receiver's GPU", on.error());
      HANDOFF_CUDA("cudaEventCreate", cudaEventCreateWithFlags(&slot.consumed, cudaEventDisableTiming));
    }
    return Status::Ok();
  }

  Result<std::unique_ptr<DeviceBytes>> copy(const std::vector<Part>& parts, Deadline deadline) override {
    std::size_t total = 0;
    const cudaStream_t s = parts.empty() ? nullptr : parts[0].stream;
    for (const Part& p : parts) {
      if (p.kind != MemoryKind::kCudaDevice || p.stream != s)
        return invalid_argument("handoff: a message's device parts come last and name one stream");
      total += p.size;
    }
    std::size_t which = kSlots;
    {
      std::unique_lock lock(mu_);
      auto free_slot = [&] {
        for (std::size_t i = 0; i < kSlots; ++i)
          if (!slots_[i].busy) return i;
        return kSlots;
      };
      if (!cv_.wait_until(lock, deadline, [&] { return closed_ || (which = free_slot()) < kSlots; }))
        return io_error("peer link: no buffer of GPU " + std::to_string(recv_) + " came free in time");
      if (closed_) return io_error("peer link is closed");
      slots_[which].busy = true;
    }
    Slot& slot = slots_[which];
    Status st = fill(slot, parts, total, s);
    if (!st.ok()) {
      // What was enqueued runs out before the buffer is handed out again.
      if (s && cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
      release(which, nullptr);
      return st.error();
    }
    return std::unique_ptr<DeviceBytes>(std::make_unique<Bytes>(shared_from_this(), which, total));
  }

  void close() override {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  struct Slot {
    void* p = nullptr;
    std::size_t bytes = 0;
    bool busy = false;
    bool consumed_pending = false;  // `consumed` recorded after the last reads
    cudaEvent_t ready = nullptr, consumed = nullptr;
  };

  // The receiver's view of one buffer.
  class Bytes final : public OwnBytes {
   public:
    Bytes(std::shared_ptr<PeerSlots> slots, std::size_t which, std::size_t n)
        : slots_(std::move(slots)), which_(which), n_(n) {}
    ~Bytes() override { slots_->release(which_, last_); }
    const void* data() const override { return slots_->slots_[which_].p; }
    std::size_t size() const override { return n_; }
    // The receiver reads its GPU's buffers from that GPU: a session made
    // ready elsewhere is refused rather than left to fault.
    Status ready_on(cudaStream_t stream) override {
      KVRING_RETURN_IF_ERROR(current_gpu_is(slots_->recv_, "peer link: the receiver's bytes"));
      HANDOFF_CUDA("cudaStreamWaitEvent", cudaStreamWaitEvent(stream, slots_->slots_[which_].ready, 0));
      last_ = stream;
      return Status::Ok();
    }
    Status to_host(std::uint8_t* out) override {
      HANDOFF_CUDA("waiting for a peer copy", cudaEventSynchronize(slots_->slots_[which_].ready));
      HANDOFF_CUDA("copying a device message to the host", cudaMemcpy(out, data(), n_, cudaMemcpyDefault));
      return Status::Ok();
    }

   private:
    std::shared_ptr<PeerSlots> slots_;
    std::size_t which_, n_;
    std::optional<cudaStream_t> last_;  // the stream the receiver read the bytes on
  };

  // Enqueues the copy of `parts` into `slot` on `s`, growing the buffer
  // first where it is too small (after the receiver's reads of it ran).
  Status fill(Slot& slot, const std::vector<Part>& parts, std::size_t total, cudaStream_t s) {
    if (slot.bytes < total) {
      if (slot.consumed_pending) HANDOFF_CUDA("waiting for the receiver's reads", cudaEventSynchronize(slot.consumed));
      slot.consumed_pending = false;
      const cuda::DeviceScope on(recv_);
      HANDOFF_CUDA("selecting the receiver's GPU", on.error());
      if (slot.p) HANDOFF_CUDA("cudaFree of a peer buffer", cudaFree(slot.p));
      slot.p = nullptr;
      slot.bytes = 0;
      const std::size_t grown = (total + 255) / 256 * 256;
      HANDOFF_CUDA("allocating " + std::to_string(grown) + " B on GPU " + std::to_string(recv_),
                   cudaMalloc(&slot.p, std::max<std::size_t>(grown, 1)));
      slot.bytes = grown;
    }
    if (slot.consumed_pending) HANDOFF_CUDA("cudaStreamWaitEvent", cudaStreamWaitEvent(s, slot.consumed, 0));
    slot.consumed_pending = false;
    std::size_t at = 0;
    for (const Part& p : parts) {
      if (p.size)
        HANDOFF_CUDA("a peer copy from GPU " + std::to_string(send_) + " to GPU " + std::to_string(recv_),
                     cudaMemcpyPeerAsync(static_cast<char*>(slot.p) + at, recv_, p.data, send_, p.size, s));
      at += p.size;
    }
    HANDOFF_CUDA("cudaEventRecord on the sender's stream", cudaEventRecord(slot.ready, s));
    return Status::Ok();
  }

  // The buffer's bytes were dropped: `consumed` follows the reads enqueued
  // on `last` (a host wait where it cannot be recorded there), or, where the
  // receiver read none there, the copy itself is waited for.
  void release(std::size_t which, std::optional<cudaStream_t> last) {
    Slot& slot = slots_[which];
    slot.consumed_pending = last && record_after_reads(slot.consumed, *last);
    if (!last && cudaEventSynchronize(slot.ready) != cudaSuccess) (void)cudaGetLastError();
    {
      std::lock_guard lock(mu_);
      slot.busy = false;
    }
    cv_.notify_all();
  }

  const int send_, recv_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  std::array<Slot, kSlots> slots_;
};

}  // namespace

bool usable() { return cuda_device_count() > 0; }

Status on_store_gpu(const KvStore& store) {
  const auto* cuda = dynamic_cast<const CudaStore*>(&store);
  // A session's GPU work runs on the current GPU.
  return cuda == nullptr ? Status::Ok() : current_gpu_is(cuda->device(), "handoff: the store");
}

Result<PeerPlan> plan_peer(int sender_gpu, int receiver_gpu, bool host_staging) {
  const int n = cuda_device_count();
  if (n == 0) return make_error(ErrorCode::kUnsupported, "the peer transport needs a visible GPU");
  for (int g : {sender_gpu, receiver_gpu})
    if (g < 0 || g >= n)
      return invalid_argument("peer link: GPU " + std::to_string(g) + " is not one of the " + std::to_string(n) +
                              " visible");
  const std::string pair = "GPU " + std::to_string(sender_gpu) + " -> GPU " + std::to_string(receiver_gpu);
  const std::string staged = ": rows staged through pinned host memory";
  if (host_staging) return PeerPlan{false, pair + staged + " (asked for)"};
  if (sender_gpu == receiver_gpu) return PeerPlan{true, pair + " (one GPU)"};
  int there = 0, back = 0;
  HANDOFF_CUDA("cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&there, receiver_gpu, sender_gpu));
  HANDOFF_CUDA("cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&back, sender_gpu, receiver_gpu));
  if (!there || !back) return PeerPlan{false, pair + staged + " (the pair has no peer access)"};
  for (auto [on_gpu, peer] : {std::pair{receiver_gpu, sender_gpu}, std::pair{sender_gpu, receiver_gpu}}) {
    const cuda::DeviceScope on(on_gpu);
    HANDOFF_CUDA("selecting GPU " + std::to_string(on_gpu), on.error());
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return PeerPlan{false, pair + staged + " (enabling peer access failed: " + cudaGetErrorName(e) + ")"};
    }
  }
  return PeerPlan{true, pair + " peer to peer"};
}

Result<std::shared_ptr<PeerCopier>> PeerCopier::create(int sender_gpu, int receiver_gpu) {
  auto slots = std::make_shared<PeerSlots>(sender_gpu, receiver_gpu);
  KVRING_RETURN_IF_ERROR(slots->init());
  return std::shared_ptr<PeerCopier>(std::move(slots));
}

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
  auto* block = dynamic_cast<OwnBytes*>(&bytes);
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
