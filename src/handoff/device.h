// The handoff's GPU side behind an interface that needs no CUDA headers:
// device_cuda.cc implements it in a build with the CUDA backend,
// device_none.cc (every factory kUnsupported) in one without.
//
// Every piece orders its work by streams and events; the host waits only
// where a value must reach it (a digest) or a buffer is about to be reused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvring/handoff.h"

namespace kvring::handoff::device {

// A build with CUDA and a visible GPU.
bool usable();

// A session's GPU work runs on the thread's current GPU, so a CUDA store's
// endpoint requires its store's GPU to be current (kInvalidArgument naming
// both otherwise); any other store passes.
Status on_store_gpu(const KvStore& store);

// Device bytes that the GPU side made for a transport; they can be read
// back to the host (waiting for them).
class OwnBytes : public DeviceBytes {
 public:
  virtual Status to_host(std::uint8_t* out) = 0;
};

// ---- The same-GPU transport's halves ----------------------------------------

// `parts` (device parts, all on one stream) copied device to device, in
// order, into one new allocation (stream-ordered on that stream).
Result<std::unique_ptr<DeviceBytes>> copy_parts(const std::vector<Part>& parts);
// The bytes of an OwnBytes appended to `out` (waits for them).
Status append_to_host(DeviceBytes& bytes, std::vector<std::uint8_t>& out);

// ---- Two GPUs of one process (local_peer_pair) -------------------------------

// Whether a pair of GPUs carries device memory peer to peer, and the words
// describe() adds. Checks the ordinals and enables peer access both ways
// where the pair has it.
struct PeerPlan {
  bool device = false;
  std::string note;
};
Result<PeerPlan> plan_peer(int sender_gpu, int receiver_gpu, bool host_staging);

// Copies a message's device parts (sender's GPU, one stream) peer to peer
// into one of a few buffers of the receiver's GPU; a buffer is reused once
// the receiver dropped the bytes it held and its reads of them ran. copy()
// waits, up to `deadline`, for a buffer the receiver released.
class PeerCopier {
 public:
  static Result<std::shared_ptr<PeerCopier>> create(int sender_gpu, int receiver_gpu);
  virtual ~PeerCopier() = default;
  virtual Result<std::unique_ptr<DeviceBytes>> copy(const std::vector<Part>& parts, Deadline deadline) = 0;
  // Wakes a copy() waiting for a buffer; it then fails. Idempotent.
  virtual void close() = 0;
};

// ---- digest64 on the GPU --------------------------------------------------------

// One digest of device rows in flight: start() enqueues digest64's words of
// K (seed 1) plus V (seed 2) on a stream; wait() returns them.
class Digester {
 public:
  static Result<std::unique_ptr<Digester>> create();
  virtual ~Digester() = default;
  virtual Status start(const void* k, const void* v, std::size_t plane_bytes,
                       cudaStream_t stream) = 0;
  virtual Result<std::uint64_t> wait() = 0;
};

// A stream of the current GPU for a session's device work; destroying it
// waits for that work.
class Stream {
 public:
  static Result<std::unique_ptr<Stream>> create();
  virtual ~Stream() = default;
  virtual cudaStream_t get() const = 0;
  virtual Status synchronize() = 0;
};

// ---- A CUDA store's rows on their way out (StoreSource) --------------------------

// Two slots, each a message's K and V gathered on the GPU (read_rows into
// device buffers, on the slots' own stream), its digest words, and, for a
// host transport, a copy in pinned host memory; prepare() enqueues, take()
// waits for the slot and hands the rows out. A slot is prepared again only
// after its rows were sent: device rows were copied by the transport on the
// slots' stream (stream order), host rows by a send that has returned.
class SourceSlots {
 public:
  // Slots for messages of up to `max_rows` rows.
  static Result<std::unique_ptr<SourceSlots>> create(const KvStore& store, std::int64_t max_rows);
  virtual ~SourceSlots() = default;
  virtual Status prepare(int slot, SeqId seq, std::int64_t layer, std::int64_t first,
                         std::int64_t rows, bool to_host) = 0;
  virtual Status take(int slot, SourceRows* out) = 0;
};

// ---- Host rows on their way into a CUDA store (StoreTarget) ----------------------

// Two slots of pinned and device staging on their own stream: put() waits
// until a slot's previous message is installed, copies the rows into its
// pinned memory, and enqueues the copy to the GPU and install_rows; the
// caller receives the next message meanwhile. finish() waits for all.
class TargetSlots {
 public:
  static Result<std::unique_ptr<TargetSlots>> create();
  virtual ~TargetSlots() = default;
  virtual Status put(KvStore& store, SeqId seq, std::int64_t layer, std::int64_t first,
                     std::int64_t rows, const std::uint16_t* k, const std::uint16_t* v) = 0;
  virtual Status finish() = 0;
};

}  // namespace kvring::handoff::device
