// The CPU backend of KvStore (host memory); make_store picks it. The class
// is open to tests, which stand in for a device's failures by overriding
// write_rows or tables_changed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention_cpu.h"
#include "host_pages.h"
#include "parallel.h"
#include "core/view_rows.h"
#include "kvring/store.h"

namespace kvring {

class CpuStore : public KvStore {
 public:
  CpuStore(ModelConfig config, StoreOptions o) : KvStore(std::move(config), o) {}

  // Calls that write at least this many bytes of K and V rows write them
  // with non-temporal stores (write_rows).
  static constexpr std::int64_t kStreamBytes = std::int64_t{4} << 20;

  Status allocate() {
    // Zero-filled on purpose: no row ever exposes uninitialized storage.
    // The mapping's pages are zero and mapped on first touch, so a pool
    // sized for the worst case costs memory only where rows land.
    auto alloc = [](std::size_t n) { return Buffer{cpu::HostPages::allocate(n * 2)}; };
    const auto ring_elems = static_cast<std::size_t>(options_.max_sequences * ring_elems_one());
    for (std::int64_t l = 0; l < n_layers(); ++l) {
      if (full_index(l) >= 0) {
        rings_.emplace_back();
        continue;
      }
      Plane p{alloc(ring_elems), alloc(ring_elems)};
      if (!p.k || !p.v) return out_of_memory("sliding rings of layer " + std::to_string(l), ring_elems * 2);
      rings_.push_back(std::move(p));
    }
    const auto pool_elems = static_cast<std::size_t>(pool_blocks() * block_elems());
    pool_ = Plane{alloc(pool_elems), alloc(pool_elems)};
    if (!pool_.k || !pool_.v) return out_of_memory("block pool", pool_elems * 2);
    rings_made_zero();
    return Status::Ok();
  }

  BackendKind backend() const override { return BackendKind::kCpu; }
  Status synchronize(cudaStream_t) const override { return Status::Ok(); }

 protected:
  // Host memory carries no extent to check `bytes` against.
  Status check_view(const char* what, MemorySpace space, DType dtype, const void* data,
                    std::uint64_t) const override {
    if (space != MemorySpace::kHost)
      return make_error(ErrorCode::kUnsupported,
                        std::string(what) + " is device memory; the CPU backend reads host memory");
    // 16-bit data (views and row buffers) is read byte-wise, so any address
    // works; f32 views are read and written as floats.
    if (dtype == DType::kF32 &&
        reinterpret_cast<std::uintptr_t>(data) % static_cast<std::uintptr_t>(dtype_bytes(dtype)) != 0)
      return invalid_argument(std::string(what) + " is not aligned to its " + dtype_name(dtype) +
                              " elements");
    return Status::Ok();
  }

  // The CPU store reads the host's tables: there is no mirror to change.
  Status write_rows(std::span<const TableChange>, std::span<const RowWrite> writes,
                    const ConstView& k, const ConstView& v, cudaStream_t) override {
    // Writes of one call never share a row (a sequence appears once per
    // layer), so they run on all cores: each task takes a run of
    // consecutive writes of at least kRowsPerTask rows in all (a decode
    // step's thousands of one-row writes are then tens of tasks, not
    // thousands).
    constexpr std::int64_t kRowsPerTask = 64;
    rows_written_ = true;
    const std::int64_t kv_dim = config_.kv_dim();
    const auto n = static_cast<std::int64_t>(writes.size());
    std::int64_t rows = 0;
    for (const RowWrite& w : writes) rows += w.placement.live_rows;
    const std::int64_t tasks = std::clamp<std::int64_t>(rows / kRowsPerTask, 1, n);
    const bool f32 = k.dtype == DType::kF32 && v.dtype == DType::kF32;
    // A call that writes at least kStreamBytes of K and V streams them
    // (detail::f32_to_f16_row_stream): rows that many are read back from
    // memory, not cache, and a plain store would first read every line it
    // overwrites (docs/PERFORMANCE.md, "Streamed row writes").
    const bool stream = rows * kv_dim * 4 >= kStreamBytes;
    cpu::parallel_for(tasks, rows * kv_dim * 8, [&](std::int64_t t) {
      thread_local std::vector<std::uint16_t> rk, rv;
      rk.resize(static_cast<std::size_t>(kv_dim));
      rv.resize(rk.size());
      for (std::int64_t i = t * n / tasks; i < (t + 1) * n / tasks; ++i) {
        const RowWrite& w = writes[static_cast<std::size_t>(i)];
        const cpu::PlaneView pv = view(w.plane);
        std::uint16_t* pk = const_cast<std::uint16_t*>(pv.k);
        std::uint16_t* pvv = const_cast<std::uint16_t*>(pv.v);
        for (int s = 0; s < w.placement.n_spans; ++s) {
          const PhysicalSpan& span = w.placement.spans[static_cast<std::size_t>(s)];
          for (std::int64_t r = 0; r < span.rows; ++r) {
            const std::int64_t src = w.source_row + span.source_first + r;
            if (f32) {
              // f32 rows convert straight into the plane, head by head.
              put_row(pv, pk, pvv, span.physical_first + r, static_cast<const float*>(k.data) + src * k.row_stride,
                      static_cast<const float*>(v.data) + src * v.row_stride, stream);
              continue;
            }
            detail::row_to_f16(k, src, rk.data());
            detail::row_to_f16(v, src, rv.data());
            put_row(pv, pk, pvv, span.physical_first + r, rk.data(), rv.data(), stream);
          }
        }
      }
      if (stream) detail::stream_fence();
    });
    return Status::Ok();
  }

  Status attend(const AttendBatch& b) override {
    const std::int64_t kv_dim = config_.kv_dim();
    const std::int64_t width = config_.n_heads * config_.head_dim;
    const bool sliding = full_index(b.layer) < 0;
    const std::span<const float> sinks = attention_sinks(b.layer);
    const cpu::AttentionShape shape{config_.n_heads, config_.n_kv_heads, config_.head_dim,
                                    sliding ? config_.sliding_window : 0, config_.score_scale_dim(),
                                    sinks.empty() ? nullptr : sinks.data()};
    std::vector<std::uint16_t> ck, cv;
    std::vector<float> q;
    for (const AttendItem& it : b.items) {
      // The chunk's rows exactly as the store will hold them.
      if (b.chunk_k != nullptr) {
        ck.resize(static_cast<std::size_t>(it.n_queries * kv_dim));
        cv.resize(ck.size());
        for (std::int64_t r = 0; r < it.n_queries; ++r) {
          detail::row_to_f16(*b.chunk_k, it.chunk_row + r, ck.data() + r * kv_dim);
          detail::row_to_f16(*b.chunk_v, it.chunk_row + r, cv.data() + r * kv_dim);
        }
      }
      const float* qp = nullptr;
      std::int64_t q_stride = b.q->row_stride;
      if (b.q->dtype == DType::kF32) {
        qp = static_cast<const float*>(b.q->data) + it.q_row * b.q->row_stride;
      } else {
        q.resize(static_cast<std::size_t>(it.n_queries * width));
        for (std::int64_t r = 0; r < it.n_queries; ++r)
          detail::row_to_f32(*b.q, it.q_row + r, q.data() + r * width);
        qp = q.data();
        q_stride = width;
      }
      float* op = static_cast<float*>(b.out->data) + it.q_row * b.out->row_stride;
      const auto run = options().attention == AttentionNumeric::kF16 ? cpu::attend_f16 : cpu::attend;
      run(view(it.plane), it.ring, shape, it.first_position, it.n_queries, it.chunk_start,
          b.chunk_k ? ck.data() : nullptr, b.chunk_k ? cv.data() : nullptr, qp, q_stride, op,
          b.out->row_stride);
    }
    return Status::Ok();
  }

  // Host memory only: the base class refused device rows (check_view).
  Status copy_out(const PlaneRef& plane, const LiveSpans& spans, std::uint16_t* k,
                  std::uint16_t* v, MemorySpace, cudaStream_t) const override {
    const cpu::PlaneView pv = view(plane);
    const std::int64_t kv_dim = config_.kv_dim(), hd = config_.head_dim;
    std::int64_t out_row = 0;
    for (int s = 0; s < spans.n_spans; ++s) {
      const PhysicalSpan& span = spans.spans[static_cast<std::size_t>(s)];
      for (std::int64_t r = 0; r < span.rows; ++r, ++out_row)
        for (std::int64_t h = 0; h < config_.n_kv_heads; ++h) {
          const std::int64_t src = cpu::head_row_offset(pv, span.physical_first + r, h);
          std::memcpy(k + out_row * kv_dim + h * hd, pv.k + src, static_cast<std::size_t>(hd) * 2);
          std::memcpy(v + out_row * kv_dim + h * hd, pv.v + src, static_cast<std::size_t>(hd) * 2);
        }
    }
    return Status::Ok();
  }

  Status copy_in(const PlaneRef& plane, const LiveSpans& spans, const std::uint16_t* k,
                 const std::uint16_t* v, MemorySpace, cudaStream_t) override {
    const cpu::PlaneView pv = view(plane);
    std::int64_t in_row = 0;
    for (int s = 0; s < spans.n_spans; ++s) {
      const PhysicalSpan& span = spans.spans[static_cast<std::size_t>(s)];
      for (std::int64_t r = 0; r < span.rows; ++r, ++in_row)
        put_row(pv, const_cast<std::uint16_t*>(pv.k), const_cast<std::uint16_t*>(pv.v),
                span.physical_first + r, k + in_row * config_.kv_dim(),
                v + in_row * config_.kv_dim());
    }
    return Status::Ok();
  }

  Status read_ring(std::int32_t slot, std::int64_t layer, std::uint16_t* k,
                   std::uint16_t* v) const override {
    const auto n = static_cast<std::size_t>(ring_elems_one());
    std::memcpy(k, ring_k(slot, layer), n * 2);
    std::memcpy(v, ring_v(slot, layer), n * 2);
    return Status::Ok();
  }

  Status set_ring_rows(std::span<const RingRows> rows, cudaStream_t) override {
    for (const RingRows& r : rows) {
      const auto at = static_cast<std::size_t>(r.begin * config_.kv_dim());
      const auto n = static_cast<std::size_t>((r.end - r.begin) * config_.kv_dim()) * 2;
      if (r.from < 0) {
        std::memset(ring_k(r.to, r.layer) + at, 0, n);
        std::memset(ring_v(r.to, r.layer) + at, 0, n);
      } else {
        std::memcpy(ring_k(r.to, r.layer) + at, ring_k(r.from, r.layer) + at, n);
        std::memcpy(ring_v(r.to, r.layer) + at, ring_v(r.from, r.layer) + at, n);
      }
    }
    return Status::Ok();
  }

  Status copy_block(std::int32_t from, std::int32_t to, cudaStream_t) override {
    const auto n = static_cast<std::size_t>(block_elems());
    std::memcpy(pool_.k.get() + to * block_elems(), pool_.k.get() + from * block_elems(), n * 2);
    std::memcpy(pool_.v.get() + to * block_elems(), pool_.v.get() + from * block_elems(), n * 2);
    return Status::Ok();
  }

 private:
  // A plane's elements (f16 bits).
  struct Buffer {
    cpu::HostPages pages;
    std::uint16_t* get() const { return static_cast<std::uint16_t*>(pages.data()); }
    explicit operator bool() const { return static_cast<bool>(pages); }
  };
  struct Plane {
    Buffer k, v;
  };

  // A plane is mapped whole at creation and backed as rows land; a mapping
  // the host refuses (past what it may commit) refuses the store.
  static Status out_of_memory(const std::string& what, std::size_t plane_bytes) {
    return make_error(ErrorCode::kIOError, "out of host memory allocating the store's " + what +
                                               ": the host refused a mapping of " +
                                               std::to_string(plane_bytes) + " bytes (one of its K and V planes)");
  }
  std::int64_t ring_elems_one() const { return ring_rows() * config_.kv_dim(); }
  std::int64_t block_elems() const { return options_.block_rows * config_.kv_dim(); }
  std::uint16_t* ring_k(std::int32_t slot, std::int64_t layer) const {
    return rings_[static_cast<std::size_t>(layer)].k.get() + slot * ring_elems_one();
  }
  std::uint16_t* ring_v(std::int32_t slot, std::int64_t layer) const {
    return rings_[static_cast<std::size_t>(layer)].v.get() + slot * ring_elems_one();
  }

  cpu::PlaneView view(const PlaneRef& p) const {
    if (full_index(p.layer) < 0)
      return cpu::PlaneView{ring_k(p.slot, p.layer), ring_v(p.slot, p.layer), Layout::kTokenMajor,
                            ring_rows(), config_.kv_dim(), config_.head_dim};
    return cpu::PlaneView{pool_.k.get(), pool_.v.get(), Layout::kHeadMajor, capacity(p.layer),
                          config_.kv_dim(), config_.head_dim, p.blocks, options_.block_rows};
  }

  // One token's row (f16 [kv_dim]) to a physical row of a plane; `stream`:
  // through non-temporal stores where a head's row fills whole lines.
  void put_row(const cpu::PlaneView& pv, std::uint16_t* pk, std::uint16_t* pvv,
               std::int64_t physical, const std::uint16_t* k, const std::uint16_t* v, bool stream = false) const {
    const std::int64_t hd = config_.head_dim;
    for (std::int64_t h = 0; h < config_.n_kv_heads; ++h) {
      const std::int64_t dst = cpu::head_row_offset(pv, physical, h);
      if (stream) {
        detail::copy_f16_row_stream(k + h * hd, pk + dst, hd);
        detail::copy_f16_row_stream(v + h * hd, pvv + dst, hd);
      } else {
        std::memcpy(pk + dst, k + h * hd, static_cast<std::size_t>(hd) * 2);
        std::memcpy(pvv + dst, v + h * hd, static_cast<std::size_t>(hd) * 2);
      }
    }
  }
  // The same from f32 [kv_dim] rows, each value rounded to f16 as
  // detail::row_to_f16 rounds it.
  void put_row(const cpu::PlaneView& pv, std::uint16_t* pk, std::uint16_t* pvv,
               std::int64_t physical, const float* k, const float* v, bool stream) const {
    const std::int64_t hd = config_.head_dim;
    for (std::int64_t h = 0; h < config_.n_kv_heads; ++h) {
      const std::int64_t dst = cpu::head_row_offset(pv, physical, h);
      if (stream) {
        detail::f32_to_f16_row_stream(k + h * hd, pk + dst, hd);
        detail::f32_to_f16_row_stream(v + h * hd, pvv + dst, hd);
      } else {
        detail::f32_to_f16_row(k + h * hd, pk + dst, hd);
        detail::f32_to_f16_row(v + h * hd, pvv + dst, hd);
      }
    }
  }

  std::vector<Plane> rings_;  // per layer (empty for full layers): [slots][ring rows][kv_dim]
  Plane pool_;                // [blocks][kv_heads][block_rows][head_dim]
};


Result<std::unique_ptr<KvStore>> make_cpu_store(const ModelConfig& config, StoreOptions options);

}  // namespace kvring
