// Disaggregated handoff: a prefilled session's KV streamed from a prefill
// store to a decode store over a transport, paced, verified and bit-exact.
//
// The pieces, each usable on its own:
//   - payload_for / plan_handoff: what a handoff of an N-token prompt carries
//     and a schedule of when each message is sent relative to prefill's
//     progress (a pure function; `kvring handoff plan` prints it and the
//     sender follows its message list and order).
//   - Transport: whole messages with deadlines; in-process (local_pair;
//     local_device_pair, which carries device memory of one GPU;
//     local_peer_pair, between two GPUs) and between processes (UCX:
//     ucx_listen / ucx_connect; Unix sockets: unix_listen / unix_connect;
//     cuda_ipc_link, device memory over either).
//   - HandoffSource / HandoffTarget: the sending session and the detached
//     receiving one: a sequence of a store read where it lies (StoreSource)
//     and installed straight into a detached sequence (StoreTarget), on
//     either backend; a KvCache (CacheSource, PrefillSource) and a fresh
//     cache (DetachedCacheTarget) for the command-line pair.
//   - send_session / receive_session: the protocol (docs/DESIGN.md, "Handoff").
//
// The payload of an N-token prompt is the first N-1 tokens' rows: the decode
// side feeds the last prompt token itself as its first step.
//
// A session's own GPU work (staging, digests, local_device_pair's copies)
// runs on the calling thread's current GPU, which must be the CUDA store's
// GPU on each side: StoreSource::create and StoreTarget::begin refuse
// another (kInvalidArgument). A CUDA store's calls restore the thread's
// current device.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvring/cache.h"
#include "kvring/config.h"
#include "kvring/snapshot.h"
#include "kvring/status.h"

namespace kvring::handoff {

namespace device {
class SourceSlots;
class TargetSlots;
}  // namespace device

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
// A duration of `seconds` in the clock's ticks: NaN and negatives are 0,
// and anything past 10^9 s (31 years) is 10^9 s, so the conversion never
// leaves the ticks' range.
inline Clock::duration duration_of(double seconds) {
  if (!(seconds > 0)) return Clock::duration::zero();
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(seconds, 1e9)));
}
inline Deadline deadline_in(double seconds) { return Clock::now() + duration_of(seconds); }

// ---------------------------------------------------------------- payload

struct LayerPayload {
  std::int64_t layer = 0;
  LayerKind kind = LayerKind::kSlidingRope;
  RingState ring;          // the ring state the receiver installs
  std::int64_t rows = 0;   // live rows sent (ring.len())
  std::int64_t bytes = 0;  // rows * kv_dim * 4 (K and V, f16)
};

struct Payload {
  std::int64_t prompt_tokens = 0;  // N
  std::int64_t rows_tokens = 0;    // N - 1: the positions whose rows travel
  std::int64_t context = 0;        // the cache size the ring capacities follow
  std::int64_t row_bytes = 0;      // one row of K and V on one layer
  std::vector<LayerPayload> layers;
  std::int64_t full_bytes = 0, sliding_bytes = 0, payload_bytes = 0;
};

// The longest prompt a handoff carries: its header holds the prompt's
// token ids, and kMaxContext of them (the longest context a model may
// have) fit a receiver's default message bound with room to spare. Only a
// model whose sequences run past their context (every layer a ring that
// holds its window) reaches it past the context.
inline constexpr std::int64_t kMaxHandoffPrompt = kMaxContext;

// The payload of an `prompt_tokens`-token prompt (>= 1) on a cache of
// `context` positions (0: the model's max_context): at most
// ModelConfig::sequence_position_limit(context) and kMaxHandoffPrompt.
Result<Payload> payload_for(const ModelConfig& config, std::int64_t prompt_tokens,
                            std::int64_t context = 0);

// ---------------------------------------------------------------- schedule

enum class Schedule {
  kSwaFirst,  // sliding rings as each becomes final; the full bulk after the last layer
  kPaced,     // every message as soon as its rows are final, through a token bucket
};
const char* schedule_name(Schedule schedule);
Result<Schedule> parse_schedule(const std::string& name);

struct PlanOptions {
  Schedule schedule = Schedule::kPaced;
  std::int64_t context = 0;                          // 0: max_context
  std::int64_t chunk_tokens = 128;                   // prefill chunk: rows become final per chunk
  std::int64_t message_bytes = std::int64_t{4} << 20;  // largest row message (whole chunks of a layer)
  // The model of time (used by the timeline, not by the sender):
  double rate_bytes_per_s = 1.25e9;    // token bucket rate (and link rate)
  std::int64_t credit_bytes = std::int64_t{64} << 20;  // receiver window: bytes unacknowledged
  double prefill_tokens_per_s = 8000;  // prefill speed; steps (chunk, layer) take equal time
  double ack_latency_s = 50e-6;        // from a message's last byte to its credit returning
};

// One row message: rows [first_row, first_row + rows) of one layer.
struct PlannedMessage {
  std::int64_t index = 0;  // position in send order
  std::int64_t layer = 0;
  LayerKind kind = LayerKind::kSlidingRope;
  std::int64_t first_row = 0, rows = 0, bytes = 0;
  // Prefill step (chunk * n_layers + layer) after which the rows are final,
  // and after which the schedule releases them (swa-first holds full rows to
  // the last step).
  std::int64_t final_step = 0, release_step = 0;
  // The modelled timeline, seconds from the start of prefill.
  double final_s = 0, release_s = 0, start_s = 0, end_s = 0, ack_s = 0;
};

struct Timeline {
  Payload payload;
  PlanOptions options;
  std::int64_t n_chunks = 0, n_steps = 0;
  double step_s = 0, prefill_end_s = 0, done_s = 0;
  std::vector<PlannedMessage> messages;  // in send order
  // Derived by check_timeline's measures.
  std::int64_t max_in_flight = 0;
  double max_idle_while_ready_s = 0;  // the longest link idle time while a released message waited
  double busy_s = 0;                  // link time carrying bytes
};

// The schedule: messages cut at chunk boundaries (full layers) and at
// message_bytes, released per the schedule, sent in release order (then layer,
// then row), each starting when released, when the token bucket allows and
// when the receiver's credits cover it.
Result<Timeline> plan_handoff(const ModelConfig& config, std::int64_t prompt_tokens,
                              const PlanOptions& options);

// Checks a timeline's invariants from its messages alone: every payload byte
// sent exactly once (per layer the messages tile the live rows), nothing sent
// before it is released or final, the bytes in flight never above the
// credits, the link never carrying two messages at once nor faster than the
// rate, and no idle gap longer than `max_idle_s` while a released message
// waits. A rate (options.rate_bytes_per_s) that is not a finite number
// above 0, or a `max_idle_s` that is not a number of at least 0, is
// refused. Fills max_in_flight, max_idle_while_ready_s and busy_s.
Status check_timeline(Timeline& timeline, double max_idle_s);

// ---------------------------------------------------------------- transport

// Where a buffer lives; a transport that cannot reach a kind refuses it
// (kUnsupported). Device memory is the current GPU's.
enum class MemoryKind { kHost, kCudaDevice };

struct Part {
  const void* data = nullptr;
  std::size_t size = 0;
  MemoryKind kind = MemoryKind::kHost;
  // A device part's bytes are ready in this stream's order: the transport
  // enqueues its copy there. Every device part of one message names the
  // same stream.
  cudaStream_t stream = nullptr;
};

// Bytes a transport left in device memory for the receiver. Destroying the
// object gives them back once the work enqueued on the last stream they
// were made ready on has run (stream-ordered; a host wait only where they
// were never made ready). Links that lend a few buffers (local_peer_pair,
// cuda_ipc_link) hold the sender back until the receiver drops a message,
// and cuda_ipc_link tells the sender so on the receiver's next call: a
// receiver drops each message's bytes before waiting for the next
// (receive_session does), and all of them before closing the link.
class DeviceBytes {
 public:
  virtual ~DeviceBytes() = default;
  virtual const void* data() const = 0;
  virtual std::size_t size() const = 0;
  // Work enqueued on `stream` after this call sees the bytes (a device-side
  // wait, not a host one).
  virtual Status ready_on(cudaStream_t stream) = 0;
};

struct ReceivedMessage {
  // The whole message, or its bytes before its first device part.
  std::vector<std::uint8_t> host;
  // The bytes from its first device part on, where the transport left them
  // in device memory; null otherwise.
  std::unique_ptr<DeviceBytes> device;
};

// Whole messages, in order, both ways. Every call has a deadline; a lost
// peer, a dropped link or a passed deadline is an error (kIOError) and the
// transport is unusable after it.
class Transport {
 public:
  virtual ~Transport() = default;
  // Sends the concatenation of `parts` as one message.
  virtual Status send_message(const std::vector<Part>& parts, Deadline deadline) = 0;
  Status send_message(const void* data, std::size_t size, Deadline deadline) {
    return send_message(std::vector<Part>{{data, size}}, deadline);
  }
  // The next message into `out`; a message over max_size is an error.
  virtual Status recv_message(std::vector<std::uint8_t>& out, Deadline deadline,
                              std::size_t max_size) = 0;
  virtual std::string describe() const = 0;  // "ucx 127.0.0.1:4242", for messages
  // Whether the next message has begun to arrive, or the link has ended,
  // so that recv_message would not wait for the peer to send it. Takes
  // nothing off the link. False where a transport cannot tell without
  // waiting (the default): a sender holding messages back (prefill,
  // pacing) then hears a receiver that ended the session only when one of
  // its sends fails, which never happens while that receiver keeps the
  // link open for its next session.
  virtual bool message_waiting() { return false; }
  // Closes the link; the peer's calls then fail. Idempotent.
  virtual void close() = 0;
  // Whether send_message takes parts of `kind` (every transport takes host).
  virtual bool carries(MemoryKind kind) const { return kind == MemoryKind::kHost; }
  // The next message. With keep_device, the bytes a sender sent from device
  // memory stay in device memory where this transport carries them
  // (out.device); otherwise every byte arrives in out.host.
  virtual Status recv(ReceivedMessage& out, Deadline deadline, std::size_t max_size,
                      bool keep_device) {
    (void)keep_device;
    out.device.reset();
    return recv_message(out.host, deadline, max_size);
  }
};

// Two connected in-process endpoints (host memory).
std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>> local_pair();

// Two connected in-process endpoints that also carry device memory of the
// current GPU: a message's device parts are copied device to device
// (enqueued on their stream, no host wait) into memory the receiver gets as
// DeviceBytes, or, when it asks for host bytes, copied to the host on
// receipt. Host parts travel as in local_pair. kUnsupported in a build
// without CUDA or where no GPU is visible.
Result<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>> local_device_pair();

// Two connected in-process endpoints between two GPUs of one host: the
// sender works on `sender_gpu`, the receiver on `receiver_gpu` (each side's
// thread has its GPU current while it calls the transport and the session).
// A message's device parts are copied peer to peer (cudaMemcpyPeerAsync on
// their stream, peer access enabled both ways) into buffers of the
// receiver's GPU that the receiver reads where they lie. Where the pair has
// no peer access, or `host_staging` asks for it, neither endpoint carries
// device memory: a CUDA store's rows are then staged through pinned host
// memory at both ends, and describe() says so and why. The same ordinal on
// both sides is a copy within one GPU. kUnsupported without CUDA; an ordinal
// that names no visible GPU is kInvalidArgument.
struct PeerLinkOptions {
  int sender_gpu = 0;
  int receiver_gpu = 1;
  bool host_staging = false;
};
Result<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>> local_peer_pair(const PeerLinkOptions& options);

// Carries device memory between two processes of one host through CUDA IPC,
// over `host`, a connected transport between them (unix_connect /
// UnixListener::accept, or UCX). Both processes wrap their end; the two
// exchange their GPUs at once (within `deadline`). A message's device parts
// are copied on their stream into one of a few buffers of the sender's GPU
// that the receiver maps (cudaIpcOpenMemHandle, peer access where its GPU
// is another) and reads where they lie; interprocess events order the
// copy before the receiver's reads and those reads before the buffer's
// reuse. Where the receiver cannot map the sender's memory (its GPU has no
// peer access to the sender's, or cannot see it), the sender's end does not
// carry device memory: rows are staged through pinned host memory, and
// describe() says so and why; `host_staging` asks for that path at this
// end's receiving side. Two ends in one process stage too (CUDA IPC maps
// nothing in the process that exported it). Both ends run on the thread's
// current GPU. kUnsupported without CUDA or a visible GPU.
Result<std::unique_ptr<Transport>> cuda_ipc_link(std::unique_ptr<Transport> host, Deadline deadline,
                                                 bool host_staging = false);

// UCX (ucp tag API, one tagged message per message, over a client-server
// endpoint made from a TCP sockaddr; UCX picks TCP, shared memory or CMA
// lanes for the data). kUnsupported when this build has no UCX.
bool ucx_compiled();
class UcxListener {
 public:
  virtual ~UcxListener() = default;
  virtual int port() const = 0;  // the bound port (useful when asked for 0)
  // Waits for one connection.
  virtual Result<std::unique_ptr<Transport>> accept(Deadline deadline) = 0;
};
// "HOST:PORT" with HOST an IPv4 address (127.0.0.1); port 0 binds any free
// port.
Result<std::unique_ptr<UcxListener>> ucx_listen(const std::string& host_port);
Result<std::unique_ptr<Transport>> ucx_connect(const std::string& host_port, Deadline deadline);
Result<std::pair<std::string, int>> parse_host_port(const std::string& host_port);

// Unix-domain stream sockets between processes of one host, host memory
// only: each message is an 8-byte little-endian length and its bytes. Every
// build has it; it is also the control channel cuda_ipc_link wraps.
class UnixListener {
 public:
  virtual ~UnixListener() = default;
  virtual const std::string& path() const = 0;
  // Waits for one connection.
  virtual Result<std::unique_ptr<Transport>> accept(Deadline deadline) = 0;
};
// Listens at `path` (at most 107 bytes), holding a lock on `path`.lock
// (made if absent, never removed) for its life: a path another listener
// holds is refused, and a socket file there otherwise is replaced (a
// listener that died left it); anything else there is refused. The
// listener removes its socket file when destroyed.
Result<std::unique_ptr<UnixListener>> unix_listen(const std::string& path);
// Connects to a listener at `path`; fails at once where none listens.
Result<std::unique_ptr<Transport>> unix_connect(const std::string& path, Deadline deadline);

// ---------------------------------------------------------------- sessions

// How each row message is verified on arrival (docs/DESIGN.md, "Handoff"):
// SHA-256 of host rows, or digest64 (src/core/digest64.h), which both sides
// compute where the rows lie, on the GPU for device rows.
enum class RowDigest : std::uint8_t { kSha256 = 0, kDigest64 = 1 };
const char* row_digest_name(RowDigest digest);

// A message's rows as a source hands them out: K and V, f16 [rows, kv_dim].
struct SourceRows {
  const void* k = nullptr;
  const void* v = nullptr;
  MemoryKind kind = MemoryKind::kHost;
  cudaStream_t stream = nullptr;  // device rows are ready in this stream's order
  // digest64's words of K (seed 1) plus those of V (seed 2), where the
  // source computed them; device rows must carry them (the sender never
  // reads device rows itself).
  std::optional<std::uint64_t> digest_words;
};

// The sending side: the header (geometry, context, token ids, metadata, the
// final ring states; no rows) and the rows of each planned message once final.
class HandoffSource {
 public:
  virtual ~HandoffSource() = default;
  virtual const Snapshot& header() const = 0;
  // The digest the session's row messages carry.
  virtual RowDigest digest() const { return RowDigest::kSha256; }
  // Waits until the message's rows are final: true, or false when the
  // deadline came first (the sender then keeps the link alive and waits
  // again); an error when the source failed (prefill stopped).
  virtual Result<bool> wait_final(const PlannedMessage& message, Deadline deadline) = 0;
  // The message's rows in logical order, f16 bits [rows, kv_dim] each. The
  // pointers stay valid until release(message). The sources here refuse a
  // message that is not rows of the header's planes (kInvalidArgument),
  // PrefillSource and the CUDA StoreSource one that is not their
  // timeline's, and PrefillSource one whose rows its cache does not hold.
  virtual Status rows(const PlannedMessage& message, const std::uint16_t** k,
                      const std::uint16_t** v) = 0;
  // The same, in device memory where `device_ok` (the transport carries it)
  // and the source holds its rows there. Messages are asked for in send
  // order. The default hands out rows().
  virtual Status message_rows(const PlannedMessage& message, bool device_ok, SourceRows* out);
  virtual void release(const PlannedMessage& /*message*/) {}
};

// The header of a session whose payload one sequence of a store holds
// (every planned row, up to its next position): the geometry, context,
// token ids, metadata and ring states a source sends. The sequence's next
// position is the payload's rows_tokens (N - 1 for an N-token prompt: a
// prefill node prefills the first N - 1 tokens, or truncates its N-th,
// since a sliding ring past the window no longer holds the row that the
// payload's first N - 1 need), and `token_ids` holds exactly those
// rows_tokens ids; kInvalidArgument otherwise.
Result<Snapshot> session_header(const KvStore& store, SeqId seq, const Payload& payload,
                                std::vector<std::int32_t> token_ids, std::string metadata);

// A finished session in one sequence of a store (either backend), read
// where it lies. On the CUDA backend each message's rows are gathered on the
// GPU into one of two staging slots and digested there (digest64), then
// handed out in device memory (a transport that carries it) or copied into
// pinned host memory (UCX): the next message is gathered and copied while
// the current one is sent. On the CPU backend rows are read into host
// buffers and the session carries SHA-256. The store, the sequence and
// `timeline` must outlive the source, and the caller makes no other call on
// the store while the session is sent.
class StoreSource : public HandoffSource {
 public:
  static Result<std::unique_ptr<StoreSource>> create(const KvStore& store, SeqId seq,
                                                     const Timeline& timeline,
                                                     std::vector<std::int32_t> token_ids,
                                                     std::string metadata);
  ~StoreSource() override;
  const Snapshot& header() const override { return header_; }
  RowDigest digest() const override;
  Result<bool> wait_final(const PlannedMessage&, Deadline) override { return true; }
  Status rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) override;
  Status message_rows(const PlannedMessage& m, bool device_ok, SourceRows* out) override;

 private:
  StoreSource(const KvStore& store, SeqId seq, const Timeline& timeline);
  const KvStore& store_;
  SeqId seq_;
  const Timeline& timeline_;
  Snapshot header_;
  std::vector<std::uint16_t> k_, v_;
  std::unique_ptr<device::SourceSlots> slots_;  // the CUDA backend's staging
  std::int64_t prepared_ = -1;  // the message gathered ahead into its slot
  bool prepared_host_ = false;
};

// A finished session: a cache whose first rows_tokens positions are the
// payload, read in place (nothing is written to it while it is sent).
class CacheSource : public HandoffSource {
 public:
  // `header` gets the ring states of the payload; `token_ids` are the payload's.
  static Result<std::unique_ptr<CacheSource>> create(const KvCache& cache, const Payload& payload,
                                                     std::vector<std::int32_t> token_ids,
                                                     std::string metadata);
  const Snapshot& header() const override { return header_; }
  Result<bool> wait_final(const PlannedMessage&, Deadline) override { return true; }
  Status rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) override;

 private:
  CacheSource(const KvCache& cache) : cache_(cache) {}
  const KvCache& cache_;
  Snapshot header_;
  std::vector<std::uint16_t> k_, v_;
};

// A session being prefilled on another thread: the prefill thread, which
// alone touches the cache, copies each message's rows out when they become
// final (stage_final), and once prefill is done (finish) the remaining rows
// are read in place. The sender thread waits on it.
class PrefillSource : public HandoffSource {
 public:
  PrefillSource(const KvCache& cache, const Timeline& timeline, Snapshot header);
  const Snapshot& header() const override { return header_; }
  // Prefill thread: copies out every message released before `steps_done`
  // (chunks done * n_layers). Messages released only at the last step are
  // left for finish(), after which they are read in place.
  Status stage_final(std::int64_t steps_done);
  // Prefill thread: prefill has ended (ok: every row final; otherwise the
  // sender is told why and stops).
  void finish(Status prefill_status);
  Result<bool> wait_final(const PlannedMessage& message, Deadline deadline) override;
  Status rows(const PlannedMessage& m, const std::uint16_t** k, const std::uint16_t** v) override;
  void release(const PlannedMessage& m) override;
  std::int64_t staged_bytes_peak() const;

 private:
  Status check_known(const PlannedMessage& m) const;

  const KvCache& cache_;
  const Timeline& timeline_;
  Snapshot header_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::int64_t next_to_stage_ = 0;
  bool finished_ = false;
  Status prefill_status_;
  std::vector<std::vector<std::uint16_t>> staged_k_, staged_v_;
  std::vector<bool> staged_;
  std::int64_t staged_bytes_ = 0, staged_peak_ = 0;
  std::vector<std::uint16_t> k_, v_;  // in-place reads after finish
};

// The receiving side: a detached target that takes the header, then rows,
// and becomes live only at commit. abort() frees what it took.
class HandoffTarget {
 public:
  virtual ~HandoffTarget() = default;
  // Refuses a header whose geometry or fingerprint the store cannot take.
  virtual Status begin(const Snapshot& header) = 0;
  virtual Status put_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                          const std::uint8_t* k, const std::uint8_t* v) = 0;
  // Rows in device memory of the current GPU (the transport left them
  // there), taken on `stream` without a host wait: only where
  // accepts_device(). commit() waits for them.
  virtual bool accepts_device() const { return false; }
  virtual Status put_device_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                                 const void* k, const void* v, cudaStream_t stream);
  virtual Status commit() = 0;
  virtual void abort() = 0;
};

// Installs straight into a detached sequence of a running store (either
// backend; KvStore::add_detached_sequence): begin() refuses a session the
// store cannot take (another geometry, more positions than its context, no
// free slot or too few free blocks) and otherwise takes a slot and every
// plane's blocks (a header it refuses for its geometry or positions leaves
// a session in progress as it was; one it takes replaces it); each
// message's rows are written where they belong as they
// arrive (once: no snapshot buffer; only a ring the rows do not fill is
// cleared, as install() does); commit() waits for the
// device and makes the sequence live; abort() removes it, leaving the store
// as it was. On the CUDA backend, host rows go through two pinned and device
// staging slots, so one message's copy to the GPU and its install run while
// the next is received; device rows are installed where they lie. Other
// calls on the store may run while a session arrives only one at a time
// with the target's own, as every call on a store: an engine that keeps
// decoding forwards a HandoffTarget's calls to this one under the lock its
// other store calls take (Handoff.DecodingGoesOnWhileASessionArrives).
// They leave the detached sequence alone; the blocks it needs were taken
// at begin(). The target's destruction, which aborts a session not
// committed, is one of its calls too.
class StoreTarget : public HandoffTarget {
 public:
  struct Options {
    // Set: a session of another geometry is refused (kMismatch); the
    // store's geometry is always required.
    std::optional<ModelConfig> expect;
    std::int64_t max_row_bytes = std::int64_t{64} << 30;
  };
  explicit StoreTarget(KvStore& store);
  StoreTarget(KvStore& store, Options options);
  // begin()'s checks that need no store: the expected geometry, the size.
  static Status check_session(const Snapshot& header, const Options& options);
  ~StoreTarget() override;  // aborts a session not committed
  Status begin(const Snapshot& header) override;
  Status put_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                  const std::uint8_t* k, const std::uint8_t* v) override;
  bool accepts_device() const override;
  Status put_device_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                         const void* k, const void* v, cudaStream_t stream) override;
  Status commit() override;
  void abort() override;
  // After commit: the new live sequence, and the header (token ids, metadata).
  std::optional<SeqId> sequence() const { return committed_ ? seq_ : std::nullopt; }
  // Blocks of the pool a session not yet committed holds (0 when none).
  std::int64_t pending_blocks() const;
  const Snapshot& header() const { return header_; }

 private:
  KvStore& store_;
  Options options_;
  Snapshot header_;  // no rows
  std::optional<SeqId> seq_;
  bool committed_ = false;
  std::vector<std::int64_t> skip_;  // per layer: the first position the store keeps
  cudaStream_t device_stream_ = nullptr;  // the stream device rows were taken on
  // A layer of the store and rows within the session's positions.
  Status check_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows) const;
  std::unique_ptr<device::TargetSlots> slots_;  // the CUDA backend's staging
};

// The tool's receiver: a StoreTarget into a new sequence of a running store
// (`store` set: the sequence exists, live, only once every row has arrived
// and verified, and the store's other sequences are never touched), or into
// a fresh one-sequence store made at begin() without zero-fill (only a ring
// the rows do not fill is cleared), handed out by take() as a cache after
// commit. Either way each row is written once, where it stays.
class DetachedCacheTarget : public HandoffTarget {
 public:
  struct Options {
    BackendKind backend = BackendKind::kCpu;
    std::int64_t context = 0;  // 0: the sender's
    // Set: a session of another geometry is refused (kMismatch), and a
    // fresh store attends with its query_pre_attn_scalar unless the header
    // given to begin() names one (a header off the wire carries the
    // geometry only; neither: scores scale by 1/sqrt(head_dim)), and takes
    // its attention_sinks where it has them (the store then attends a
    // layer only once its sinks are set).
    std::optional<ModelConfig> expect;
    // The most a session may bring: its rows, and without `store` the fresh
    // store's footprint (compute_footprint at the context), refused at
    // begin() with kCapacityExceeded before anything is allocated.
    std::int64_t max_row_bytes = std::int64_t{64} << 30;
    // Set: commit adds the session to this store as a new sequence, and a
    // session the store cannot take (another geometry, more positions than
    // its context, no free slot, too few free blocks) is refused at begin().
    KvStore* store = nullptr;
  };
  explicit DetachedCacheTarget(Options options);
  ~DetachedCacheTarget() override;
  Status begin(const Snapshot& header) override;
  Status put_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                  const std::uint8_t* k, const std::uint8_t* v) override;
  bool accepts_device() const override;
  Status put_device_rows(std::int64_t layer, std::int64_t first_row, std::int64_t rows,
                         const void* k, const void* v, cudaStream_t stream) override;
  Status commit() override;
  void abort() override;
  // After commit: the live cache (none in store mode), the new sequence
  // (store mode) and the snapshot header (token ids, metadata).
  std::unique_ptr<KvCache> take() { return std::move(cache_); }
  std::optional<SeqId> sequence() const { return seq_; }
  const Snapshot& header() const { return header_; }
  // Bytes the target holds now: a pending session's blocks (store mode) or
  // its fresh store, or the cache not yet taken; 0 after abort.
  std::int64_t held_row_bytes() const;

 private:
  Options options_;
  Snapshot header_;
  std::unique_ptr<KvStore> own_;  // the fresh store, until commit
  std::unique_ptr<StoreTarget> target_;
  std::unique_ptr<KvCache> cache_;
  std::optional<SeqId> seq_;
};

struct SendOptions {
  // Longest wait for the receiver (accept, credits, done). While prefill or
  // pacing holds a message back, a keep-alive goes every timeout_s / 4, at
  // most 0.25 s apart (the receiver's timeout is its own setting).
  double timeout_s = 10;
  double rate_bytes_per_s = 0;  // token bucket; 0: unpaced
  // The slowest the receiver may take the whole session, as a rate: the
  // time this end spends waiting on it from its acceptance on (its sends,
  // its replies; not the source's prefill nor the pacing), summed over the
  // session, past 2 x timeout_s (one for the receiver's commit) + the
  // payload's bytes at this rate fails the session. Each
  // wait's own bound (timeout_s) does not bound their sum: a receiver that
  // answers each message just within it would otherwise hold the sender
  // for as many timeouts as there are messages. The default, 64 KiB/s, is
  // the receiver's own (ReceiveOptions::min_bytes_per_s). 0: no bound.
  double min_bytes_per_s = 64 << 10;
};

struct SendReport {
  std::int64_t messages = 0, payload_bytes = 0, wire_bytes = 0;
  std::int64_t credit_bytes = 0, max_in_flight = 0;
  double seconds = 0;  // header sent to commit confirmed
};

// Sends the session: the header, each planned message once final (rows with
// their digest), then the end; returns once the receiver confirmed its
// commit. The source is only read: on any error the session stays usable.
// A message of the timeline that is not rows of the header's planes (a
// layer of them, rows all live, its bytes theirs) is refused
// (kInvalidArgument) before the source is asked for its rows.
Result<SendReport> send_session(Transport& transport, HandoffSource& source,
                                const Timeline& timeline, const SendOptions& options = {});

struct ReceiveOptions {
  double timeout_s = 10;  // longest wait for any message once connected
  // Longest run of keep-alives with no rows between them (the sender's
  // prefill still running) before the session is refused; 0: no limit.
  // Under swa-first every message waits for the end of prefill, so this
  // must outlast the sender's whole prefill.
  double max_keep_s = 300;
  // The slowest a whole session may run, as a rate: a session that has not
  // ended max_keep_s + timeout_s + its header's row bytes at this rate
  // after it was accepted is refused. Each message's own wait (timeout_s)
  // and each run of keep-alives (max_keep_s) are bounded already; this
  // bounds their sum, so that a sender trickling rows (or keep-alives
  // between them) cannot hold the target's blocks for ever. The ACKs'
  // sends end at it too; the refusal's ERROR then takes at most 1 s more,
  // and a receiver that ends lingers as docs/DESIGN.md says. The default,
  // 64 KiB/s, stays below what a sender streaming at its prefill's pace
  // sends (docs/DESIGN.md, "Faults"). 0, or max_keep_s 0: no bound.
  double min_bytes_per_s = 64 << 10;
  // Row bytes the sender may send unacknowledged; no message after the
  // header may carry more rows than this. Handed out as at most the rows a
  // message of max_message_bytes carries (its 61-byte head aside, at
  // least 1 B), so a sender refuses a larger message at the acceptance.
  std::int64_t credit_bytes = std::int64_t{64} << 20;
  // The largest message taken (the header's token ids and metadata).
  std::int64_t max_message_bytes = std::int64_t{256} << 20;
};

struct ReceiveReport {
  std::int64_t messages = 0, payload_bytes = 0;
  double seconds = 0;  // header received to commit
};

// Receives one session into `target`: every message verified on arrival,
// committed only when all rows arrived. On any error the target is aborted
// (its store as it was), the sender is told why where the link still works,
// and the error names what went wrong.
Result<ReceiveReport> receive_session(Transport& transport, HandoffTarget& target,
                                      const ReceiveOptions& options = {});

}  // namespace kvring::handoff
