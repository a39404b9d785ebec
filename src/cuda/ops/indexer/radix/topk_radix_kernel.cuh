// The radix top-k kernel (topk_radix.cu launches it): one cluster of CTAs per row, each CTA loads
// its chunk of the row's keys into shared memory and runs the selection core (radix_select.cuh).
#pragma once

#include <algorithm>

#include "cuda/ops/indexer/radix/radix_select.cuh"
#include "cuda/ops/indexer/topk_rules.cuh"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

inline constexpr int kRadixLoadBatch = 8;  // loads in flight per thread

struct RadixTopkLaunch {
  const float* scores = nullptr;
  int64_t n = 0;
  const int32_t* token_position = nullptr;  // null: the whole row is eligible
  int compress_ratio = 0;
  int64_t group_size = 1;
  int32_t* picks = nullptr;
  int64_t k = 0;
  int64_t chunk = 0;  // keys per CTA: CTA r of a row's cluster holds positions [r * chunk, (r + 1) * chunk)
  int cluster = 1;    // CTAs per row (> 1 on sm_90 only)
};

// A grid of tokens x cluster CTAs.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_radix_kernel(RadixTopkLaunch a) {
  using radix_topk::RowCluster;
  extern __shared__ uint32_t keys[];  // [a.chunk]
  __shared__ radix_topk::SelectShared<kThreads> shared;
  const int64_t t = blockIdx.x / RowCluster::size();
  const int64_t length = topk_eligible_length(a.n, a.token_position, a.compress_ratio, a.group_size, t);
  const int64_t first = int64_t{RowCluster::rank()} * a.chunk;
  const int count = static_cast<int>(std::clamp<int64_t>(length - first, 0, a.chunk));
  const float* row = a.scores + t * a.n + first;
  for (int base = 0; base < count; base += kThreads * kRadixLoadBatch) {
    float score[kRadixLoadBatch];
#pragma unroll
    for (int j = 0; j < kRadixLoadBatch; ++j) {
      const int i = base + j * kThreads + static_cast<int>(threadIdx.x);
      score[j] = i < count ? __ldcs(row + i) : 0.0f;  // read once: streamed past the caches
    }
#pragma unroll
    for (int j = 0; j < kRadixLoadBatch; ++j) {
      const int i = base + j * kThreads + static_cast<int>(threadIdx.x);
      if (i < count) keys[i] = topk_key(score[j]);
    }
  }
  __syncthreads();
  const radix_topk::Selection selection = radix_topk::select_picks(keys, count, a.k, shared);
  radix_topk::write_picks(keys, count, first, selection, a.picks + t * a.k, a.k, shared);
}

template <int kThreads>
void launch_topk_radix(const RadixTopkLaunch& a, int64_t tokens, cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(a.chunk) * sizeof(uint32_t);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(topk_radix_kernel<kThreads>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(tokens * a.cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute cluster = {};
  if (a.cluster > 1) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(a.cluster);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&config, topk_radix_kernel<kThreads>, a));
}

}  // namespace dsv4::cuda
