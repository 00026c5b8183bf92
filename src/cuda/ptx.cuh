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

// The same barrier in halves. A CTA of a cluster launch arrives with no
// memory order as it starts, and waits before its first store into another
// CTA's shared memory: the wait returns once every CTA of the cluster runs.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// The shared-memory address of `p` (this CTA's shared memory) in the CTA
// of cluster rank `rank`, for st.shared::cluster.
__device__ __forceinline__ unsigned cluster_address(const void* p, unsigned rank) {
  unsigned out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(out)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(rank));
  return out;
}
__device__ __forceinline__ void store_cluster(unsigned addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void store_cluster(unsigned addr, float2 v) {
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
__device__ __forceinline__ void store_cluster(unsigned addr, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}

// Stores into another CTA's shared memory that count their bytes at an
// mbarrier of that CTA (`bar`, its shared::cluster address): the receiver
// waits at its own barrier for the bytes it expects, and no cluster-wide
// barrier or fence stands between the stores and its reads.
__device__ __forceinline__ void store_async(unsigned addr, float2 v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(addr),
               "f"(v.x), "f"(v.y), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void store_async(unsigned addr, float4 v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   addr),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
               : "memory");
}

// ---- mbarriers (shared::cta addresses) -----------------------------------------

// One expected arrival; the init is released to the cluster by the fence,
// before the CTA's arrival at the cluster barrier.
__device__ __forceinline__ void mbarrier_init_for_cluster(unsigned bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
               "fence.mbarrier_init.release.cluster;\n" ::"r"(bar)
               : "memory");
}
// The one arrival, with the bytes the phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until phase 0 completes, acquiring at cluster scope what the
// stores that completed it wrote.
__device__ __forceinline__ void mbarrier_wait_first_phase(unsigned bar) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(bar)
      : "memory");
}

// ---- Programmatic dependent launch (sm_90) -------------------------------------------

// Runs in a kernel that may be launched as a programmatic dependent
// (LaunchPolicy::programmatic) before its first read or write of global
// memory: the grid launched after this one that way may start now (it
// waits here in turn), and this one waits until the grids before it have
// completed with their memory visible. Before it a kernel works from its
// parameters alone. Where the kernel was not launched that way, or before
// sm_90, the wait returns at once.
__device__ __forceinline__ void enter_dependent() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n"
               "griddepcontrol.wait;\n" ::: "memory");
#endif
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

// One 64-bit word at gpu scope, relaxed.
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
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

// ---- Warpgroup MMA (sm_90a) ------------------------------------------------------

// A shared-memory matrix descriptor for wgmma under the 128-byte swizzle:
// the operand's 16-byte piece c of 128-byte row r (of a 1024-byte aligned
// group of 8 rows) lies at c ^ (r % 8). `lead` and `stride` are the byte
// offsets the operand's major-ness gives them (the PTX ISA's "Matrix
// Descriptor Format"): for a K-major operand, stride is the offset between
// groups of 8 rows and lead is unused; for an MN-major one, lead is the
// offset between 64-element column blocks and stride between groups of 8
// rows of K.
__device__ __forceinline__ std::uint64_t wgmma_desc_sw128(unsigned addr, unsigned lead, unsigned stride) {
  return static_cast<std::uint64_t>((addr & 0x3ffffu) >> 4) |
         (static_cast<std::uint64_t>(lead >> 4) << 16) |
         (static_cast<std::uint64_t>(stride >> 4) << 32) | (std::uint64_t{1} << 62);
}
// Orders register writes before the next wgmma's reads of them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of the warpgroup's committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory this thread wrote through the generic proxy (stores,
// cp.async), made visible to the async proxy (wgmma) past the next barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// d += a * B for the warpgroup's 64 x N tile: A (f16, 16 rows a warp) from
// registers in mma.m16n8k16's A layout, B (f16, 16 x N) from shared memory
// (K-major, or N-major for the _nb form), f32 accumulation (d = a * B
// where not `accumulate`); d in the C layout of N / 8 m16n8 tiles.
// Asynchronous: between the warpgroup's commit and wait the accumulators
// are not to be touched (wgmma_fence_operands after the wait).
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const std::uint32_t (&a)[4],
                                        std::uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
      "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0));
}
__device__ __forceinline__ void wgmma_m64n128k16_nb(float (&d)[64], const std::uint32_t (&a)[4],
                                        std::uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"
      "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34,"
      "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51,"
      "%52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0));
}
// Ties registers a wgmma writes to this point of the program: the
// compiler sees them redefined here, so no read of them moves above the
// wgmma_wait before it (nor a write below the wgmma that reads them).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
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
// 8 bytes, through L1 (cp.async.cg moves only 16).
__device__ __forceinline__ void cp_async8(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
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
