// The radix implementation of run_topk: a row's keys are read from global memory once, into the
// shared memory of the CTAs that select its picks (topk_radix_kernel.cuh, radix_select.cuh). On
// sm_90 a row may be split over a thread-block cluster of up to kMaxCluster CTAs (distributed
// shared memory, no global scratch), as split_rows() chooses from the clusters' occupancy;
// elsewhere one CTA holds the whole row.
#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/radix/topk_radix_kernel.cuh"

namespace dsv4::cuda {

extern template void launch_topk_radix<256>(const RadixTopkLaunch&, int64_t, cudaStream_t);
extern template void launch_topk_radix<512>(const RadixTopkLaunch&, int64_t, cudaStream_t);
extern template void launch_topk_radix<1024>(const RadixTopkLaunch&, int64_t, cudaStream_t);
extern template int topk_radix_resident_rows<256>(int64_t, int, int);
extern template int topk_radix_resident_rows<512>(int64_t, int, int);
extern template int topk_radix_resident_rows<1024>(int64_t, int, int);

namespace {

constexpr int64_t kMinChunk = 8192;    // keys per CTA below which a row is not split further
constexpr int64_t kSmallChunk = 4096;  // chunks up to this many keys take 256 threads, longer ones 512 or 1024

struct RowSplit {
  int cluster = 1;    // CTAs per row
  int64_t chunk = 0;  // keys per CTA
  int threads = 1024;
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

int64_t chunk_of(int64_t n, int64_t cluster) {
  const int64_t chunk = (n + cluster - 1) / cluster;
  return (chunk + radix_topk::kTileKeys - 1) / radix_topk::kTileKeys * radix_topk::kTileKeys;
}

// The fewest CTAs a row of n keys fits (supports() rejects rows needing more than max_cluster()).
int64_t min_cluster(int64_t n, const DeviceInfo& device) {
  const int64_t capacity = std::max<int64_t>(max_chunk(device), radix_topk::kTileKeys);
  int64_t cluster = (n + capacity - 1) / capacity;
  while (chunk_of(n, cluster) > capacity) ++cluster;  // the rounding to whole tiles
  return cluster;
}

// Rows that run at once for a split (topk_radix_resident_rows) on `device`, cached: the
// occupancy queries take microseconds, and a step asks for the same few splits each layer. The
// query takes the chunk rounded up to kOccupancyKeys (at most max_chunk): the estimate is never
// above the split's own occupancy, and rows of every length share a bounded set of cache entries.
constexpr int64_t kOccupancyKeys = 4096;  // 16 KB of shared memory
int resident_rows(const RowSplit& split, const DeviceInfo& device) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int, int64_t>, int> cache;
  const int64_t chunk =
      std::min((split.chunk + kOccupancyKeys - 1) / kOccupancyKeys * kOccupancyKeys, std::max(max_chunk(device), split.chunk));
  const auto key = std::make_tuple(device.ordinal, split.threads, split.cluster, chunk);
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = cache.find(key); found != cache.end()) return found->second;
  const int rows = split.threads == 256   ? topk_radix_resident_rows<256>(chunk, split.cluster, device.multiprocessors)
                   : split.threads == 512 ? topk_radix_resident_rows<512>(chunk, split.cluster, device.multiprocessors)
                                          : topk_radix_resident_rows<1024>(chunk, split.cluster, device.multiprocessors);
  cache.emplace(key, rows);
  return rows;
}

// The split of `rows` rows of n keys expected to finish first, by a simple model: a wave of
// resident rows takes time in proportion to a thread's keys, so the cost is waves x keys per
// thread. For 64 rows of 128K on an H100 (bench/probes/topk_split_table.cu prints the occupancy per
// split) clusters of 8 CTAs of 512 threads run 30 at once, 3 waves of 32 keys a thread; clusters of
// 7 CTAs of 512 threads run 32, 2 waves of 37 keys: the model picks them. Ties go to fewer waves,
// then to fewer CTAs a row (fewer cluster barriers). A row is split only into chunks of at least
// kMinChunk keys.
RowSplit split_rows(int64_t rows, int64_t n, const DeviceInfo& device) {
  const int64_t first = min_cluster(n, device);
  RowSplit best;
  int64_t best_cost = INT64_MAX, best_waves = INT64_MAX;
  for (int64_t cluster = first; cluster <= std::max<int64_t>(first, max_cluster(device)); ++cluster) {
    const int64_t chunk = chunk_of(n, cluster);
    if (cluster > first && chunk < kMinChunk) break;
    for (const int threads : {256, 512, 1024}) {
      if ((threads == 256) != (chunk <= kSmallChunk)) continue;
      const RowSplit split{static_cast<int>(cluster), chunk, threads};
      const int64_t resident = std::max(resident_rows(split, device), 1);
      const int64_t waves = (rows + resident - 1) / resident;
      const int64_t cost = waves * ((chunk + threads - 1) / threads);
      if (cost < best_cost || (cost == best_cost && waves < best_waves)) best = split, best_cost = cost, best_waves = waves;
    }
  }
  return best;
}

std::string supports(const TopkParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  const int64_t n = p.scores.shape[1];
  if (min_cluster(n, device) <= max_cluster(device)) return "";  // any k, group size and number of rows
  return "rows of " + std::to_string(n) + " scores exceed the shared memory of " + std::to_string(max_cluster(device)) +
         (max_cluster(device) == 1 ? " CTA" : " CTAs") + " (" + std::to_string(max_cluster(device) * max_chunk(device)) +
         " scores)";
}

void run(const TopkParams& p, cudaStream_t stream) {
  RadixTopkLaunch a{topk_launch(p)};
  const int64_t tokens = p.scores.shape[0];
  if (tokens == 0 || a.k == 0) return;
  const RowSplit split = split_rows(tokens, a.n, device_info());
  DSV4_CHECK(tokens * split.cluster <= INT_MAX, "topk: ", tokens, " rows of ", split.cluster, " CTAs are too many");
  a.chunk = split.chunk;
  a.cluster = split.cluster;
  if (split.threads == 256) launch_topk_radix<256>(a, tokens, stream);
  else if (split.threads == 512) launch_topk_radix<512>(a, tokens, stream);
  else launch_topk_radix<1024>(a, tokens, stream);
  check_launch("topk");
}

}  // namespace

const TopkImplementation kTopkRadix = {"radix", &supports, &run};

}  // namespace dsv4::cuda
