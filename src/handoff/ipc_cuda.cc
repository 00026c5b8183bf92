// cuda_ipc_link: device memory between two processes of one host through
// CUDA IPC, over a host transport that carries the link's frames.
//
// Frames on the host transport; the last byte names the kind, and the
// fixed fields of that kind come just before it, so that a message's host
// bytes lead the frame and travel in place (the sender passes the caller's
// parts through; the receiver hands out the frame without its tail):
//   hello    'H' magic, a per-process nonce, the GPU's UUID and PCI bus id
//            (both ends, first)
//   verdict  'V' why this end cannot map the peer's memory (empty: it
//            can), then whether it can
//   host     'M' a message of host bytes only
//   device   'D' the message's host bytes, then where its device parts lie:
//            the sender's buffer `slot` (generation, sizes, its memory and
//            `ready` event handles)
//   release  'R' the receiver dropped buffer `slot`'s bytes; its `consumed`
//            event (handle in the frame) follows the reads it enqueued
//   closed   'C' this end unmapped the peer's buffers and closed its events,
//            and touches neither again
// A sender's buffer is reused only after its release: the next copy into
// it follows the receiver's reads (`consumed`) and the buffer's last copy
// (`ready`). Neither end makes its streams wait on the other's event: each
// waits for a peer's event on the host, up to the call's deadline
// (wait_peer_event), so a peer whose work never ends costs a timeout, not a
// stream that never drains. A buffer that grows is a new allocation (a new
// generation), which the receiver maps anew, checking that the mapping
// holds what the frame claims; the old allocation is freed at the first
// release of the new one, by which time the receiver has unmapped it. What an end
// exported (buffers, events) is freed only after the peer said 'C' or its
// link ended (an end says 'C' once it holds nothing of the peer's: at
// close, or when the last bytes it handed out are dropped after it); a
// peer that does neither within kCloseWaitS leaves them allocated, never
// freed under its mappings. CUDA IPC opens no handle in the process that
// made it, so two ends of one process (the same nonce) stage rows through
// the host.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "cuda/allocation.h"
#include "cuda_call.h"
#include "device.h"
#include "kvring/handoff.h"

namespace kvring::handoff {
namespace {

constexpr std::uint8_t kHello = 'H', kVerdict = 'V', kHostMsg = 'M', kDeviceMsg = 'D', kRelease = 'R',
                       kClosed = 'C';
constexpr char kMagic[8] = {'k', 'v', 'r', 'i', 'p', 'c', '0', '1'};
constexpr std::size_t kSlots = 4;
// magic nonce uuid bus-id 'H'
constexpr std::size_t kHelloBytes = 8 + 8 + 16 + 16 + 1;
// slot generation buffer-bytes size mem-handle event-handle 'D'
constexpr std::size_t kDeviceTail = 1 + 8 + 8 + 8 + 64 + 64 + 1;
// slot has-event event-handle 'R'
constexpr std::size_t kReleaseBytes = 1 + 1 + 64 + 1;

// A frame's kind (0 for an empty one).
std::uint8_t kind_of(const std::vector<std::uint8_t>& frame) { return frame.empty() ? 0 : frame.back(); }
// Frames, and their bytes, that a sender queues while it waits for a
// release.
constexpr std::size_t kMostQueued = 4096, kMostQueuedBytes = std::size_t{64} << 20;
// How long closing waits for the peer's 'C'.
constexpr double kCloseWaitS = 2;
// How long message_waiting reads the rest of a frame that has begun to
// arrive.
constexpr double kFrameRestS = 5;

// This process, as the peer tells it from another: random, so that
// processes of separate pid namespaces never look like one.
std::uint64_t process_nonce() {
  static const std::uint64_t nonce = [] {
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) ^ rd() ^ static_cast<std::uint64_t>(getpid());
  }();
  return nonce;
}

static_assert(sizeof(cudaIpcMemHandle_t) == 64 && sizeof(cudaIpcEventHandle_t) == 64);

Error cuda_failed(const std::string& what, cudaError_t e) { return device::cuda_failed("cuda ipc link", what, e); }
#define IPC_CUDA(what, expr) HANDOFF_CUDA_CALL("cuda ipc link", (what), (expr))

// Waits on the host, up to `deadline`, for an event the peer records
// (`what` names the peer's work). Once it returned, the peer's work before
// the event's record is done, so work this end enqueues afterwards sees it
// without a device-side wait.
Status wait_peer_event(cudaEvent_t event, Deadline deadline, const std::string& what) {
  for (auto pause = std::chrono::microseconds(10);; pause = std::min(2 * pause, std::chrono::microseconds(1000))) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady) return cuda_failed("waiting for " + what, e);
    if (Clock::now() >= deadline) return io_error("cuda ipc link: timed out waiting for " + what);
    std::this_thread::sleep_for(pause);
  }
}

void put(std::vector<std::uint8_t>& out, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}
void put64(std::vector<std::uint8_t>& out, std::uint64_t v) { put(out, &v, 8); }
std::uint64_t get64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// This process's GPU, as the peer names it.
struct Gpu {
  int ordinal = -1;
  std::array<char, 16> uuid{};
  std::array<char, 16> bus{};  // "0000:3b:00.0", NUL-padded
  std::string bus_id() const { return std::string(bus.data(), strnlen(bus.data(), bus.size())); }
};

Result<Gpu> current_gpu() {
  Gpu g;
  IPC_CUDA("cudaGetDevice", cudaGetDevice(&g.ordinal));
  cudaDeviceProp prop{};
  IPC_CUDA("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, g.ordinal));
  std::memcpy(g.uuid.data(), prop.uuid.bytes, 16);
  char bus[32] = {};
  IPC_CUDA("cudaDeviceGetPCIBusId", cudaDeviceGetPCIBusId(bus, sizeof bus, g.ordinal));
  std::memcpy(g.bus.data(), bus, std::min(strnlen(bus, sizeof bus), g.bus.size()));
  return g;
}

// The bytes from `p` to the end of the allocation that holds it
// (cuda::allocation_bytes): a mapping is never read past what it holds,
// whatever a frame claims.
Result<std::uint64_t> allocation_bytes(const void* p) {
  const auto bytes = cuda::allocation_bytes(p);
  if (!bytes) return make_error(ErrorCode::kCuda, "cuda ipc link: the mapped buffer's size is unknown");
  return *bytes;
}

class IpcLink;

// The receiver's view of one of the peer's buffers.
class IpcBytes final : public device::OwnBytes {
 public:
  IpcBytes(std::shared_ptr<IpcLink> link, std::size_t slot, const void* p, std::size_t n)
      : link_(std::move(link)), slot_(slot), p_(p), n_(n) {}
  ~IpcBytes() override;
  const void* data() const override { return p_; }
  std::size_t size() const override { return n_; }
  Status ready_on(cudaStream_t stream) override;
  Status to_host(std::uint8_t* out) override;

 private:
  std::shared_ptr<IpcLink> link_;
  std::size_t slot_;
  const void* p_;
  std::size_t n_;
  std::optional<cudaStream_t> last_;  // the stream the receiver read the bytes on
};

// Both directions' state; the transport and every IpcBytes hold it.
class IpcLink : public std::enable_shared_from_this<IpcLink> {
 public:
  explicit IpcLink(std::unique_ptr<Transport> host) : host_(std::move(host)) {}
  // Every IpcBytes is gone (each holds the link): what this end imported
  // is released; what it exported is freed once the peer is done with it.
  ~IpcLink() {
    release_imports();
    if (!host_closed_) finish_close();
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (!peer_done_) return;  // left allocated: the peer may still map it
    for (In& in : in_)
      if (in.consumed) cudaEventDestroy(in.consumed);
    for (Out& out : out_) {
      if (out.ready) {
        cudaEventSynchronize(out.ready);
        cudaEventDestroy(out.ready);
      }
      if (out.retired) cudaFree(out.retired);
      if (out.p) cudaFree(out.p);
    }
  }

  Status handshake(Deadline deadline, bool host_staging) {
    auto gpu = current_gpu();
    if (!gpu) return gpu.error();
    self_ = *gpu;
    std::vector<std::uint8_t> hello;
    put(hello, kMagic, 8);
    put64(hello, process_nonce());
    put(hello, self_.uuid.data(), 16);
    put(hello, self_.bus.data(), 16);
    hello.push_back(kHello);
    KVRING_RETURN_IF_ERROR(host_->send_message(hello.data(), hello.size(), deadline));
    std::vector<std::uint8_t> in;
    KVRING_RETURN_IF_ERROR(host_->recv_message(in, deadline, 4096));
    if (in.size() != kHelloBytes || kind_of(in) != kHello || std::memcmp(in.data(), kMagic, 8) != 0)
      return io_error("cuda ipc link: " + host_->describe() + " did not answer as a cuda ipc link");
    const bool same_process = get64(in.data() + 8) == process_nonce();
    std::memcpy(peer_.uuid.data(), in.data() + 16, 16);
    std::memcpy(peer_.bus.data(), in.data() + 32, 16);
    peer_.bus.back() = '\0';
    // Whether this end maps the peer's buffers.
    std::string why_not;
    if (host_staging) {
      why_not = "asked for";
    } else if (same_process) {
      why_not = "both ends are in one process, where local_device_pair carries device memory";
    } else if (peer_.uuid != self_.uuid) {
      int there = -1, ok = 0;
      if (cudaDeviceGetByPCIBusId(&there, peer_.bus_id().c_str()) != cudaSuccess) {
        (void)cudaGetLastError();
        why_not = "the sender's GPU " + peer_.bus_id() + " is not visible to the receiver";
      } else if (cudaDeviceCanAccessPeer(&ok, self_.ordinal, there) != cudaSuccess || !ok) {
        (void)cudaGetLastError();
        why_not = "GPU " + self_.bus_id() + " has no peer access to GPU " + peer_.bus_id();
      }
    }
    std::vector<std::uint8_t> verdict;
    put(verdict, why_not.data(), why_not.size());
    verdict.push_back(static_cast<std::uint8_t>(why_not.empty()));
    verdict.push_back(kVerdict);
    KVRING_RETURN_IF_ERROR(host_->send_message(verdict.data(), verdict.size(), deadline));
    KVRING_RETURN_IF_ERROR(host_->recv_message(in, deadline, 4096));
    if (in.size() < 2 || kind_of(in) != kVerdict || in[in.size() - 2] > 1)
      return io_error("cuda ipc link: " + host_->describe() + " sent a malformed verdict");
    sends_device_ = in[in.size() - 2] == 1;
    maps_peer_ = why_not.empty();
    // The events this end records after its reads of each peer buffer, on
    // its GPU, exported once.
    if (maps_peer_) IPC_CUDA("cudaStreamCreate", cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (maps_peer_)
      for (In& slot : in_) {
        IPC_CUDA("cudaEventCreate",
                 cudaEventCreateWithFlags(&slot.consumed, cudaEventDisableTiming | cudaEventInterprocess));
        IPC_CUDA("cudaIpcGetEventHandle", cudaIpcGetEventHandle(&slot.consumed_handle, slot.consumed));
      }
    // Each direction that stages says so, and why.
    const std::string peer_why(in.begin(), in.end() - 2);
    what_ = "cuda ipc over " + host_->describe() + ", GPU " + self_.bus_id() + " <-> GPU " + peer_.bus_id();
    if (!sends_device_) what_ += "; rows sent are staged through pinned host memory (" + peer_why + ")";
    if (!why_not.empty()) what_ += "; rows received are staged through pinned host memory (" + why_not + ")";
    return Status::Ok();
  }

  bool sends_device() const { return sends_device_; }
  const std::string& what() const { return what_; }

  Status send(const std::vector<Part>& parts, Deadline deadline) {
    KVRING_RETURN_IF_ERROR(usable());
    KVRING_RETURN_IF_ERROR(flush_releases(deadline));
    std::size_t first_device = parts.size(), device_bytes = 0;
    cudaStream_t s = nullptr;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      if (p.kind == MemoryKind::kHost) {
        if (first_device < parts.size()) return invalid_argument("cuda ipc link: a host part after a device part");
        continue;
      }
      if (first_device == parts.size()) {
        first_device = i;
        s = p.stream;
      } else if (p.stream != s) {
        return invalid_argument("cuda ipc link: a message's device parts name one stream");
      }
      device_bytes += p.size;
    }
    if (device_bytes > 0 && !sends_device_) return make_error(ErrorCode::kUnsupported, what_);
    // The host parts as they are, then the tail.
    std::vector<Part> frame(parts.begin(), parts.begin() + static_cast<std::ptrdiff_t>(first_device));
    std::vector<std::uint8_t> tail;
    if (device_bytes == 0) {
      // No device bytes to carry (empty device parts): a host message.
      tail.push_back(kHostMsg);
    } else {
      KVRING_RETURN_IF_ERROR(on_link_gpu());
      auto slot = take_slot(deadline);
      if (!slot) return broken(slot.error());
      Out& out = out_[*slot];
      if (Status st = fill(out, parts, first_device, device_bytes, s, deadline); !st.ok()) {
        if (s && cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
        out.busy = false;
        return broken(st.error());
      }
      tail.push_back(static_cast<std::uint8_t>(*slot));
      put64(tail, out.generation);
      put64(tail, out.bytes);
      put64(tail, device_bytes);
      put(tail, &out.mem_handle, 64);
      put(tail, &out.ready_handle, 64);
      tail.push_back(kDeviceMsg);
    }
    frame.push_back({tail.data(), tail.size()});
    if (Status st = host_->send_message(frame, deadline); !st.ok()) return broken(st.error());
    return Status::Ok();
  }

  Status recv(ReceivedMessage& out, Deadline deadline, std::size_t max_size, bool keep_device) {
    out.device.reset();  // its release goes out before this end waits
    KVRING_RETURN_IF_ERROR(usable());
    KVRING_RETURN_IF_ERROR(flush_releases(deadline));
    max_frame_ = max_size + kDeviceTail;
    std::vector<std::uint8_t> frame;
    if (!inbox_.empty()) {
      frame = std::move(inbox_.front());
      inbox_.pop_front();
      inbox_bytes_ -= frame.size();
    } else {
      for (;;) {
        if (Status st = host_->recv_message(frame, deadline, max_frame_); !st.ok()) return broken(st.error());
        if (kind_of(frame) != kRelease) break;
        KVRING_RETURN_IF_ERROR(take_release(frame));
      }
    }
    if (frame.empty()) return broken(io_error("cuda ipc link: an empty frame from " + host_->describe()));
    if (kind_of(frame) == kClosed) {
      peer_done_ = true;
      return broken(io_error("cuda ipc link: " + host_->describe() + " closed by the peer"));
    }
    if (kind_of(frame) == kHostMsg) {
      frame.pop_back();
      if (frame.size() > max_size) return broken(too_big(frame.size(), max_size));
      out.host = std::move(frame);
      return Status::Ok();
    }
    if (kind_of(frame) != kDeviceMsg || frame.size() < kDeviceTail)
      return broken(io_error("cuda ipc link: a malformed frame from " + host_->describe()));
    if (!maps_peer_)
      return broken(io_error("cuda ipc link: " + host_->describe() + " sent device memory this end said it cannot map"));
    const std::size_t host_size = frame.size() - kDeviceTail;
    const std::uint8_t* tail = frame.data() + host_size;
    const std::size_t slot = tail[0];
    const std::uint64_t generation = get64(tail + 1), buffer = get64(tail + 9), size = get64(tail + 17);
    if (slot >= kSlots || size > buffer || size > max_size || host_size > max_size - size)
      return broken(size > max_size ? too_big(size, max_size)
                                    : io_error("cuda ipc link: a malformed device frame from " + host_->describe()));
    if (Status st = on_link_gpu(); !st.ok()) return broken(st.error());
    In& in = in_[slot];
    {
      std::lock_guard lock(mu_);
      if (in.held)
        return broken(io_error("cuda ipc link: buffer " + std::to_string(slot) + " reused before its release"));
      if (Status st = map(in, tail, generation, buffer); !st.ok()) return broken(st.error());
    }
    // Only this thread touches a buffer no bytes are held of.
    if (Status st = wait_peer_event(in.ready, deadline, "the sender's copy into buffer " + std::to_string(slot));
        !st.ok())
      return broken(st.error());
    {
      std::lock_guard lock(mu_);
      in.held = true;
    }
    auto bytes = std::make_unique<IpcBytes>(shared_from_this(), slot, in.mapped, static_cast<std::size_t>(size));
    frame.resize(host_size);
    out.host = std::move(frame);
    if (keep_device) {
      out.device = std::move(bytes);
      return Status::Ok();
    }
    const std::size_t at = out.host.size();
    out.host.resize(at + size);
    if (Status st = bytes->to_host(out.host.data() + at); !st.ok()) return broken(st.error());
    return Status::Ok();
  }

  // Whether the next recv returns without waiting for the peer: a message
  // frame read ahead, or the link broken, closed or ended. Frames the host
  // link already holds are read now; releases are taken, anything else is
  // queued for recv, so nothing a recv would return is lost.
  bool message_waiting() {
    if (broken_ || closed_ || !inbox_.empty()) return true;
    while (host_->message_waiting()) {
      // The frame has begun to arrive: the rest follows without the peer's
      // next call, so a short deadline only guards a peer that stopped
      // mid-frame (then the link is broken, which recv reports at once).
      std::vector<std::uint8_t> frame;
      if (Status st = host_->recv_message(frame, deadline_in(kFrameRestS), max_frame_); !st.ok()) {
        (void)broken(st.error());
        return true;
      }
      if (kind_of(frame) == kRelease) {
        if (!take_release(frame).ok()) return true;
        continue;
      }
      inbox_bytes_ += frame.size();
      inbox_.push_back(std::move(frame));
      return true;
    }
    return false;
  }

  // Refuses further calls, then finishes the close once no bytes of the
  // peer's buffers are held (here, or when the last IpcBytes goes).
  void close() {
    if (closed_) return;
    closed_ = true;
    if (!broken_) (void)flush_releases(deadline_in(0.5));
    if (release_imports()) finish_close();
  }

  // IpcBytes' side. The sender's copy into the buffer was waited for when
  // the frame was received, so any stream of the link's GPU reads it.
  Status readable_here() const { return on_link_gpu(); }
  Status copy_to_host(const void* p, std::size_t n, std::uint8_t* out) {
    IPC_CUDA("copying a device message to the host", cudaMemcpyAsync(out, p, n, cudaMemcpyDeviceToHost, stream_));
    IPC_CUDA("copying a device message to the host", cudaStreamSynchronize(stream_));
    return Status::Ok();
  }
  // The bytes of `slot` were dropped, read on `last` where set: `consumed`
  // follows those reads (a host wait where it cannot be recorded there),
  // and the release goes out with this end's next call.
  void dropped(std::size_t slot, std::optional<cudaStream_t> last) {
    std::lock_guard lock(mu_);
    In& in = in_[slot];
    in.held = false;
    const bool has_event = last && device::record_after_reads(in.consumed, *last);
    if (has_event) in.consumed_pending = true;
    std::vector<std::uint8_t> frame{static_cast<std::uint8_t>(slot), static_cast<std::uint8_t>(has_event)};
    cudaIpcEventHandle_t h{};
    if (has_event) h = in.consumed_handle;
    put(frame, &h, 64);
    frame.push_back(kRelease);
    releases_.push_back(std::move(frame));
  }

 private:
  // A buffer of this end's GPU for outgoing device bytes.
  struct Out {
    void* p = nullptr;
    std::uint64_t bytes = 0, generation = 0;
    cudaIpcMemHandle_t mem_handle{};
    cudaEvent_t ready = nullptr;  // interprocess, after each copy into it
    cudaIpcEventHandle_t ready_handle{};
    bool busy = false;
    cudaEvent_t consumed = nullptr;  // the peer's, opened from its release
    cudaIpcEventHandle_t consumed_handle{};
    bool consumed_pending = false;  // the next copy waits for `consumed`
    void* retired = nullptr;        // the previous generation, freed at the next release
  };
  // The peer's buffer as this end maps it.
  struct In {
    void* mapped = nullptr;
    std::uint64_t mapped_bytes = 0;  // from the mapping's start to the allocation's end
    std::uint64_t generation = 0;
    cudaEvent_t ready = nullptr;
    cudaIpcEventHandle_t ready_handle{};
    cudaEvent_t consumed = nullptr;  // this end's, interprocess
    cudaIpcEventHandle_t consumed_handle{};
    bool consumed_pending = false;
    bool held = false;  // bytes handed out and not yet dropped
  };

  // The current GPU is the one the link was made on (its buffers, its
  // events and what it told the peer about mapping).
  Status on_link_gpu() const { return device::current_gpu_is(self_.ordinal, "cuda ipc link: the link"); }

  // Says 'C' (this end holds nothing of the peer's any more) and waits up
  // to kCloseWaitS for the peer's 'C' or the link's end, which is when what
  // this end exported may go; then closes the host link.
  void finish_close() {
    host_closed_ = true;
    const Deadline until = deadline_in(kCloseWaitS);
    (void)host_->send_message(&kClosed, 1, until);
    for (const auto& f : inbox_)
      if (kind_of(f) == kClosed) peer_done_ = true;
    if (!exported()) peer_done_ = true;
    std::vector<std::uint8_t> frame;
    while (!peer_done_) {
      const Status st = host_->recv_message(frame, until, kMostQueuedBytes);
      if (st.ok()) {
        peer_done_ = kind_of(frame) == kClosed;  // anything else the peer still sends is dropped
        continue;
      }
      // The link's end: a peer says 'C' before its link ends, and a process
      // that ended holds no mappings. A deadline that passed, or a frame
      // past the bound, says nothing of the peer: its exports stay.
      const std::string& why = st.error().message;
      peer_done_ = why.find("timed out") == std::string::npos && why.find("exceeds") == std::string::npos;
      break;
    }
    host_->close();
  }

  // Whether this end made anything the peer may have opened.
  bool exported() const {
    for (const In& in : in_)
      if (in.consumed) return true;
    for (const Out& out : out_)
      if (out.ready || out.p || out.retired) return true;
    return false;
  }

  // Unmaps the peer's buffers and closes its events where this end holds
  // no bytes of them (after this end's reads of them ran); whether it
  // released all of them.
  bool release_imports() {
    std::lock_guard lock(mu_);
    bool all = true;
    for (In& in : in_) {
      if (in.held) {
        all = false;
        continue;
      }
      if (in.consumed_pending && cudaEventSynchronize(in.consumed) != cudaSuccess) (void)cudaGetLastError();
      in.consumed_pending = false;
      if (in.mapped && cudaIpcCloseMemHandle(in.mapped) != cudaSuccess) (void)cudaGetLastError();
      in.mapped = nullptr;
      if (in.ready) cudaEventDestroy(in.ready);
      in.ready = nullptr;
    }
    for (Out& out : out_) {
      // This end's waits on the peer's event precede its buffer's `ready`.
      if (out.consumed) {
        if (out.ready) cudaEventSynchronize(out.ready);
        cudaEventDestroy(out.consumed);
        out.consumed = nullptr;
      }
    }
    return all;
  }

  Status usable() const {
    if (broken_) return *broken_;
    if (closed_) return io_error("cuda ipc link over " + host_->describe() + " is closed");
    return Status::Ok();
  }
  Error broken(Error e) {
    if (!broken_) broken_ = e;
    return e;
  }
  Error too_big(std::size_t n, std::size_t max) {
    return io_error("cuda ipc link: a message of " + std::to_string(n) + " B from " + host_->describe() + " exceeds " +
                    std::to_string(max) + " B");
  }

  Status flush_releases(Deadline deadline) {
    std::deque<std::vector<std::uint8_t>> pending;
    {
      std::lock_guard lock(mu_);
      pending.swap(releases_);
    }
    for (const auto& frame : pending)
      if (Status st = host_->send_message(frame.data(), frame.size(), deadline); !st.ok()) return broken(st.error());
    return Status::Ok();
  }

  // A buffer no message holds, reading the peer's frames (and queueing what
  // is not a release) until one is released.
  Result<std::size_t> take_slot(Deadline deadline) {
    for (;;) {
      for (std::size_t i = 0; i < kSlots; ++i)
        if (!out_[i].busy) {
          out_[i].busy = true;
          return i;
        }
      std::vector<std::uint8_t> frame;
      KVRING_RETURN_IF_ERROR(host_->recv_message(frame, deadline, max_frame_));
      if (kind_of(frame) == kRelease) {
        KVRING_RETURN_IF_ERROR(take_release(frame));
      } else if (kind_of(frame) == kClosed) {
        peer_done_ = true;
        return io_error("cuda ipc link: " + host_->describe() + " closed by the peer");
      } else {
        if (inbox_.size() == kMostQueued || inbox_bytes_ + frame.size() > kMostQueuedBytes)
          return io_error("cuda ipc link: " + host_->describe() + " sent " + std::to_string(inbox_.size()) +
                          " messages (" + std::to_string(inbox_bytes_) + " B) and released no buffer");
        inbox_bytes_ += frame.size();
        inbox_.push_back(std::move(frame));
      }
    }
  }

  Status take_release(const std::vector<std::uint8_t>& frame) {
    if (frame.size() != kReleaseBytes || frame[0] >= kSlots || frame[1] > 1 || !out_[frame[0]].busy)
      return broken(io_error("cuda ipc link: a malformed release from " + host_->describe()));
    Out& out = out_[frame[0]];
    out.busy = false;
    // The receiver mapped this generation, so it unmapped the one before.
    if (out.retired) {
      if (out.ready) cudaEventSynchronize(out.ready);
      cudaFree(out.retired);
      out.retired = nullptr;
    }
    out.consumed_pending = frame[1] == 1;
    if (!out.consumed_pending) return Status::Ok();
    cudaIpcEventHandle_t h;
    std::memcpy(&h, frame.data() + 2, 64);
    if (!out.consumed || std::memcmp(&h, &out.consumed_handle, 64) != 0) {
      if (out.consumed) cudaEventDestroy(out.consumed);
      out.consumed = nullptr;
      if (const cudaError_t e = cudaIpcOpenEventHandle(&out.consumed, h); e != cudaSuccess)
        return broken(cuda_failed("opening the receiver's event", e));
      out.consumed_handle = h;
    }
    return Status::Ok();
  }

  // Copies the device parts into `out` on `s`, growing it first (a new
  // generation), once the peer's reads of it ran (waited for up to
  // `deadline`).
  Status fill(Out& out, const std::vector<Part>& parts, std::size_t first_device, std::size_t bytes, cudaStream_t s,
              Deadline deadline) {
    if (!out.ready) {
      IPC_CUDA("cudaEventCreate",
               cudaEventCreateWithFlags(&out.ready, cudaEventDisableTiming | cudaEventInterprocess));
      IPC_CUDA("cudaIpcGetEventHandle", cudaIpcGetEventHandle(&out.ready_handle, out.ready));
    }
    if (out.bytes < bytes) {
      // The previous allocation stays until the receiver unmapped it (the
      // next release of this buffer).
      out.consumed_pending = false;
      out.retired = out.p;
      out.p = nullptr;
      out.bytes = 0;
      const std::size_t grown = (bytes + 255) / 256 * 256;
      IPC_CUDA("allocating " + std::to_string(grown) + " B of ipc buffer", cudaMalloc(&out.p, grown));
      out.bytes = grown;
      ++out.generation;
      IPC_CUDA("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&out.mem_handle, out.p));
    }
    if (out.consumed_pending)
      KVRING_RETURN_IF_ERROR(wait_peer_event(out.consumed, deadline, "the receiver's reads of a buffer"));
    out.consumed_pending = false;
    // After the buffer's last copy too, which may have run on another stream.
    if (out.generation > 0) IPC_CUDA("cudaStreamWaitEvent", cudaStreamWaitEvent(s, out.ready, 0));
    std::size_t at = 0;
    for (std::size_t i = first_device; i < parts.size(); ++i) {
      if (parts[i].size)
        IPC_CUDA("a device copy into an ipc buffer", cudaMemcpyAsync(static_cast<char*>(out.p) + at, parts[i].data,
                                                                      parts[i].size, cudaMemcpyDeviceToDevice, s));
      at += parts[i].size;
    }
    IPC_CUDA("cudaEventRecord", cudaEventRecord(out.ready, s));
    return Status::Ok();
  }

  // Maps the peer's buffer that a device frame's `tail` names (a new
  // generation replaces the old mapping once this end's reads of it ran)
  // and its `ready` event.
  Status map(In& in, const std::uint8_t* tail, std::uint64_t generation, std::uint64_t buffer) {
    cudaIpcMemHandle_t mem;
    cudaIpcEventHandle_t ready;
    std::memcpy(&mem, tail + 25, 64);
    std::memcpy(&ready, tail + 89, 64);
    if (!in.mapped || in.generation != generation) {
      if (in.consumed_pending) IPC_CUDA("waiting for reads of a buffer", cudaEventSynchronize(in.consumed));
      in.consumed_pending = false;
      if (in.mapped) IPC_CUDA("cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(in.mapped));
      in.mapped = nullptr;
      in.mapped_bytes = 0;
      IPC_CUDA("mapping the sender's buffer (cudaIpcOpenMemHandle)",
               cudaIpcOpenMemHandle(&in.mapped, mem, cudaIpcMemLazyEnablePeerAccess));
      in.generation = generation;
      auto held = allocation_bytes(in.mapped);
      if (!held) return held.error();
      in.mapped_bytes = *held;
    }
    if (buffer > in.mapped_bytes)
      return io_error("cuda ipc link: " + host_->describe() + " claims a buffer of " + std::to_string(buffer) +
                      " B, its mapping holds " + std::to_string(in.mapped_bytes) + " B");
    if (!in.ready || std::memcmp(&ready, &in.ready_handle, 64) != 0) {
      if (in.ready) cudaEventDestroy(in.ready);
      in.ready = nullptr;
      IPC_CUDA("opening the sender's event", cudaIpcOpenEventHandle(&in.ready, ready));
      in.ready_handle = ready;
    }
    return Status::Ok();
  }

  std::unique_ptr<Transport> host_;
  Gpu self_, peer_;
  bool sends_device_ = false, maps_peer_ = false, closed_ = false;
  bool peer_done_ = false;    // the peer said 'C', or its link ended: this end's exports may go
  bool host_closed_ = false;  // finish_close ran
  std::optional<Error> broken_;
  std::string what_;
  std::array<Out, kSlots> out_;
  std::array<In, kSlots> in_;
  std::deque<std::vector<std::uint8_t>> inbox_;  // frames read ahead: waiting for a release, or message_waiting
  std::size_t inbox_bytes_ = 0;
  std::size_t max_frame_ = std::size_t{1} << 20;  // the bound of the last recv, for frames read ahead
  std::mutex mu_;  // guards in_'s mappings and holds, and releases_ (IpcBytes may drop on another thread)
  std::deque<std::vector<std::uint8_t>> releases_;
  cudaStream_t stream_ = nullptr;  // host copies of device messages (made with the link where it maps)
};

IpcBytes::~IpcBytes() { link_->dropped(slot_, last_); }
Status IpcBytes::ready_on(cudaStream_t stream) {
  KVRING_RETURN_IF_ERROR(link_->readable_here());
  last_ = stream;
  return Status::Ok();
}
Status IpcBytes::to_host(std::uint8_t* out) { return link_->copy_to_host(p_, n_, out); }

class IpcTransport : public Transport {
 public:
  explicit IpcTransport(std::shared_ptr<IpcLink> link) : link_(std::move(link)) {}
  ~IpcTransport() override { close(); }
  bool carries(MemoryKind kind) const override { return kind == MemoryKind::kHost || link_->sends_device(); }
  Status send_message(const std::vector<Part>& parts, Deadline deadline) override { return link_->send(parts, deadline); }
  Status recv(ReceivedMessage& out, Deadline deadline, std::size_t max_size, bool keep_device) override {
    return link_->recv(out, deadline, max_size, keep_device);
  }
  Status recv_message(std::vector<std::uint8_t>& out, Deadline deadline, std::size_t max_size) override {
    ReceivedMessage m;
    KVRING_RETURN_IF_ERROR(link_->recv(m, deadline, max_size, false));
    out = std::move(m.host);
    return Status::Ok();
  }
  std::string describe() const override { return link_->what(); }
  bool message_waiting() override { return link_->message_waiting(); }
  void close() override { link_->close(); }

 private:
  std::shared_ptr<IpcLink> link_;
};

}  // namespace

Result<std::unique_ptr<Transport>> cuda_ipc_link(std::unique_ptr<Transport> host, Deadline deadline,
                                                 bool host_staging) {
  if (!host) return invalid_argument("cuda ipc link: no host transport");
  if (!device::usable())
    return make_error(ErrorCode::kUnsupported, "the cuda ipc link needs the CUDA backend and a visible GPU");
  auto link = std::make_shared<IpcLink>(std::move(host));
  if (Status st = link->handshake(deadline, host_staging); !st.ok()) {
    link->close();
    return st.error();
  }
  return std::unique_ptr<Transport>(std::make_unique<IpcTransport>(std::move(link)));
}

}  // namespace kvring::handoff
