// Inline PTX the attention kernels use, one wrapper an instruction (or a
// fixed pair), with no policy of its own: which to use where is the
// kernels' rule (docs/CUDA.md, "Attention").
#pragma once

#include <cstdint>

namespace kvring::cuda {

// ---- Thread-block clusters ------------------------------------------------------

// The cluster's barrier: arrivals release this CTA's shared-memory writes,
// the wait acquires the others'.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// ---- Relaxed 128-bit global accesses -----------------------------------------------

// Two 64-bit words stored and loaded as one access at gpu scope: each word
// is single-copy atomic, so a reader sees either the whole old word or the
// whole new one.
__device__ __forceinline__ void st_relaxed_v2_b64(std::uint64_t* p, std::uint64_t a,
                                                  std::uint64_t b) {
  asm volatile("st.relaxed.gpu.global.v2.b64 [%0], {%1, %2};\n" ::"l"(p), "l"(a), "l"(b)
               : "memory");
}
__device__ __forceinline__ void ld_relaxed_v2_b64(const std::uint64_t* p, std::uint64_t& a,
                                                  std::uint64_t& b) {
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];\n" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// ---- Tensor cores -----------------------------------------------------------------

// d += a * b for one m16n8k16 tile: f16 operands, f32 accumulation.
__device__ __forceinline__ void mma16816(float (&d)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 f16 matrices; lane 8m + r gives the address of row r of matrix
// m and receives word m (row lane / 4, columns 2 (lane % 4) + {0, 1}).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&d)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

// Four transposed 8x8 f16 matrices; lane 8m + r gives the address of row r
// of matrix m and receives word m.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&d)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

// ---- Shared memory and cp.async --------------------------------------------------

// 16 bytes from a shared-space address.
__device__ __forceinline__ uint4 lds128(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// cp.async: 16 bytes global -> shared (a shared-space address) without
// registers, under an L2 eviction policy (createpolicy below); a source
// size of 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid,
                                           std::uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
               "l"(src), "r"(valid ? 16 : 0), "l"(policy)
               : "memory");
}
// The same without an L2 policy (the default priority).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- L2 eviction policies ----------------------------------------------------------

// Policies for every access they are given to: evict-first, and the default
// (evict-normal) priority.
__device__ __forceinline__ std::uint64_t l2_evict_first_policy() {
  std::uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ std::uint64_t l2_evict_normal_policy() {
  std::uint64_t p;
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

}  // namespace kvring::cuda
