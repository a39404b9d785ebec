// Warp-specialized kernels: named barriers between the roles (bar.sync waits, bar.arrive only
// signals, so a producer never waits for its consumers' arrivals and the other way round) and the
// register hand-over between them (setmaxnreg, sm_90a).
#pragma once

#include <cuda_runtime.h>

namespace dsv4::cuda {

__device__ __forceinline__ void barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// bar.sync that also ORs `predicate` over the threads that take part: every one gets the result.
__device__ __forceinline__ bool barrier_sync_or(int id, int threads, bool predicate) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(predicate)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// setmaxnreg (sm_90a): a role that needs few registers releases them, one that holds large
// accumulators claims them (claim waits until the block's other warps have released enough).
// Elsewhere (the compute_80 PTX) both are no-ops: those builds never take these kernels.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

}  // namespace dsv4::cuda
