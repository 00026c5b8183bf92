// Snapshot and restore of a KV cache.
//
// A snapshot holds each plane's live rows in logical order (f16 bits) and its
// ring state. Restore installs them at the rotation a sequentially built ring
// holds (RingState::sequential), which is the rotation every live ring has,
// so a restored cache is byte-identical to the live one: the rotation
// travels with the cache (docs/DESIGN.md, "Snapshots and kvpack").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kvring/cache.h"
#include "kvring/config.h"
#include "kvring/layout.h"
#include "kvring/ring.h"
#include "kvring/status.h"

namespace kvring {

// The layout every plane of a layer kind has (sliding: token-major, full:
// head-major).
Layout layout_for(LayerKind kind);

// Allocates buffers of 2 MiB and more on 2 MiB boundaries and asks the kernel
// for transparent huge pages there (madvise): a snapshot's first touch of its
// row buffers then faults 512 times fewer pages. Smaller buffers come from
// the ordinary heap.
void* allocate_rows(std::size_t bytes);
void free_rows(void* p, std::size_t bytes) noexcept;

template <class T>
struct RowAllocator {
  using value_type = T;
  RowAllocator() = default;
  template <class U>
  RowAllocator(const RowAllocator<U>&) noexcept {}  // NOLINT
  T* allocate(std::size_t n) { return static_cast<T*>(allocate_rows(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { free_rows(p, n * sizeof(T)); }
  friend bool operator==(const RowAllocator&, const RowAllocator&) { return true; }
};

// f16 bits of rows, [rows, kv_dim].
using RowBuffer = std::vector<std::uint16_t, RowAllocator<std::uint16_t>>;

struct PlaneSnapshot {
  LayerKind kind = LayerKind::kSlidingRope;
  Layout layout = Layout::kTokenMajor;
  RingState ring;  // as a sequentially built plane of the source's context
                   // holds it, without rollback slack (take_snapshot)
  // Live rows origin_logical .. origin_logical + len - 1, f16 bits
  // [ring.len(), kv_dim] each; empty in a header-only snapshot.
  RowBuffer k, v;
};

struct Snapshot {
  ModelConfig config;               // the geometry (its name is not significant)
  std::int64_t context = 0;         // positions the source cache was sized for
  std::int64_t token_count = 0;     // the next position of every plane
  std::vector<std::int32_t> token_ids;  // empty, or the token_count ids
  std::string metadata;             // application blob, opaque to kvring
  std::vector<PlaneSnapshot> planes;    // one per layer, in layer order

  // f16 bytes of K and V over all planes, as the ring states say; defined
  // for a snapshot that validate_snapshot accepts (header_only or not),
  // whose counts cannot overflow.
  std::int64_t row_bytes() const;
};

// Copies one sequence's rows out of a store (token_ids and metadata are left
// for the caller to fill). Each plane is recorded as the ring a
// sequentially built plane of the store's context holds, without the
// rollback slack, whatever forks and rollbacks the sequence went through.
Result<Snapshot> take_snapshot(const KvStore& store, SeqId seq);
Status take_snapshot(const KvStore& store, SeqId seq, Snapshot& out);
// The same without the rows (a header-only snapshot, as validate_snapshot's
// header_only checks): the rings and sizes a snapshot or pack of the
// sequence records (row_bytes()), its row buffers emptied, their memory
// kept. On an error `out` holds no valid snapshot.
Status take_snapshot_header(const KvStore& store, SeqId seq, Snapshot& out);
// Leaves `s` no valid snapshot (validate_snapshot and restore refuse it:
// token_count -1), its row buffers kept for reuse. What the calls that
// fill a caller's snapshot do on an error.
void invalidate_snapshot(Snapshot& s);
// The same for a one-sequence cache.
Result<Snapshot> take_snapshot(const KvCache& cache);
// The same into `out`, reusing its row buffers: a caller that snapshots
// again and again keeps its memory warm instead of faulting in fresh pages.
// On an error `out` holds no valid snapshot (invalidate_snapshot).
Status take_snapshot(const KvCache& cache, Snapshot& out);

// Checks that a snapshot is self-consistent: geometry, one plane per layer of
// the right kind, layout and capacity, rings ending at token_count, token ids,
// and (unless header_only) row buffers of len * kv_dim values.
Status validate_snapshot(const Snapshot& snapshot, bool header_only = false);

// Checks, without touching `target`, that `header` can be restored into it:
// the same geometry (a kMismatch naming the first differing field), and for
// every plane a target ring that the snapshot's rows fill. The target may
// have a larger context: full planes keep every row; a sliding plane needs
// the snapshot to hold every row its ring would hold.
Status check_restorable(const Snapshot& header, const KvStore& target);
Status check_restorable(const Snapshot& header, const KvCache& target);
// The same for restore(header, target, seq), and that the pool can give
// its full planes their blocks in some order of installs
// (kResourceExhausted): every refusal restore() makes before it touches
// the sequence, decided by the header alone.
Status check_restorable(const Snapshot& header, const KvStore& target, SeqId seq);
// The ring plane `layer` of `target` gets when `header` is restored into it
// (what restore() installs: the last of the snapshot's rows the target's
// plane holds, at a sequentially built ring's rotation), or why it cannot.
Result<RingState> restore_ring(const Snapshot& header, std::int64_t layer, const KvStore& target);

// Replaces every plane of `target` with the snapshot's rows. Everything is
// checked first; on an error in the input the target is left exactly as it
// was. Should the backend itself fail part-way (a device error), the target
// is reset to empty and the error says so: it never holds a mix.
Status restore(const Snapshot& snapshot, KvCache& target);
// The same into one sequence of a store; other sequences are not touched.
// Full planes whose blocks the pool cannot give in any order of installs
// are refused first (kResourceExhausted, nothing changed). The new rows
// take the free blocks, reuse the blocks the sequence holds alone and
// replace those it shares with a fork (KvStore::blocks_to_install); when
// the free blocks do not cover them all at once, planes that give blocks
// back go in first.
Status restore(const Snapshot& snapshot, KvStore& target, SeqId seq);
// Restores into a new sequence of `target`; on an error the store holds no
// new sequence. Every refusal comes before the sequence is added (a pool
// too small for the full planes included); a device failure part-way
// removes it again.
Result<SeqId> restore_new_sequence(const Snapshot& snapshot, KvStore& target);
// The pool blocks restore_new_sequence of this snapshot (its header is
// enough) takes from `target`, or check_restorable's refusal: an engine's
// price for resuming a paused sequence.
Result<std::int64_t> blocks_to_restore(const Snapshot& header, const KvStore& target);
// Every refusal restore_new_sequence makes before it adds the sequence,
// decided by the header alone, in this order: check_restorable's, then no
// free slot (add_sequence's refusal), then too few free pool blocks (both
// kResourceExhausted). An engine's admission check for a paused sequence;
// restore_pack into a store makes it before reading any payload.
Status check_restorable_as_new(const Snapshot& header, const KvStore& target);

// The detached install path: a new cache on `backend` (context: the
// snapshot's, or `context` when non-zero; attention under `attention`)
// allocated without the zero-fill, since the install overwrites every row a
// reader can see and clears the planes it does not fill.
Result<std::unique_ptr<KvCache>> restore_detached(const Snapshot& snapshot,
                                                  BackendKind backend = BackendKind::kCpu,
                                                  std::int64_t context = 0,
                                                  AttentionNumeric attention = AttentionNumeric::kF32);

}  // namespace kvring
