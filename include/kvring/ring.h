// Ring state: the bookkeeping of one plane, with no memory in it.
//
// A plane holds at most `capacity` rows; `len` are live. The live rows are
// the logical positions [origin_logical, origin_logical + len), and the row
// for origin_logical sits at physical slot origin_physical. Every physical
// slot is derived from the explicit origins:
//   physical(p) = (origin_physical + (p - origin_logical)) % capacity
// and never from the absolute position alone.
//
// A sliding ring (wraps = true) overwrites its oldest row once full. A full
// plane (wraps = false) never wraps: a position past its capacity is a
// kCapacityExceeded error. Every method that fails leaves the state as it was.
#pragma once

#include <array>
#include <cstdint>

#include "kvring/status.h"

namespace kvring {

// A run of consecutive physical rows that receives consecutive source rows.
struct PhysicalSpan {
  std::int64_t physical_first = 0;  // first physical slot
  std::int64_t source_first = 0;    // first source row (index into the batch)
  std::int64_t rows = 0;
};

// Where a batch of `count` rows starting at logical `start` lands.
// Source rows [0, first_live) are overwritten within the same batch (the
// batch was longer than the ring), so they are never written; rows
// [first_live, count) land in at most two spans, in source order.
struct BatchPlacement {
  std::int64_t first_live = 0;
  std::int64_t live_rows = 0;
  int n_spans = 0;
  std::array<PhysicalSpan, 2> spans{};
};

// The live rows of a ring in logical order, as at most two physical spans:
// logical origin_logical + k lives at spans[0] for k < spans[0].rows, then
// continues at spans[1]. source_first counts logical rows from the origin.
struct LiveSpans {
  int n_spans = 0;
  std::array<PhysicalSpan, 2> spans{};
};

class RingState {
 public:
  RingState() = default;
  // capacity >= 1. A sliding ring wraps; a full plane does not.
  static RingState sliding(std::int64_t capacity) { return RingState(capacity, true); }
  static RingState full(std::int64_t capacity) { return RingState(capacity, false); }
  // A state as recorded elsewhere (a snapshot); checks its parts: len in
  // [0, capacity], origin_physical in [0, capacity), an origin moved only
  // on a full sliding ring (not a rolled-back one) and physical 0 where it
  // has not moved, and an end (origin_logical + len) within 2^62
  // positions. The rotation of a moved origin is not checked: a restore
  // or an install places the rows at the rotation it needs and checks
  // that itself.
  static Result<RingState> from_parts(std::int64_t capacity, bool wraps, std::int64_t len,
                                      std::int64_t origin_logical,
                                      std::int64_t origin_physical);

  std::int64_t capacity() const { return capacity_; }
  std::int64_t len() const { return len_; }
  std::int64_t origin_logical() const { return origin_logical_; }
  std::int64_t origin_physical() const { return origin_physical_; }
  bool wraps() const { return wraps_; }
  // The only position the next append accepts.
  std::int64_t next_position() const { return origin_logical_ + len_; }
  bool holds(std::int64_t position) const {
    return position >= origin_logical_ && position < origin_logical_ + len_;
  }
  // Whether the `count` positions from `first` are all live: count in
  // [0, len()] and first .. first + count - 1 held (no sum that overflows).
  bool holds_rows(std::int64_t first, std::int64_t count) const {
    return count >= 0 && count <= len_ && first >= origin_logical_ && first - origin_logical_ <= len_ - count;
  }

  // Physical slot of a live logical position (precondition: holds(position)).
  std::int64_t physical(std::int64_t position) const {
    std::int64_t p = origin_physical_ + (position - origin_logical_);
    return p >= capacity_ ? p - capacity_ : p;
  }

  // Reserves the physical row for `position` and advances the origins.
  // Errors: kCacheDiscontinuity when position != next_position();
  // kCapacityExceeded when a full plane is full; kInvalidArgument at
  // position 2^62 or past it (no ring's end passes 2^62).
  Result<std::int64_t> append(std::int64_t layer, std::int64_t position);

  // Placement of `count` >= 1 rows starting at `start`, without changing the
  // state; commit_batch applies it. Same errors as append, and
  // kInvalidArgument for a count below 1; a ring of no rows (capacity < 1:
  // a default state) refuses every append (kInvalidArgument).
  Result<BatchPlacement> plan_batch(std::int64_t layer, std::int64_t start,
                                    std::int64_t count) const;
  // Applies `count` rows; a count no plan_batch accepts (below 1, past a
  // full plane's capacity or past position 2^62) changes nothing.
  void commit_batch(std::int64_t count);
  // plan_batch then commit_batch.
  Result<BatchPlacement> append_batch(std::int64_t layer, std::int64_t start,
                                      std::int64_t count);

  // The state with its last `count` rows dropped: the origins stay, so a
  // sliding ring may then hold fewer rows than its capacity with
  // origin_logical > 0. kInvalidArgument unless 0 <= count <= len, so no
  // state a program builds holds rows outside [0, capacity].
  Result<RingState> rolled_back(std::int64_t count) const;

  // The live rows [first, first + count) as physical spans; a range that
  // is not all live gives none (n_spans 0).
  LiveSpans spans(std::int64_t first, std::int64_t count) const;
  LiveSpans live_spans() const { return spans(origin_logical_, len_); }

  // The state a sequentially built ring holds after `next` positions
  // 0..next-1 were appended (restore installs at this rotation).
  static Result<RingState> sequential(std::int64_t capacity, bool wraps, std::int64_t next);

  friend bool operator==(const RingState&, const RingState&) = default;

 private:
  RingState(std::int64_t capacity, bool wraps) : capacity_(capacity), wraps_(wraps) {}

  std::int64_t capacity_ = 0;
  std::int64_t len_ = 0;
  std::int64_t origin_logical_ = 0;
  std::int64_t origin_physical_ = 0;
  bool wraps_ = true;
};

}  // namespace kvring
