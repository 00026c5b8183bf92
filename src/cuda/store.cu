// Store kernels (f32 rows -> f16 plane rows), the prefill chunk conversion,
// and the gather/scatter of snapshot copies. All are bandwidth-bound: each
// thread moves 8 consecutive elements (one 16-byte f16 store) where the
// geometry allows, else one.
#include <algorithm>

#include "f16_device.cuh"
#include "kernels.h"

namespace kvring::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H200 several times over; the loops are grid-stride.
constexpr std::int64_t kMaxBlocks = 4096;

unsigned blocks_for(std::int64_t units) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((units + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Eight consecutive elements: every index in a row is contiguous over 8
// elements when head_dim % 8 == 0, in both layouts.
bool vector_rows(Shape s) { return s.head_dim % 8 == 0 && s.kv_dim % 8 == 0; }

__device__ __forceinline__ void store8(const float* src, std::uint16_t* dst) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  uint4 o;
  o.x = store_f16x2(a.x, a.y);
  o.y = store_f16x2(a.z, a.w);
  o.z = store_f16x2(b.x, b.y);
  o.w = store_f16x2(b.z, b.w);
  *reinterpret_cast<uint4*>(dst) = o;
}

__device__ __forceinline__ std::uint64_t index_of(const PlaneDev& p, Shape s, std::int64_t physical,
                                                  std::int64_t element) {
  return plane_index(p.layout, static_cast<std::uint64_t>(physical),
                     static_cast<std::uint64_t>(element), static_cast<std::uint64_t>(s.kv_dim),
                     static_cast<std::uint64_t>(s.head_dim), static_cast<std::uint64_t>(p.capacity));
}

// Row r of k/v (f32) into physical row `physical` of the plane; units of
// kPer elements, u in [0, kv_dim / kPer).
// A null v (and p.v) stores K only.
template <int kPer>
__device__ __forceinline__ void store_unit(const PlaneDev& p, Shape s, std::int64_t physical,
                                           const float* k, const float* v, std::int64_t e) {
  const std::uint64_t dst = index_of(p, s, physical, e);
  if constexpr (kPer == 8) {
    store8(k + e, p.k + dst);
    if (v) store8(v + e, p.v + dst);
  } else {
    p.k[dst] = store_f16(k[e]);
    if (v) p.v[dst] = store_f16(v[e]);
  }
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

struct StoreRows {
  PlaneDev plane;
  Shape shape;
  std::int64_t physical_first;
  std::int64_t rows;
  const float* k;  // [rows, kv_dim]
  const float* v;
};

template <int kPer>
__global__ void __launch_bounds__(kThreads) store_rows_kernel(StoreRows a) {
  for_each_unit<kPer>(a.rows, a.shape.kv_dim, [&](std::int64_t r, std::int64_t e) {
    store_unit<kPer>(a.plane, a.shape, a.physical_first + r, a.k + r * a.shape.kv_dim,
                     a.v ? a.v + r * a.shape.kv_dim : nullptr, e);
  });
}

// Block b writes row b of k/v into layer b's plane.
template <int kPer>
__global__ void __launch_bounds__(kThreads) store_token_layers_kernel(LayerRows rows, Shape shape,
                                                                      const float* k, const float* v) {
  const int l = blockIdx.x;
  const std::int64_t per_row = shape.kv_dim / kPer;
  const float* kr = k + static_cast<std::int64_t>(l) * shape.kv_dim;
  const float* vr = v + static_cast<std::int64_t>(l) * shape.kv_dim;
  for (std::int64_t u = threadIdx.x; u < per_row; u += blockDim.x)
    store_unit<kPer>(rows.plane[l], shape, rows.physical[l], kr, vr, u * kPer);
}

// Block (x, i) stores span i's units, grid-stride over x.
template <int kPer>
__global__ void __launch_bounds__(kThreads) store_spans_kernel(SpanRows a, Shape shape) {
  const int i = static_cast<int>(blockIdx.y);
  const PlaneDev plane = a.plane[i];
  const std::int64_t physical = a.physical[i];
  const float* k = a.k[i];
  const float* v = a.v[i];
  for_each_unit<kPer>(a.rows[i], shape.kv_dim, [&](std::int64_t r, std::int64_t e) {
    store_unit<kPer>(plane, shape, physical + r, k + r * shape.kv_dim, v + r * shape.kv_dim, e);
  });
}

__global__ void __launch_bounds__(kThreads) convert_kernel(const float* src, std::uint16_t* dst,
                                                           std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = store_f16(src[i]);
}

struct CopyRows {
  std::uint16_t* plane;
  std::int64_t capacity;
  Layout layout;
  Shape shape;
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
    const std::uint64_t pi = plane_index(
        a.layout, static_cast<std::uint64_t>(physical), static_cast<std::uint64_t>(e),
        static_cast<std::uint64_t>(a.shape.kv_dim), static_cast<std::uint64_t>(a.shape.head_dim),
        static_cast<std::uint64_t>(a.capacity));
    Unit* plane = reinterpret_cast<Unit*>(a.plane + pi);
    Unit* buf = reinterpret_cast<Unit*>(a.buf + r * a.shape.kv_dim + e);
    if constexpr (kGather)
      *buf = *plane;
    else
      *plane = *buf;
  });
}

cudaError_t launched() { return cudaGetLastError(); }

}  // namespace

cudaError_t launch_store_rows(const PlaneDev& plane, Shape shape, std::int64_t physical_first,
                              std::int64_t rows, const float* k, const float* v,
                              cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const StoreRows a{plane, shape, physical_first, rows, k, v};
  if (vector_rows(shape) && aligned16(k) && aligned16(v))  // aligned16(nullptr) holds
    store_rows_kernel<8><<<blocks_for(rows * shape.kv_dim / 8), kThreads, 0, stream>>>(a);
  else
    store_rows_kernel<1><<<blocks_for(rows * shape.kv_dim), kThreads, 0, stream>>>(a);
  return launched();
}

cudaError_t launch_store_token_layers(const LayerRows& rows, Shape shape, const float* k,
                                      const float* v, cudaStream_t stream) {
  if (rows.n <= 0) return cudaSuccess;
  if (vector_rows(shape) && aligned16(k) && aligned16(v))
    store_token_layers_kernel<8><<<rows.n, kThreads, 0, stream>>>(rows, shape, k, v);
  else
    store_token_layers_kernel<1><<<rows.n, kThreads, 0, stream>>>(rows, shape, k, v);
  return launched();
}

cudaError_t launch_store_spans(const SpanRows& spans, Shape shape, cudaStream_t stream) {
  if (spans.n <= 0) return cudaSuccess;
  std::int64_t most = 0;
  bool vec = vector_rows(shape);
  for (int i = 0; i < spans.n; ++i) {
    most = std::max(most, spans.rows[i]);
    vec = vec && aligned16(spans.k[i]) && aligned16(spans.v[i]);
  }
  const auto n = static_cast<unsigned>(spans.n);
  if (vec)
    store_spans_kernel<8><<<dim3(blocks_for(most * shape.kv_dim / 8), n), kThreads, 0, stream>>>(spans, shape);
  else
    store_spans_kernel<1><<<dim3(blocks_for(most * shape.kv_dim), n), kThreads, 0, stream>>>(spans, shape);
  return launched();
}

cudaError_t launch_convert_f16(const float* src, std::uint16_t* dst, std::int64_t n,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  convert_kernel<<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  return launched();
}

cudaError_t launch_gather_rows(const std::uint16_t* plane_buf, std::int64_t capacity,
                               Layout layout, Shape shape, SpanMap map, std::int64_t first,
                               std::int64_t rows, std::uint16_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  // The kernel only reads through `plane` when gathering.
  const CopyRows a{const_cast<std::uint16_t*>(plane_buf), capacity, layout, shape, map, first,
                   rows, out};
  if (vector_rows(shape) && aligned16(out))
    copy_rows_kernel<8, true><<<blocks_for(rows * shape.kv_dim / 8), kThreads, 0, stream>>>(a);
  else
    copy_rows_kernel<1, true><<<blocks_for(rows * shape.kv_dim), kThreads, 0, stream>>>(a);
  return launched();
}

cudaError_t launch_scatter_rows(std::uint16_t* plane_buf, std::int64_t capacity, Layout layout,
                                Shape shape, SpanMap map, std::int64_t first, std::int64_t rows,
                                const std::uint16_t* in, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  // The kernel only reads through `buf` when scattering.
  const CopyRows a{plane_buf, capacity, layout, shape, map, first, rows,
                   const_cast<std::uint16_t*>(in)};
  if (vector_rows(shape) && aligned16(in))
    copy_rows_kernel<8, false><<<blocks_for(rows * shape.kv_dim / 8), kThreads, 0, stream>>>(a);
  else
    copy_rows_kernel<1, false><<<blocks_for(rows * shape.kv_dim), kThreads, 0, stream>>>(a);
  return launched();
}

}  // namespace kvring::cuda
