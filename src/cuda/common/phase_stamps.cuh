// Phase timestamps of a kernel's warpgroups, for a diagnostic build only
// (bench/probes/attention_phase_stamps.cu): with DSV4_PHASE_STAMPS defined, DSV4_PHASE_STAMP(k)
// records the SM clock as stamp k of the calling thread's warpgroup in its block when the thread
// leads the warpgroup, and DSV4_PHASE_STAMP_ON(k, v) does so once v is available (a load has
// landed). Without it both are nothing.
#pragma once

#ifdef DSV4_PHASE_STAMPS
#include <cuda_runtime.h>

namespace dsv4::cuda {
inline constexpr int kStampBlocks = 512, kStampWarpgroups = 3, kStampsPerWarpgroup = 96;
__device__ long long g_phase_stamps[kStampBlocks][kStampWarpgroups][kStampsPerWarpgroup];
__device__ __forceinline__ void phase_stamp(int k) {
  const unsigned block = (blockIdx.x * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z;
  if (threadIdx.x % 128 == 0 && block < kStampBlocks && threadIdx.x / 128 < kStampWarpgroups && k < kStampsPerWarpgroup)
    g_phase_stamps[block][threadIdx.x / 128][k] = clock64();
}
void register_phase_stamps_dump();  // the probe's: prints them at exit
}  // namespace dsv4::cuda
#define DSV4_PHASE_STAMP(k) ::dsv4::cuda::phase_stamp(k)
#define DSV4_PHASE_STAMP_ON(k, v)                   \
  do {                                              \
    asm volatile("" ::"l"(static_cast<long long>(v))); \
    ::dsv4::cuda::phase_stamp(k);                   \
  } while (0)
#else
#define DSV4_PHASE_STAMP(k) ((void)0)
#define DSV4_PHASE_STAMP_ON(k, v) ((void)0)
#endif
