// The KV store an engine embeds: many sequences of one model geometry.
//
// Per sequence: one ring per sliding layer (max(32, min(context, W)) +
// slack rows, token-major, in the sequence's slot) and, per full layer, a
// block table into one pool of fixed-size blocks that every sequence
// shares (head-major inside a block).
// The base class owns every ring state, block table and reference count,
// and does every check and every piece of placement arithmetic; a backend
// only moves bytes to the placements it is given and attends over them
// (docs/DESIGN.md, "Many sequences").
//
// Threads: calls on one store are made one at a time, except read_rows(),
// install(), install_plane() and install_rows() of different layers, which
// may run concurrently.
//
// Failure contract: an operation that returns an error has changed nothing,
// for any sequence it names. Should a backend fail part-way (a device
// error), the rows it had written are not reachable: ring states, block
// tables and the pool are restored to what they were. Two cases cannot be
// restored so: the device's copy of a block table failing to go back too,
// and a write into a full sliding ring that failed once its rows began to
// land (they take the slots of its oldest live ones; an error before that,
// such as an allocation, changes no ring). The sequences concerned are
// refused (kCuda) by every call on them but reset_sequence,
// remove_sequence, contains, is_detached, next_position, ring, blocks_held
// and blocks_held_alone, until they are reset or removed; the store's
// other sequences are not affected. (A failed install leaves its plane empty
// instead, which needs no mirror.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvring/config.h"
#include "kvring/layout.h"
#include "kvring/ring.h"
#include "kvring/status.h"

// The CUDA runtime's stream handle, declared as cuda_runtime_api.h does.
typedef struct CUstream_st* cudaStream_t;

namespace kvring {

enum class BackendKind { kCpu, kCuda };
const char* backend_name(BackendKind kind);

// ---- Views of caller memory ---------------------------------------------

enum class MemorySpace : std::uint8_t { kHost, kDevice };
enum class DType : std::uint8_t { kF32, kF16, kBF16 };
const char* dtype_name(DType dtype);
std::int64_t dtype_bytes(DType dtype);

// A matrix [rows, cols] of `dtype` in caller memory; row r starts
// r * row_stride elements after `data` (row_stride >= cols; a view spans
// at most 2^44 elements, (rows - 1) * row_stride + cols). The store
// reads or writes it in place: no copy is made of an engine's tensor.
// `data` is aligned to its elements; the CPU backend also takes 16-bit
// (f16, bf16) views and row buffers at any address, since it reads them
// byte-wise. A device view must end inside device memory: the CUDA
// backend refuses one that runs past the allocations the driver reports
// (docs/CUDA.md, "Views"), so a kernel never faults on it; one that runs
// into a neighbouring allocation is the caller's to avoid, as is a host
// view longer than its memory (host memory carries no extent to check).
struct ConstView {
  const void* data = nullptr;
  MemorySpace space = MemorySpace::kHost;
  DType dtype = DType::kF32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
};
struct MutView {
  void* data = nullptr;
  MemorySpace space = MemorySpace::kHost;
  DType dtype = DType::kF32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
  operator ConstView() const { return {data, space, dtype, rows, cols, row_stride}; }  // NOLINT
};

// Dense row-major views (row_stride == cols).
ConstView host_view(const float* data, std::int64_t rows, std::int64_t cols);
MutView host_view(float* data, std::int64_t rows, std::int64_t cols);
ConstView device_view(const float* data, std::int64_t rows, std::int64_t cols);
MutView device_view(float* data, std::int64_t rows, std::int64_t cols);
// Views of any dtype and row stride: a column slice of a wider tensor (K
// and V in an engine's fused QKV projection, say) is a view of its first
// element with the tensor's row stride, in elements.
ConstView host_view(const void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                    std::int64_t row_stride);
MutView host_view(void* data, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride);
ConstView device_view(const void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                      std::int64_t row_stride);
MutView device_view(void* data, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride);
// Views of no data (null): a MutView, which serves as a ConstView too, so
// that host_view(nullptr, 0, cols) names one function rather than both the
// const and the mutable one. An empty batch takes one (as any view of no
// rows); a call with rows refuses it.
MutView host_view(std::nullptr_t, std::int64_t rows, std::int64_t cols);
MutView device_view(std::nullptr_t, std::int64_t rows, std::int64_t cols);
MutView host_view(std::nullptr_t, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride);
MutView device_view(std::nullptr_t, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride);

// ---- Sequences ------------------------------------------------------------

// A sequence's handle: its slot, the slot's generation and its store's tag,
// so a handle of a removed sequence is refused even after its slot is
// reused, and a handle of another store is refused too (kNotFound): stores
// alive at once hold distinct tags (up to 4095 of them), and a dropped
// store's tag comes back only after the other 4094 have each been taken.
enum class SeqId : std::uint64_t {};
std::string seq_name(SeqId seq);

// Positions [start, start + count) of one sequence.
struct SeqSpan {
  SeqId seq{};
  std::int64_t start = 0;
  std::int64_t count = 0;
};
// A decode query: the token at `position`, whose K/V is already stored.
struct SeqQuery {
  SeqId seq{};
  std::int64_t position = 0;
};

// How attention computes its outputs (StoreOptions::attention). Within one
// numeric, a query's bits depend only on its position, its visible rows'
// values and its own query values: not on chunking, rotation, batch, slot
// or blocks, and a prefilled token equals a decoded one (docs/DESIGN.md,
// "Attention numerics").
enum class AttentionNumeric : std::uint8_t {
  // f32 queries, scores, softmax and accumulation (the default).
  kF32,
  // Each query head scaled by a power of two and rounded to f16, the
  // softmax weights rounded to f16, both products on f16 tensor cores with
  // f32 accumulation; scores, softmax and sums in f32. The rows are taken
  // in tiles of kF16AttendTile at multiples of that position, in splits of
  // kF16AttendSplitRows at multiples of that position, the splits combined
  // in order. On the GPU: head_dim 128, at most 64 query heads per KV
  // head, a device of compute capability 9.0 and a build with sm_90a code.
  kF16,
};
const char* attention_numeric_name(AttentionNumeric numeric);
Result<AttentionNumeric> parse_attention_numeric(std::string_view name);
inline constexpr std::int64_t kF16AttendTile = 64;
inline constexpr std::int64_t kF16AttendSplitRows = 2048;

// The most blocks a store's pool holds (StoreOptions::pool_blocks).
inline constexpr std::int64_t kMaxPoolBlocks = std::int64_t{1} << 30;
// The most plane storage one store may have: 2^62 bytes, so that any sum
// of its parts, and any offset into them, fits a signed 64-bit integer.
inline constexpr std::int64_t kMaxStoreBytes = std::int64_t{1} << 62;

struct StoreOptions {
  // Sequences the store holds at once (slots; each holds its sliding
  // rings), in [1, 2^20].
  std::int64_t max_sequences = 1;
  // Positions one sequence may reach (0: the model's max_context), with no
  // plane shorter than kMinPlaneRows (32): a full layer holds max(32,
  // context) positions and stops there. A sliding layer whose ring holds its
  // window (max(32, min(context, W)) >= W) may run past it; one whose ring
  // is shorter than W stops at the context.
  std::int64_t context = 0;
  // Extra rows of every sliding ring, in [0, sliding_window]: a sequence
  // can always be rolled back to any position within `slack` of the
  // furthest it reached, and not before its last restore
  // (truncate_sequence). An engine that drafts k tokens speculatively and
  // may reject them all sets at least k.
  std::int64_t slack = 0;
  // Rows of one full-attention block: a power of two in [16, 65536]
  // (0: 256, or the smallest power of two from 16 that holds a full plane
  // when that is less).
  std::int64_t block_rows = 0;
  // Blocks in the shared pool (0: enough for every slot at full context),
  // at most 2^30. Options whose storage (every slot's rings and the whole
  // pool, allocated_bytes()) would pass 2^62 bytes are refused.
  std::int64_t pool_blocks = 0;
  // Zero-fill storage at creation and a slot's rings when a sequence is
  // added. Only a detached install, which overwrites every row a reader can
  // see, may turn this off.
  bool zero_fill = true;
  AttentionNumeric attention = AttentionNumeric::kF32;
};

// ---- The store ------------------------------------------------------------

class KvStore {
 public:
  virtual ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  virtual BackendKind backend() const = 0;
  const ModelConfig& config() const { return config_; }
  // The options with every default resolved.
  const StoreOptions& options() const { return options_; }
  std::int64_t context() const { return options_.context; }
  std::int64_t n_layers() const { return config_.n_layers; }
  // A layer outside [0, n_layers()): token-major, capacity 0.
  Layout layout(std::int64_t layer) const;
  // Rows of a sliding ring; positions of a full plane.
  std::int64_t capacity(std::int64_t layer) const;
  // The positions a layer's plane may reach: for a sliding ring shorter
  // than its window, the context (past it, its queries would need rows it
  // dropped). Other planes are bounded by their capacity alone: a full
  // plane stops at capacity(layer) and a ring that holds its window never
  // stops, and for both this returns kNoPositionLimit (2^62).
  std::int64_t position_limit(std::int64_t layer) const;
  static constexpr std::int64_t kNoPositionLimit = kvring::kNoPositionLimit;

  // Bytes of plane storage: every slot's rings plus the whole pool.
  std::int64_t allocated_bytes() const;
  // Bytes of one sliding ring (K and V) and of one block (K and V).
  std::int64_t ring_bytes() const;
  std::int64_t block_bytes() const;
  std::int64_t pool_blocks() const { return options_.pool_blocks; }
  std::int64_t free_blocks() const {
    return static_cast<std::int64_t>(free_.size()) + options_.pool_blocks - fresh_;
  }

  // ---- Sequences ----------------------------------------------------------
  // Errors: kResourceExhausted when every slot is taken.
  Result<SeqId> add_sequence();
  // Frees the slot and drops the sequence's references to its blocks.
  Status remove_sequence(SeqId seq);
  // Empties the sequence (position 0); its blocks go back to the pool.
  // Under zero_fill its rings are then zeroed; an error there (a device
  // failure) is returned with the sequence empty all the same.
  Status reset_sequence(SeqId seq);
  // A new sequence with the same contents: its sliding rings are copied,
  // its full blocks are shared (a block is written only while one sequence
  // holds it; the first write into a shared block copies it, and when all
  // its holders write into it in one call, all but one copy it).
  Result<SeqId> fork_sequence(SeqId source);
  // Rolls the sequence back by its last `tokens` tokens. Refused, changing
  // nothing, past its start or when a sliding ring would then no longer
  // hold the rows a ring without slack holds at the new end (at least the W
  // before it). Always allowed to an end within `slack` of the furthest
  // position the sequence reached and not before the position it was
  // restored or installed at: a snapshot holds no slack rows.
  Status truncate_sequence(SeqId seq, std::int64_t tokens);
  // Rolls every layer of the sequence back to `position` tokens, also when
  // its layers stand at different positions, as a step of one call per
  // layer that was refused part-way (the pool ran dry at a full layer)
  // leaves them: every layer must hold at least `position` tokens, and the
  // rule above holds at `position`. Refused, changing nothing, otherwise:
  // a step of more tokens than `slack` may have overwritten ring rows its
  // start needs, and is then completed forward instead (docs/DESIGN.md).
  Status truncate_sequence_to(SeqId seq, std::int64_t position);
  // The smallest position truncate_sequence_to accepts for the sequence
  // now: how far speculative tokens can be taken back. kInvalidArgument
  // when no one position is accepted.
  Result<std::int64_t> rollback_floor(SeqId seq) const;

  bool contains(SeqId seq) const;
  std::vector<SeqId> sequences() const;
  std::int64_t sequence_count() const;
  // Slots that add_sequence, add_detached_sequence or fork_sequence can
  // still take: not those of live or detached sequences, nor slots retired
  // after 2^32 generations. O(max_sequences).
  std::int64_t free_slots() const;
  // Ok when free_slots() > 0; else add_sequence's refusal
  // (kResourceExhausted, naming the retired slots), from the store alone.
  Status check_free_slot() const;
  // The next position every layer of the sequence expects; when its layers
  // stand at different positions (a step refused part-way through its
  // layers), kCacheDiscontinuity naming the first layer that differs from
  // layer 0 (truncate_sequence_to rolls them back to one).
  Result<std::int64_t> next_position(SeqId seq) const;
  Result<RingState> ring(SeqId seq, std::int64_t layer) const;
  // Blocks the sequence's full planes hold (shared ones included).
  Result<std::int64_t> blocks_held(SeqId seq) const;
  // Of those, the blocks no other sequence holds: what remove_sequence and
  // reset_sequence give back to the pool (a preemption's price).
  Result<std::int64_t> blocks_held_alone(SeqId seq) const;
  // Blocks that storing `spans` into every full layer would take from the
  // pool (new blocks, and copies of shared blocks written into; of the
  // holders of a shared block that all write into it in one call, one
  // keeps it). Spans that store would refuse in any layer (an unknown or
  // repeated sequence, an empty span, one that does not continue a plane,
  // runs past it or past the layer's position_limit) get store's error,
  // not a count: a step priced here is refused only for want of blocks
  // (kResourceExhausted).
  Result<std::int64_t> blocks_to_store(std::span<const SeqSpan> spans) const;
  // What install() of a ring of `rows` rows into plane `layer` of `seq`
  // takes from the pool while it runs (new blocks, and new ones for blocks
  // the plane shares with a fork), and what it gives back once it is in
  // (blocks the plane holds alone past the new rows). A sliding plane takes
  // none; `rows` past the plane's capacity is refused.
  struct InstallBlocks {
    std::int64_t take = 0;
    std::int64_t give = 0;
    std::int64_t shared = 0;  // of `take`, blocks that replace ones shared with a fork
  };
  Result<InstallBlocks> blocks_to_install(SeqId seq, std::int64_t layer, std::int64_t rows) const;

  // ---- Batched operations -------------------------------------------------
  // Device views need the CUDA backend; its calls are enqueued on `stream`
  // (null: the store's own stream) and never synchronise the device. Host
  // views work on both backends; on CUDA such a call waits for its copies.

  // Stores K/V rows of several sequences into one layer. Span i's rows are
  // the next `count` rows of k and v ([sum of counts, kv_dim]), in span
  // order. A sequence appears at most once.
  //
  // A step stored layer by layer (store, prefill) that the pool cannot
  // hold is refused at the first full layer short of blocks, after the
  // layers before it took theirs: the sequence's layers then stand at
  // different positions until the step is finished or rolled back
  // (truncate_sequence_to, within the rollback slack). An engine prices a
  // step for every layer before it starts: blocks_to_store against
  // free_blocks, or store_all_layers, which all layers accept or none.
  Status store(std::int64_t layer, std::span<const SeqSpan> spans, const ConstView& k,
               const ConstView& v, cudaStream_t stream = nullptr);
  // The same for every layer at once: k, v [n_layers * rows, kv_dim], layer
  // l's rows from l * rows on (rows = sum of counts). All layers accept the
  // batch or none changes.
  Status store_all_layers(std::span<const SeqSpan> spans, const ConstView& k,
                          const ConstView& v, cudaStream_t stream = nullptr);
  // Decode attention of queries whose K/V is stored: q, out
  // [queries, n_heads * head_dim], f32 out. A sequence may appear many times.
  // A query's visible rows must still be live: after a store of more tokens
  // than a ring's slack, the earlier of those tokens can no longer be
  // queried here (kInvalidArgument); a chunk's own queries are prefill's.
  // out may be q itself (same data and row stride), and may share no byte
  // with another view of the call (here or in prefill); rows of out beside
  // rows of q in one buffer share none.
  Status attend_decode(std::int64_t layer, std::span<const SeqQuery> queries, const ConstView& q,
                       const MutView& out, cudaStream_t stream = nullptr);
  // Ragged chunked prefill: stores each span's chunk and computes attention
  // for its queries, each seeing the rows before the chunk and the chunk's
  // rows up to itself. k, v [rows, kv_dim]; q, out [rows, n_heads *
  // head_dim] (rows = sum of counts, in span order). Equals, bit for bit,
  // the tokens stored and decoded one at a time. A decode step written as
  // one-token chunks (device K/V, q and out, the f32 numeric) is one launch
  // on CUDA, which stores each row as it attends: the engine's
  // store-and-decode call.
  Status prefill(std::int64_t layer, std::span<const SeqSpan> chunks, const ConstView& k,
                 const ConstView& v, const ConstView& q, const MutView& out,
                 cudaStream_t stream = nullptr);
  // Waits for the work this store enqueued on `stream` (null: its own).
  virtual Status synchronize(cudaStream_t stream = nullptr) const = 0;

  // Attention sinks (gpt-oss): one learned logit per query head of a
  // layer, in the units of the scaled scores q . k / sqrt(s), that joins
  // each softmax's denominator and weighs no row: out = sum_j e^(s_j) v_j /
  // (e^sink + sum_j e^(s_j)). They are model weights, not cache: set once
  // per layer after loading (not while a call of this store runs), they
  // apply to every later attend_decode and prefill of that layer, under
  // both numerics, and are no part of snapshots, packs or handoffs.
  // `sinks` holds n_heads finite values, or is empty to remove the
  // layer's. On the CUDA backend the values go to device memory on the
  // store's stream (CudaStore::stream()), after the work the store
  // enqueued before, and the call waits for them; a launch reads them when
  // it runs. A CUDA graph captured earlier keeps whether the layer had
  // sinks then, and reads the values current when it runs (replayed in
  // order with the store's other work, as cuda_store.h asks). The call
  // allocates (the first time) and waits on the store's stream: not while
  // a capture in global or thread-local mode runs on the store's GPU
  // (cuda_store.h). Errors:
  // kInvalidArgument (layer, count, a value that is not finite; on the
  // CUDA backend, while the store's own stream is being captured), kCuda
  // (the device refused the copy); the layer's sinks are then unchanged.
  // A store whose config
  // says the model has sinks (ModelConfig::attention_sinks, gpt-oss)
  // refuses attend_decode and prefill of a layer whose sinks are not set
  // (kConfig), so such a model is never attended without them.
  Status set_attention_sinks(std::int64_t layer, std::span<const float> sinks);
  // The layer's sinks (empty: none, or a layer outside the model).
  std::span<const float> attention_sinks(std::int64_t layer) const;

  // ---- Detached sequences ---------------------------------------------------
  // A sequence being installed from elsewhere (a handoff's receiving side):
  // it holds a slot and the blocks its planes take, but it is not live.
  // Only install, install_plane, install_rows, blocks_to_install, ring,
  // next_position, blocks_held, blocks_held_alone, is_detached, attach_sequence and
  // remove_sequence reach it; sequences(), sequence_count()
  // and contains() leave it out, and every batched operation, read_rows,
  // read_plane, fork, truncate and reset refuse it (kNotFound), so nothing
  // reads or extends rows that are still arriving (nor, in blocks taken
  // from the pool, rows some removed sequence left there). attach_sequence
  // makes it live once it is whole: every layer's plane ends at one
  // position and an install wrote every one of its live rows (else
  // kInvalidArgument, and it stays detached; with nothing installed it is
  // whole, an empty sequence); remove_sequence frees it and everything it
  // took instead.
  // Errors: kResourceExhausted when every slot is taken.
  Result<SeqId> add_detached_sequence();
  Status attach_sequence(SeqId seq);
  bool is_detached(SeqId seq) const;

  // ---- Rows of one sequence (f16 bits) --------------------------------------
  // Rows are in host memory, or with MemorySpace::kDevice in device memory
  // of the store's GPU (the CUDA backend): such a call is enqueued on
  // `stream` (null: the store's own) and does not wait for the device; a
  // host call on the CUDA backend waits for its copies.
  // Live rows [first, first + count) in logical order: k, v [count, kv_dim].
  Status read_rows(SeqId seq, std::int64_t layer, std::int64_t first, std::int64_t count,
                   std::uint16_t* k, std::uint16_t* v, MemorySpace space = MemorySpace::kHost,
                   cudaStream_t stream = nullptr) const;
  // The physical image of a plane, [capacity * kv_dim] each, layout-indexed
  // (layout.h): a sliding ring's storage as it is; a full plane's rows
  // [0, len) from its blocks and zeros past them.
  Status read_plane(SeqId seq, std::int64_t layer, std::uint16_t* k, std::uint16_t* v) const;
  // Replaces a plane of the sequence with `ring.len()` rows in logical order
  // (k, v [len, kv_dim]). `ring` is a state of this plane's capacity whose
  // rotation is origin_logical % capacity (a sliding ring) or zero (full),
  // and a sliding ring holds at least the rows a ring without slack holds
  // at its end (origin_logical <= max(0, next_position - (capacity -
  // slack))), as truncate_sequence keeps them; else kInvalidArgument.
  // A snapshot's plane gives such a state through restore_ring
  // (snapshot.h), which places it in this store's capacity.
  // Should the backend fail while copying, the plane is left empty.
  Status install(SeqId seq, std::int64_t layer, const RingState& ring, const std::uint16_t* k,
                 const std::uint16_t* v, MemorySpace space = MemorySpace::kHost,
                 cudaStream_t stream = nullptr);
  // install() in two steps, for a detached sequence whose rows arrive in
  // pieces: install_plane sets the plane to `ring` (install's rules; blocks
  // taken, a ring that is not full cleared) with its live rows not yet
  // written, and install_rows writes live rows [first, first + count) of it
  // (k, v [count, kv_dim], logical order). A live sequence is refused: its
  // rows would be readable before they were written. Should the backend
  // fail while copying, rows [first, first + count) count as not written
  // (attach_sequence refuses the sequence until they are written again).
  Status install_plane(SeqId seq, std::int64_t layer, const RingState& ring,
                       cudaStream_t stream = nullptr);
  Status install_rows(SeqId seq, std::int64_t layer, std::int64_t first, std::int64_t count,
                      const std::uint16_t* k, const std::uint16_t* v,
                      MemorySpace space = MemorySpace::kHost, cudaStream_t stream = nullptr);

 protected:
  KvStore(ModelConfig config, StoreOptions resolved);

  // ---- What a backend implements ------------------------------------------
  // A plane of one sequence: its slot's ring (sliding) or its block table
  // (full: row r lives in block blocks[r / block_rows]).
  struct PlaneRef {
    std::int32_t slot = 0;
    std::int64_t layer = 0;
    const std::int32_t* blocks = nullptr;
    std::int64_t n_blocks = 0;
  };
  // One span of a store: row source_row + span.source_first + i of the
  // views goes to physical row span.physical_first + i of `plane`, for each
  // span of `placement`.
  struct RowWrite {
    PlaneRef plane;
    std::int64_t source_row = 0;
    BatchPlacement placement;
  };
  struct AttendItem {
    PlaneRef plane;
    RingState ring;               // the plane as before the chunk
    std::int64_t first_position;  // queries first_position .. + n_queries - 1
    std::int64_t n_queries;
    std::int64_t chunk_start;     // rows from here on come from the chunk
    std::int64_t q_row;           // the first query's row in q and out
    std::int64_t chunk_row;       // the chunk's first row in chunk_k, chunk_v
  };
  struct AttendBatch {
    std::int64_t layer;
    std::span<const AttendItem> items;
    const ConstView* q;
    const MutView* out;
    const ConstView* chunk_k;  // null in decode
    const ConstView* chunk_v;
    cudaStream_t stream;
    // Set by a backend's attend_and_store for its own attend: the launch
    // also stores the chunk's rows.
    bool store_chunk = false;
  };
  // A block table's entries [first, first + count) changed (backends that
  // mirror tables elsewhere update the mirror; stream-ordered).
  struct TableChange {
    std::int32_t slot;
    std::int64_t full_index;
    const std::int32_t* table;
    std::int64_t first;
    std::int64_t count;
  };

  // Checks a view's memory space, dtype and alignment for this backend,
  // and, where the backend can tell, that the `bytes` from `data` on (the
  // view's extent: its last row's end) lie in the memory that holds it.
  virtual Status check_view(const char* what, MemorySpace space, DType dtype, const void* data,
                            std::uint64_t bytes) const = 0;
  // Checks what this backend's attention needs of the call's queries and
  // outputs beyond check_view (row strides, counts, the geometry), before
  // a call plans or changes anything.
  virtual Status check_attention(const ConstView& q, const MutView& out) const;
  // Writes (f32, f16 or bf16 sources, stored as f16 by round to nearest
  // even) into any layers; one call is one batch of the caller. `changes`
  // are the call's table changes, not yet mirrored (tables_changed's
  // contract: they have landed for any work enqueued after the call); the
  // writes name their blocks through their PlaneRef, so a backend may
  // mirror the changes in the same step as the rows.
  // A backend sets rows_written_ as it begins the work that writes the
  // rows (before a launch that may write any of them), not before.
  virtual Status write_rows(std::span<const TableChange> changes,
                            std::span<const RowWrite> writes, const ConstView& k,
                            const ConstView& v, cudaStream_t stream) = 0;
  virtual Status attend(const AttendBatch& batch) = 0;
  // A prefill's attention over its chunks, then the chunks' store
  // (`writes`, from batch.chunk_k and chunk_v), with the call's table
  // changes already applied. This default runs attend, then write_rows; a
  // backend may do both in one pass where the bytes stored and the outputs
  // are the same.
  virtual Status attend_and_store(const AttendBatch& batch, std::span<const RowWrite> writes);
  // Rows of a plane to or from packed f16 [rows, kv_dim] in caller memory
  // of `space` (checked by check_view); device copies are enqueued on
  // `stream` (null: the backend's own) and do not wait.
  virtual Status copy_out(const PlaneRef& plane, const LiveSpans& spans, std::uint16_t* k,
                          std::uint16_t* v, MemorySpace space, cudaStream_t stream) const = 0;
  virtual Status copy_in(const PlaneRef& plane, const LiveSpans& spans, const std::uint16_t* k,
                         const std::uint16_t* v, MemorySpace space, cudaStream_t stream) = 0;
  // The whole storage of a slot's ring (token-major, [ring rows * kv_dim]).
  virtual Status read_ring(std::int32_t slot, std::int64_t layer, std::uint16_t* k,
                           std::uint16_t* v) const = 0;
  // The physical rows [begin, end) of slot `to`'s ring of `layer`: zeros
  // (from < 0), or the same rows of slot `from`'s ring.
  struct RingRows {
    std::int32_t to = 0;
    std::int32_t from = -1;
    std::int64_t layer = 0;
    std::int64_t begin = 0;
    std::int64_t end = 0;
  };
  // Sets every range of `rows` (0 <= begin < end <= ring rows, sliding
  // layers, no two overlapping): an add, a reset or a fork hands over every
  // ring of its slot in one call.
  virtual Status set_ring_rows(std::span<const RingRows> rows, cudaStream_t stream) = 0;
  virtual Status copy_block(std::int32_t from, std::int32_t to, cudaStream_t stream) = 0;
  virtual Status tables_changed(std::span<const TableChange> changes, cudaStream_t stream);
  // A layer's sinks are about to become `sinks` (checked; empty: none):
  // a backend that attends from its own copy of them takes it here. An
  // error leaves the layer's sinks as they were.
  virtual Status sinks_changed(std::int64_t layer, std::span<const float> sinks);
  // For a backend whose storage is zero when made whatever zero_fill says
  // (fresh anonymous mappings): every ring is known zero.
  void rings_made_zero();

  // The block of `slot`'s full plane `fi` that holds `position`; -1 when
  // the table does not reach it.
  std::int32_t block_at(std::int32_t slot, std::int64_t fi, std::int64_t position) const;
  std::int64_t full_index(std::int64_t layer) const {
    return full_index_[static_cast<std::size_t>(layer)];
  }
  std::int64_t n_full() const { return n_full_; }
  std::int64_t max_blocks_per_plane() const { return max_blocks_; }
  std::int64_t ring_rows() const { return ring_rows_; }

  ModelConfig config_;
  StoreOptions options_;
  // Set by a backend once a batched write's rows may have begun to land
  // (write_rows, or an attend_and_store that stores as it attends); the
  // base clears it before each batched write (mark_overwritten).
  bool rows_written_ = false;

 private:
  struct Sequence {
    bool live = false;
    bool detached = false;  // taken by add_detached_sequence, not yet attached
    // Why the sequence's rows can no longer be trusted after a failed call:
    // the device's copy of its block tables may differ from `tables` (the
    // undo could not be mirrored), or a backend failed part-way through a
    // write that overwrote live rows of a full sliding ring. Refused by
    // slot_of and slot_any until reset or removed. Set only by calls that
    // run alone (stores and prefills), never by an install.
    enum class Stale : std::uint8_t { kNo, kMirror, kOverwritten };
    Stale stale = Stale::kNo;
    std::uint32_t generation = 0;
    std::vector<RingState> rings;                    // [n_layers]
    std::vector<std::vector<std::int32_t>> tables;  // [n_full][blocks]
    // [n_full]: the serial of the last transaction that saved the table
    // (Txn::save keeps each table once, found in constant time).
    std::vector<std::uint64_t> saved_in;
    // While detached: which live rows of each layer's plane an install
    // wrote, bit i for row origin_logical + i, and how many ([n_layers];
    // installs of different layers touch different entries).
    struct Written {
      std::vector<std::uint64_t> bits;
      std::int64_t rows = 0;
    };
    std::vector<Written> written;
    // [n_layers]: how many physical rows of the slot's sliding ring of the
    // layer, from its first, may hold other than zeros: 0 when it holds
    // only zeros (as created or cleared, not written since), so that an
    // install need not clear it and a clear need clear only those rows.
    // One each: installs of different layers set theirs at once.
    std::vector<std::int64_t> ring_dirty;
  };
  // Every write into slot `slot`'s sliding rings of `layer` (all layers
  // when -1) goes through this before it lands (of the physical rows below
  // `rows`; -1: anywhere); clears (clear_dirty_rings) and forks set the
  // extents themselves.
  void ring_written(std::int32_t slot, std::int64_t layer, std::int64_t rows = -1);
  // Clears the rows of the slot's ring of `layer` (every sliding layer
  // when -1) that may hold other than zeros; after an error the extents
  // are as they were.
  Status clear_dirty_rings(std::int32_t slot, std::int64_t layer, cudaStream_t stream);
  // A slot's ring_dirty is made when a sequence first takes the slot (empty
  // before: every ring as the store made it, zero where rings_zero_), so
  // that the bookkeeping grows with the slots used, not with max_sequences
  // x n_layers. Calls that may run concurrently (installs) find it made.
  void slot_rings_known(std::int32_t slot) {
    std::vector<std::int64_t>& z = slots_[static_cast<std::size_t>(slot)].ring_dirty;
    if (z.empty()) z.assign(static_cast<std::size_t>(config_.n_layers), rings_zero_ ? 0 : ring_rows());
  }
  bool rings_zero_ = false;
  struct Txn;
  // Working vectors of the batched calls, kept between calls so that a
  // step allocates (and first-touches) nothing.
  struct Scratch;

  // The slot of a live sequence; slot_any also finds a detached one.
  // Both refuse a stale sequence; find_slot does not.
  Result<std::int32_t> slot_of(SeqId seq) const;
  Result<std::int32_t> slot_any(SeqId seq) const;
  Result<std::int32_t> find_slot(SeqId seq, bool detached_ok) const;
  Result<std::int32_t> usable_slot(SeqId seq, bool detached_ok) const;
  Result<SeqId> add_slot(bool detached);
  // Install's two halves before the rows: plan_plane takes the blocks a
  // plane of `state` needs (bookkeeping only; on an error roll back), and
  // ready_plane mirrors the tables and clears a ring the rows do not fill.
  Status plan_plane(Txn& txn, std::int32_t slot, std::int64_t layer, const RingState& state);
  Status ready_plane(Txn& txn, std::int32_t slot, std::int64_t layer, const RingState& state,
                     cudaStream_t stream);
  // A plane left empty after a backend failed part-way through an install.
  void empty_plane(Txn& txn, std::int32_t slot, std::int64_t layer);
  // A detached sequence's record of written rows (Sequence::written) after
  // an install of the layer's plane (all its live rows written, or none),
  // and after install_rows wrote live rows [first, first + count)
  // (`written`), or failed while writing them (not `written`).
  void mark_installed(std::int32_t slot, std::int64_t layer, bool rows_written);
  void mark_written(std::int32_t slot, std::int64_t layer, std::int64_t first, std::int64_t count,
                    bool written);
  // Row buffers of `rows` packed f16 rows of kv_dim each (a count not yet
  // checked against the rings).
  Status check_rows_memory(MemorySpace space, const std::uint16_t* k, const std::uint16_t* v,
                           std::int64_t rows) const;
  // Rows [first, first + count) are live in ring `r` of the sequence.
  Status check_live(SeqId seq, std::int64_t layer, const RingState& r, std::int64_t first,
                    std::int64_t count) const;
  Status check_layer(std::int64_t layer) const;
  // A model with attention sinks (ModelConfig::attention_sinks) attends a
  // layer only once its sinks are set (kConfig otherwise).
  Status check_sinks(std::int64_t layer) const;
  PlaneRef plane_ref(std::int32_t slot, std::int64_t layer) const;
  Status check_rows_view(const char* what, const ConstView& v, std::int64_t rows,
                         std::int64_t cols) const;
  Status check_out_view(const char* what, const MutView& v, std::int64_t rows,
                        std::int64_t cols) const;
  // copies[i]: whether span i copies the block its first row falls in on
  // full plane `fi`. A block other sequences hold too is written in place
  // only when every holder writes into it in the same call, and then only
  // by the one that starts furthest (the last of equals); the others copy
  // it. Its rows land past every row the others hold, so no holder ever
  // sees another's writes, even after a rollback. `slots[i]` is span i's
  // slot. One pass over the spans, however many hold a block.
  void first_block_copies(std::span<const SeqSpan> spans, std::span<const std::int32_t> slots,
                          std::int64_t fi, std::vector<char>& copies) const;
  // Plans the writes of `spans` into `layer` in `txn`: ring placements,
  // new blocks, copies of shared blocks. Leaves the store unchanged. The
  // caller has passed every layer's spans through check_placements first;
  // `placements` are its answers for this layer, span by span.
  Status plan_store(Txn& txn, std::int64_t layer, std::span<const SeqSpan> spans,
                    std::span<const std::int32_t> slots, std::span<const BatchPlacement> placements,
                    std::vector<RowWrite>& writes);
  // Points the planned table changes at the tables (planning may have
  // moved a table's storage after a change named it).
  void seal(Txn& txn);
  // After a device error (kCuda) in `writes`, rolled back, once the
  // backend began writing rows (rows_written_): the sequences whose full
  // sliding rings a write went into are refused until reset
  // (Sequence::stale), their oldest live rows' slots written over. An
  // error before that (an allocation, an upload, the attention of a
  // prefill) leaves every ring as it was.
  void mark_overwritten(const Status& failed, std::span<const RowWrite> writes);
  // The end of a batched write: on `st`'s error, rollback and
  // mark_overwritten, and `st` returned; else commit.
  Status settle(Txn& txn, const Status& st, std::span<const RowWrite> writes);
  // Applies block copies, then the table changes and the writes in one
  // write_rows, then commits; rolls back on a backend error.
  Status finish_store(Txn& txn, std::vector<RowWrite>& writes, const ConstView& k,
                      const ConstView& v, cudaStream_t stream);
  // The planned copies of shared blocks (copy_blocks), then the table
  // changes mirrored (apply_blocks).
  Status copy_blocks(const Txn& txn, cudaStream_t stream);
  Status apply_blocks(Txn& txn, cudaStream_t stream);
  // Undoes the transaction: tables, pool and, where `restore_mirror`, the
  // device's copy of the changed tables; a failure there leaves their
  // sequences stale (Sequence::stale).
  void rollback(Txn& txn, bool restore_mirror = true);
  void commit(Txn& txn);
  Result<std::vector<std::int32_t>> slots_of_spans(std::span<const SeqSpan> spans,
                                                   bool unique) const;
  // Where span `sp` of sequence `seq` lands in `layer`'s plane `r`, or
  // store's refusal (discontinuity, capacity, `limit`: position_limit).
  Result<BatchPlacement> place_span(std::int64_t layer, const RingState& r, const SeqSpan& sp,
                                    std::int64_t limit) const;
  // place_span's refusal of any span in `layer`, before any block is taken:
  // a batch that could never be stored is refused as such, not for want of
  // blocks (kResourceExhausted) that an earlier span took. Appends each
  // span's placement to `placements` where given.
  Status check_placements(std::int64_t layer, std::span<const SeqSpan> spans,
                          std::span<const std::int32_t> slots,
                          std::vector<BatchPlacement>* placements = nullptr) const;
  void release_table(std::vector<std::int32_t>& table);
  void release_tables(Sequence& s);
  // Frees a slot's sequence: its blocks, its rings. With `retire_handle`
  // its generation moves on, so its handle names nothing from then on;
  // without, the slot's next sequence gets the same handle, which only a
  // sequence whose handle never left the library may do.
  void vacate(std::int32_t slot, bool retire_handle);
  RingState fresh_ring(std::int64_t layer) const;

  // Reaches the slots' generations, which only 2^32 sequences through one
  // slot could otherwise move; defined by the tests alone.
  friend struct KvStoreTestAccess;
  // The library's own restores and handoffs (src/core/store_access.h).
  friend struct KvStoreAccess;
  // kResourceExhausted's message when no slot is free, naming the retired.
  std::string slots_taken() const;

  std::vector<std::int64_t> full_index_;
  std::vector<std::vector<float>> sinks_;  // per layer: n_heads logits, or none
  std::int64_t n_full_ = 0;
  std::int64_t ring_rows_ = 0;
  std::int64_t max_blocks_ = 0;
  std::vector<Sequence> slots_;
  // This store's part of every handle it makes (handle, find_slot).
  std::uint32_t tag_;
  SeqId handle(std::size_t slot, std::uint32_t generation) const;
  // Every slot below this one is live or retired (add_slot and fork look
  // from here; a removal moves it down).
  std::size_t free_from_ = 0;
  // The first slot a new sequence may take, from free_from_ on, or
  // slots_.size() when none.
  std::size_t free_slot();
  // The pool's bookkeeping grows with the blocks taken, not with the pool:
  // blocks [fresh_, pool_blocks) were never taken, and free_ holds the
  // blocks given back, taken from the back before a fresh one (so the pool
  // hands out block 0 first, then the most recently freed); a rolled-back
  // call puts its blocks back as they were (rollback). The sequences
  // holding block b are refs(b), in pages of kRefPage counters made as
  // fresh blocks reach them; a page never moves once made.
  static constexpr int kRefPageBits = 12;
  static constexpr std::int64_t kRefPage = std::int64_t{1} << kRefPageBits;
  std::int32_t& refs(std::int32_t b) const {
    return ref_pages_[static_cast<std::size_t>(b >> kRefPageBits)][b & (kRefPage - 1)];
  }
  std::vector<std::unique_ptr<std::int32_t[]>> ref_pages_;
  std::int64_t fresh_ = 0;
  std::vector<std::int32_t> free_;
  // Guards fresh_, free_ and the making of pages for install() and
  // read_rows() of different layers of one sequence, which may run
  // concurrently (snapshot restore).
  mutable std::mutex pool_mutex_;
  std::unique_ptr<Scratch> scratch_;
};

// Resolves and checks options against a geometry (every default filled in).
Result<StoreOptions> resolve_store_options(const ModelConfig& config, StoreOptions options);

// A store on the chosen backend. The CUDA backend checks the device's
// compute capability and refuses GPUs it was not built for.
Result<std::unique_ptr<KvStore>> make_store(BackendKind kind, const ModelConfig& config,
                                            StoreOptions options = {});

}  // namespace kvring
