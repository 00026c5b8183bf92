#include "kvring/ring.h"

#include <algorithm>
#include <string>

namespace kvring {

namespace {

Error capacity_exceeded(std::int64_t layer, std::int64_t capacity, std::int64_t last) {
  return make_error(ErrorCode::kCapacityExceeded,
                    "layer " + std::to_string(layer) + ": full-attention plane holds " +
                        std::to_string(capacity) + " positions, asked for position " +
                        std::to_string(last));
}

// x % capacity for x >= 0, without a division where x < 2 capacity (a
// decode step's every placement).
std::int64_t wrap_row(std::int64_t x, std::int64_t capacity) {
  if (x < capacity) return x;
  return x - capacity < capacity ? x - capacity : x % capacity;
}

// Cuts `rows` consecutive rows starting at physical slot `phys` (source row
// `source`) where they cross the end of the ring: at most two spans.
int split_at_wrap(std::int64_t phys, std::int64_t source, std::int64_t rows,
                  std::int64_t capacity, std::array<PhysicalSpan, 2>& spans) {
  int n = 0;
  while (rows > 0) {
    const std::int64_t run = std::min(rows, capacity - phys);
    spans[static_cast<std::size_t>(n++)] = PhysicalSpan{phys, source, run};
    rows -= run;
    source += run;
    phys = 0;
  }
  return n;
}

Error no_rows(std::int64_t layer, std::int64_t capacity) {
  return invalid_argument("layer " + std::to_string(layer) + ": a ring of capacity " +
                          std::to_string(capacity) + " holds no rows");
}

// Positions stay below 2^62 (from_parts holds every recorded ring to an end
// of at most 2^62), so start + count and len + count cannot overflow: a
// batch of `count` rows from `start` that would pass it is refused.
Error past_last_position(std::int64_t layer, std::int64_t start, std::int64_t count) {
  return invalid_argument("layer " + std::to_string(layer) + ": a batch of " + std::to_string(count) +
                          " rows from position " + std::to_string(start) +
                          " would pass position 2^62, the last a ring holds");
}

}  // namespace

Result<RingState> RingState::from_parts(std::int64_t capacity, bool wraps, std::int64_t len,
                                        std::int64_t origin_logical,
                                        std::int64_t origin_physical) {
  if (capacity < 1) return invalid_argument("ring capacity " + std::to_string(capacity) + " < 1");
  if (len < 0 || len > capacity)
    return invalid_argument("ring len " + std::to_string(len) + " outside [0, " +
                            std::to_string(capacity) + "]");
  if (origin_logical < 0)
    return invalid_argument("ring origin_logical " + std::to_string(origin_logical) + " < 0");
  // Positions stay below 2^62 (plan_batch): next_position() never overflows.
  if (origin_logical > (std::int64_t{1} << 62) - len)
    return invalid_argument("ring origin_logical " + std::to_string(origin_logical) +
                            " puts its end past 2^62");
  if (origin_physical < 0 || origin_physical >= capacity)
    return invalid_argument("ring origin_physical " + std::to_string(origin_physical) +
                            " outside [0, " + std::to_string(capacity) + ")");
  // A ring only moves its origin once it is full; a full plane never does.
  if (origin_logical > 0 && (len != capacity || !wraps))
    return invalid_argument("ring origin_logical " + std::to_string(origin_logical) +
                            " > 0 on a ring that is not a full sliding ring");
  if (origin_logical == 0 && origin_physical != 0)
    return invalid_argument("ring origin_physical " + std::to_string(origin_physical) +
                            " with origin_logical 0");
  RingState r(capacity, wraps);
  r.len_ = len;
  r.origin_logical_ = origin_logical;
  r.origin_physical_ = origin_physical;
  return r;
}

Result<RingState> RingState::rolled_back(std::int64_t count) const {
  if (count < 0 || count > len_)
    return invalid_argument("cannot roll a ring of " + std::to_string(len_) + " rows back by " +
                            std::to_string(count));
  RingState r = *this;
  r.len_ -= count;
  return r;
}

Result<std::int64_t> RingState::append(std::int64_t layer, std::int64_t position) {
  if (capacity_ < 1) return no_rows(layer, capacity_);
  const std::int64_t expected = next_position();
  if (position != expected) return cache_discontinuity(layer, expected, position);
  if (position >= (std::int64_t{1} << 62)) return past_last_position(layer, position, 1);
  if (len_ < capacity_) {
    std::int64_t write = origin_physical_ + len_;
    if (write >= capacity_) write -= capacity_;
    ++len_;
    return write;
  }
  if (!wraps_) return capacity_exceeded(layer, capacity_, position);
  const std::int64_t write = origin_physical_;
  ++origin_logical_;
  origin_physical_ = origin_physical_ + 1 == capacity_ ? 0 : origin_physical_ + 1;
  return write;
}

Result<BatchPlacement> RingState::plan_batch(std::int64_t layer, std::int64_t start,
                                             std::int64_t count) const {
  if (capacity_ < 1) return no_rows(layer, capacity_);
  if (count < 1)
    return invalid_argument("layer " + std::to_string(layer) + ": batch of " +
                            std::to_string(count) + " rows");
  const std::int64_t expected = next_position();
  if (start != expected) return cache_discontinuity(layer, expected, start);
  if (count > (std::int64_t{1} << 62) - start) return past_last_position(layer, start, count);
  const std::int64_t total = len_ + count;
  if (!wraps_ && total > capacity_)
    return capacity_exceeded(layer, capacity_, start + count - 1);

  // State after the batch.
  const std::int64_t overflow = total > capacity_ ? total - capacity_ : 0;
  const std::int64_t new_origin_logical = origin_logical_ + overflow;
  const std::int64_t new_origin_physical = wrap_row(origin_physical_ + overflow, capacity_);

  BatchPlacement p;
  p.first_live = count > capacity_ ? count - capacity_ : 0;
  p.live_rows = count - p.first_live;
  // The first live source row's logical position, and its physical slot by
  // the explicit-origin translation against the post-batch origins.
  const std::int64_t first_logical = start + p.first_live;
  const std::int64_t phys = wrap_row(new_origin_physical + (first_logical - new_origin_logical), capacity_);
  p.n_spans = split_at_wrap(phys, p.first_live, p.live_rows, capacity_, p.spans);
  return p;
}

void RingState::commit_batch(std::int64_t count) {
  // No plan_batch accepts these: no rows, a full plane past its capacity,
  // or an end past 2^62.
  if (capacity_ < 1 || count < 1 || count > (std::int64_t{1} << 62) - next_position() ||
      (!wraps_ && count > capacity_ - len_))
    return;
  const std::int64_t total = len_ + count;
  if (total <= capacity_) {
    len_ = total;
    return;
  }
  const std::int64_t overflow = total - capacity_;
  origin_logical_ += overflow;
  origin_physical_ = wrap_row(origin_physical_ + overflow, capacity_);
  len_ = capacity_;
}

Result<BatchPlacement> RingState::append_batch(std::int64_t layer, std::int64_t start,
                                               std::int64_t count) {
  auto p = plan_batch(layer, start, count);
  if (p) commit_batch(count);
  return p;
}

LiveSpans RingState::spans(std::int64_t first, std::int64_t count) const {
  LiveSpans s;
  // Rows not all live (a ring of no rows has none): no spans.
  if (count <= 0 || !holds_rows(first, count)) return s;
  s.n_spans = split_at_wrap(physical(first), first - origin_logical_, count, capacity_, s.spans);
  return s;
}

Result<RingState> RingState::sequential(std::int64_t capacity, bool wraps, std::int64_t next) {
  if (capacity < 1) return invalid_argument("ring capacity " + std::to_string(capacity) + " < 1");
  if (next < 0) return invalid_argument("ring position " + std::to_string(next) + " < 0");
  // Positions stay below 2^62, as from_parts requires of every ring.
  if (next > (std::int64_t{1} << 62))
    return invalid_argument("ring position " + std::to_string(next) + " past 2^62");
  if (!wraps && next > capacity)
    return make_error(ErrorCode::kCapacityExceeded,
                      "full-attention plane holds " + std::to_string(capacity) +
                          " positions, asked for " + std::to_string(next));
  RingState r(capacity, wraps);
  if (next <= capacity) {
    r.len_ = next;
    return r;
  }
  r.len_ = capacity;
  r.origin_logical_ = next - capacity;
  // Rotation of a sequentially built ring: the slot position origin_logical
  // received when it was appended. This is the restore rotation of DESIGN.md.
  r.origin_physical_ = r.origin_logical_ % capacity;
  return r;
}

}  // namespace kvring
