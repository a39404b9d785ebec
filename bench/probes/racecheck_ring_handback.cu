// Does compute-sanitizer's racecheck order a shared-memory read before a barrier against a write
// after it, when the write is a cp.async or the barrier a bar.arrive / bar.sync pair? The wgmma
// attention's ring hand-back is that pattern (consumers read raw rows, arrive on kRawFree; the
// producer syncs on it, then cp.asyncs the next tile into the same bytes), and racecheck reports
// WAR hazards there (bench/RESULTS.md, ninth, seventeenth and twenty-fourth sessions). Each case
// below is a correct program; the ones racecheck flags are the constructs it does not model.
//
//   nvcc -std=c++20 -gencode arch=compute_90a,code=sm_90a -o racecheck_ring_handback racecheck_ring_handback.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard ./racecheck_ring_handback <case>
//
// Cases: store_syncthreads, cp_async_syncthreads, store_arrive_sync, cp_async_arrive_sync, and
// cluster_pull: the split merge's pattern (each block of a 2-block cluster fills its shared memory,
// cluster barrier, reads its partner's through `ld.shared::cluster`, cluster barrier, overwrites its
// own); cluster_pull_exited: the same after the last warp of each block has exited, as the
// attention's producer warps do before the merge.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kReaders = 128, kWriters = 32, kThreads = kReaders + kWriters, kWords = 1024;

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

enum class Write { kStore, kCpAsync };
enum class Barrier { kSyncthreads, kArriveSync };

// Readers sum the buffer, then hand it back; writers wait for it and fill it again, twice over.
template <Write kWrite, Barrier kBarrier>
__global__ void __launch_bounds__(kThreads) hand_back(const uint4* source, uint32_t* out) {
  __shared__ alignas(16) uint32_t ring[kWords];
  const int tid = threadIdx.x;
  for (int i = tid; i < kWords; i += kThreads) ring[i] = i;
  __syncthreads();
  uint32_t sum = 0;
  for (int round = 0; round < 2; ++round) {
    if (tid < kReaders) {
      for (int i = tid; i < kWords; i += kReaders) sum += ring[i];
      if constexpr (kBarrier == Barrier::kArriveSync) asm volatile("bar.arrive 1, %0;\n" ::"n"(kThreads) : "memory");
    } else {
      if constexpr (kBarrier == Barrier::kArriveSync) asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
    }
    if constexpr (kBarrier == Barrier::kSyncthreads) __syncthreads();
    if (tid >= kReaders) {
      for (int i = (tid - kReaders) * 4; i < kWords; i += kWriters * 4) {
        if constexpr (kWrite == Write::kStore) {
          *reinterpret_cast<uint4*>(&ring[i]) = source[i / 4 + round];
        } else {
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(&ring[i])),
                       "l"(source + i / 4 + round)
                       : "memory");
        }
      }
      if constexpr (kWrite == Write::kCpAsync) asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
    __syncthreads();  // the writes are visible to the next round's readers
  }
  out[blockIdx.x * kThreads + tid] = sum;
}

template <bool kSomeExit>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads) cluster_pull(uint32_t* out) {
  namespace cg = cooperative_groups;
  if (kSomeExit && threadIdx.x >= kReaders) return;
  __shared__ alignas(16) uint32_t partial[kWords];
  const cg::cluster_group cluster = cg::this_cluster();
  const uint32_t rank = cluster.block_rank(), partner = rank ^ 1u;
  uint32_t sum = 0;
  for (int round = 0; round < 2; ++round) {
    for (int i = threadIdx.x; i < kWords; i += (kSomeExit ? kReaders : kThreads)) partial[i] = i + rank + round;
    cluster.sync();  // both partials whole
    for (int i = threadIdx.x; i < kWords; i += (kSomeExit ? kReaders : kThreads)) {
      uint32_t remote, value;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(shared_address(&partial[i])), "r"(partner));
      asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(value) : "r"(remote) : "memory");
      sum += value;
    }
    cluster.sync();  // the partner has read ours before we overwrite it
  }
  out[blockIdx.x * kThreads + threadIdx.x] = sum;
}

int finish(const char* what) {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "racecheck_ring_handback: %s: %s\n", what, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

template <Write kWrite, Barrier kBarrier>
int run(const uint4* source, uint32_t* out) {
  hand_back<kWrite, kBarrier><<<2, kThreads>>>(source, out);
  return finish("hand_back");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: racecheck_ring_handback store_syncthreads|cp_async_syncthreads|store_arrive_sync|"
                 "cp_async_arrive_sync|cluster_pull|cluster_pull_exited\n");
    return 2;
  }
  uint4* source = nullptr;
  uint32_t* out = nullptr;
  if (cudaMalloc(&source, (kWords / 4 + 2) * sizeof(uint4)) != cudaSuccess ||
      cudaMalloc(&out, 2 * kThreads * sizeof(uint32_t)) != cudaSuccess) {
    std::fprintf(stderr, "racecheck_ring_handback: cudaMalloc failed\n");
    return 1;
  }
  cudaMemset(source, 1, (kWords / 4 + 2) * sizeof(uint4));
  const char* c = argv[1];
  int rc = 2;
  if (!std::strcmp(c, "store_syncthreads")) rc = run<Write::kStore, Barrier::kSyncthreads>(source, out);
  else if (!std::strcmp(c, "cp_async_syncthreads")) rc = run<Write::kCpAsync, Barrier::kSyncthreads>(source, out);
  else if (!std::strcmp(c, "store_arrive_sync")) rc = run<Write::kStore, Barrier::kArriveSync>(source, out);
  else if (!std::strcmp(c, "cp_async_arrive_sync")) rc = run<Write::kCpAsync, Barrier::kArriveSync>(source, out);
  else if (!std::strcmp(c, "cluster_pull")) {
    cluster_pull<false><<<2, kThreads>>>(out);
    rc = finish("cluster_pull");
  } else if (!std::strcmp(c, "cluster_pull_exited")) {
    cluster_pull<true><<<2, kThreads>>>(out);
    rc = finish("cluster_pull_exited");
  } else std::fprintf(stderr, "racecheck_ring_handback: unknown case '%s'\n", c);
  if (rc == 0) std::printf("%s: ran\n", c);
  return rc;
}
