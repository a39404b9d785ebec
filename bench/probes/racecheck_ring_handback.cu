// Does compute-sanitizer's racecheck order a shared-memory read before a barrier against a write
// after it, when the write is a cp.async or the barrier a bar.arrive / bar.sync pair? The wgmma
// attention's ring hand-back is that pattern (consumers read raw rows, arrive on kRawFree; the
// producer syncs on it, then cp.asyncs the next tile into the same bytes), and racecheck reports
// WAR hazards there (bench/RESULTS.md, ninth, seventeenth and twenty-fourth sessions). And does it
// run the attention's split-merge clusters (up to 16 blocks, a non-portable size, with setmaxnreg
// and most of the shared memory), which end in "Internal Sanitizer Error" under it? Each case below
// is a correct program; the ones racecheck flags are the constructs it does not model. (Answers:
// bench/RESULTS.md, twenty-sixth and twenty-seventh sessions.)
//
//   nvcc -std=c++20 -I src -gencode arch=compute_90a,code=sm_90a -o racecheck_ring_handback \
//        bench/probes/racecheck_ring_handback.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard ./racecheck_ring_handback <case>
//
// Cases (twenty-sixth session): store_syncthreads, cp_async_syncthreads, store_arrive_sync,
// cp_async_arrive_sync (these four in their own PTX), and cluster_pull: the split merge's pattern
// (each block of a 2-block cluster fills its shared memory, cluster barrier, reads its partner's
// through `ld.shared::cluster`, cluster barrier, overwrites its own); cluster_pull_exited: the same
// after the last warp of each block has exited, as the attention's producer warps do before the
// merge. Twenty-seventh session, with the library's helpers (common/*.cuh): cp_async_group_arrive_sync
// (the kernel's copy form: a byte-count operand, commit, wait_group 0), store_mbarrier (the hand-back
// on an mbarrier instead of a named barrier), and the merge's clusters as the kernel runs them:
// merge<N>[_roles][_big][_z][_pdl] for clusters of N = 2 … 16 blocks, `_roles` with the kernel's warp roles (384
// threads; the producer warpgroup releases registers and exits, the consumers claim theirs), `_big`
// with 200 KB of dynamic shared memory, `_z` with the clusters along z of a 3-D grid, `_pdl` as a
// programmatic dependent launch; each block reads every other block's partial.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/distributed_shared.cuh"
#include "cuda/common/warp_roles.cuh"

namespace {

using namespace dsv4::cuda;

constexpr int kReaders = 128, kWriters = 32, kThreads = kReaders + kWriters, kWords = 1024;

// kCpAsyncGroup: the library's cp_async (a byte-count operand) committed and waited with wait_group 0.
enum class Write { kStore, kCpAsync, kCpAsyncGroup };
// kMbarrier: readers arrive on an mbarrier, writers wait for its phase.
enum class Barrier { kSyncthreads, kArriveSync, kMbarrier };

// Readers sum the buffer, then hand it back; writers wait for it and fill it again, twice over.
template <Write kWrite, Barrier kBarrier>
__global__ void __launch_bounds__(kThreads) hand_back(const uint4* source, uint32_t* out) {
  __shared__ alignas(16) uint32_t ring[kWords];
  __shared__ alignas(8) uint64_t read_barrier;
  const int tid = threadIdx.x;
  const uint32_t read = shared_address(&read_barrier);
  for (int i = tid; i < kWords; i += kThreads) ring[i] = i;
  if (tid == 0) mbarrier_init(read, kReaders);
  __syncthreads();
  uint32_t sum = 0;
  for (int round = 0; round < 2; ++round) {
    if (tid < kReaders) {
      for (int i = tid; i < kWords; i += kReaders) sum += ring[i];
      if constexpr (kBarrier == Barrier::kArriveSync) asm volatile("bar.arrive 1, %0;\n" ::"n"(kThreads) : "memory");
      if constexpr (kBarrier == Barrier::kMbarrier) mbarrier_arrive(read);
    } else {
      if constexpr (kBarrier == Barrier::kArriveSync) asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
      if constexpr (kBarrier == Barrier::kMbarrier) mbarrier_wait(read, round % 2);
    }
    if constexpr (kBarrier == Barrier::kSyncthreads) __syncthreads();
    if (tid >= kReaders) {
      for (int i = (tid - kReaders) * 4; i < kWords; i += kWriters * 4) {
        if constexpr (kWrite == Write::kStore) {
          *reinterpret_cast<uint4*>(&ring[i]) = source[i / 4 + round];
        } else if constexpr (kWrite == Write::kCpAsync) {
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(&ring[i])),
                       "l"(source + i / 4 + round)
                       : "memory");
        } else {
          cp_async<16>(shared_address(&ring[i]), source + i / 4 + round, true);
        }
      }
      if constexpr (kWrite == Write::kCpAsync) asm volatile("cp.async.wait_all;\n" ::: "memory");
      if constexpr (kWrite == Write::kCpAsyncGroup) {
        cp_async_commit();
        cp_async_wait<0>();
      }
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

// The split merge's clusters as the attention runs them: `blocks` blocks (a launch attribute), each
// fills its partial (shared_bytes of dynamic shared memory, the first kWords words used), cluster
// barrier, reads every block's partial in rank order (ld.shared::cluster.v4), cluster barrier.
// With kRoles, 384 threads: the last warpgroup releases registers and exits at once (the producer),
// the other two claim theirs (the consumers), as in sparse_attention_wgmma_kernel.
constexpr int kRoleThreads = 384, kRoleConsumers = 256;
template <bool kRoles>
__global__ void __launch_bounds__(kRoleThreads, 1) cluster_merge(uint32_t* out) {
  namespace cg = cooperative_groups;
  extern __shared__ uint4 partial[];
  wait_for_preceding_grids();  // no-ops unless launched as a dependent launch (_pdl)
  allow_dependent_launch();
  if constexpr (kRoles) {
    if (threadIdx.x >= kRoleConsumers) {
      release_registers<88>();
      return;
    }
    claim_registers<208>();
  }
  const int readers = kRoles ? kRoleConsumers : kRoleThreads;
  const cg::cluster_group cluster = cg::this_cluster();
  const uint32_t rank = cluster.block_rank(), blocks = cluster.num_blocks();
  if (!kRoles || threadIdx.x < readers)
    for (int i = threadIdx.x; i < kWords / 4; i += readers) partial[i] = make_uint4(i, rank, 1, 2);
  cluster.sync();  // every partial whole
  float sum = 0.0f;
  if (!kRoles || threadIdx.x < readers)
    for (int i = threadIdx.x; i < kWords / 4; i += readers)
      for (uint32_t z = 0; z < blocks; ++z) {
        const float4 v = load_cluster_shared_v4(cluster_shared_address(shared_address(&partial[i]), z));
        sum += v.x + v.y;
      }
  cluster.sync();  // no block leaves while the others read its shared memory
  const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (!kRoles || threadIdx.x < readers) out[block * kRoleThreads + threadIdx.x] = static_cast<uint32_t>(sum);
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

// Two launches of cluster_merge, each of two clusters of `blocks` along x, or (along_z) of six
// clusters along z in a 3 x 2 grid of them, as the attention's (token, head group, split) grid;
// with dependent, the second launch is a programmatic dependent launch.
template <bool kRoles>
int run_merge(int blocks, bool big, bool along_z, bool dependent, uint32_t* out) {
  const size_t shared_bytes = big ? 200 * 1024 : kWords * sizeof(uint32_t);
  auto kernel = cluster_merge<kRoles>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)) !=
          cudaSuccess) {
    std::fprintf(stderr, "racecheck_ring_handback: cudaFuncSetAttribute failed\n");
    return 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = along_z ? dim3(3, 2, blocks) : dim3(2 * blocks);
  config.blockDim = dim3(kRoleThreads);
  config.dynamicSmemBytes = shared_bytes;
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = along_z ? 1 : blocks, attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = along_z ? blocks : 1;
  attributes[1] = dependent_launch_attribute();
  config.attrs = attributes;
  for (int launch = 0; launch < 2; ++launch) {
    config.numAttrs = dependent && launch == 1 ? 2 : 1;
    const cudaError_t e = cudaLaunchKernelEx(&config, kernel, out);
    if (e != cudaSuccess) {
      std::fprintf(stderr, "racecheck_ring_handback: launch: %s\n", cudaGetErrorString(e));
      return 1;
    }
  }
  return finish("cluster_merge");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: racecheck_ring_handback store_syncthreads|cp_async_syncthreads|store_arrive_sync|"
                 "cp_async_arrive_sync|cp_async_group_arrive_sync|store_mbarrier|cluster_pull|cluster_pull_exited|"
                 "merge<2-16>[_roles][_big][_z][_pdl]\n");
    return 2;
  }
  uint4* source = nullptr;
  uint32_t* out = nullptr;
  if (cudaMalloc(&source, (kWords / 4 + 2) * sizeof(uint4)) != cudaSuccess ||
      cudaMalloc(&out, 6 * 16 * kRoleThreads * sizeof(uint32_t)) != cudaSuccess) {
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
  else if (!std::strcmp(c, "cp_async_group_arrive_sync")) rc = run<Write::kCpAsyncGroup, Barrier::kArriveSync>(source, out);
  else if (!std::strcmp(c, "store_mbarrier")) rc = run<Write::kStore, Barrier::kMbarrier>(source, out);
  else if (!std::strncmp(c, "merge", 5)) {
    char* after = nullptr;
    const long n = std::strtol(c + 5, &after, 10);
    const int blocks = n >= 2 && n <= 16 ? static_cast<int>(n) : 0;
    const char* rest = after;
    auto take = [&](const char* suffix) {
      const size_t n = std::strlen(suffix);
      const bool here = !std::strncmp(rest, suffix, n);
      if (here) rest += n;
      return here;
    };
    const bool roles = take("_roles"), big = take("_big"), along_z = take("_z"), dependent = take("_pdl");
    if (blocks == 0 || *rest) std::fprintf(stderr, "racecheck_ring_handback: unknown case '%s'\n", c);
    else
      rc = roles ? run_merge<true>(blocks, big, along_z, dependent, out)
                 : run_merge<false>(blocks, big, along_z, dependent, out);
  }
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
