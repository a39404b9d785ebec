// The SIMT implementation of run_topk: one block per row, a radix select then one ordered pass.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/common/device_math.cuh"
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/topk_rules.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kTopkThreads = 256;

// One block per row: a 4-pass radix select finds the key of the k-th best element, then one
// ordered pass writes every better element and the first ties in index order (so the picks come
// out ascending).
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(TopkLaunch a) {
  using Scan = cub::BlockScan<int, kTopkThreads>;
  using Reduce = cub::BlockReduce<int, kTopkThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ unsigned histogram[256];
  __shared__ uint32_t shared_prefix;
  __shared__ int shared_remaining;
  __shared__ int shared_eligible;

  const int64_t t = blockIdx.x;
  const float* row = a.scores + t * a.n;
  int32_t* picks = a.picks + t * a.k;
  const int64_t length = topk_eligible_length(a.n, a.token_position, a.compress_ratio, a.group_size, t);

  int eligible = 0;
  for (int64_t j = threadIdx.x; j < length; j += kTopkThreads) eligible += topk_key(row[j]) != 0u;
  eligible = Reduce(temp.reduce).Sum(eligible);
  if (threadIdx.x == 0) shared_eligible = eligible;
  __syncthreads();
  const int64_t take = a.k < shared_eligible ? a.k : int64_t{shared_eligible};

  // Select keys > threshold, plus the first `ties` keys == threshold in index order.
  uint32_t threshold = 0u;
  int64_t ties = 0;
  if (take < shared_eligible) {
    uint32_t prefix = 0u, mask = 0u;
    int remaining = static_cast<int>(take);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += kTopkThreads) histogram[i] = 0u;
      __syncthreads();
      for (int64_t j = threadIdx.x; j < length; j += kTopkThreads) {
        const uint32_t key = topk_key(row[j]);
        if (key != 0u && (key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int above = 0, bucket = 255;
        for (; bucket > 0 && above + static_cast<int>(histogram[bucket]) < remaining; --bucket) above += histogram[bucket];
        shared_prefix = prefix | (static_cast<uint32_t>(bucket) << shift);
        shared_remaining = remaining - above;
      }
      __syncthreads();
      prefix = shared_prefix;
      remaining = shared_remaining;
      mask |= 0xffu << shift;
    }
    threshold = prefix;
    ties = remaining;
  }

  int64_t written = 0, ties_seen = 0;
  for (int64_t base = 0; base < length && written < take; base += kTopkThreads) {
    const int64_t j = base + threadIdx.x;
    const uint32_t key = j < length ? topk_key(row[j]) : 0u;
    const int is_tie = ties > 0 && key == threshold;
    int tie_rank = 0, tie_total = 0;
    Scan(temp.scan).ExclusiveSum(is_tie, tie_rank, tie_total);
    __syncthreads();
    const int selected = key > threshold || (is_tie && ties_seen + tie_rank < ties);
    int slot = 0, selected_total = 0;
    Scan(temp.scan).ExclusiveSum(selected, slot, selected_total);
    __syncthreads();
    if (selected) picks[written + slot] = static_cast<int32_t>(j);
    written += selected_total;
    ties_seen += tie_total;
  }
  for (int64_t i = take + threadIdx.x; i < a.k; i += kTopkThreads) picks[i] = -1;
}

std::string supports(const TopkParams&, const DeviceInfo& device) {
  return needs_compute_capability_at_least(80, device);  // any row length, k and group size
}

void run(const TopkParams& p, cudaStream_t stream) {
  const TopkLaunch a = topk_launch(p);
  const int64_t tokens = p.scores.shape[0];
  if (tokens == 0 || a.k == 0) return;
  topk_kernel<<<static_cast<unsigned>(tokens), kTopkThreads, 0, stream>>>(a);
  check_launch("topk");
}

}  // namespace

const TopkImplementation kTopkSimt = {"simt", &supports, &run};

}  // namespace dsv4::cuda
