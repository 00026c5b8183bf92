// The handoff payload and its send schedule (a pure function of the geometry,
// the prompt length and the options).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>

#include "kvring/handoff.h"

namespace kvring::handoff {

namespace {
// Messages one plan may hold (muse-glimmer's whole context in messages of
// one row is 1.8M).
constexpr std::int64_t kMaxPlannedMessages = std::int64_t{1} << 22;
// The longest a planned handoff may take, prefill included: some 30,000
// years, far past any real plan (slow ones are still made). Rates that take
// longer are a mistake, and a sender paced by them would wait on its own
// token bucket past any deadline.
constexpr double kMaxPlanSeconds = 1e12;
}  // namespace

const char* schedule_name(Schedule schedule) {
  return schedule == Schedule::kSwaFirst ? "swa-first" : "paced";
}

Result<Schedule> parse_schedule(const std::string& name) {
  if (name == "swa-first") return Schedule::kSwaFirst;
  if (name == "paced") return Schedule::kPaced;
  return invalid_argument("unknown schedule '" + name + "' (swa-first or paced)");
}

Result<Payload> payload_for(const ModelConfig& config, std::int64_t prompt_tokens,
                            std::int64_t context) {
  KVRING_RETURN_IF_ERROR(config.validate());
  auto ctx = resolve_context(config, context);
  if (!ctx) return ctx.error();
  if (prompt_tokens < 1)
    return invalid_argument("a handoff needs a prompt of at least 1 token, got " + std::to_string(prompt_tokens));
  if (const std::int64_t limit = config.sequence_position_limit(*ctx); prompt_tokens > limit)
    return invalid_argument("a prompt of " + std::to_string(prompt_tokens) + " tokens exceeds the context " +
                            std::to_string(*ctx) +
                            (limit > *ctx ? " (" + std::to_string(limit) + " positions on its full planes)" : "") +
                            " of model '" + config.name + "'");
  if (prompt_tokens > kMaxHandoffPrompt)
    return invalid_argument("a prompt of " + std::to_string(prompt_tokens) + " tokens exceeds the " +
                            std::to_string(kMaxHandoffPrompt) + " a handoff carries");
  Payload p;
  p.prompt_tokens = prompt_tokens;
  p.rows_tokens = prompt_tokens - 1;
  p.context = *ctx;
  p.row_bytes = config.kv_dim() * 4;
  for (std::int64_t l = 0; l < config.n_layers; ++l) {
    LayerPayload lp;
    lp.layer = l;
    lp.kind = config.kind(l);
    auto ring = RingState::sequential(config.plane_capacity(l, *ctx), lp.kind == LayerKind::kSlidingRope,
                                      p.rows_tokens);
    if (!ring) return ring.error();
    lp.ring = *ring;
    lp.rows = ring->len();
    lp.bytes = lp.rows * p.row_bytes;
    (lp.kind == LayerKind::kFullNope ? p.full_bytes : p.sliding_bytes) += lp.bytes;
    p.layers.push_back(lp);
  }
  p.payload_bytes = p.full_bytes + p.sliding_bytes;
  return p;
}

namespace {

// The time prefill step `step` (chunk * n_layers + layer) ends, with every
// step of a chunk taking an equal share of the chunk's tokens.
double step_end_s(const Timeline& t, std::int64_t step) {
  const std::int64_t L = t.payload.layers.size();
  const std::int64_t chunk = step / L, layer = step % L;
  const double tps = t.options.prefill_tokens_per_s;
  const std::int64_t C = t.options.chunk_tokens;
  const std::int64_t before = chunk * C;
  const std::int64_t in_chunk = std::max<std::int64_t>(0, std::min(C, t.payload.rows_tokens - before));
  return (static_cast<double>(before) + static_cast<double>(in_chunk) * (layer + 1) / L) / tps;
}

}  // namespace

Result<Timeline> plan_handoff(const ModelConfig& config, std::int64_t prompt_tokens,
                              const PlanOptions& options) {
  auto payload = payload_for(config, prompt_tokens, options.context);
  if (!payload) return payload.error();
  if (options.chunk_tokens < 1) return invalid_argument("chunk tokens must be at least 1");
  if (options.message_bytes < payload->row_bytes)
    return invalid_argument("message bytes " + std::to_string(options.message_bytes) +
                            " are below one row (" + std::to_string(payload->row_bytes) + " B)");
  if (!(options.rate_bytes_per_s > 0) || !std::isfinite(options.rate_bytes_per_s))
    return invalid_argument("the rate must be a positive number of bytes per second");
  if (!(options.prefill_tokens_per_s > 0) || !std::isfinite(options.prefill_tokens_per_s))
    return invalid_argument("the prefill speed must be a positive number of tokens per second");
  if (!(options.ack_latency_s >= 0) || !std::isfinite(options.ack_latency_s))
    return invalid_argument("the ack latency must be a finite number >= 0");
  if (options.credit_bytes < options.message_bytes)
    return invalid_argument("receiver credits (" + std::to_string(options.credit_bytes) +
                            " B) must cover one message (" + std::to_string(options.message_bytes) + " B)");
  Timeline t;
  t.payload = std::move(*payload);
  t.options = options;
  const Payload& p = t.payload;
  const std::int64_t L = static_cast<std::int64_t>(p.layers.size());
  const std::int64_t C = options.chunk_tokens;
  t.n_chunks = p.rows_tokens < 1 ? 1 : 1 + (p.rows_tokens - 1) / C;
  t.n_steps = t.n_chunks * L;
  t.step_s = step_end_s(t, 0);
  t.prefill_end_s = static_cast<double>(p.rows_tokens) / options.prefill_tokens_per_s;

  // Whole chunks per message where a message holds at least one chunk.
  const std::int64_t cap_rows = options.message_bytes / p.row_bytes;
  const std::int64_t full_rows_per_msg = cap_rows >= C ? cap_rows / C * C : cap_rows;
  auto rows_per_message = [&](const LayerPayload& lp) {
    return lp.kind == LayerKind::kFullNope ? full_rows_per_msg : cap_rows;
  };
  // The messages are counted before any is made: a plan of too many is
  // refused, not built (its memory and its checks grow with the count).
  std::int64_t n_messages = 0;
  for (const LayerPayload& lp : p.layers)
    n_messages += lp.rows == 0 ? 0 : 1 + (lp.rows - 1) / rows_per_message(lp);
  if (n_messages > kMaxPlannedMessages)
    return invalid_argument("the plan would send " + std::to_string(n_messages) + " messages (at most " +
                            std::to_string(kMaxPlannedMessages) + "); use larger messages");
  t.messages.reserve(static_cast<std::size_t>(n_messages));
  for (const LayerPayload& lp : p.layers) {
    const std::int64_t first = lp.ring.origin_logical(), end = first + lp.rows;
    const std::int64_t per = rows_per_message(lp);
    for (std::int64_t at = first; at < end;) {
      const std::int64_t stop = std::min(end, at + per);
      PlannedMessage m;
      m.layer = lp.layer;
      m.kind = lp.kind;
      m.first_row = at;
      m.rows = stop - at;
      m.bytes = m.rows * p.row_bytes;
      // Full rows are final once their chunk passed the layer; a sliding
      // ring once the last chunk did.
      const std::int64_t chunk = lp.kind == LayerKind::kFullNope ? (stop - 1) / C : t.n_chunks - 1;
      m.final_step = chunk * L + lp.layer;
      m.release_step = (options.schedule == Schedule::kSwaFirst && lp.kind == LayerKind::kFullNope)
                           ? t.n_steps - 1
                           : m.final_step;
      m.final_s = step_end_s(t, m.final_step);
      m.release_s = step_end_s(t, m.release_step);
      t.messages.push_back(m);
      at = stop;
    }
  }
  std::stable_sort(t.messages.begin(), t.messages.end(), [](const PlannedMessage& a, const PlannedMessage& b) {
    if (a.release_step != b.release_step) return a.release_step < b.release_step;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.first_row < b.first_row;
  });

  // The link: one message at a time at the rate; a message waits for its
  // release, the link and enough credit (acknowledgements return credit).
  double link_free = 0;
  std::deque<std::pair<double, std::int64_t>> unacked;  // (ack time, bytes), in ack order
  std::int64_t in_flight = 0;
  for (std::size_t i = 0; i < t.messages.size(); ++i) {
    PlannedMessage& m = t.messages[i];
    m.index = static_cast<std::int64_t>(i);
    double start = std::max(m.release_s, link_free);
    while (!unacked.empty() && unacked.front().first <= start) {
      in_flight -= unacked.front().second;
      unacked.pop_front();
    }
    while (in_flight + m.bytes > options.credit_bytes) {
      start = std::max(start, unacked.front().first);
      in_flight -= unacked.front().second;
      unacked.pop_front();
    }
    m.start_s = start;
    m.end_s = start + static_cast<double>(m.bytes) / options.rate_bytes_per_s;
    m.ack_s = m.end_s + options.ack_latency_s;
    link_free = m.end_s;
    in_flight += m.bytes;
    unacked.emplace_back(m.ack_s, m.bytes);
  }
  t.done_s = t.messages.empty() ? t.prefill_end_s : std::max(t.prefill_end_s, t.messages.back().ack_s);
  if (!std::isfinite(t.done_s))
    return invalid_argument("the rates give a schedule whose times overflow (prefill ends at " +
                            std::to_string(t.prefill_end_s) + " s); use larger rates");
  if (t.done_s > kMaxPlanSeconds) {
    char why[200];
    std::snprintf(why, sizeof why, "the rates give a handoff that ends %.3g s after prefill starts, past the %.0e s "
                  "a plan may take; use larger rates", t.done_s, kMaxPlanSeconds);
    return invalid_argument(why);
  }
  KVRING_RETURN_IF_ERROR(check_timeline(t, options.ack_latency_s));
  return t;
}

Status check_timeline(Timeline& t, double max_idle_s) {
  const Payload& p = t.payload;
  // Times are compared to within rounding: 1 ns, or 1e-12 of the time where
  // times run past 1000 s (a slow rate or prefill), which a double's 53
  // bits hold with room to spare.
  auto eps_at = [](double t) { return std::max(1e-9, 1e-12 * std::abs(t)); };
  auto bad = [](const std::string& what) { return make_error(ErrorCode::kInternal, "handoff timeline: " + what); };
  // Every byte exactly once: per layer, the messages tile the live rows.
  std::map<std::int64_t, std::vector<const PlannedMessage*>> by_layer;
  std::int64_t total = 0;
  // The rate and the bound are compared with, and a NaN compares false:
  // a timeline at a rate that is not a positive number, or checked
  // against a bound that is not one at least 0, would pass unmeasured.
  if (!(t.options.rate_bytes_per_s > 0) || !std::isfinite(t.options.rate_bytes_per_s))
    return bad("the rate " + std::to_string(t.options.rate_bytes_per_s) + " B/s is not a finite number above 0");
  if (!(max_idle_s >= 0)) return bad("the idle bound " + std::to_string(max_idle_s) + " s is not a number of at least 0");
  if (static_cast<std::int64_t>(t.messages.size()) > kMaxPlannedMessages)
    return bad(std::to_string(t.messages.size()) + " messages (at most " + std::to_string(kMaxPlannedMessages) + ")");
  for (const PlannedMessage& m : t.messages) {
    if (m.layer < 0 || m.layer >= static_cast<std::int64_t>(p.layers.size()))
      return bad("message " + std::to_string(m.index) + " names layer " + std::to_string(m.layer));
    if (!std::isfinite(m.final_s) || !std::isfinite(m.release_s) || !std::isfinite(m.start_s) ||
        !std::isfinite(m.end_s) || !std::isfinite(m.ack_s))
      return bad("message " + std::to_string(m.index) + " has a time that is not a finite number");
    if (m.rows < 1 || p.row_bytes < 1 || m.rows > std::numeric_limits<std::int64_t>::max() / p.row_bytes ||
        m.bytes != m.rows * p.row_bytes)
      return bad("message " + std::to_string(m.index) + " has " + std::to_string(m.rows) + " rows in " +
                 std::to_string(m.bytes) + " B");
    by_layer[m.layer].push_back(&m);
    // Each message's bytes fit 64 bits; their sum need not (a timeline is
    // the caller's), and a wrapped sum could equal the payload's.
    if (__builtin_add_overflow(total, m.bytes, &total))
      return bad("the messages carry more than 2^63 B in all");
  }
  for (const LayerPayload& lp : p.layers) {
    auto& ms = by_layer[lp.layer];
    std::sort(ms.begin(), ms.end(), [](auto* a, auto* b) { return a->first_row < b->first_row; });
    std::int64_t next = lp.ring.origin_logical();
    for (const PlannedMessage* m : ms) {
      if (m->first_row != next)
        return bad("layer " + std::to_string(lp.layer) + ": row " + std::to_string(next) + " is " +
                   (m->first_row > next ? "never sent" : "sent twice"));
      // A ring ends within 2^62; rows past 2^63 would wrap.
      if (__builtin_add_overflow(next, m->rows, &next))
        return bad("layer " + std::to_string(lp.layer) + ": message " + std::to_string(m->index) +
                   " runs past position 2^63");
    }
    // (Counted from the origin: the payload's row count is the caller's too.)
    if (next - lp.ring.origin_logical() != lp.rows)
      return bad("layer " + std::to_string(lp.layer) + ": " + std::to_string(next - lp.ring.origin_logical()) +
                 " rows from " + std::to_string(lp.ring.origin_logical()) + " sent, " + std::to_string(lp.rows) +
                 " live");
  }
  if (total != p.payload_bytes)
    return bad(std::to_string(total) + " B sent, payload " + std::to_string(p.payload_bytes) + " B");
  // Releases, the link and the rate, in send order.
  std::vector<const PlannedMessage*> order;
  for (const PlannedMessage& m : t.messages) order.push_back(&m);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->start_s < b->start_s; });
  double busy = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const PlannedMessage& m = *order[i];
    const double eps = eps_at(m.ack_s);
    if (m.release_step < m.final_step || m.release_s + eps < m.final_s || m.start_s + eps < m.release_s)
      return bad("message " + std::to_string(m.index) + " leaves before its rows are final or released");
    if (m.end_s - m.start_s + eps < static_cast<double>(m.bytes) / t.options.rate_bytes_per_s)
      return bad("message " + std::to_string(m.index) + " is faster than the rate");
    if (i > 0 && m.start_s + eps < order[i - 1]->end_s)
      return bad("messages " + std::to_string(order[i - 1]->index) + " and " + std::to_string(m.index) + " overlap");
    if (m.ack_s + eps < m.end_s) return bad("message " + std::to_string(m.index) + " acknowledged before its end");
    busy += m.end_s - m.start_s;
  }
  // Bytes in flight: +bytes at start, -bytes at ack (credit returned by a
  // start at the same instant counts as returned).
  std::vector<std::pair<double, std::int64_t>> events;
  for (const PlannedMessage& m : t.messages) {
    events.emplace_back(m.start_s, m.bytes);
    events.emplace_back(m.ack_s, -m.bytes);
  }
  std::sort(events.begin(), events.end());
  std::int64_t in_flight = 0, peak = 0;
  for (auto& [time, delta] : events) {
    in_flight += delta;
    peak = std::max(peak, in_flight);
  }
  if (peak > t.options.credit_bytes)
    return bad(std::to_string(peak) + " B in flight, credits " + std::to_string(t.options.credit_bytes) + " B");
  // Idle while ready: a gap on the link while a released message waited.
  // For message i: the earliest release among messages i.. up to the first
  // released at or after i's start. That end only moves forward (starts
  // are sorted), so one pass with a window minimum (a deque of indices of
  // increasing release) finds every one.
  double idle = 0;
  double free_at = 0;
  std::deque<std::size_t> window;  // indices [i, hi), releases increasing
  std::size_t hi = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    while (!window.empty() && window.front() < i) window.pop_front();
    auto push = [&](std::size_t j) {
      while (!window.empty() && order[window.back()]->release_s >= order[j]->release_s) window.pop_back();
      window.push_back(j);
    };
    if (hi <= i) {
      hi = i + 1;
      push(i);
    }
    if (order[i]->release_s < order[i]->start_s)
      while (hi < order.size() && order[hi]->release_s < order[i]->start_s) push(hi++);
    const double earliest = order[window.front()]->release_s;
    idle = std::max(idle, order[i]->start_s - std::max(free_at, earliest));
    free_at = order[i]->end_s;
  }
  if (idle > max_idle_s + eps_at(order.empty() ? 0.0 : order.back()->end_s))
    return bad("the link idles " + std::to_string(idle) + " s while data is ready (bound " +
               std::to_string(max_idle_s) + " s)");
  t.max_in_flight = peak;
  t.max_idle_while_ready_s = idle;
  t.busy_s = busy;
  return Status::Ok();
}

}  // namespace kvring::handoff
