// Store kernels (f32, f16 or bf16 rows -> f16 plane rows), the prefill
// chunk conversion, and the gather/scatter of snapshot copies. All are
// bandwidth-bound: each thread moves 8 consecutive elements (one 16-byte
// f16 store) where the geometry allows, else one.
#include <algorithm>

#include "f16_device.cuh"
#include "kernels.h"
#include "launch_plain.cuh"
#include "ptx.cuh"

namespace kvring::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H200 several times over; the loops are grid-stride.
constexpr std::int64_t kMaxBlocks = 4096;
// The store kernels keep five blocks an SM (at most 48 registers a
// thread, which the kernel with its descriptors in the parameters would
// otherwise exceed): their bytes in flight come from the warps.
constexpr int kStoreBlocksPerSm = 5;

unsigned blocks_for(std::int64_t units) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((units + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Eight consecutive elements: every index in a row is contiguous over 8
// elements when head_dim % 8 == 0, in both layouts.
bool vector_rows(Shape s) { return s.head_dim % 8 == 0 && s.kv_dim % 8 == 0; }

// Offset of (physical row, element) in a plane: a token-major ring when
// table is null, else a block of the pool.
__device__ __forceinline__ std::int64_t plane_offset(const std::int32_t* table, Shape s,
                                                     PoolGeometry g, std::int64_t physical,
                                                     std::int64_t e) {
  if (table == nullptr)
    return static_cast<std::int64_t>(token_major_index(static_cast<std::uint64_t>(physical),
                                                       static_cast<std::uint64_t>(e),
                                                       static_cast<std::uint64_t>(s.kv_dim)));
  const std::int64_t h = e / s.head_dim;
  return block_row_offset(table, g, s.head_dim, physical, h) + (e - h * s.head_dim);
}

// f(r, e) for every unit of kPer elements of rows [0, rows): row r,
// first element e; grid-stride.
template <int kPer, class F>
__device__ __forceinline__ void for_each_unit(std::int64_t rows, std::int32_t kv_dim, F&& f) {
  const std::int64_t per_row = kv_dim / kPer;
  const std::int64_t total = rows * per_row;
  for (std::int64_t u = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; u < total;
       u += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = u / per_row;
    f(r, (u - r * per_row) * kPer);
  }
}

// Every row of every span: row R of the concatenation belongs to the last
// span whose first_row <= R. Warp w of the grid takes rows [w * per, (w +
// 1) * per); its lanes take a row's units in turn.
template <int kPer>
__device__ __forceinline__ void store_spans(const StoreLaunch& a) {
  // The launch's table writes: no span reads the mirror in such a launch
  // (kernels.h), so they need no order against the rows.
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < a.n_table_writes;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads)
    a.tables[a.table_writes[i].at] = a.table_writes[i].block;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  const std::int64_t warp = blockIdx.x * static_cast<std::int64_t>(kThreads / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t per = (a.total_rows + warps - 1) / warps;
  const std::int64_t first = warp * per;
  const std::int64_t end = min(first + per, a.total_rows);
  if (first >= end) return;
  // The one span of a launch without descriptors is read by value (its
  // address is never taken, so it stays in the parameter space).
  const int n_spans = a.spans != nullptr ? a.n_spans : 1;
  auto span_at = [&](int i) { return a.spans != nullptr ? a.spans[i] : a.single; };
  int lo = 0, hi = n_spans - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.spans[mid].first_row <= first) lo = mid; else hi = mid - 1;
  }
  StoreSpan s = span_at(lo);
  std::int64_t next = lo + 1 < n_spans ? a.spans[lo + 1].first_row : a.total_rows;
  const std::int32_t kv_dim = a.shape.kv_dim;
  for (std::int64_t R = first; R < end; ++R) {
    while (R >= next) {
      s = a.spans[++lo];
      next = lo + 1 < n_spans ? a.spans[lo + 1].first_row : a.total_rows;
    }
    const std::int64_t r = R - s.first_row;
    for (std::int64_t e = static_cast<std::int64_t>(lane) * kPer; e < kv_dim; e += 32 * kPer) {
      const std::int64_t dst = plane_offset(s.first_id >= 0 ? a.block_ids + s.first_id : s.table, a.shape,
                                            a.pool, s.physical_first + r, e);
      if constexpr (kPer == 8) {
        *reinterpret_cast<uint4*>(s.k + dst) = source_f16x8(a.k, s.src_row + r, e);
        *reinterpret_cast<uint4*>(s.v + dst) = source_f16x8(a.v, s.src_row + r, e);
      } else {
        s.k[dst] = source_f16(a.k, s.src_row + r, e);
        s.v[dst] = source_f16(a.v, s.src_row + r, e);
      }
    }
  }
}

template <int kPer>
__global__ void __launch_bounds__(kThreads, kStoreBlocksPerSm) store_spans_kernel(StoreLaunch a) {
  enter_dependent();
  store_spans<kPer>(a);
}

// The descriptors are read where they lie, in the parameter space (a
// __grid_constant__ parameter's address is a generic one).
template <int kPer>
__global__ void __launch_bounds__(kThreads, kStoreBlocksPerSm) store_inline_kernel(const __grid_constant__ StoreInline p) {
  enter_dependent();
  StoreLaunch a = p.a;
  a.spans = reinterpret_cast<const StoreSpan*>(p.bytes);
  a.table_writes = reinterpret_cast<const TableWrite*>(p.bytes + p.writes_at);
  a.block_ids = reinterpret_cast<const std::int32_t*>(p.bytes + p.ids_at);
  store_spans<kPer>(a);
}

// Rows [0, rows) are K's, [rows, 2 rows) V's; dst holds them in that
// order.
template <int kPer>
__global__ void __launch_bounds__(kThreads) convert_kv_kernel(SourceRows k, SourceRows v,
                                                              std::int64_t rows, std::int32_t cols,
                                                              std::uint16_t* dst) {
  for_each_unit<kPer>(2 * rows, cols, [&](std::int64_t r, std::int64_t e) {
    const bool is_v = r >= rows;
    const SourceRows src = is_v ? v : k;
    const std::int64_t sr = is_v ? r - rows : r;
    if constexpr (kPer == 8)
      *reinterpret_cast<uint4*>(dst + r * cols + e) = source_f16x8(src, sr, e);
    else
      dst[r * cols + e] = source_f16(src, sr, e);
  });
}

struct CopyRows {
  PlaneBuf plane;
  Shape shape;
  PoolGeometry pool;
  SpanMap map;
  std::int64_t first;
  std::int64_t rows;
  std::uint16_t* buf;  // token-major [rows, kv_dim]
};

// kGather: plane -> buf; else buf -> plane. kPer elements per thread.
template <int kPer, bool kGather>
__global__ void __launch_bounds__(kThreads) copy_rows_kernel(CopyRows a) {
  using Unit = std::conditional_t<kPer == 8, uint4, std::uint16_t>;
  for_each_unit<kPer>(a.rows, a.shape.kv_dim, [&](std::int64_t r, std::int64_t e) {
    const std::int64_t j = a.first + r;
    const std::int64_t physical =
        j < a.map.rows0 ? a.map.physical[0] + j : a.map.physical[1] + (j - a.map.rows0);
    Unit* plane = reinterpret_cast<Unit*>(
        a.plane.base + plane_offset(a.plane.table, a.shape, a.pool, physical, e));
    Unit* buf = reinterpret_cast<Unit*>(a.buf + r * a.shape.kv_dim + e);
    if constexpr (kGather)
      *buf = *plane;
    else
      *plane = *buf;
  });
}

// Whether a segment moves 16 bytes a unit (its addresses and length allow)
// or 2.
__host__ __device__ bool wide_segment(const FillSegment& g) {
  return ((reinterpret_cast<std::uintptr_t>(g.dst) | reinterpret_cast<std::uintptr_t>(g.src)) & 15u) == 0 &&
         g.elems % 8 == 0;
}
std::int64_t segment_units(const FillSegment& g) { return wide_segment(g) ? g.elems / 8 : g.elems; }

// Block (x, y) takes segment y's units x, x + gridDim.x, ... a thread each.
__global__ void __launch_bounds__(kThreads) fill_segments_kernel(const __grid_constant__ FillLaunch a) {
  const FillSegment& g = a.segments[blockIdx.y];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x;
  if (wide_segment(g)) {
    auto* d = reinterpret_cast<uint4*>(g.dst);
    const auto* s = reinterpret_cast<const uint4*>(g.src);
    for (std::int64_t i = first; i < g.elems / 8; i += stride) d[i] = s != nullptr ? s[i] : make_uint4(0, 0, 0, 0);
  } else {
    for (std::int64_t i = first; i < g.elems; i += stride) g.dst[i] = g.src != nullptr ? g.src[i] : 0;
  }
}

// Applies the table writes with a grid-stride loop.
__global__ void __launch_bounds__(kThreads)
    table_writes_kernel(const TableWrite* writes, std::int64_t n, std::int32_t* tables) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads)
    tables[writes[i].at] = writes[i].block;
}

}  // namespace

// One warp a row (or a thread a table write) at the least, up to
// kMaxBlocks blocks.
unsigned store_blocks(const StoreLaunch& a) { return blocks_for(std::max(a.total_rows * 32, a.n_table_writes)); }

// The store kernel for `a` (8 elements a thread where its rows allow, else
// one) over store_blocks(a), its argument `arg`, as a programmatic
// dependent of the work before it where `programmatic`; nothing when the
// launch has no rows and no table writes.
template <class Arg>
cudaError_t launch_store(void (*kernel8)(Arg), void (*kernel1)(Arg), const StoreLaunch& a, const Arg& arg,
                         bool programmatic, cudaStream_t stream) {
  if ((a.n_spans <= 0 || a.total_rows <= 0) && a.n_table_writes <= 0) return cudaSuccess;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(store_blocks(a), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  programmatic_attribute(attr);
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, a.vector && vector_rows(a.shape) ? kernel8 : kernel1, arg);
  if (e != cudaSuccess) (void)cudaGetLastError();  // reported here, not by a later call
  return e;
}

cudaError_t launch_store_spans(const StoreLaunch& a, bool programmatic, cudaStream_t stream) {
  return launch_store(store_spans_kernel<8>, store_spans_kernel<1>, a, a, programmatic, stream);
}

cudaError_t launch_store_inline(const StoreInline& p, bool programmatic, cudaStream_t stream) {
  return launch_store(store_inline_kernel<8>, store_inline_kernel<1>, p.a, p, programmatic, stream);
}

cudaError_t launch_convert_kv(SourceRows k, SourceRows v, std::int64_t rows, std::int32_t cols,
                              bool vector, std::uint16_t* dst, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vector && cols % 8 == 0)
    return launch_plain(convert_kv_kernel<8>, blocks_for(2 * rows * cols / 8), kThreads, 0, stream, k, v, rows, cols,
                        dst);
  return launch_plain(convert_kv_kernel<1>, blocks_for(2 * rows * cols), kThreads, 0, stream, k, v, rows, cols, dst);
}

cudaError_t launch_table_writes(const TableWrite* writes, std::int64_t n, std::int32_t* tables,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return launch_plain(table_writes_kernel, blocks_for(n), kThreads, 0, stream, writes, n, tables);
}

cudaError_t launch_fill_segments(const FillLaunch& a, cudaStream_t stream) {
  if (a.n <= 0) return cudaSuccess;
  std::int64_t most = 0;
  for (int i = 0; i < a.n; ++i) most = std::max(most, segment_units(a.segments[i]));
  // Blocks enough for four units a thread of the longest segment, up to
  // kMaxBlocks / n a segment (the loops are grid-stride).
  const std::int64_t per = std::max<std::int64_t>(1, kMaxBlocks / a.n);
  const auto x = static_cast<unsigned>(std::clamp<std::int64_t>((most + 4 * kThreads - 1) / (4 * kThreads), 1, per));
  return launch_plain(fill_segments_kernel, dim3(x, static_cast<unsigned>(a.n)), kThreads, 0, stream, a);
}

cudaError_t launch_gather_rows(PlaneBuf plane, Shape shape, PoolGeometry pool, SpanMap map,
                               std::int64_t first, std::int64_t rows, std::uint16_t* out,
                               cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const CopyRows a{plane, shape, pool, map, first, rows, out};
  if (vector_rows(shape) && aligned16(out))
    return launch_plain(copy_rows_kernel<8, true>, blocks_for(rows * shape.kv_dim / 8), kThreads, 0, stream, a);
  return launch_plain(copy_rows_kernel<1, true>, blocks_for(rows * shape.kv_dim), kThreads, 0, stream, a);
}

cudaError_t launch_scatter_rows(PlaneBuf plane, Shape shape, PoolGeometry pool, SpanMap map,
                                std::int64_t first, std::int64_t rows, const std::uint16_t* in,
                                cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  // The kernel only reads through `buf` when scattering.
  const CopyRows a{plane, shape, pool, map, first, rows, const_cast<std::uint16_t*>(in)};
  if (vector_rows(shape) && aligned16(in))
    return launch_plain(copy_rows_kernel<8, false>, blocks_for(rows * shape.kv_dim / 8), kThreads, 0, stream, a);
  return launch_plain(copy_rows_kernel<1, false>, blocks_for(rows * shape.kv_dim), kThreads, 0, stream, a);
}

}  // namespace kvring::cuda
