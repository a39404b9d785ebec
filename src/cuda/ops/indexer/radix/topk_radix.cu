// The radix implementation of run_topk: a row's keys are read from global memory once, into the
// shared memory of the CTAs that select its picks (topk_radix_kernel.cuh, radix_select.cuh). On
// sm_90 a row longer than kChunkTarget is split over a thread-block cluster of up to kMaxCluster
// CTAs (distributed shared memory, no global scratch); elsewhere one CTA holds the whole row.
#include <algorithm>
#include <climits>

#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/radix/topk_radix_kernel.cuh"

namespace dsv4::cuda {

extern template void launch_topk_radix<256>(const RadixTopkLaunch&, int64_t, cudaStream_t);
extern template void launch_topk_radix<512>(const RadixTopkLaunch&, int64_t, cudaStream_t);
extern template void launch_topk_radix<1024>(const RadixTopkLaunch&, int64_t, cudaStream_t);

namespace {

constexpr int64_t kChunkTarget = 16384;  // keys per CTA (64 KB) a long row is split into
constexpr int64_t kSmallChunk = 4096;    // chunks up to this many keys take 256 threads, longer ones 512 or 1024
// CTAs of 1024 threads an H100 / H200 runs at once: one per SM, 16 clusters of 8 on its 132 SMs.
// A grid of more takes CTAs of 512 threads, two per SM where their chunks fit (16K keys do): twice
// the rows in flight, and one CTA's barriers and distributed shared memory reads overlap the
// other's loads and passes. One wave of fewer CTAs keeps 1024 threads: more warps per chunk.
constexpr int64_t kOneWaveCtas = 128;

struct RowSplit {
  int cluster = 1;    // CTAs per row
  int64_t chunk = 0;  // keys per CTA
};

// Keys one CTA can hold next to the selection's own shared memory (of the 1024-thread kernel: a
// chunk too long for the 256-thread one's share is longer than kSmallChunk anyway), after which
// they start 16-byte aligned.
int64_t max_chunk(const DeviceInfo& device) {
  constexpr int64_t kSelectBytes = (sizeof(radix_topk::SelectShared<1024>) + 15) / 16 * 16;
  const int64_t bytes = device.max_shared_bytes_per_block - kSelectBytes;
  return std::max<int64_t>(0, bytes / static_cast<int64_t>(sizeof(uint32_t))) / radix_topk::kTileKeys *
         radix_topk::kTileKeys;
}

// Clusters exist in the sm_90a code only (other devices run the compute_80 PTX).
int max_cluster(const DeviceInfo& device) {
  return device.compute_capability == 90 ? radix_topk::kMaxCluster : 1;
}

// Chunks of about kChunkTarget keys, on at most max_cluster() CTAs; smaller chunks on more CTAs
// where one CTA cannot hold kChunkTarget keys (supports() rejects rows needing more than
// max_cluster() CTAs).
RowSplit split_rows(int64_t n, const DeviceInfo& device) {
  const int64_t capacity = std::max<int64_t>(max_chunk(device), 1);
  const int64_t target = std::clamp<int64_t>((n + kChunkTarget - 1) / kChunkTarget, 1, max_cluster(device));
  const int64_t cluster = std::max(target, (n + capacity - 1) / capacity);
  const int64_t chunk = (n + cluster - 1) / cluster;
  return {static_cast<int>(std::min<int64_t>(cluster, INT_MAX)),
          (chunk + radix_topk::kTileKeys - 1) / radix_topk::kTileKeys * radix_topk::kTileKeys};
}

std::string supports(const TopkParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  const int64_t n = p.scores.shape[1];
  if (split_rows(n, device).cluster <= max_cluster(device)) return "";  // any k, group size and number of rows
  return "rows of " + std::to_string(n) + " scores exceed the shared memory of " + std::to_string(max_cluster(device)) +
         (max_cluster(device) == 1 ? " CTA" : " CTAs") + " (" + std::to_string(max_cluster(device) * max_chunk(device)) +
         " scores)";
}

void run(const TopkParams& p, cudaStream_t stream) {
  RadixTopkLaunch a{topk_launch(p)};
  const int64_t tokens = p.scores.shape[0];
  if (tokens == 0 || a.k == 0) return;
  const RowSplit split = split_rows(a.n, device_info());
  DSV4_CHECK(tokens * split.cluster <= INT_MAX, "topk: ", tokens, " rows of ", split.cluster, " CTAs are too many");
  a.chunk = split.chunk;
  a.cluster = split.cluster;
  if (split.chunk <= kSmallChunk) launch_topk_radix<256>(a, tokens, stream);
  else if (tokens * split.cluster <= kOneWaveCtas) launch_topk_radix<1024>(a, tokens, stream);
  else launch_topk_radix<512>(a, tokens, stream);
  check_launch("topk");
}

}  // namespace

const TopkImplementation kTopkRadix = {"radix", &supports, &run};

}  // namespace dsv4::cuda
