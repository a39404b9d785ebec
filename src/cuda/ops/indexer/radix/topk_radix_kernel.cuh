// The radix top-k kernels (topk_radix.cu launches them): one cluster of CTAs per row, each CTA
// reading its chunk of the row's scores and counting the first radix pass as it reads them, then
// running the selection core (radix_select.cuh) on the chunk's keys held in one of two ways:
// - resident: the CTA stores every key of its chunk in shared memory as it reads it. One read of
//   the scores, but the rows' keys must fit the GPU's shared memory to run at once (64 rows of
//   128K do not: 33.5 MB of keys against 30 MB on an H100).
// - streamed: the CTA keeps only the first pass's counts, then reads its chunk a second time
//   (from L2 mostly: the first read keeps it there) and gathers in row order the keys the later
//   passes and the picks need: those at or above the first pass's threshold bin, which are few
//   unless many scores fall in that bin. When its chunk has more of them than a CTA can hold
//   (kGatherCapacity), the CTA reads its scores from global memory again for each later pass
//   instead. Little shared memory a CTA, so every row's clusters run at once.
#pragma once

#include <algorithm>

#include "cuda/ops/indexer/radix/radix_select.cuh"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/topk_rules.cuh"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

inline constexpr int kRadixLoadBatch = 4;  // tiles loaded at once: 16 scores in flight per thread

enum class RadixRows { resident, streamed };

// Keys a streamed CTA gathers (a multiple of the tile; at least the largest k, so that a row with
// fewer eligible keys than k is always gathered).
inline constexpr int kGatherCapacity = 4096;
static_assert(kGatherCapacity % radix_topk::kTileKeys == 0 && kGatherCapacity >= 2048);

struct RadixTopkLaunch : TopkLaunch {
  int64_t chunk = 0;  // keys per CTA (a multiple of radix_topk::kTileKeys): CTA r of a row's cluster
                      // holds positions [r * chunk, (r + 1) * chunk)
  int cluster = 1;    // CTAs per row (> 1 on sm_90 only)
};

// The dynamic shared memory of a CTA: the resident chunk's keys, or the gathered keys and their
// positions.
template <RadixRows kRows>
constexpr size_t radix_dynamic_shared_bytes(int64_t chunk) {
  return kRows == RadixRows::resident ? static_cast<size_t>(chunk) * sizeof(uint32_t)
                                      : size_t{kGatherCapacity} * (sizeof(uint32_t) + sizeof(int32_t));
}

// Scores i .. i + 3 of a chunk of `count` scores (-inf past count): one 16-byte load where the
// chunk is aligned to 16 bytes (rows of a multiple of 4 scores), else four. The last read of a
// score streams past the caches; an earlier one leaves it in L2 for the next.
__device__ __forceinline__ float4 load_scores(const float* chunk, int i, int count, bool aligned, bool last_read) {
  const auto load = [&](const auto* p) { return last_read ? __ldcs(p) : __ldcg(p); };
  if (aligned && i + 4 <= count) return load(reinterpret_cast<const float4*>(chunk + i));
  float score[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) score[j] = i + j < count ? load(chunk + i + j) : -INFINITY;
  return make_float4(score[0], score[1], score[2], score[3]);
}

// A CTA's chunk of scores in global memory as a key source (radix_select.cuh): a streamed CTA's
// later passes read it when its keys were not gathered.
struct ScoreKeys {
  const float* scores;  // [count] f32: the chunk
  int count;
  bool aligned;
  int64_t first;  // the chunk's first row position
  __device__ void load(int tile, uint32_t (&key)[radix_topk::kKeysPerLane]) const {
    const float4 s = load_scores(scores, tile * radix_topk::kTileKeys + static_cast<int>(threadIdx.x) % kWarpSize * 4,
                                 count, aligned, false);
    key[0] = topk_key(s.x), key[1] = topk_key(s.y), key[2] = topk_key(s.z), key[3] = topk_key(s.w);
  }
  __device__ int64_t position(int i) const { return first + i; }
};

// Gathers in row order the CTA's keys the selection still reads (key != 0, (key & mask) >=
// prefix: the first pass's threshold bin and above) with their positions, and pads the last tile
// with 0; returns how many (the caller has checked that they fit kGatherCapacity). The tiles go
// round-robin over the warps, kRadixLoadBatch rounds loaded at once. The counts of up to
// kWarpSize / kWarps rounds (per round and warp, in row order) are combined through shared memory
// by one barrier and one warp scan (`scan_counts`, two scans' worth so that the next scan's counts
// do not overwrite those a slower warp still reads): a barrier a round, and each warp adding the
// warps before it one by one, took a third of the gather's instructions (RESULTS, forty-eighth
// session).
template <int kThreads>
__device__ int gather_keys(const ScoreKeys& chunk, const radix_topk::SelectionState& state, uint32_t* keys,
                           int32_t* positions, int (&scan_counts)[2][kWarpSize]) {
  using radix_topk::kKeysPerLane, radix_topk::kTileKeys;
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kScanRounds = kRadixLoadBatch < kWarpSize / kWarps ? kRadixLoadBatch : kWarpSize / kWarps;
  static_assert(kScanRounds >= 1 && kRadixLoadBatch % kScanRounds == 0);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int tiles = (chunk.count + kTileKeys - 1) / kTileKeys;
  int gathered = 0, scans = 0;
  for (int batch = 0; batch * kWarps < tiles; batch += kRadixLoadBatch) {
    uint32_t key[kRadixLoadBatch][kKeysPerLane] = {};
#pragma unroll
    for (int b = 0; b < kRadixLoadBatch; ++b)
      if ((batch + b) * kWarps + warp < tiles) chunk.load((batch + b) * kWarps + warp, key[b]);
#pragma unroll
    for (int first = 0; first < kRadixLoadBatch; first += kScanRounds, ++scans) {
      int(&counts)[kWarpSize] = scan_counts[scans & 1];  // entry r·kWarps + w: round first + r, warp w
      bool kept[kScanRounds][kKeysPerLane];
      int lane_before[kScanRounds];  // this lane's offset among its warp's keys of the round
#pragma unroll
      for (int r = 0; r < kScanRounds; ++r) {
        int lane_kept = 0;
#pragma unroll
        for (int j = 0; j < kKeysPerLane; ++j) {
          const uint32_t k = key[first + r][j];
          kept[r][j] = k != 0u && (k & state.mask) >= state.prefix;
          lane_kept += kept[r][j] ? 1 : 0;
        }
        const int through = radix_topk::warp_inclusive_sum(lane_kept);
        lane_before[r] = through - lane_kept;
        if (lane == kWarpSize - 1) counts[r * kWarps + warp] = through;
      }
      __syncthreads();
      const int count = lane < kScanRounds * kWarps ? counts[lane] : 0;
      const int counts_through = radix_topk::warp_inclusive_sum(count);
#pragma unroll
      for (int r = 0; r < kScanRounds; ++r) {
        const int tile = (batch + first + r) * kWarps + warp;
        int at = gathered + __shfl_sync(kFullMask, counts_through - count, r * kWarps + warp) + lane_before[r];
#pragma unroll
        for (int j = 0; j < kKeysPerLane; ++j)
          if (kept[r][j]) {
            keys[at] = key[first + r][j];
            positions[at] = static_cast<int32_t>(chunk.position(tile * kTileKeys + lane * kKeysPerLane + j));
            ++at;
          }
      }
      gathered += __shfl_sync(kFullMask, counts_through, kWarpSize - 1);
    }
  }
  const int padded = (gathered + kTileKeys - 1) / kTileKeys * kTileKeys;
  for (int i = gathered + static_cast<int>(threadIdx.x); i < padded; i += kThreads) keys[i] = 0u;
  __syncthreads();
  return gathered;
}

// A grid of tokens x cluster CTAs. Each instantiation is capped at 64 registers per thread, so
// that an SM holds 1024 of its threads: one CTA of 1024, two of 512 or four of 256 (shared memory
// permitting).
template <int kThreads, RadixRows kRows>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) topk_radix_kernel(RadixTopkLaunch a) {
  using radix_topk::kTileKeys, radix_topk::RowCluster;
  constexpr bool kResident = kRows == RadixRows::resident;
  // resident: [a.chunk] keys; streamed: [kGatherCapacity] keys, then [kGatherCapacity] positions
  extern __shared__ __align__(16) uint32_t keys[];
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
      if (base + b < tiles.end) score[b] = load_scores(row, (base + b) * kTileKeys + lane_first, count, aligned, kResident);
#pragma unroll
    for (int b = 0; b < kRadixLoadBatch; ++b)
      if (base + b < tiles.end) {
        const uint32_t key[radix_topk::kKeysPerLane] = {topk_key(score[b].x), topk_key(score[b].y),
                                                        topk_key(score[b].z), topk_key(score[b].w)};
        if constexpr (kResident) radix_topk::store_tile(keys, base + b, key);
        radix_topk::count_first_pass(key, shared);
      }
  }
  DSV4_PHASE_STAMP(radix_topk::kTopkStampLoaded);
  const radix_topk::SelectionState state = radix_topk::first_pass(a.k, shared);
  int32_t* const picks = a.picks + t * a.k;
  auto select = [&](const auto& source, int source_count) {
    radix_topk::write_picks(source, source_count, radix_topk::refine(source, source_count, state, a.k, shared), picks,
                            a.k, shared);
  };
  if constexpr (kResident) {
    select(radix_topk::ChunkKeys{keys, first}, count);
  } else {
    const ScoreKeys chunk{row, count, aligned, first};
    if (radix_topk::cta_kept_keys(state, shared) <= kGatherCapacity) {
      __shared__ int scan_counts[2][kWarpSize];
      int32_t* const positions = reinterpret_cast<int32_t*>(keys + kGatherCapacity);
      const int gathered = gather_keys<kThreads>(chunk, state, keys, positions, scan_counts);
      DSV4_PHASE_STAMP(radix_topk::kTopkStampGathered);
      select(radix_topk::GatheredKeys{keys, positions}, gathered);
    } else {
      select(chunk, count);
    }
  }
}

// A launch of `ctas` CTAs in clusters of `cluster` (attribute: storage for the cluster attribute).
template <int kThreads, RadixRows kRows>
cudaLaunchConfig_t topk_radix_config(int64_t ctas, int64_t chunk, int cluster, cudaStream_t stream,
                                     cudaLaunchAttribute& attribute) {
  const size_t shared = radix_dynamic_shared_bytes<kRows>(chunk);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(topk_radix_kernel<kThreads, kRows>, cudaFuncAttributeMaxDynamicSharedMemorySize,
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

template <int kThreads, RadixRows kRows>
void launch_topk_radix(const RadixTopkLaunch& a, int64_t tokens, cudaStream_t stream) {
#ifdef DSV4_PHASE_STAMPS
  static const bool stamps_registered = (register_phase_stamps_dump(), true);
  (void)stamps_registered;
#endif
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = topk_radix_config<kThreads, kRows>(tokens * a.cluster, a.chunk, a.cluster, stream, cluster);
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&config, topk_radix_kernel<kThreads, kRows>, a));
}

// Rows (clusters of `cluster` CTAs of `chunk` keys) the device runs at once: the occupancy of
// clusters on sm_90 (which counts how they fit the GPCs), else of CTAs.
template <int kThreads, RadixRows kRows>
int topk_radix_resident_rows(int64_t chunk, int cluster, int multiprocessors) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = topk_radix_config<kThreads, kRows>(cluster, chunk, cluster, nullptr, attribute);
  int rows = 0;
  if (cluster > 1) {
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&rows, topk_radix_kernel<kThreads, kRows>, &config));
  } else {
    DSV4_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&rows, topk_radix_kernel<kThreads, kRows>, kThreads, config.dynamicSmemBytes));
    rows *= multiprocessors;
  }
  return rows;
}

}  // namespace dsv4::cuda
