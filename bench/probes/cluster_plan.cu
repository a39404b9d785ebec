// Probe: how many clusters of s blocks of the wgmma sparse attention (native rows, bf16 output) the
// device runs at once (cudaOccupancyMaxActiveClusters, s = 1 … 16, as the launch asks), and the split
// plan plan_split_kv_clusters makes from them for V4.1-Flash decode steps (64 heads, 640 rows: 10
// tiles), and the split that groups of 8 heads would get: whether the device can place them at b1 (which
// the twenty-eighth session's `wip/head-groups-8` run could not tell, bench/RESULTS.md).
// Not part of the build. From build/ (a configured Release tree with libdsv4.a built):
//   nvcc --options-file CMakeFiles/dsv4.dir/includes_CUDA.rsp -O3 -DNDEBUG -std=c++20 \
//     --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//     ../bench/probes/cluster_plan.cu libdsv4.a -lcublasLt -lcuda -o cluster_plan
#include <cstdio>
#include <span>

#include "cuda/ops/attention/split_kv.h"
#include "cuda/ops/attention/wgmma/sparse_attention_wgmma_kernel.cuh"

int main() {
  using namespace dsv4;
  using namespace dsv4::cuda;
  using R = attention_wgmma::Ring<KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>;
  const auto kernel = sparse_attention_wgmma_kernel<uint16_t, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(R::kSharedBytes));
  cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs, %zu bytes of shared memory a block\n", prop.name, prop.multiProcessorCount,
              R::kSharedBytes);
  constexpr int kMax = attention_wgmma::kMaxClusterSplits;
  int capacity[kMax + 1] = {};
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(attention_wgmma::kThreads);
  config.dynamicSmemBytes = R::kSharedBytes;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster.val.clusterDim.y = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  std::printf("clusters at once, by size:");
  for (int s = 1; s <= kMax; ++s) {
    config.gridDim = dim3(1, 1, s);
    cluster.val.clusterDim.z = s;
    if (cudaOccupancyMaxActiveClusters(&capacity[s], kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      capacity[s] = 0;
    }
    std::printf(" %d:%d", s, capacity[s]);
  }
  std::printf("\n");
  const std::span<const int> known(capacity, kMax + 1);
  for (int64_t tokens : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    const ClusterSplitPlan plan = plan_split_kv_clusters(tokens, 64, 64, 10, known);
    const int64_t groups = (64 + plan.heads_per_block - 1) / plan.heads_per_block;
    // Groups of 8 (the planner stops at 16): the split the same rule gives their 8 blocks a token.
    const SplitKvPlan eight = plan_split_kv_clusters(tokens * 8, 10, known);
    std::printf("b%-4lld plan: %2d heads a block, %2d splits of %lld tiles, %4lld blocks | groups of 8: %2d splits of "
                "%lld tiles, %4lld blocks\n",
                static_cast<long long>(tokens), plan.heads_per_block, plan.split.splits,
                static_cast<long long>(plan.split.tiles_per_split), static_cast<long long>(tokens * groups * plan.split.splits),
                eight.splits, static_cast<long long>(eight.tiles_per_split),
                static_cast<long long>(tokens * 8 * eight.splits));
  }
  return 0;
}
