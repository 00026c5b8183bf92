// A seeded, randomized state-machine test of the many-sequence store against
// a reference model, for any backend: run_seeds(kind, ...) at the end.
// tests/store_model_test.cc runs it on the CPU; the CUDA store keeps the
// same contracts (the same stored f16 bits, batch and solo outputs equal bit
// for bit, refusals that change nothing), so a CUDA test runs it unchanged.
//
// Random operations (sequences added, removed, reset, forked, truncated;
// stores into one layer or all layers, prefill, decode; installs into live
// and detached sequences; snapshots taken and restored, some of them
// corrupted) run against a small geometry whose pool and slots run out
// often: a fixed hybrid one, or one drawn per seed. The model holds, per
// sequence and layer, the live range [origin, next), the f16 bits of every
// live row, the storage of sliding rings and the pool blocks of full planes
// (shared after a fork until written). It predicts whether each call must
// succeed, and the test checks:
//   - a call succeeds exactly when the model says it may (the documented
//     rules: positions, capacities, the pool, the slots, detached sequences),
//     a refusal has the documented code where the model knows it, and none
//     is an internal error;
//   - after a success, every sequence's ring(), next_position(),
//     blocks_held(), read_rows() (all live rows and a stretch of them),
//     read_plane() (live rows where the layout puts them; zeros, or rows
//     written before, elsewhere) and the store's free_blocks() and
//     sequences() agree with the model (free blocks: the pool less the
//     distinct blocks the sequences hold);
//   - after a failure, the whole store (every ring state, every plane image,
//     the blocks held and free, the sequence list) is byte-identical to
//     before the call;
//   - decode and prefill outputs are bitwise equal to a decode, one query at
//     a time, in a fresh store of the same backend, another slack and block
//     size that holds the same visible rows (bits never depend on batch,
//     rotation, slot or blocks; a prefilled token equals a decoded one), and
//     within rounding of attention computed from its definition;
//   - snapshots hold the model's rows and restore into stores of other
//     slack, blocks and context; restore_ring, blocks_to_store and
//     blocks_to_install agree with the model; the planes' capacities, limits
//     and sizes and the resolved options agree with the geometry.
// Every view and row buffer is in host memory, which both backends take.
//
// Environment: KVRING_MODEL_SEEDS and KVRING_MODEL_OPS override the seed
// count and the operations per seed (longer runs under sanitizers),
// KVRING_MODEL_FIRST_SEED the first seed; KVRING_MODEL_PROGRESS=1 prints a
// line per seed, KVRING_MODEL_VERBOSE=1 every call.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kvring/config.h"
#include "kvring/f16.h"
#include "kvring/layout.h"
#include "kvring/snapshot.h"
#include "kvring/store.h"
#include "test_util.h"

namespace kvring::store_model {

using Row = std::vector<std::uint16_t>;  // kv_dim f16 bits; empty: not known
using testing::env_or;

inline float bf16_value(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct PlaneModel {
  std::int64_t origin = 0, next = 0;  // live positions [origin, next)
  std::vector<Row> k, v;              // by position; rows before origin unused
  std::vector<std::int64_t> blocks;   // full planes: the model's block ids
  // Sliding rings: the storage, by physical row (position x lives in row
  // x % capacity); empty where not known.
  std::vector<Row> pk, pv;
};

struct SeqModel {
  SeqId id{};
  bool detached = false;
  std::int64_t plan = -1;  // detached: the position its installs mostly end at
  std::vector<PlaneModel> planes;
};

struct SnapModel {
  Snapshot snap;
};

// Rows of a caller view in any dtype, and the f16 bits the store keeps.
struct Input {
  std::vector<std::uint32_t> buf;  // 4-byte aligned storage
  ConstView view;
  std::vector<Row> rows;        // as stored (f16 bits)
  std::vector<float> values;    // as f32 (queries), [rows, cols]
};

struct RingImage {
  bool ok = false;
  RingState ring;
  bool operator==(const RingImage&) const = default;
};

struct SeqImage {
  std::uint64_t id = 0;
  bool contains = false, detached = false;
  bool next_ok = false;
  std::int64_t next = 0;
  std::int64_t blocks = -1;
  std::vector<RingImage> rings;
  std::vector<std::vector<std::uint16_t>> planes;  // k then v per layer (live ones)
  bool operator==(const SeqImage&) const = default;
};

struct StoreImage {
  std::vector<SeqImage> seqs;
  std::vector<std::uint64_t> list;
  std::int64_t free = 0, count = 0;
  bool operator==(const StoreImage&) const = default;
};

// Per operation kind: calls that succeeded and calls refused (a summary of
// what a run exercised).
using Stats = std::map<std::string, std::pair<std::int64_t, std::int64_t>>;

// The geometry of a run: the fixed small hybrid, or one drawn per seed.
enum class Geometry { kFixed, kRandom };

class Harness {
 public:
  Harness(BackendKind backend, Geometry geometry, std::uint64_t seed, Stats& stats,
          std::function<void()> before_step = {})
      : backend_(backend),
        geometry_(geometry),
        seed_(seed),
        rng_(seed),
        stats_(stats),
        before_step_(std::move(before_step)) {}

  // Runs `ops` operations, each after `before_step` where given; false
  // after the first mismatch (reported).
  bool run(std::int64_t ops) {
    if (!setup()) return false;
    for (op_ = 0; op_ < ops && ok_; ++op_) {
      if (before_step_) before_step_();
      step();
      if (ok_) check_model();
    }
    return ok_;
  }
  std::int64_t ops_done() const { return op_; }

 private:
  // ---- Setup ----------------------------------------------------------------
  bool setup() {
    StoreOptions o;
    if (geometry_ == Geometry::kFixed) {
      const std::int64_t window = pick({32, 32, 48});
      cfg_ = testing::small_config(window, 256, 8);
      o.context = pick({256, 256, 160, 40});
      o.max_sequences = pick({2, 3, 3, 4});
      o.slack = pick({0, 0, 4, 16, window});
      o.block_rows = pick({16, 16, 32});
      o.pool_blocks = uniform(2, 24);
      o.zero_fill = rng_() % 5 != 0;
      o.attention = rng_() % 4 == 0 ? AttentionNumeric::kF16 : AttentionNumeric::kF32;
    } else if (!draw_geometry(o)) {
      return false;
    }
    auto s = make_store(backend_, cfg_, o);
    // A backend may not take the f16 numeric for every geometry (the GPU's
    // needs head_dim 128): such a run uses f32.
    if (!s && s.error().code == ErrorCode::kUnsupported && o.attention == AttentionNumeric::kF16) {
      o.attention = AttentionNumeric::kF32;
      s = make_store(backend_, cfg_, o);
    }
    if (!s) return fail("make_store: " + s.error().to_string());
    store_ = std::move(*s);
    opt_ = store_->options();
    // Defaults: the model's context; blocks of 256 rows, or the smallest
    // power of two from 16 that holds a full plane; a pool for every slot
    // at full context.
    {
      const std::int64_t full_rows = cfg_.plane_capacity(LayerKind::kFullNope, opt_.context);
      std::int64_t rows = 16;
      while (rows < 256 && rows < full_rows) rows *= 2;
      if ((o.context == 0 && opt_.context != cfg_.max_context) || (o.block_rows == 0 && opt_.block_rows != rows) ||
          (o.pool_blocks == 0 && opt_.pool_blocks != cfg_.count(LayerKind::kFullNope) * opt_.max_sequences *
                                                         ceil_div(full_rows, opt_.block_rows)))
        return fail("resolved options: context " + std::to_string(opt_.context) + ", block_rows " +
                    std::to_string(opt_.block_rows) + ", pool_blocks " + std::to_string(opt_.pool_blocks));
    }
    StoreOptions ro;
    ro.context = opt_.context;
    ro.block_rows = opt_.block_rows == 16 ? 64 : 16;
    ro.attention = opt_.attention;
    auto r = make_store(backend_, cfg_, ro);
    if (!r) return fail("make_store (reference): " + r.error().to_string());
    ref_ = std::move(*r);
    auto rs = ref_->add_sequence();
    if (!rs) return fail("reference add_sequence");
    ref_seq_ = *rs;
    // The planes' shapes and sizes.
    const std::int64_t n_sliding = cfg_.count(LayerKind::kSlidingRope);
    const std::int64_t ring_bytes = (cfg_.plane_capacity(LayerKind::kSlidingRope, opt_.context) + opt_.slack) * kv() * 4;
    if (store_->ring_bytes() != ring_bytes || store_->block_bytes() != opt_.block_rows * kv() * 4 ||
        store_->allocated_bytes() != opt_.max_sequences * n_sliding * ring_bytes + opt_.pool_blocks * store_->block_bytes() ||
        store_->free_blocks() != opt_.pool_blocks)
      return fail("ring_bytes, block_bytes, allocated_bytes or free_blocks disagree with the geometry");
    // position_limit() bounds only what capacity does not: a sliding ring
    // shorter than its window.
    for (std::int64_t l = 0; l < L(); ++l)
      if (store_->capacity(l) != cap(l) || store_->position_limit(l) != (full(l) ? std::int64_t{1} << 62 : limit(l)) ||
          store_->layout(l) != (full(l) ? Layout::kHeadMajor : Layout::kTokenMajor))
        return fail("layer " + std::to_string(l) + ": capacity " + std::to_string(store_->capacity(l)) +
                    ", position_limit " + std::to_string(store_->position_limit(l)) + ", the model " +
                    std::to_string(cap(l)) + ", " + std::to_string(limit(l)));
    // A store of another context and slack that snapshots also restore into
    // (drawn by the checks' generator: the operations stay as they were).
    StoreOptions xo;
    xo.context = check_uniform(1, cfg_.max_context);
    xo.slack = check_uniform(0, std::min<std::int64_t>(16, cfg_.sliding_window));
    xo.block_rows = std::int64_t{16} << check_uniform(0, 3);
    xo.attention = opt_.attention;
    auto x = make_store(backend_, cfg_, xo);
    if (!x) return fail("make_store (other context): " + x.error().to_string());
    other_ = std::move(*x);
    auto xs = other_->add_sequence();
    if (!xs) return fail("other store add_sequence");
    other_seq_ = *xs;
    std::ostringstream os;
    os << backend_name(backend_) << " seed " << seed_ << ":";
    if (geometry_ == Geometry::kRandom) {
      os << " layers ";
      for (std::int64_t l = 0; l < L(); ++l) os << (full(l) ? 'F' : 'S');
      os << " heads " << cfg_.n_heads << "/" << cfg_.n_kv_heads << " head_dim " << cfg_.head_dim
         << " max_context " << cfg_.max_context << ",";
    }
    os << " W " << cfg_.sliding_window << " context " << opt_.context << " max_sequences "
       << opt_.max_sequences << " slack " << opt_.slack << " block_rows " << opt_.block_rows
       << " pool " << opt_.pool_blocks << " zero_fill " << opt_.zero_fill << " numeric "
       << attention_numeric_name(opt_.attention);
    header_ = os.str();
    return true;
  }

  // A small geometry of any shape the config expresses (layers sliding or
  // full in any pattern, GQA groups of any size, odd head dims, windows
  // shorter and longer than the minimum plane), with store options whose
  // slots and pool run out.
  bool draw_geometry(StoreOptions& o) {
    const std::int64_t n_layers = uniform(1, 6);
    const std::int64_t n_kv_heads = uniform(1, 4);
    const std::int64_t group = chance(30) ? pick({3, 5, 6, 7}) : uniform(1, 8);
    const std::int64_t head_dim = chance(85) ? pick({1, 2, 3, 8, 17, 64, 128}) : uniform(1, 256);
    const std::int64_t window = uniform(1, 40);
    const std::int64_t max_context = chance(70) ? uniform(1, 160) : uniform(161, 320);
    cfg_ = make_hybrid_config("model-test", n_layers, 0, n_kv_heads * group, n_kv_heads, head_dim,
                              window, max_context);
    const int pattern = static_cast<int>(uniform(0, 4));
    const std::int64_t every = uniform(1, n_layers);
    for (std::int64_t l = 0; l < n_layers; ++l) {
      bool is_full = false;
      switch (pattern) {
        case 0: is_full = false; break;                     // all sliding
        case 1: is_full = true; break;                      // all full
        case 2: is_full = l % every == every - 1; break;    // every `every`-th full
        default: is_full = chance(50); break;               // any mix
      }
      cfg_.layer_kinds[static_cast<std::size_t>(l)] = is_full ? LayerKind::kFullNope : LayerKind::kSlidingRope;
    }
    // A model without sliding layers may leave its window unset.
    if (cfg_.count(LayerKind::kSlidingRope) == 0 && chance(30)) cfg_.sliding_window = 0;
    if (Status st = cfg_.validate(); !st.ok()) return fail("drawn geometry: " + st.to_string());
    o.context = chance(40) ? 0 : uniform(1, max_context);
    o.max_sequences = uniform(1, 6);
    o.slack = uniform(0, std::min<std::int64_t>(8, cfg_.sliding_window));
    o.block_rows = chance(85) ? pick({0, 16, 16, 32, 64, 128}) : pick({256, 1024});
    if (cfg_.kv_dim() <= 64 && chance(3)) o.block_rows = 65536;
    o.zero_fill = chance(80);
    o.attention = chance(25) ? AttentionNumeric::kF16 : AttentionNumeric::kF32;
    // The pool: mostly too small for every slot at full context.
    auto resolved = resolve_store_options(cfg_, o);
    if (!resolved) return fail("drawn options: " + resolved.error().to_string());
    const std::int64_t per_plane = ceil_div(cfg_.plane_capacity(LayerKind::kFullNope, resolved->context),
                                            resolved->block_rows);
    const std::int64_t all = cfg_.count(LayerKind::kFullNope) * o.max_sequences * per_plane;
    if (chance(85)) o.pool_blocks = uniform(1, std::max<std::int64_t>(1, all));
    return true;
  }

  // ---- Randomness -------------------------------------------------------------
  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {  // [lo, hi]
    return lo + static_cast<std::int64_t>(rng_() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  // The same from the checks' own generator, so that what the checks look
  // at never changes the operations a seed runs.
  std::int64_t check_uniform(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(check_rng_() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  std::int64_t pick(std::initializer_list<std::int64_t> xs) {
    return *(xs.begin() + uniform(0, static_cast<std::int64_t>(xs.size()) - 1));
  }
  bool chance(int percent) { return uniform(0, 99) < percent; }

  // ---- Geometry ------------------------------------------------------------------
  std::int64_t kv() const { return cfg_.kv_dim(); }
  std::int64_t width() const { return cfg_.n_heads * cfg_.head_dim; }
  std::int64_t L() const { return cfg_.n_layers; }
  bool full(std::int64_t l) const { return cfg_.kind(l) == LayerKind::kFullNope; }
  std::int64_t cap(std::int64_t l) const {
    return full(l) ? cfg_.plane_capacity(l, opt_.context)
                   : cfg_.plane_capacity(l, opt_.context) + opt_.slack;
  }
  // Positions a plane may reach (a sliding ring shorter than its window stops
  // at the context; a full plane at its capacity).
  std::int64_t limit(std::int64_t l) const {
    if (full(l)) return cap(l);
    if (cfg_.plane_capacity(l, opt_.context) < cfg_.sliding_window) return opt_.context;
    return std::int64_t{1} << 62;
  }
  std::int64_t ceil_div(std::int64_t a, std::int64_t b) const { return (a + b - 1) / b; }
  // The first full layer (0 in a model without one).
  std::size_t first_full() const {
    for (std::int64_t l = 0; l < L(); ++l)
      if (full(l)) return static_cast<std::size_t>(l);
    return 0;
  }
  // A full layer at random (any layer in a model without one).
  std::int64_t full_or_any() {
    std::vector<std::int64_t> fulls;
    for (std::int64_t l = 0; l < L(); ++l)
      if (full(l)) fulls.push_back(l);
    if (fulls.empty()) return uniform(0, L() - 1);
    return fulls[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(fulls.size()) - 1))];
  }
  // The furthest position a detached sequence's installs plan for: a full
  // plane's capacity, or (no full layer) a few turns of the ring.
  std::int64_t plan_end() const {
    const auto f = static_cast<std::int64_t>(first_full());
    if (full(f)) return cap(f);
    return std::min(limit(0), 3 * cap(0));
  }

  // ---- Reporting -------------------------------------------------------------------
  bool fail(const std::string& what) {
    if (ok_) {
      ADD_FAILURE() << header_ << "\n  op " << op_ << ": " << desc_ << "\n  " << what
                    << "\n  recent ops:\n"
                    << recent();
    }
    ok_ = false;
    return false;
  }
  std::string recent() const {
    std::string s;
    const std::size_t from = history_.size() > 40 ? history_.size() - 40 : 0;
    for (std::size_t i = from; i < history_.size(); ++i) s += "    " + history_[i] + "\n";
    return s;
  }
  void describe(const std::string& d) {
    desc_ = d;
    history_.push_back(std::to_string(op_) + ": " + d);
  }
  static std::string name(SeqId s) { return seq_name(s); }

  // ---- Model queries -------------------------------------------------------------
  SeqModel* find(SeqId id) {
    for (auto& s : seqs_)
      if (s.id == id) return &s;
    return nullptr;
  }
  SeqModel* live(SeqId id) {
    SeqModel* s = find(id);
    return s != nullptr && !s->detached ? s : nullptr;
  }
  std::int64_t refs(std::int64_t l, std::int64_t id) const {
    std::int64_t n = 0;
    for (const auto& s : seqs_)
      for (const std::int64_t b : s.planes[static_cast<std::size_t>(l)].blocks) n += b == id;
    return n;
  }
  std::int64_t model_free() const {
    std::set<std::int64_t> used;
    for (const auto& s : seqs_)
      for (const auto& p : s.planes) used.insert(p.blocks.begin(), p.blocks.end());
    return opt_.pool_blocks - static_cast<std::int64_t>(used.size());
  }
  std::optional<std::int64_t> model_next(const SeqModel& s) const {
    const std::int64_t n = s.planes[0].next;
    for (const auto& p : s.planes)
      if (p.next != n) return std::nullopt;
    return n;
  }
  SeqModel fresh_model(SeqId id, bool detached) const {
    SeqModel m;
    m.id = id;
    m.detached = detached;
    m.planes.resize(static_cast<std::size_t>(L()));
    // Under zero_fill a new (or reset) sequence's rings are zero.
    for (std::int64_t l = 0; l < L(); ++l)
      if (!full(l)) {
        PlaneModel& p = m.planes[static_cast<std::size_t>(l)];
        p.pk.assign(static_cast<std::size_t>(cap(l)), opt_.zero_fill ? zero_row() : Row{});
        p.pv = p.pk;
      }
    return m;
  }
  bool slot_free() const { return static_cast<std::int64_t>(seqs_.size()) < opt_.max_sequences; }

  // A sequence handle: mostly a live one, sometimes detached, removed or bogus.
  SeqId any_seq(int bad_percent = 8) {
    if (!chance(bad_percent) && !seqs_.empty()) {
      std::vector<SeqId> ids;
      for (const auto& s : seqs_)
        if (!s.detached) ids.push_back(s.id);
      if (!ids.empty() && !chance(5)) return ids[static_cast<std::size_t>(uniform(0, ids.size() - 1))];
      return seqs_[static_cast<std::size_t>(uniform(0, seqs_.size() - 1))].id;
    }
    if (!dead_.empty() && chance(70)) return dead_[static_cast<std::size_t>(uniform(0, dead_.size() - 1))];
    return SeqId{static_cast<std::uint64_t>(uniform(0, 5))};
  }

  // ---- Inputs ------------------------------------------------------------------------
  Input make_input(std::int64_t rows, std::int64_t cols, bool query) {
    Input in;
    const DType dt = chance(60) ? DType::kF32 : (chance(50) ? DType::kF16 : DType::kBF16);
    const std::int64_t stride = chance(70) ? cols : cols + uniform(1, 5);
    const std::int64_t elems = rows > 0 ? (rows - 1) * stride + cols : 0;
    const std::int64_t bytes = elems * dtype_bytes(dt);
    in.buf.assign(static_cast<std::size_t>((bytes + 3) / 4 + 1), 0xdeadbeef);
    auto* base = reinterpret_cast<unsigned char*>(in.buf.data());
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    in.rows.resize(static_cast<std::size_t>(rows));
    in.values.resize(static_cast<std::size_t>(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      Row& row = in.rows[static_cast<std::size_t>(r)];
      row.resize(static_cast<std::size_t>(cols));
      for (std::int64_t c = 0; c < cols; ++c) {
        const float x = dist(rng_);
        unsigned char* at = base + (r * stride + c) * dtype_bytes(dt);
        float value = 0;
        if (dt == DType::kF32) {
          std::memcpy(at, &x, 4);
          value = x;
          row[static_cast<std::size_t>(c)] = f32_to_f16(x);
        } else if (dt == DType::kF16) {
          const std::uint16_t h = f32_to_f16(x);
          std::memcpy(at, &h, 2);
          value = f16_to_f32(h);
          row[static_cast<std::size_t>(c)] = h;
        } else {
          std::uint32_t u;
          std::memcpy(&u, &x, 4);
          const auto h = static_cast<std::uint16_t>(u >> 16);
          std::memcpy(at, &h, 2);
          value = bf16_value(h);
          row[static_cast<std::size_t>(c)] = f32_to_f16(value);
        }
        in.values[static_cast<std::size_t>(r * cols + c)] = value;
      }
    }
    (void)query;
    in.view = ConstView{base, MemorySpace::kHost, dt, rows, cols, stride};
    return in;
  }

  // ---- Model effects ----------------------------------------------------------------------
  Row zero_row() const { return Row(static_cast<std::size_t>(kv()), 0); }
  // Position `pos` of plane l holds rows k, v.
  void set_row(PlaneModel& p, std::int64_t l, std::int64_t pos, const Row& k, const Row& v) {
    if (static_cast<std::int64_t>(p.k.size()) <= pos) {
      p.k.resize(static_cast<std::size_t>(pos + 1));
      p.v.resize(static_cast<std::size_t>(pos + 1));
    }
    p.k[static_cast<std::size_t>(pos)] = k;
    p.v[static_cast<std::size_t>(pos)] = v;
    if (!full(l)) {
      p.pk[static_cast<std::size_t>(pos % cap(l))] = k;
      p.pv[static_cast<std::size_t>(pos % cap(l))] = v;
    }
  }
  // Appends `count` rows to plane l of `s` (stores, prefill).
  void append(SeqModel& s, std::int64_t l, std::int64_t count, const std::vector<Row>& k,
              const std::vector<Row>& v, std::size_t from) {
    PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
    for (std::int64_t i = 0; i < count; ++i)
      set_row(p, l, p.next + i, k[from + static_cast<std::size_t>(i)], v[from + static_cast<std::size_t>(i)]);
    const std::int64_t len = std::min(cap(l), p.next - p.origin + count);
    p.next += count;
    p.origin = p.next - len;
    if (full(l)) {
      const std::int64_t B = opt_.block_rows;
      const std::int64_t first = (p.next - count) / B;
      if (first < static_cast<std::int64_t>(p.blocks.size()) &&
          refs(l, p.blocks[static_cast<std::size_t>(first)]) > 1)
        p.blocks[static_cast<std::size_t>(first)] = next_block_++;
      while (static_cast<std::int64_t>(p.blocks.size()) < ceil_div(p.next, B))
        p.blocks.push_back(next_block_++);
    }
  }
  // Blocks a store of `count` rows at plane l of `s` takes from the pool.
  std::int64_t store_blocks(const SeqModel& s, std::int64_t l, std::int64_t start,
                            std::int64_t count) const {
    if (!full(l)) return 0;
    const PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
    const std::int64_t B = opt_.block_rows;
    const auto held = static_cast<std::int64_t>(p.blocks.size());
    std::int64_t n = std::max<std::int64_t>(0, ceil_div(start + count, B) - held);
    if (start / B < held && refs(l, p.blocks[static_cast<std::size_t>(start / B)]) > 1) ++n;
    return n;
  }
  // What an install of `rows` rows into plane l takes and gives back.
  std::pair<std::int64_t, std::int64_t> install_blocks(const SeqModel& s, std::int64_t l,
                                                       std::int64_t rows) const {
    if (!full(l)) return {0, 0};
    const PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
    const auto n = static_cast<std::size_t>(ceil_div(rows, opt_.block_rows));
    std::int64_t take = 0, give = 0;
    for (std::size_t b = 0; b < std::max(n, p.blocks.size()); ++b) {
      const bool alone = b < p.blocks.size() && refs(l, p.blocks[b]) == 1;
      if (b < n && !alone) ++take;
      if (b >= n && alone) ++give;
    }
    return {take, give};
  }
  // Plane l of `s` becomes `ring` with rows k, v (null: rows not written).
  void install_model(SeqModel& s, std::int64_t l, const RingState& ring, const std::vector<Row>* k,
                     const std::vector<Row>* v) {
    PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
    if (full(l)) {
      const auto n = static_cast<std::size_t>(ceil_div(ring.len(), opt_.block_rows));
      std::vector<std::int64_t> nb;
      for (std::size_t b = 0; b < n; ++b)
        nb.push_back(b < p.blocks.size() && refs(l, p.blocks[b]) == 1 ? p.blocks[b] : next_block_++);
      p.blocks = nb;
    }
    p.origin = ring.origin_logical();
    p.next = ring.next_position();
    p.k.assign(static_cast<std::size_t>(p.next), Row{});
    p.v.assign(static_cast<std::size_t>(p.next), Row{});
    // A ring that is not full is cleared first; rows not written are not
    // known.
    if (!full(l) && ring.len() < cap(l)) {
      p.pk.assign(static_cast<std::size_t>(cap(l)), zero_row());
      p.pv = p.pk;
    }
    for (std::int64_t i = 0; i < ring.len(); ++i)
      set_row(p, l, p.origin + i, k != nullptr ? (*k)[static_cast<std::size_t>(i)] : Row{},
              k != nullptr ? (*v)[static_cast<std::size_t>(i)] : Row{});
  }

  // ---- Store images --------------------------------------------------------------------
  StoreImage image() const {
    StoreImage im;
    std::vector<SeqId> ids;
    for (const auto& s : seqs_) ids.push_back(s.id);
    for (const auto d : dead_) ids.push_back(d);
    for (const SeqId id : ids) {
      SeqImage si;
      si.id = static_cast<std::uint64_t>(id);
      si.contains = store_->contains(id);
      si.detached = store_->is_detached(id);
      auto n = store_->next_position(id);
      si.next_ok = n.ok();
      si.next = n.ok() ? *n : 0;
      auto b = store_->blocks_held(id);
      si.blocks = b.ok() ? *b : -1;
      for (std::int64_t l = 0; l < L(); ++l) {
        auto r = store_->ring(id, l);
        si.rings.push_back(RingImage{r.ok(), r.ok() ? *r : RingState{}});
        if (si.contains) {
          const auto n_el = static_cast<std::size_t>(store_->capacity(l) * kv());
          std::vector<std::uint16_t> k(n_el), v(n_el);
          if (!store_->read_plane(id, l, k.data(), v.data()).ok()) k.assign(1, 0xffff);
          si.planes.push_back(std::move(k));
          si.planes.push_back(std::move(v));
        }
      }
      im.seqs.push_back(std::move(si));
    }
    for (const SeqId s : store_->sequences()) im.list.push_back(static_cast<std::uint64_t>(s));
    im.free = store_->free_blocks();
    im.count = store_->sequence_count();
    return im;
  }

  // ---- Checks ---------------------------------------------------------------------------
  void check_model() {
    if (store_->free_blocks() != model_free())
      return void(fail("free_blocks " + std::to_string(store_->free_blocks()) + ", the model " +
                       std::to_string(model_free())));
    std::vector<std::uint64_t> want, got;
    for (const auto& s : seqs_)
      if (!s.detached) want.push_back(static_cast<std::uint64_t>(s.id));
    for (const SeqId s : store_->sequences()) got.push_back(static_cast<std::uint64_t>(s));
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    if (want != got) return void(fail("sequences() differ from the model"));
    if (store_->sequence_count() != static_cast<std::int64_t>(want.size()))
      return void(fail("sequence_count"));
    for (const SeqId d : dead_)
      if (store_->contains(d) || store_->ring(d, 0).ok() || store_->blocks_held(d).ok())
        return void(fail(name(d) + " was removed but is still reachable"));
    for (const auto& s : seqs_) {
      if (!check_seq(s)) return;
    }
  }

  bool check_seq(const SeqModel& s) {
    const std::string who = name(s.id);
    if (store_->contains(s.id) != !s.detached || store_->is_detached(s.id) != s.detached)
      return fail(who + ": contains/is_detached disagree with the model");
    std::int64_t blocks = 0;
    for (std::int64_t l = 0; l < L(); ++l) {
      const PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
      blocks += static_cast<std::int64_t>(p.blocks.size());
      auto r = store_->ring(s.id, l);
      if (!r) return fail(who + ": ring(" + std::to_string(l) + "): " + r.error().to_string());
      const std::int64_t c = cap(l);
      const std::int64_t want_phys = full(l) ? 0 : p.origin % c;
      if (r->capacity() != c || r->wraps() == full(l) || r->origin_logical() != p.origin ||
          r->len() != p.next - p.origin || r->origin_physical() != want_phys)
        return fail(who + " layer " + std::to_string(l) + ": ring (cap " +
                    std::to_string(r->capacity()) + ", len " + std::to_string(r->len()) +
                    ", origin " + std::to_string(r->origin_logical()) + "/" +
                    std::to_string(r->origin_physical()) + "), the model: cap " + std::to_string(c) +
                    ", live [" + std::to_string(p.origin) + ", " + std::to_string(p.next) + ")");
      if (full(l) && static_cast<std::int64_t>(p.blocks.size()) != ceil_div(p.next, opt_.block_rows))
        return fail(who + ": the model's block table is inconsistent (test bug)");
      if (s.detached) {
        // Rows still arriving are not readable.
        const auto n_el = static_cast<std::size_t>(std::max<std::int64_t>(1, c * kv()));
        std::vector<std::uint16_t> k(n_el), v(n_el);
        if (p.next > p.origin && store_->read_rows(s.id, l, p.origin, 1, k.data(), v.data()).ok())
          return fail(who + " is detached, but read_rows of layer " + std::to_string(l) + " succeeded");
        if (store_->read_plane(s.id, l, k.data(), v.data()).ok())
          return fail(who + " is detached, but read_plane of layer " + std::to_string(l) + " succeeded");
        continue;
      }
      // Live rows, in logical order.
      const std::int64_t len = p.next - p.origin;
      if (len > 0) {
        std::vector<std::uint16_t> k(static_cast<std::size_t>(len * kv())), v(k.size());
        Status st = store_->read_rows(s.id, l, p.origin, len, k.data(), v.data());
        if (!st.ok()) return fail(who + ": read_rows: " + st.to_string());
        for (std::int64_t i = 0; i < len; ++i) {
          const Row& mk = p.k[static_cast<std::size_t>(p.origin + i)];
          const Row& mv = p.v[static_cast<std::size_t>(p.origin + i)];
          if (mk.empty()) continue;
          if (std::memcmp(mk.data(), k.data() + i * kv(), static_cast<std::size_t>(kv()) * 2) != 0 ||
              std::memcmp(mv.data(), v.data() + i * kv(), static_cast<std::size_t>(kv()) * 2) != 0)
            return fail(who + " layer " + std::to_string(l) + ": read_rows position " +
                        std::to_string(p.origin + i) + " differs from the model");
        }
      }
      // A stretch of them (across the ring's wrap and block edges), or one
      // reaching past them, which is refused.
      {
        std::int64_t first = p.origin + check_uniform(0, len);
        std::int64_t count = check_uniform(0, p.next - first);
        if (check_uniform(0, 9) == 0) first = check_uniform(0, 1) == 0 ? p.origin - 1 : p.next - count + 1;
        const bool live_rows = first >= p.origin && first + count <= p.next;
        std::vector<std::uint16_t> k(static_cast<std::size_t>(std::max<std::int64_t>(1, count) * kv())), v(k.size());
        const Status st = store_->read_rows(s.id, l, first, count, k.data(), v.data());
        if (st.ok() != (live_rows || count == 0))
          return fail(who + " layer " + std::to_string(l) + ": read_rows [" + std::to_string(first) + ", +" +
                      std::to_string(count) + ") " + (st.ok() ? "succeeded" : st.to_string()) +
                      ", live are [" + std::to_string(p.origin) + ", " + std::to_string(p.next) + ")");
        for (std::int64_t i = 0; st.ok() && i < count; ++i) {
          const Row& mk = p.k[static_cast<std::size_t>(first + i)];
          const Row& mv = p.v[static_cast<std::size_t>(first + i)];
          if (mk.empty()) continue;
          if (std::memcmp(mk.data(), k.data() + i * kv(), static_cast<std::size_t>(kv()) * 2) != 0 ||
              std::memcmp(mv.data(), v.data() + i * kv(), static_cast<std::size_t>(kv()) * 2) != 0)
            return fail(who + " layer " + std::to_string(l) + ": read_rows [" + std::to_string(first) +
                        ", +" + std::to_string(count) + ") position " + std::to_string(first + i) +
                        " differs from the model");
        }
      }
      // The physical image: live rows where the layout puts them; a full
      // plane is zero past its rows.
      const auto n_el = static_cast<std::size_t>(c * kv());
      std::vector<std::uint16_t> pk(n_el), pv(n_el);
      Status st = store_->read_plane(s.id, l, pk.data(), pv.data());
      if (!st.ok()) return fail(who + ": read_plane: " + st.to_string());
      const auto hd = static_cast<std::uint64_t>(cfg_.head_dim);
      std::vector<bool> live_row(static_cast<std::size_t>(c), false);
      for (std::int64_t pos = p.origin; pos < p.next; ++pos) {
        const std::int64_t phys = full(l) ? pos : (pos - p.origin + want_phys) % c;
        live_row[static_cast<std::size_t>(phys)] = true;
        const Row& mk = p.k[static_cast<std::size_t>(pos)];
        const Row& mv = p.v[static_cast<std::size_t>(pos)];
        if (mk.empty()) continue;
        for (std::int64_t h = 0; h < cfg_.n_kv_heads; ++h)
          for (std::uint64_t d = 0; d < hd; ++d) {
            const std::uint64_t at =
                full(l) ? head_major_index(static_cast<std::uint64_t>(h), static_cast<std::uint64_t>(phys), d,
                                           static_cast<std::uint64_t>(c), hd)
                        : token_major_index(static_cast<std::uint64_t>(phys), static_cast<std::uint64_t>(h * cfg_.head_dim) + d,
                                            static_cast<std::uint64_t>(kv()));
            const auto e = static_cast<std::size_t>(h * cfg_.head_dim + static_cast<std::int64_t>(d));
            if (pk[at] != mk[e] || pv[at] != mv[e])
              return fail(who + " layer " + std::to_string(l) + ": read_plane position " +
                          std::to_string(pos) + " (physical " + std::to_string(phys) +
                          ") differs from the model");
          }
      }
      // A sliding ring's rows past its live ones: zero or rows written
      // before, as the model knows them.
      if (!full(l))
        for (std::int64_t row = 0; row < c; ++row) {
          const Row& mk = p.pk[static_cast<std::size_t>(row)];
          const Row& mv = p.pv[static_cast<std::size_t>(row)];
          if (mk.empty() || live_row[static_cast<std::size_t>(row)]) continue;
          const std::size_t at = static_cast<std::size_t>(row * kv());
          if (std::memcmp(mk.data(), pk.data() + at, static_cast<std::size_t>(kv()) * 2) != 0 ||
              std::memcmp(mv.data(), pv.data() + at, static_cast<std::size_t>(kv()) * 2) != 0)
            return fail(who + " layer " + std::to_string(l) + ": read_plane row " + std::to_string(row) +
                        " (not live) differs from the model: " +
                        (std::all_of(mk.begin(), mk.end(), [](std::uint16_t x) { return x == 0; }) ? "zero" : "a row written before") +
                        " expected");
        }
      if (full(l))
        for (std::int64_t row = 0; row < c; ++row) {
          if (live_row[static_cast<std::size_t>(row)]) continue;
          for (std::int64_t h = 0; h < cfg_.n_kv_heads; ++h)
            for (std::uint64_t d = 0; d < hd; ++d) {
              const auto at = head_major_index(static_cast<std::uint64_t>(h), static_cast<std::uint64_t>(row), d,
                                               static_cast<std::uint64_t>(c), hd);
              if (pk[at] != 0 || pv[at] != 0)
                return fail(who + " layer " + std::to_string(l) + ": read_plane row " +
                            std::to_string(row) + " past the full plane's rows is not zero");
            }
        }
    }
    auto n = store_->next_position(s.id);
    const auto mn = model_next(s);
    if (n.ok() != mn.has_value() || (mn && *n != *mn))
      return fail(who + ": next_position " + (n.ok() ? std::to_string(*n) : n.error().to_string()) +
                  ", the model " + (mn ? std::to_string(*mn) : "discontinuous"));
    auto b = store_->blocks_held(s.id);
    if (!b || *b != blocks)
      return fail(who + ": blocks_held " + (b ? std::to_string(*b) : b.error().to_string()) +
                  ", the model " + std::to_string(blocks));
    return true;
  }

  // Checks a call's outcome against the prediction; on a failure, that the
  // store is as before, and its code where the model knows it (the
  // documented ones: kNotFound for a handle that is not live, or not there;
  // kResourceExhausted for slots or blocks that run out, kCapacityExceeded
  // for positions past a plane's limit).
  bool outcome(const Status& st, bool expect_ok, const StoreImage& before,
               std::optional<ErrorCode> code = std::nullopt) {
    {
      const std::string kind = desc_.substr(0, desc_.find(' '));
      auto& c = stats_[kind];
      (st.ok() ? c.first : c.second) += 1;
      if (verbose_) std::printf("%lld %s -> %s\n", static_cast<long long>(op_), desc_.c_str(), st.to_string().c_str());
    }
    if (st.ok() != expect_ok)
      return fail(std::string(st.ok() ? "succeeded" : "failed") + ", the model expected " +
                  (expect_ok ? "success" : "a refusal") + (st.ok() ? "" : ": " + st.to_string()));
    if (!st.ok()) {
      if (st.error().message.empty()) return fail("an error without a message");
      // kInternal says an invariant of kvring broke: never the answer to a
      // request, however wrong.
      if (st.error().code == ErrorCode::kInternal) return fail("refused as an internal error: " + st.to_string());
      if (code && st.error().code != *code)
        return fail("refused as " + st.to_string() + ", the model expected " + error_code_name(*code));
      if (!(image() == before)) return fail("refused (" + st.to_string() + ") but the store changed");
    }
    return true;
  }

  // ---- Reference decode ----------------------------------------------------------------
  // Decode output of a query at `pos` of plane l (model rows of `s`) in the
  // reference store, or nothing when a visible row is unknown.
  std::optional<std::vector<float>> reference(const PlaneModel& p, std::int64_t l, std::int64_t pos,
                                              const float* q) {
    const std::int64_t rc = ref_->capacity(l);
    auto ring = RingState::sequential(rc, !full(l), pos + 1);
    if (!ring) {
      fail("reference ring: " + ring.error().to_string());
      return std::nullopt;
    }
    std::vector<std::uint16_t> k, v;
    for (std::int64_t x = ring->origin_logical(); x < ring->next_position(); ++x) {
      if (x >= static_cast<std::int64_t>(p.k.size()) || p.k[static_cast<std::size_t>(x)].empty())
        return std::nullopt;
      k.insert(k.end(), p.k[static_cast<std::size_t>(x)].begin(), p.k[static_cast<std::size_t>(x)].end());
      v.insert(v.end(), p.v[static_cast<std::size_t>(x)].begin(), p.v[static_cast<std::size_t>(x)].end());
    }
    Status st = ref_->install(ref_seq_, l, *ring, k.data(), v.data());
    if (!st.ok()) {
      fail("reference install: " + st.to_string());
      return std::nullopt;
    }
    std::vector<float> out(static_cast<std::size_t>(width()));
    const SeqQuery query{ref_seq_, pos};
    st = ref_->attend_decode(l, {&query, 1}, host_view(q, 1, width()), host_view(out.data(), 1, width()));
    if (!st.ok()) {
      fail("reference decode: " + st.to_string());
      return std::nullopt;
    }
    return out;
  }

  bool check_outputs(const SeqModel& s, std::int64_t l, std::int64_t pos, const float* q,
                     const float* out) {
    auto want = reference(s.planes[static_cast<std::size_t>(l)], l, pos, q);
    if (!ok_) return false;
    if (!want) return true;
    if (std::memcmp(want->data(), out, want->size() * 4) != 0)
      return fail(name(s.id) + " layer " + std::to_string(l) + ": attention output at position " +
                  std::to_string(pos) + " differs from a decode of the same rows in a fresh store");
    // Within rounding of attention computed from the definition.
    const std::vector<double> exact = naive(s.planes[static_cast<std::size_t>(l)], l, pos, q);
    const double tol = opt_.attention == AttentionNumeric::kF16 ? 3e-2 : 1e-4;
    for (std::size_t i = 0; i < exact.size(); ++i)
      if (!(std::abs(out[i] - exact[i]) <= tol * (1.0 + std::abs(exact[i]))))
        return fail(name(s.id) + " layer " + std::to_string(l) + ": attention output at position " +
                    std::to_string(pos) + ", element " + std::to_string(i) + " is " + std::to_string(out[i]) +
                    ", attention by its definition " + std::to_string(exact[i]));
    return true;
  }

  // Attention at `pos` over the model's rows of plane l (all known), in
  // double: per query head h, softmax(q_h . k / sqrt(head_dim)) . v over
  // the visible rows of KV head h / (n_heads / n_kv_heads).
  std::vector<double> naive(const PlaneModel& p, std::int64_t l, std::int64_t pos, const float* q) const {
    const std::int64_t hd = cfg_.head_dim, group = cfg_.gqa_group();
    const std::int64_t lo = visible_begin(cfg_, cfg_.kind(l), pos);
    std::vector<double> out(static_cast<std::size_t>(width()), 0.0);
    std::vector<double> w(static_cast<std::size_t>(pos - lo + 1));
    for (std::int64_t h = 0; h < cfg_.n_heads; ++h) {
      const std::int64_t kvh = h / group;
      double mx = -1e300;
      for (std::int64_t x = lo; x <= pos; ++x) {
        const Row& k = p.k[static_cast<std::size_t>(x)];
        double dot = 0;
        for (std::int64_t d = 0; d < hd; ++d)
          dot += static_cast<double>(q[h * hd + d]) * f16_to_f32(k[static_cast<std::size_t>(kvh * hd + d)]);
        w[static_cast<std::size_t>(x - lo)] = dot / std::sqrt(static_cast<double>(hd));
        mx = std::max(mx, w[static_cast<std::size_t>(x - lo)]);
      }
      double sum = 0;
      for (double& e : w) sum += (e = std::exp(e - mx));
      for (std::int64_t x = lo; x <= pos; ++x) {
        const Row& v = p.v[static_cast<std::size_t>(x)];
        for (std::int64_t d = 0; d < hd; ++d)
          out[static_cast<std::size_t>(h * hd + d)] +=
              w[static_cast<std::size_t>(x - lo)] / sum * f16_to_f32(v[static_cast<std::size_t>(kvh * hd + d)]);
      }
    }
    return out;
  }

  // ---- Operations ------------------------------------------------------------------------
  void step() {
    // Layers left at different positions (single-layer stores, prefill of
    // one layer, installs) are mostly brought level again.
    for (const auto& sm : seqs_)
      if (!sm.detached && !model_next(sm) && chance(40)) {
        // A full plane that cannot catch up within the pool: start over.
        std::int64_t hi = 0;
        for (const auto& p : sm.planes) hi = std::max(hi, p.next);
        std::int64_t need = 0;
        for (std::int64_t l = 0; l < L(); ++l) {
          const PlaneModel& p = sm.planes[static_cast<std::size_t>(l)];
          if (p.next < hi) need += store_blocks(sm, l, p.next, hi - p.next);
        }
        if (need > model_free() && chance(50)) {
          describe("reset_sequence " + name(sm.id));
          const StoreImage before = image();
          const Status st = store_->reset_sequence(sm.id);
          if (outcome(st, true, before)) *find(sm.id) = fresh_model(sm.id, false);
          return;
        }
        return op_store(false);
      }
    const int r = static_cast<int>(uniform(0, 99));
    if (r < 6) return op_add(false);
    if (r < 9) return op_add(true);
    if (r < 14) return op_remove();
    if (r < 17) return op_reset();
    if (r < 23) return op_fork();
    if (r < 27) return op_truncate();
    if (r < 30) return op_truncate_to();
    if (r < 38) return op_store(false);
    if (r < 55) return op_store(true);
    if (r < 63) return op_prefill();
    if (r < 71) return op_decode();
    if (r < 77) return op_install();
    if (r < 81) return op_install_plane();
    if (r < 85) return op_install_rows();
    if (r < 88) return op_attach();
    if (r < 92) return op_snapshot();
    if (r < 97) return op_restore();
    return op_restore_new();
  }

  void op_add(bool detached) {
    if (!slot_free() && chance(50)) return op_remove();
    describe(detached ? "add_detached_sequence" : "add_sequence");
    const StoreImage before = image();
    auto id = detached ? store_->add_detached_sequence() : store_->add_sequence();
    if (!outcome(id.ok() ? Status::Ok() : Status(id.error()), slot_free(), before, ErrorCode::kResourceExhausted))
      return;
    if (!id) return;
    if (find(*id) != nullptr) return void(fail("a new sequence reuses a live handle"));
    for (const SeqId d : dead_)
      if (d == *id) return void(fail("a new sequence reuses a removed handle"));
    seqs_.push_back(fresh_model(*id, detached));
    if (detached) seqs_.back().plan = uniform(0, plan_end());
    describe((detached ? "add_detached_sequence -> " : "add_sequence -> ") + name(*id));
  }

  void op_remove() {
    const SeqId id = any_seq(10);
    describe("remove_sequence " + name(id));
    const StoreImage before = image();
    SeqModel* s = find(id);
    const Status st = store_->remove_sequence(id);
    if (!outcome(st, s != nullptr, before, ErrorCode::kNotFound) || !st.ok()) return;
    dead_.push_back(id);
    if (dead_.size() > 6) dead_.erase(dead_.begin());
    seqs_.erase(seqs_.begin() + (s - seqs_.data()));
  }

  void op_reset() {
    const SeqId id = any_seq(10);
    describe("reset_sequence " + name(id));
    const StoreImage before = image();
    SeqModel* s = live(id);
    const Status st = store_->reset_sequence(id);
    if (!outcome(st, s != nullptr, before, ErrorCode::kNotFound) || !st.ok()) return;
    *s = fresh_model(id, false);
  }

  void op_fork() {
    if (!slot_free() && chance(50)) return op_remove();
    const SeqId id = any_seq(10);
    describe("fork_sequence " + name(id));
    const StoreImage before = image();
    SeqModel* s = live(id);
    auto f = store_->fork_sequence(id);
    if (!outcome(f.ok() ? Status::Ok() : Status(f.error()), s != nullptr && slot_free(), before,
                 s == nullptr ? ErrorCode::kNotFound : ErrorCode::kResourceExhausted) ||
        !f)
      return;
    SeqModel copy = *s;
    copy.id = *f;
    seqs_.push_back(std::move(copy));
    describe("fork_sequence " + name(id) + " -> " + name(*f));
  }

  void op_truncate() {
    const SeqId id = any_seq(5);
    SeqModel* s = live(id);
    std::int64_t tokens = 1;
    const std::int64_t next = s != nullptr ? model_next(*s).value_or(0) : 0;
    switch (uniform(0, 5)) {
      case 0: tokens = uniform(0, std::max<std::int64_t>(0, opt_.slack)); break;
      case 1: tokens = uniform(0, next + 2); break;
      case 2: tokens = next; break;
      case 3: tokens = -uniform(1, 3); break;
      default: tokens = uniform(0, std::min<std::int64_t>(next, opt_.slack + 4)); break;
    }
    describe("truncate_sequence " + name(id) + " by " + std::to_string(tokens));
    const StoreImage before = image();
    bool expect = s != nullptr && model_next(*s).has_value() && tokens >= 0 && tokens <= next;
    const std::int64_t end = next - tokens;
    if (expect && tokens > 0)
      for (std::int64_t l = 0; l < L(); ++l) {
        if (full(l)) continue;
        // The ring must still hold the rows a ring without slack holds at
        // the new end.
        const std::int64_t need = std::max<std::int64_t>(0, end - cfg_.plane_capacity(l, opt_.context));
        if (s->planes[static_cast<std::size_t>(l)].origin > need) expect = false;
      }
    const Status st = store_->truncate_sequence(id, tokens);
    if (!outcome(st, expect, before, s == nullptr ? std::optional(ErrorCode::kNotFound) : std::nullopt) || !st.ok())
      return;
    for (std::int64_t l = 0; l < L(); ++l) {
      PlaneModel& p = s->planes[static_cast<std::size_t>(l)];
      p.next -= tokens;
      p.k.resize(static_cast<std::size_t>(p.next));
      p.v.resize(static_cast<std::size_t>(p.next));
      if (full(l)) p.blocks.resize(static_cast<std::size_t>(ceil_div(p.next, opt_.block_rows)));
    }
  }

  // The smallest position truncate_sequence_to takes: every layer that ends
  // past it must hold it, and a sliding ring that dropped rows must still
  // hold what a ring without slack holds there.
  std::optional<std::int64_t> model_floor(const SeqModel& s) const {
    std::int64_t floor = 0, ceiling = std::numeric_limits<std::int64_t>::max();
    for (std::int64_t l = 0; l < L(); ++l) {
      const PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
      const std::int64_t own =
          !full(l) && p.origin > 0 ? p.origin + cfg_.plane_capacity(l, opt_.context) : p.origin;
      floor = std::max(floor, std::min(own, p.next));
      ceiling = std::min(ceiling, p.next);
    }
    if (floor > ceiling) return std::nullopt;
    return floor;
  }

  // truncate_sequence_to, also on sequences whose layers stand at
  // different positions (a per-layer store refused part-way), and
  // rollback_floor against the model.
  void op_truncate_to() {
    const SeqId id = any_seq(5);
    SeqModel* s = live(id);
    std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = 0;
    if (s != nullptr)
      for (const PlaneModel& p : s->planes) lo = std::min(lo, p.next), hi = std::max(hi, p.next);
    const std::optional<std::int64_t> floor = s != nullptr ? model_floor(*s) : std::nullopt;
    const Result<std::int64_t> got = store_->rollback_floor(id);
    if (s != nullptr && got.ok() != floor.has_value()) {
      fail("rollback_floor " + name(id) + ": ok " + std::to_string(got.ok()) + " against the model");
      return;
    }
    if (got.ok() && floor && *got != *floor) {
      fail("rollback_floor " + name(id) + " = " + std::to_string(*got) + ", the model " + std::to_string(*floor));
      return;
    }
    std::int64_t end = 0;
    switch (uniform(0, 4)) {
      case 0: end = floor.value_or(0); break;
      case 1: end = floor.value_or(1) - 1; break;
      case 2: end = s != nullptr ? lo : 0; break;
      case 3: end = s != nullptr ? uniform(0, hi + 1) : 0; break;
      default: end = -uniform(0, 2); break;
    }
    describe("truncate_sequence_to " + name(id) + " at " + std::to_string(end));
    const StoreImage before = image();
    bool expect = s != nullptr && end >= 0 && end <= lo;
    for (std::int64_t l = 0; expect && l < L(); ++l) {
      const PlaneModel& p = s->planes[static_cast<std::size_t>(l)];
      if (full(l) || p.next == end) continue;
      const std::int64_t need = std::max<std::int64_t>(0, end - cfg_.plane_capacity(l, opt_.context));
      if (p.origin > need) expect = false;
    }
    const Status st = store_->truncate_sequence_to(id, end);
    if (!outcome(st, expect, before, s == nullptr ? std::optional(ErrorCode::kNotFound) : std::nullopt) || !st.ok())
      return;
    for (std::int64_t l = 0; l < L(); ++l) {
      PlaneModel& p = s->planes[static_cast<std::size_t>(l)];
      p.next = end;
      p.k.resize(static_cast<std::size_t>(p.next));
      p.v.resize(static_cast<std::size_t>(p.next));
      if (full(l)) p.blocks.resize(static_cast<std::size_t>(ceil_div(p.next, opt_.block_rows)));
    }
  }

  // Spans of a batch: mostly valid continuations, sometimes not.
  std::vector<SeqSpan> make_spans(std::int64_t layer_for_start, bool allow_bad) {
    std::vector<SeqSpan> spans;
    const std::int64_t n = uniform(allow_bad && chance(3) ? 0 : 1, 3);
    std::vector<SeqId> used;
    for (std::int64_t i = 0; i < n; ++i) {
      SeqId id = any_seq(allow_bad ? 6 : 0);
      if (std::find(used.begin(), used.end(), id) != used.end() && !(allow_bad && chance(15))) {
        // another one
        id = any_seq(allow_bad ? 6 : 0);
        if (std::find(used.begin(), used.end(), id) != used.end() && !(allow_bad && chance(15))) continue;
      }
      used.push_back(id);
      SeqModel* s = find(id);
      const std::int64_t l = layer_for_start >= 0 ? layer_for_start : uniform(0, L() - 1);
      std::int64_t start = s != nullptr ? s->planes[static_cast<std::size_t>(l)].next : 0;
      if (allow_bad && chance(4)) start += pick({-1, 1, 5});
      std::int64_t count = chance(75) ? uniform(1, 12) : uniform(1, 48);
      if (chance(3)) count = uniform(opt_.context - start - 2, opt_.context - start + 2);
      if (allow_bad && chance(2)) count = pick({0, -1});
      if (count > 400) count = 400;
      if (count < -1) count = 1;
      spans.push_back(SeqSpan{id, start, count});
    }
    return spans;
  }

  std::string spans_str(const std::vector<SeqSpan>& spans) const {
    std::string s = "[";
    for (const auto& sp : spans)
      s += " " + name(sp.seq) + "@" + std::to_string(sp.start) + "+" + std::to_string(sp.count);
    return s + " ]";
  }

  // Whether storing `spans` into `layers` must succeed.
  // `continues`: the spans name live sequences once each and continue every
  // layer, so that only a plane's limit or the pool can refuse them;
  // `placed`: they also fit every plane, whatever the pool holds
  // (blocks_needed then counts the blocks they take).
  // The code of a refusal of spans that continue their planes: within every
  // limit (placed), only the pool can refuse them.
  static ErrorCode limit_or_pool(bool placed) {
    return placed ? ErrorCode::kResourceExhausted : ErrorCode::kCapacityExceeded;
  }

  bool store_ok(const std::vector<SeqSpan>& spans, const std::vector<std::int64_t>& layers,
                std::int64_t* blocks_needed = nullptr, bool* placed = nullptr, bool* continues = nullptr) {
    std::int64_t need = 0;
    bool valid = true, next = true;
    std::vector<SeqId> seen;
    if (placed != nullptr) *placed = false;
    if (continues != nullptr) *continues = false;
    for (const auto& sp : spans) {
      SeqModel* s = live(sp.seq);
      if (s == nullptr || sp.count < 1) return false;
      if (std::find(seen.begin(), seen.end(), sp.seq) != seen.end()) return false;
      seen.push_back(sp.seq);
      for (const std::int64_t l : layers) {
        const PlaneModel& p = s->planes[static_cast<std::size_t>(l)];
        if (sp.start != p.next) next = false;
        if (sp.start != p.next || sp.start + sp.count > limit(l)) valid = false;
        else need += store_blocks(*s, l, sp.start, sp.count);
      }
    }
    // When every holder of a shared block writes into it, one keeps it.
    if (valid)
      for (const std::int64_t l : layers) {
        if (!full(l)) continue;
        std::map<std::int64_t, std::int64_t> writers;
        for (const auto& sp : spans) {
          const PlaneModel& p = live(sp.seq)->planes[static_cast<std::size_t>(l)];
          const auto first = static_cast<std::size_t>(sp.start / opt_.block_rows);
          if (first < p.blocks.size() && refs(l, p.blocks[first]) > 1) ++writers[p.blocks[first]];
        }
        for (const auto& [block, n] : writers) need -= n == refs(l, block) ? 1 : 0;
      }
    if (blocks_needed != nullptr) *blocks_needed = need;
    if (placed != nullptr) *placed = valid && !spans.empty();
    if (continues != nullptr) *continues = next && !spans.empty();
    return valid && need <= model_free();
  }

  void op_store(bool all_layers) {
    std::int64_t layer = all_layers ? -1 : uniform(0, L() - 1);
    std::vector<SeqSpan> spans;
    // Single-layer stores mostly bring a lagging layer level with the rest
    // (an engine stores layer by layer).
    if (!all_layers)
      for (const auto& sm : seqs_) {
        if (sm.detached || model_next(sm)) continue;
        std::int64_t lo = 0, hi = 0;
        for (std::int64_t l = 0; l < L(); ++l) {
          if (sm.planes[static_cast<std::size_t>(l)].next < sm.planes[static_cast<std::size_t>(lo)].next) lo = l;
          hi = std::max(hi, sm.planes[static_cast<std::size_t>(l)].next);
        }
        const std::int64_t start = sm.planes[static_cast<std::size_t>(lo)].next;
        layer = lo;
        spans.push_back(SeqSpan{sm.id, start, std::min<std::int64_t>(hi - start, 400)});
        break;
      }
    if (spans.empty()) spans = make_spans(all_layers ? uniform(0, L() - 1) : layer, chance(50));
    std::int64_t rows = 0;
    for (const auto& sp : spans) rows += std::max<std::int64_t>(0, sp.count);
    const std::int64_t nl = all_layers ? L() : 1;
    Input k = make_input(rows * nl, kv(), false), v = make_input(rows * nl, kv(), false);
    bool view_ok = true;
    if (chance(3)) {
      k.view.rows += 1;
      view_ok = false;
    }
    describe(std::string(all_layers ? "store_all_layers " : "store layer " + std::to_string(layer) + " ") +
             spans_str(spans) + (view_ok ? "" : " (k has a row too many)"));
    std::vector<std::int64_t> layers;
    if (all_layers)
      for (std::int64_t l = 0; l < L(); ++l) layers.push_back(l);
    else
      layers.push_back(layer);
    std::int64_t need = 0;
    bool placed = false, continues = false;
    bool expect = store_ok(spans, layers, &need, &placed, &continues) && view_ok;
    for (const auto& sp : spans)
      if (sp.count < 1) expect = false;
    if (spans.empty()) expect = view_ok;
    // blocks_to_store counts the blocks of every full layer of valid spans,
    // whether the pool holds them or not.
    if (all_layers && placed) {
      auto b = store_->blocks_to_store(spans);
      if (!b || *b != need)
        return void(fail("blocks_to_store " + (b ? std::to_string(*b) : b.error().to_string()) +
                         ", the model " + std::to_string(need)));
    }
    const StoreImage before = image();
    const Status st = all_layers ? store_->store_all_layers(spans, k.view, v.view)
                                 : store_->store(layer, spans, k.view, v.view);
    // Spans that continue every plane are refused only for a plane's limit
    // or, within the limits, the pool.
    if (!outcome(st, expect, before, continues && view_ok ? std::optional(limit_or_pool(placed)) : std::nullopt) ||
        !st.ok())
      return;
    std::size_t row = 0;
    for (const std::int64_t l : layers) {
      for (const auto& sp : spans) {
        append(*find(sp.seq), l, sp.count, k.rows, v.rows, row);
        row += static_cast<std::size_t>(sp.count);
      }
    }
  }

  // Prefill of one layer, or (mostly) the same chunks through every layer in
  // turn, as an engine runs them.
  void op_prefill() {
    if (chance(40)) {
      const std::int64_t layer = uniform(0, L() - 1);
      prefill_layer(layer, make_spans(layer, chance(50)));
      return;
    }
    const std::vector<SeqSpan> spans = make_spans(0, chance(20));
    for (std::int64_t l = 0; l < L() && ok_; ++l) {
      if (!prefill_layer(l, spans)) return;
      if (l + 1 < L()) check_model();
    }
  }

  bool prefill_layer(std::int64_t layer, std::vector<SeqSpan> spans) {
    std::int64_t rows = 0;
    for (const auto& sp : spans) rows += std::max<std::int64_t>(0, sp.count);
    Input k = make_input(rows, kv(), false), v = make_input(rows, kv(), false);
    Input q = make_input(rows, width(), true);
    std::vector<float> out(static_cast<std::size_t>(std::max<std::int64_t>(1, rows * width())), -7.0f);
    MutView ov{out.data(), MemorySpace::kHost, DType::kF32, rows, width(), width()};
    describe("prefill layer " + std::to_string(layer) + " " + spans_str(spans));
    bool continues = false, placed = false;
    bool expect = store_ok(spans, {layer}, nullptr, &placed, &continues);
    for (const auto& sp : spans) {
      if (sp.count < 1) expect = false;
      SeqModel* s = live(sp.seq);
      if (s == nullptr) continue;
      const PlaneModel& p = s->planes[static_cast<std::size_t>(layer)];
      const std::int64_t lo = visible_begin(cfg_, cfg_.kind(layer), sp.start);
      if (lo < sp.start && lo < p.origin) expect = continues = false;
    }
    if (spans.empty()) expect = true;
    const StoreImage before = image();
    const Status st = store_->prefill(layer, spans, k.view, v.view, q.view, ov);
    if (!outcome(st, expect, before, continues ? std::optional(limit_or_pool(placed)) : std::nullopt) ||
        !st.ok())
      return false;
    std::size_t row = 0;
    for (const auto& sp : spans) {
      append(*find(sp.seq), layer, sp.count, k.rows, v.rows, row);
      row += static_cast<std::size_t>(sp.count);
    }
    row = 0;
    for (const auto& sp : spans)
      for (std::int64_t i = 0; i < sp.count; ++i, ++row)
        if (!check_outputs(*find(sp.seq), layer, sp.start + i, q.values.data() + row * width(),
                           out.data() + row * width()))
          return false;
    return true;
  }

  void op_decode() {
    const std::int64_t layer = uniform(0, L() - 1);
    std::int64_t n = uniform(chance(5) ? 0 : 1, 6);
    std::vector<SeqQuery> queries;
    std::vector<SeqId> ready;
    for (const auto& sm : seqs_)
      if (!sm.detached && sm.planes[static_cast<std::size_t>(layer)].next > 0) ready.push_back(sm.id);
    if (ready.empty()) n = std::min<std::int64_t>(n, 1);
    for (std::int64_t i = 0; i < n; ++i) {
      const SeqId id = !ready.empty() && chance(95) ? ready[static_cast<std::size_t>(uniform(0, ready.size() - 1))]
                                                    : any_seq(30);
      const SeqModel* s = find(id);
      std::int64_t pos = 0;
      if (s != nullptr) {
        const PlaneModel& p = s->planes[static_cast<std::size_t>(layer)];
        pos = p.next - 1 - (chance(70) ? 0 : uniform(0, std::max<std::int64_t>(0, p.next - p.origin - 1)));
        if (chance(2)) pos = p.next;
        if (chance(2)) pos = p.origin - 1;
      }
      queries.push_back(SeqQuery{id, pos});
    }
    Input q = make_input(n, width(), true);
    std::vector<float> out(static_cast<std::size_t>(std::max<std::int64_t>(1, n * width())), -7.0f);
    MutView ov{out.data(), MemorySpace::kHost, DType::kF32, n, width(), width()};
    const bool in_place = q.view.dtype == DType::kF32 && chance(30);
    if (in_place) ov = MutView{const_cast<void*>(q.view.data), MemorySpace::kHost, DType::kF32, n, width(), q.view.row_stride};
    std::string d = "attend_decode layer " + std::to_string(layer) + (in_place ? " in place" : "") + " [";
    for (const auto& qu : queries) d += " " + name(qu.seq) + "@" + std::to_string(qu.position);
    describe(d + " ]");
    bool expect = true;
    for (const auto& qu : queries) {
      const SeqModel* s = live(qu.seq);
      if (s == nullptr) {
        expect = false;
        continue;
      }
      const PlaneModel& p = s->planes[static_cast<std::size_t>(layer)];
      const std::int64_t lo = visible_begin(cfg_, cfg_.kind(layer), qu.position);
      if (qu.position < p.origin || qu.position >= p.next || lo < p.origin) expect = false;
    }
    const StoreImage before = image();
    const Status st = store_->attend_decode(layer, queries, q.view, ov);
    if (!outcome(st, expect, before) || !st.ok()) return;
    for (std::int64_t i = 0; i < n; ++i) {
      const float* o = static_cast<const float*>(ov.data) + i * ov.row_stride;
      if (!check_outputs(*find(queries[static_cast<std::size_t>(i)].seq), layer,
                         queries[static_cast<std::size_t>(i)].position, q.values.data() + i * width(), o))
        return;
    }
  }

  // A ring state for plane l: mostly one install() accepts, sometimes not.
  RingState make_ring(std::int64_t l, bool* valid, std::int64_t at = -1) {
    const std::int64_t c = cap(l);
    *valid = true;
    const int kind = static_cast<int>(uniform(0, 99));
    if (kind < 4) {
      *valid = false;
      return full(l) ? RingState::full(c + 1) : RingState::sliding(c - 1);
    }
    if (kind < 7) {
      *valid = false;
      return full(l) ? RingState::sliding(c) : RingState::full(c);
    }
    if (kind < 10 && !full(l)) {
      // A full sliding ring at another rotation.
      const std::int64_t o = uniform(1, 3 * c);
      auto r = RingState::from_parts(c, true, c, o, (o + 1) % c);
      *valid = false;
      return *r;
    }
    std::int64_t n = full(l) ? uniform(0, c) : uniform(0, std::min<std::int64_t>(3 * c, 600));
    if (chance(30)) n = uniform(0, 3 * opt_.block_rows);
    if (at >= 0 && chance(60)) n = at;
    if (full(l)) n = std::min(n, c);
    RingState r = *RingState::sequential(c, !full(l), n);
    if (!full(l) && chance(20) && r.len() > 0) r = *r.rolled_back(uniform(0, r.len()));
    if (r.next_position() > limit(l)) *valid = false;
    // Rolled back past the rows a ring without slack holds at its end.
    if (!full(l) && r.origin_logical() > std::max<std::int64_t>(0, r.next_position() - (c - opt_.slack)))
      *valid = false;
    return r;
  }

  std::string ring_str(const RingState& r) const {
    return "ring(cap " + std::to_string(r.capacity()) + (r.wraps() ? " sliding" : " full") + ", len " +
           std::to_string(r.len()) + ", origin " + std::to_string(r.origin_logical()) + "/" +
           std::to_string(r.origin_physical()) + ")";
  }

  // Whether an install of `ring` into plane l of `s` fits the pool.
  bool install_fits(const SeqModel& s, std::int64_t l, const RingState& ring) const {
    return install_blocks(s, l, ring.len()).first <= model_free();
  }

  bool check_install_blocks(const SeqModel& s, std::int64_t l, const RingState& ring) {
    if (ring.len() > cap(l)) return true;
    auto b = store_->blocks_to_install(s.id, l, ring.len());
    const auto [take, give] = install_blocks(s, l, ring.len());
    // Of the blocks taken, those that replace blocks shared with a fork.
    std::int64_t shared = 0;
    if (full(l)) {
      const PlaneModel& p = s.planes[static_cast<std::size_t>(l)];
      const auto n = static_cast<std::size_t>(ceil_div(ring.len(), opt_.block_rows));
      for (std::size_t i = 0; i < std::min(n, p.blocks.size()); ++i) shared += refs(l, p.blocks[i]) > 1;
    }
    if (!b || b->take != take || b->give != give || b->shared != shared)
      return fail("blocks_to_install " + (b ? std::to_string(b->take) + "/" + std::to_string(b->give) + "/" +
                                                  std::to_string(b->shared)
                                             : b.error().to_string()) +
                  ", the model " + std::to_string(take) + "/" + std::to_string(give) + "/" +
                  std::to_string(shared));
    return true;
  }

  void op_install() {
    const SeqId id = any_seq(6);
    const std::int64_t l = chance(50) ? full_or_any() : uniform(0, L() - 1);
    bool valid = true;
    const SeqModel* target = find(id);
    const RingState ring =
        make_ring(l, &valid, target == nullptr ? -1 : target->detached ? target->plan : model_next(*target).value_or(-1));
    Input k = make_input(ring.len(), kv(), false), v = make_input(ring.len(), kv(), false);
    std::vector<std::uint16_t> kb, vb;
    for (const auto& r : k.rows) kb.insert(kb.end(), r.begin(), r.end());
    for (const auto& r : v.rows) vb.insert(vb.end(), r.begin(), r.end());
    const bool null_rows = ring.len() > 0 && chance(3);
    describe("install " + name(id) + " layer " + std::to_string(l) + " " + ring_str(ring) +
             (null_rows ? " with null rows" : ""));
    SeqModel* s = find(id);
    if (s != nullptr && valid && !check_install_blocks(*s, l, ring)) return;
    const bool expect = s != nullptr && valid && !null_rows && install_fits(*s, l, ring);
    const StoreImage before = image();
    const Status st = store_->install(id, l, ring, null_rows ? nullptr : kb.data(), vb.data());
    std::optional<ErrorCode> code;
    if (s == nullptr) code = ErrorCode::kNotFound;
    else if (valid && !null_rows) code = ErrorCode::kResourceExhausted;
    if (!outcome(st, expect, before, code) || !st.ok()) return;
    install_model(*s, l, ring, &k.rows, &v.rows);
  }

  SeqId detached_or_any() {
    std::vector<SeqId> ids;
    for (const auto& s : seqs_)
      if (s.detached) ids.push_back(s.id);
    if (!ids.empty() && chance(85)) return ids[static_cast<std::size_t>(uniform(0, ids.size() - 1))];
    return any_seq(20);
  }

  void op_install_plane() {
    const SeqId id = detached_or_any();
    const std::int64_t l = chance(50) ? full_or_any() : uniform(0, L() - 1);
    bool valid = true;
    const SeqModel* target = find(id);
    const RingState ring =
        make_ring(l, &valid, target == nullptr ? -1 : target->detached ? target->plan : model_next(*target).value_or(-1));
    describe("install_plane " + name(id) + " layer " + std::to_string(l) + " " + ring_str(ring));
    SeqModel* s = find(id);
    const bool expect = s != nullptr && s->detached && valid && install_fits(*s, l, ring);
    const StoreImage before = image();
    const Status st = store_->install_plane(id, l, ring);
    std::optional<ErrorCode> code;
    if (s == nullptr) code = ErrorCode::kNotFound;
    else if (s->detached && valid) code = ErrorCode::kResourceExhausted;
    if (!outcome(st, expect, before, code) || !st.ok()) return;
    install_model(*s, l, ring, nullptr, nullptr);
  }

  void op_install_rows() {
    const SeqId id = detached_or_any();
    const std::int64_t l = uniform(0, L() - 1);
    SeqModel* s = find(id);
    std::int64_t first = 0, count = 1;
    if (s != nullptr) {
      const PlaneModel& p = s->planes[static_cast<std::size_t>(l)];
      // Mostly the first unwritten stretch of live rows.
      first = p.origin;
      while (first < p.next && !p.k[static_cast<std::size_t>(first)].empty()) ++first;
      if (first == p.next || chance(30)) first = p.origin + uniform(0, std::max<std::int64_t>(0, p.next - p.origin - 1));
      count = chance(60) ? p.next - first : uniform(0, std::max<std::int64_t>(1, p.next - first + 1));
      if (chance(5)) first -= 1;
    }
    Input k = make_input(std::max<std::int64_t>(0, count), kv(), false), v = make_input(std::max<std::int64_t>(0, count), kv(), false);
    std::vector<std::uint16_t> kb, vb;
    for (const auto& r : k.rows) kb.insert(kb.end(), r.begin(), r.end());
    for (const auto& r : v.rows) vb.insert(vb.end(), r.begin(), r.end());
    kb.push_back(0);
    vb.push_back(0);
    describe("install_rows " + name(id) + " layer " + std::to_string(l) + " [" + std::to_string(first) +
             ", +" + std::to_string(count) + ")");
    bool expect = s != nullptr && s->detached;
    if (expect && count != 0) {
      const PlaneModel& p = s->planes[static_cast<std::size_t>(l)];
      if (count < 0 || first < p.origin || first + count > p.next) expect = false;
    }
    const StoreImage before = image();
    const Status st = store_->install_rows(id, l, first, count, kb.data(), vb.data());
    if (!outcome(st, expect, before) || !st.ok()) return;
    for (std::int64_t i = 0; i < count; ++i)
      set_row(s->planes[static_cast<std::size_t>(l)], l, first + i, k.rows[static_cast<std::size_t>(i)],
              v.rows[static_cast<std::size_t>(i)]);
  }

  void op_attach() {
    if (std::none_of(seqs_.begin(), seqs_.end(), [](const SeqModel& m) { return m.detached; }) &&
        chance(80))
      return op_add(true);
    const SeqId id = detached_or_any();
    describe("attach_sequence " + name(id));
    SeqModel* s = find(id);
    const StoreImage before = image();
    const Status st = store_->attach_sequence(id);
    if (!outcome(st, s != nullptr && s->detached && whole(*s), before) || !st.ok()) return;
    s->detached = false;
  }
  // Every plane ends at one position and every live row was written.
  bool whole(const SeqModel& s) const {
    if (!model_next(s)) return false;
    for (const PlaneModel& p : s.planes)
      for (std::int64_t x = p.origin; x < p.next; ++x)
        if (p.k[static_cast<std::size_t>(x)].empty()) return false;
    return true;
  }

  // A snapshot of a live sequence, checked against the model.
  void op_snapshot() {
    const SeqId id = any_seq(8);
    describe("take_snapshot " + name(id));
    SeqModel* s = live(id);
    bool expect = s != nullptr && model_next(*s).has_value();
    if (expect)
      for (std::int64_t l = 0; l < L(); ++l) {
        const auto r = RingState::sequential(cfg_.plane_capacity(l, opt_.context), !full(l), *model_next(*s));
        if (!r || r->origin_logical() < s->planes[static_cast<std::size_t>(l)].origin) expect = false;
      }
    const StoreImage before = image();
    auto snap = take_snapshot(*store_, id);
    if (!(image() == before)) return void(fail("take_snapshot changed the store"));
    if (snap.ok() != expect)
      return void(fail(std::string("take_snapshot ") + (snap.ok() ? "succeeded" : snap.error().to_string()) +
                       ", the model expected " + (expect ? "success" : "a refusal")));
    if (!snap) {
      if (snap.error().code == ErrorCode::kInternal)
        fail("take_snapshot refused as an internal error: " + snap.error().to_string());
      return;
    }
    if (Status v = validate_snapshot(*snap); !v.ok()) return void(fail("snapshot invalid: " + v.to_string()));
    for (std::int64_t l = 0; l < L(); ++l) {
      const PlaneSnapshot& p = snap->planes[static_cast<std::size_t>(l)];
      const PlaneModel& m = s->planes[static_cast<std::size_t>(l)];
      for (std::int64_t i = 0; i < p.ring.len(); ++i) {
        const Row& mk = m.k[static_cast<std::size_t>(p.ring.origin_logical() + i)];
        const Row& mv = m.v[static_cast<std::size_t>(p.ring.origin_logical() + i)];
        if (mk.empty()) continue;
        if (std::memcmp(mk.data(), p.k.data() + i * kv(), static_cast<std::size_t>(kv()) * 2) != 0 ||
            std::memcmp(mv.data(), p.v.data() + i * kv(), static_cast<std::size_t>(kv()) * 2) != 0)
          return void(fail("snapshot layer " + std::to_string(l) + " row " + std::to_string(i) +
                           " differs from the model"));
      }
    }
    // Into a store of another slack and block size: the same rows.
    if (Status r = restore(*snap, *ref_, ref_seq_); !r.ok())
      return void(fail("restore into the reference store: " + r.to_string()));
    for (std::int64_t l = 0; l < L(); ++l) {
      const PlaneSnapshot& p = snap->planes[static_cast<std::size_t>(l)];
      auto r = ref_->ring(ref_seq_, l);
      if (!r || r->next_position() != snap->token_count || r->len() != p.ring.len())
        return void(fail("reference store: restored layer " + std::to_string(l) + " holds another ring"));
      std::vector<std::uint16_t> k(p.k.size()), v(p.v.size());
      if (p.ring.len() > 0 &&
          (!ref_->read_rows(ref_seq_, l, r->origin_logical(), r->len(), k.data(), v.data()).ok() ||
           std::memcmp(k.data(), p.k.data(), k.size() * 2) != 0 || std::memcmp(v.data(), p.v.data(), v.size() * 2) != 0))
        return void(fail("reference store: restored layer " + std::to_string(l) + " holds other rows"));
    }
    if (!restore_elsewhere(*snap)) return;
    snaps_.push_back(std::move(*snap));
    if (snaps_.size() > 6) snaps_.erase(snaps_.begin());
  }

  // Restores `snap` into the store of another context and slack: refused,
  // changing nothing, exactly where a plane there cannot take what the
  // snapshot holds (a full plane shorter than its positions, a ring shorter
  // than the window stopping at the context, a ring needing rows it does not
  // record); otherwise each plane holds the snapshot's last rows.
  bool restore_elsewhere(const Snapshot& snap) {
    KvStore& x = *other_;
    const std::int64_t n = snap.token_count, slack = x.options().slack;
    const std::string where = "restore into a store of context " + std::to_string(x.context()) +
                              ", slack " + std::to_string(slack) + ": ";
    bool expect = true;
    std::vector<RingState> before;
    for (std::int64_t l = 0; l < L(); ++l) {
      const std::int64_t unslacked = cfg_.plane_capacity(l, x.context());
      if (full(l) && n > unslacked) expect = false;
      if (!full(l) && unslacked < cfg_.sliding_window && n > x.context()) expect = false;
      if (std::min(n, unslacked) > snap.planes[static_cast<std::size_t>(l)].ring.len()) expect = false;
      before.push_back(*x.ring(other_seq_, l));
    }
    const Status st = restore(snap, x, other_seq_);
    (st.ok() ? stats_["restore_elsewhere"].first : stats_["restore_elsewhere"].second) += 1;
    if (st.ok() != expect)
      return fail(where + (st.ok() ? "succeeded" : st.to_string()) + ", the model expected " +
                  (expect ? "success" : "a refusal"));
    for (std::int64_t l = 0; l < L(); ++l) {
      const PlaneSnapshot& p = snap.planes[static_cast<std::size_t>(l)];
      auto r = x.ring(other_seq_, l);
      if (!st.ok()) {
        if (!(*r == before[static_cast<std::size_t>(l)])) return fail(where + "refused but the store changed");
        continue;
      }
      const std::int64_t c = cfg_.plane_capacity(l, x.context()) + (full(l) ? 0 : slack);
      const std::int64_t rows = std::min({n, c, p.ring.len()});
      if (r->next_position() != n || r->len() != rows)
        return fail(where + "layer " + std::to_string(l) + " holds " + ring_str(*r) + ", the model " +
                    std::to_string(rows) + " rows to position " + std::to_string(n));
      const auto skip = static_cast<std::size_t>((p.ring.len() - rows) * kv());
      std::vector<std::uint16_t> k(p.k.size() - skip + 1), v(k.size());
      if (!x.read_rows(other_seq_, l, n - rows, rows, k.data(), v.data()).ok() ||
          !std::equal(p.k.begin() + static_cast<std::ptrdiff_t>(skip), p.k.end(), k.begin()) ||
          !std::equal(p.v.begin() + static_cast<std::ptrdiff_t>(skip), p.v.end(), v.begin()))
        return fail(where + "layer " + std::to_string(l) + " holds other rows than the snapshot's last");
    }
    return true;
  }

  // A snapshot to restore: mostly one taken, sometimes corrupted.
  const Snapshot* pick_snapshot(Snapshot& scratch, bool* valid) {
    *valid = true;
    if (snaps_.empty()) return nullptr;
    const Snapshot& s = snaps_[static_cast<std::size_t>(uniform(0, snaps_.size() - 1))];
    if (!chance(12)) return &s;
    scratch = s;
    *valid = false;
    switch (uniform(0, 3)) {
      case 0: scratch.token_count += 1; break;
      case 1:
        if (scratch.planes[first_full()].k.empty()) scratch.planes[first_full()].k.push_back(0);
        else scratch.planes[first_full()].k.pop_back();
        break;
      case 2: scratch.config.n_heads *= 2; break;
      default: scratch.planes.pop_back(); break;
    }
    return &scratch;
  }

  // Whether the snapshot's full planes fit the pool in some order of installs
  // into `s` (null: a new sequence).
  bool restore_fits(const Snapshot& snap, const SeqModel& s) const {
    std::vector<std::pair<std::int64_t, std::int64_t>> planes;
    for (std::int64_t l = 0; l < L(); ++l)
      if (full(l)) planes.push_back(install_blocks(s, l, snap.planes[static_cast<std::size_t>(l)].ring.len()));
    std::sort(planes.begin(), planes.end());
    do {
      std::int64_t left = model_free();
      bool fits = true;
      for (const auto& [take, give] : planes) {
        if (take > left) fits = false;
        left += give - take;
      }
      if (fits) return true;
    } while (std::next_permutation(planes.begin(), planes.end()));
    return false;
  }

  // The ring plane l gets from a snapshot (taken from this store): its
  // rows at the rotation a sequentially built ring has.
  RingState restored_ring(const Snapshot& snap, std::int64_t l) const {
    const PlaneSnapshot& p = snap.planes[static_cast<std::size_t>(l)];
    const std::int64_t c = cap(l);
    if (full(l)) return *RingState::sequential(c, false, snap.token_count);
    return *RingState::sequential(c, true, p.ring.origin_logical() + c)->rolled_back(c - p.ring.len());
  }

  // restore_ring() agrees with the model for every layer.
  bool check_restore_rings(const Snapshot& snap) {
    for (std::int64_t l = 0; l < L(); ++l) {
      auto r = restore_ring(snap, l, *store_);
      if (!r || !(*r == restored_ring(snap, l)))
        return fail("restore_ring layer " + std::to_string(l) + ": " +
                    (r ? ring_str(*r) : r.error().to_string()) + ", the model " +
                    ring_str(restored_ring(snap, l)));
    }
    return true;
  }

  void restore_model(SeqModel& s, const Snapshot& snap) {
    for (std::int64_t l = 0; l < L(); ++l) {
      const PlaneSnapshot& p = snap.planes[static_cast<std::size_t>(l)];
      std::vector<Row> k, v;
      for (std::int64_t i = 0; i < p.ring.len(); ++i) {
        k.emplace_back(p.k.begin() + i * kv(), p.k.begin() + (i + 1) * kv());
        v.emplace_back(p.v.begin() + i * kv(), p.v.begin() + (i + 1) * kv());
      }
      install_model(s, l, restored_ring(snap, l), &k, &v);
    }
  }

  void op_restore() {
    Snapshot scratch;
    bool valid = true;
    const Snapshot* snap = pick_snapshot(scratch, &valid);
    if (snap == nullptr) return op_snapshot();
    const SeqId id = any_seq(8);
    describe("restore " + std::to_string(snap->token_count) + " tokens into " + name(id) +
             (valid ? "" : " (a corrupted snapshot)"));
    SeqModel* s = live(id);
    if (valid && !check_restore_rings(*snap)) return;
    const bool expect = s != nullptr && valid && restore_fits(*snap, *s);
    const StoreImage before = image();
    const Status st = restore(*snap, *store_, id);
    std::optional<ErrorCode> code;
    if (s == nullptr) code = ErrorCode::kNotFound;
    else if (valid) code = ErrorCode::kResourceExhausted;
    if (!outcome(st, expect, before, code) || !st.ok()) return;
    restore_model(*s, *snap);
  }

  void op_restore_new() {
    Snapshot scratch;
    bool valid = true;
    const Snapshot* snap = pick_snapshot(scratch, &valid);
    if (snap == nullptr) return op_snapshot();
    describe(std::string("restore_new_sequence ") + std::to_string(snap->token_count) + " tokens" +
             (valid ? "" : " (a corrupted snapshot)"));
    const SeqModel empty = fresh_model(SeqId{}, false);
    const bool expect = valid && slot_free() && restore_fits(*snap, empty);
    const StoreImage before = image();
    auto id = restore_new_sequence(*snap, *store_);
    if (!outcome(id.ok() ? Status::Ok() : Status(id.error()), expect, before,
                 valid ? std::optional(ErrorCode::kResourceExhausted) : std::nullopt) ||
        !id)
      return;
    SeqModel m = fresh_model(*id, false);
    restore_model(m, *snap);
    seqs_.push_back(std::move(m));
    describe("restore_new_sequence -> " + name(*id));
  }

  BackendKind backend_;
  Geometry geometry_;
  std::uint64_t seed_;
  std::mt19937_64 rng_;
  std::mt19937_64 check_rng_{seed_ ^ 0x9e3779b97f4a7c15ull};
  Stats& stats_;
  std::function<void()> before_step_;
  ModelConfig cfg_;
  StoreOptions opt_;
  std::unique_ptr<KvStore> store_, ref_;
  SeqId ref_seq_{};
  std::unique_ptr<KvStore> other_;
  SeqId other_seq_{};
  std::vector<SeqModel> seqs_;
  std::vector<SeqId> dead_;
  std::vector<Snapshot> snaps_;
  std::int64_t next_block_ = 0;
  std::int64_t op_ = 0;
  bool ok_ = true;
  bool verbose_ = env_or("KVRING_MODEL_VERBOSE", 0) != 0;
  std::string header_, desc_;
  std::vector<std::string> history_;
};
// Runs the harness over seeds (KVRING_MODEL_FIRST_SEED on, default 1;
// KVRING_MODEL_SEEDS of them, default `seeds`; KVRING_MODEL_OPS operations
// each, default `ops`), stops after three failing seeds, and prints what
// the run exercised. `before_step` runs before each operation.
inline void run_seeds(BackendKind backend, Geometry geometry, std::uint64_t seeds, std::int64_t ops,
                      const std::function<void()>& before_step = {}) {
  seeds = env_or("KVRING_MODEL_SEEDS", seeds);
  ops = static_cast<std::int64_t>(env_or("KVRING_MODEL_OPS", static_cast<std::uint64_t>(ops)));
  const std::uint64_t first = env_or("KVRING_MODEL_FIRST_SEED", 1);
  Stats stats;
  std::int64_t total = 0;
  int failed = 0;
  for (std::uint64_t seed = first; seed < first + seeds; ++seed) {
    Harness h(backend, geometry, seed, stats, before_step);
    if (!h.run(ops)) ++failed;
    total += h.ops_done();
    if (env_or("KVRING_MODEL_PROGRESS", 0) != 0)
      std::fprintf(stderr, "seed %llu: %lld ops, %d failed so far\n", static_cast<unsigned long long>(seed),
                   static_cast<long long>(h.ops_done()), failed);
    if (failed >= 3) break;
  }
  EXPECT_EQ(failed, 0);
  for (const auto& [kind, n] : stats)
    std::printf("  %-22s %6lld ok %6lld refused\n", kind.c_str(), static_cast<long long>(n.first),
                static_cast<long long>(n.second));
  std::printf("store model (%s): %lld operations over %llu seeds\n", backend_name(backend),
              static_cast<long long>(total), static_cast<unsigned long long>(seeds));
}

}  // namespace kvring::store_model
