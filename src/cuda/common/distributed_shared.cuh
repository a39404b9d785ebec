// Distributed shared memory (sm_90 thread-block clusters) in 32-bit shared::cluster addresses: a
// block's loads from another's shared memory without the 64-bit generic pointers of
// cooperative_groups' map_shared_rank (two registers per address, where a kernel keeps many loads
// in flight at its register bound).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

// The shared::cluster address of `shared` (this block's shared::cta address) in block `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_shared_address(uint32_t shared, uint32_t rank) {
  uint32_t address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(address) : "r"(shared), "r"(rank));
  return address;
}

// 16 bytes from a shared::cluster address (written before a cluster barrier with release / acquire
// semantics).
__device__ __forceinline__ float4 load_cluster_shared_v4(uint32_t address) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(address)
               : "memory");
  return v;
}

// 8 bytes from a shared::cluster address (the same rule).
__device__ __forceinline__ float2 load_cluster_shared_v2(uint32_t address) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(address) : "memory");
  return v;
}

// A cluster barrier in two halves, in the .aligned forms (every thread of the warp arrives
// together), which cuda::ptx does not expose. The arrival is relaxed: it orders none of the
// thread's memory accesses (a barrier that only keeps blocks alive while others read their shared
// memory needs none once those reads have returned, and then does not wait for the thread's global
// stores to become visible, as a release would).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
// Orders the thread's earlier accesses to its block's shared memory before its later ones at
// cluster scope, and only those (a release restricted to shared::cta, sm_90): followed by a
// relaxed arrival, the barrier's wait (acquire) then lets the other blocks read what it wrote,
// without the full release's wait for the thread's global accesses.
__device__ __forceinline__ void fence_release_shared_to_cluster() {
  asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
}

}  // namespace dsv4::cuda
