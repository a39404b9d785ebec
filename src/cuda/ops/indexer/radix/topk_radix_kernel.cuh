// The radix top-k kernel (topk_radix.cu launches it): one cluster of CTAs per row, each CTA loads
// its chunk of the row's keys into shared memory, counting the first radix pass as it stores them,
// and runs the selection core (radix_select.cuh).
#pragma once

#include <algorithm>

#include "cuda/ops/indexer/radix/radix_select.cuh"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/topk_rules.cuh"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

inline constexpr int kRadixLoadBatch = 4;  // tiles loaded at once: 16 scores in flight per thread

struct RadixTopkLaunch : TopkLaunch {
  int64_t chunk = 0;  // keys per CTA (a multiple of radix_topk::kTileKeys): CTA r of a row's cluster
                      // holds positions [r * chunk, (r + 1) * chunk)
  int cluster = 1;    // CTAs per row (> 1 on sm_90 only)
};

// Scores i .. i + 3 of a chunk of `count` scores (-inf past count): one 16-byte load where the
// chunk is aligned to 16 bytes (rows of a multiple of 4 scores), else four. Read once: streamed
// past the caches.
__device__ __forceinline__ float4 load_scores(const float* chunk, int i, int count, bool aligned) {
  if (aligned && i + 4 <= count) return __ldcs(reinterpret_cast<const float4*>(chunk + i));
  float score[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) score[j] = i + j < count ? __ldcs(chunk + i + j) : -INFINITY;
  return make_float4(score[0], score[1], score[2], score[3]);
}

// A grid of tokens x cluster CTAs. Each instantiation is capped at 64 registers per thread, so
// that an SM holds 1024 of its threads: one CTA of 1024, two of 512 or four of 256 (shared memory
// permitting).
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) topk_radix_kernel(RadixTopkLaunch a) {
  using radix_topk::kTileKeys, radix_topk::RowCluster;
  extern __shared__ __align__(16) uint32_t keys[];  // [a.chunk]
  __shared__ radix_topk::SelectShared<kThreads> shared;
  const int64_t t = blockIdx.x / RowCluster::size();
  const int64_t length = topk_eligible_length(a.n, a.token_position, a.compress_ratio, a.group_size, t);
  const int64_t first = int64_t{RowCluster::rank()} * a.chunk;
  const int count = static_cast<int>(std::clamp<int64_t>(length - first, 0, a.chunk));
  const float* row = a.scores + t * a.n + first;
  const bool aligned = reinterpret_cast<uintptr_t>(row) % sizeof(float4) == 0;
  const int lane_first = static_cast<int>(threadIdx.x) % kWarpSize * radix_topk::kKeysPerLane;
  DSV4_PHASE_STAMP(radix_topk::kTopkStampStart);
  radix_topk::clear_counts(shared);
  const radix_topk::TileRange tiles = radix_topk::warp_tiles<kThreads>(count);
  for (int base = tiles.begin; base < tiles.end; base += kRadixLoadBatch) {
    float4 score[kRadixLoadBatch] = {};
#pragma unroll
    for (int b = 0; b < kRadixLoadBatch; ++b)
      if (base + b < tiles.end) score[b] = load_scores(row, (base + b) * kTileKeys + lane_first, count, aligned);
#pragma unroll
    for (int b = 0; b < kRadixLoadBatch; ++b)
      if (base + b < tiles.end) {
        const uint32_t key[radix_topk::kKeysPerLane] = {topk_key(score[b].x), topk_key(score[b].y),
                                                        topk_key(score[b].z), topk_key(score[b].w)};
        radix_topk::store_tile(keys, base + b, key);
        radix_topk::count_first_pass(key, shared);
      }
  }
  DSV4_PHASE_STAMP(radix_topk::kTopkStampLoaded);
  const radix_topk::Selection selection = radix_topk::select_picks(keys, count, a.k, shared);
  radix_topk::write_picks(keys, count, first, selection, a.picks + t * a.k, a.k, shared);
}

// A launch of `ctas` CTAs in clusters of `cluster` (attribute: storage for the cluster attribute).
template <int kThreads>
cudaLaunchConfig_t topk_radix_config(int64_t ctas, int64_t chunk, int cluster, cudaStream_t stream,
                                     cudaLaunchAttribute& attribute) {
  const size_t shared = static_cast<size_t>(chunk) * sizeof(uint32_t);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(topk_radix_kernel<kThreads>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  if (cluster > 1) {
    attribute = {};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return config;
}

template <int kThreads>
void launch_topk_radix(const RadixTopkLaunch& a, int64_t tokens, cudaStream_t stream) {
#ifdef DSV4_PHASE_STAMPS
  static const bool stamps_registered = (register_phase_stamps_dump(), true);
  (void)stamps_registered;
#endif
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = topk_radix_config<kThreads>(tokens * a.cluster, a.chunk, a.cluster, stream, cluster);
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&config, topk_radix_kernel<kThreads>, a));
}

// Rows (clusters of `cluster` CTAs of `chunk` keys) the device runs at once: the occupancy of
// clusters on sm_90 (which counts how they fit the GPCs), else of CTAs.
template <int kThreads>
int topk_radix_resident_rows(int64_t chunk, int cluster, int multiprocessors) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = topk_radix_config<kThreads>(cluster, chunk, cluster, nullptr, attribute);
  int rows = 0;
  if (cluster > 1) {
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&rows, topk_radix_kernel<kThreads>, &config));
  } else {
    DSV4_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&rows, topk_radix_kernel<kThreads>, kThreads, config.dynamicSmemBytes));
    rows *= multiprocessors;
  }
  return rows;
}

}  // namespace dsv4::cuda
