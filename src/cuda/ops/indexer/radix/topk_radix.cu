// The radix implementation of run_topk (topk_radix_kernel.cuh, radix_select.cuh): a row is split
// over a thread-block cluster of up to kMaxCluster CTAs on sm_90 (distributed shared memory, no
// global scratch), one CTA elsewhere. Its CTAs hold their chunks' keys in shared memory
// (resident) when every row's clusters fit the GPU at once that way, else they read their scores
// twice and keep only the keys the selection needs (streamed), which takes any row length.
#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/radix/topk_radix_kernel.cuh"

namespace dsv4::cuda {

#define DSV4_TOPK_RADIX(kThreads, kRows)                                                          \
  extern template void launch_topk_radix<kThreads, kRows>(const RadixTopkLaunch&, int64_t, cudaStream_t); \
  extern template int topk_radix_resident_rows<kThreads, kRows>(int64_t, int, int);
DSV4_TOPK_RADIX(256, RadixRows::resident)
DSV4_TOPK_RADIX(512, RadixRows::resident)
DSV4_TOPK_RADIX(1024, RadixRows::resident)
DSV4_TOPK_RADIX(256, RadixRows::streamed)
DSV4_TOPK_RADIX(512, RadixRows::streamed)
#undef DSV4_TOPK_RADIX

namespace {

constexpr int64_t kMinChunk = 8192;    // keys per CTA below which a row is not split further
constexpr int64_t kSmallChunk = 4096;  // resident chunks up to this many keys take 256 threads, longer ones 512 or 1024

struct RowSplit {
  RadixRows rows = RadixRows::resident;
  int cluster = 1;    // CTAs per row
  int64_t chunk = 0;  // keys per CTA
  int threads = 1024;
};

// Keys one resident CTA can hold next to the selection's own shared memory (of the 1024-thread
// kernel: a chunk too long for the 256-thread one's share is longer than kSmallChunk anyway),
// after which they start 16-byte aligned.
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

// The fewest resident CTAs a row of n keys fits (more than max_cluster(): the row is streamed).
int64_t min_cluster(int64_t n, const DeviceInfo& device) {
  const int64_t capacity = std::max<int64_t>(max_chunk(device), radix_topk::kTileKeys);
  int64_t cluster = (n + capacity - 1) / capacity;
  while (chunk_of(n, cluster) > capacity) ++cluster;  // the rounding to whole tiles
  return cluster;
}

template <RadixRows kRows>
int resident_rows_of(int threads, int64_t chunk, int cluster, int multiprocessors) {
  if constexpr (kRows == RadixRows::resident) {
    return threads == 256   ? topk_radix_resident_rows<256, kRows>(chunk, cluster, multiprocessors)
           : threads == 512 ? topk_radix_resident_rows<512, kRows>(chunk, cluster, multiprocessors)
                            : topk_radix_resident_rows<1024, kRows>(chunk, cluster, multiprocessors);
  } else {
    return threads == 256 ? topk_radix_resident_rows<256, kRows>(chunk, cluster, multiprocessors)
                          : topk_radix_resident_rows<512, kRows>(chunk, cluster, multiprocessors);
  }
}

// Rows that run at once for a split (topk_radix_resident_rows) on `device`, cached: the
// occupancy queries take microseconds, and a step asks for the same few splits each layer. A
// resident split's query takes the chunk rounded up to kOccupancyKeys (at most max_chunk): the
// estimate is never above the split's own occupancy, and rows of every length share a bounded set
// of cache entries. A streamed CTA's shared memory does not depend on its chunk.
constexpr int64_t kOccupancyKeys = 4096;  // 16 KB of shared memory
int resident_rows(const RowSplit& split, const DeviceInfo& device) {
  static std::mutex mutex;
  static std::map<std::tuple<int, RadixRows, int, int, int64_t>, int> cache;
  const bool resident = split.rows == RadixRows::resident;
  const int64_t chunk =
      resident ? std::min((split.chunk + kOccupancyKeys - 1) / kOccupancyKeys * kOccupancyKeys, std::max(max_chunk(device), split.chunk))
               : 0;
  const auto key = std::make_tuple(device.ordinal, split.rows, split.threads, split.cluster, chunk);
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = cache.find(key); found != cache.end()) return found->second;
  const int rows = resident ? resident_rows_of<RadixRows::resident>(split.threads, chunk, split.cluster, device.multiprocessors)
                            : resident_rows_of<RadixRows::streamed>(split.threads, chunk, split.cluster, device.multiprocessors);
  cache.emplace(key, rows);
  return rows;
}

// The split of `rows` rows of n keys of one kind expected to finish first, by a simple model: a
// wave of resident rows takes time in proportion to a thread's keys, so the cost is waves x keys
// per thread. For 64 rows of 128K on an H100 (bench/probes/topk_split_table.cu prints the occupancy
// per resident split) resident clusters of 8 CTAs of 512 threads run 30 at once, 3 waves of 32
// keys a thread; clusters of 7 CTAs of 512 threads run 32, 2 waves of 37 keys: the model picks
// them. Ties go to fewer waves, then to fewer CTAs a row (fewer cluster barriers). A row is split
// only into chunks of at least kMinChunk keys. Returns the split and its waves.
std::pair<RowSplit, int64_t> best_split(RadixRows kind, int64_t rows, int64_t n, const DeviceInfo& device) {
  const bool resident = kind == RadixRows::resident;
  const int64_t first = resident ? min_cluster(n, device) : 1;
  RowSplit best;
  int64_t best_cost = INT64_MAX, best_waves = INT64_MAX;
  for (int64_t cluster = first; cluster <= std::max<int64_t>(first, max_cluster(device)); ++cluster) {
    const int64_t chunk = chunk_of(n, cluster);
    if (cluster > first && chunk < kMinChunk) break;
    for (const int threads : {256, 512, 1024}) {
      if (resident ? (threads == 256) != (chunk <= kSmallChunk) : threads == 1024) continue;
      const RowSplit split{kind, static_cast<int>(cluster), chunk, threads};
      const int64_t at_once = std::max(resident_rows(split, device), 1);
      const int64_t waves = (rows + at_once - 1) / at_once;
      const int64_t cost = waves * ((chunk + threads - 1) / threads);
      if (cost < best_cost || (cost == best_cost && waves < best_waves)) best = split, best_cost = cost, best_waves = waves;
    }
  }
  return {best, best_waves};
}

// Resident rows read their scores once: they are preferred wherever they fit and run in one wave.
// Rows whose keys would need more waves (or more CTAs than a cluster has) are streamed, which
// reads the scores twice but runs every row at once.
RowSplit split_rows(int64_t rows, int64_t n, const DeviceInfo& device) {
  if (min_cluster(n, device) <= max_cluster(device)) {
    const auto [resident, waves] = best_split(RadixRows::resident, rows, n, device);
    if (waves == 1) return resident;
  }
  return best_split(RadixRows::streamed, rows, n, device).first;
}

// A CTA counts its chunk's keys in 32 bits, tiles included.
constexpr int64_t kMaxRow = int64_t{1} << 30;

std::string supports(const TopkParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  const int64_t n = p.scores.shape[1];  // any k, group size and number of rows
  return n <= kMaxRow ? "" : "rows of " + std::to_string(n) + " scores, supports at most " + std::to_string(kMaxRow);
}

void launch(RadixTopkLaunch a, const RowSplit& split, int64_t tokens, cudaStream_t stream) {
  DSV4_CHECK(tokens * split.cluster <= INT_MAX, "topk: ", tokens, " rows of ", split.cluster, " CTAs are too many");
  a.chunk = split.chunk;
  a.cluster = split.cluster;
  if (split.rows == RadixRows::streamed) {
    if (split.threads == 256) launch_topk_radix<256, RadixRows::streamed>(a, tokens, stream);
    else launch_topk_radix<512, RadixRows::streamed>(a, tokens, stream);
  } else if (split.threads == 256) {
    launch_topk_radix<256, RadixRows::resident>(a, tokens, stream);
  } else if (split.threads == 512) {
    launch_topk_radix<512, RadixRows::resident>(a, tokens, stream);
  } else {
    launch_topk_radix<1024, RadixRows::resident>(a, tokens, stream);
  }
  check_launch("topk");
}

// Every row streamed (the tests run both kinds on every shape).
RowSplit streamed_rows(int64_t rows, int64_t n, const DeviceInfo& device) {
  return best_split(RadixRows::streamed, rows, n, device).first;
}

template <RowSplit (*kSplit)(int64_t, int64_t, const DeviceInfo&)>
void run(const TopkParams& p, cudaStream_t stream) {
  const RadixTopkLaunch a{topk_launch(p)};
  const int64_t tokens = p.scores.shape[0];
  if (tokens == 0 || a.k == 0) return;
  launch(a, kSplit(tokens, a.n, device_info()), tokens, stream);
}

}  // namespace

const TopkImplementation kTopkRadix = {"radix", &supports, &run<split_rows>};
const TopkImplementation kTopkRadixStreamed = {"radix_streamed", &supports, &run<streamed_rows>};

}  // namespace dsv4::cuda
