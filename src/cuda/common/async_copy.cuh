// Asynchronous global -> shared copies (cp.async, sm_80+) and ldmatrix, the data movement the
// tensor-core kernels share.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A 4-byte store to a shared-memory address (32 bits where a generic pointer takes 64).
__device__ __forceinline__ void store_shared_u32(uint32_t shared, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(shared), "r"(value) : "memory");
}

// An atomic add (no result) at a shared-memory address: formed once, the address serves many adds,
// where atomicAdd on a generic pointer re-derives the CTA's shared window (in cluster kernels S2R
// SR_CgaCtaId and three integer instructions) before each.
__device__ __forceinline__ void add_shared_u32(uint32_t shared, uint32_t value) {
  asm volatile("red.shared.add.u32 [%0], %1;\n" ::"r"(shared), "r"(value) : "memory");
}

// kBytes (4, 8 or 16) global -> shared, asynchronous; zero-filled without reading `global` when
// !valid (`global` must still be a valid address then). 16-byte copies bypass L1 (.cg), smaller
// ones cannot (.ca).
template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t shared, const void* global, bool valid = true) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16);
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global), "r"(valid ? 16 : 0)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared), "l"(global), "n"(kBytes),
                 "r"(valid ? kBytes : 0)
                 : "memory");
}

// L2 policies for cp_async: evict-first for data a kernel reads once (its lines are the first to go
// when the L2 needs room, so that what every launch reads again stays), evict-normal (the default)
// for data other blocks read again.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_evict_normal_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cp_async with an L2 policy.
template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t shared, const void* global, bool valid, uint64_t policy) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16);
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(shared), "l"(global),
                 "r"(valid ? 16 : 0), "l"(policy)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], %2, %3, %4;\n" ::"r"(shared), "l"(global),
                 "n"(kBytes), "r"(valid ? kBytes : 0), "l"(policy)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of the thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Commits the thread's outstanding copies and waits for all of them.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared-memory mbarriers (sm_80+ for the cp.async arrive, sm_90 for try_wait): a phase completes
// once `count` arrivals have happened; waiters name the phase by its parity.
__device__ __forceinline__ void mbarrier_init(uint32_t barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}
// An arrival (release: the thread's earlier writes are visible to whoever waits for the phase).
__device__ __forceinline__ void mbarrier_arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// An arrival once every cp.async the thread issued so far has landed (counted in `count`: noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}
// The initializing thread's mbarrier.init made visible to the async proxy (a bulk copy's
// complete_tx) and, after a barrier, to the other threads (sm_90).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// An arrival that also expects `bytes` of asynchronous copies (complete_tx) in the current phase
// (sm_90). Copies may complete before it: the phase stays open until every arrival has happened.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory by the
// copy engine in one bulk copy, landing on `barrier` (complete_tx of its bytes), with an L2 policy
// (sm_90).
__device__ __forceinline__ void bulk_copy(uint32_t shared, const void* global, uint32_t bytes, uint32_t barrier,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
          shared),
      "l"(global), "r"(bytes), "r"(barrier), "l"(policy)
      : "memory");
}
// The box at coordinates (x, y) of a 2-d tensor map, as tensor_copy_3d.
__device__ __forceinline__ void tensor_copy_2d(uint32_t shared, const void* tensor_map, int x, int y, uint32_t barrier,
                                               uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], [%4], "
      "%5;\n" ::"r"(shared),
      "l"(tensor_map), "r"(x), "r"(y), "r"(barrier), "l"(policy)
      : "memory");
}
// The box at coordinates (x, y, z) of a 3-d tensor map (a __grid_constant__ kernel parameter or
// global memory) from global to shared memory (aligned as the map's swizzle needs), landing on
// `barrier` (complete_tx of the box's bytes), with an L2 policy (l2_evict_first_policy: data read
// once) (sm_90).
__device__ __forceinline__ void tensor_copy_3d(uint32_t shared, const void* tensor_map, int x, int y, int z,
                                               uint32_t barrier, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, "
      "%4}], [%5], %6;\n" ::"r"(shared),
      "l"(tensor_map), "r"(x), "r"(y), "r"(z), "r"(barrier), "l"(policy)
      : "memory");
}
// Waits (acquire) until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

// Four 8x8 b16 matrices: lanes 8m … 8m + 7 give the row addresses of matrix m, which lands in
// r[m] (lane l holds row l / 4, bytes 4·(l % 4) … + 3 of each).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

}  // namespace dsv4::cuda
