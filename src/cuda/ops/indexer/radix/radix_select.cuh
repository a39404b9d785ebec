// The selection core of the radix top-k: the keys of one row (topk_rules.cuh) lie in the shared
// memory of the CTAs of a thread-block cluster, each CTA holding a contiguous chunk in row order.
// select_picks finds the k-th best key with four 8-bit radix passes whose histograms the CTAs
// combine through distributed shared memory; write_picks then writes every pick at its rank in the
// row's ascending pick list. Nothing goes through global memory but the picks, and the result is a
// pure function of the keys (histogram counts do not depend on the order of the atomics).
//
// It only reads each CTA's `keys[0, count)`, the keys of row positions first + i: a kernel that
// computes its chunk's scores into shared memory instead of loading them (a fused score scan) can
// call it as is.
#pragma once

#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "cuda/common/device_math.cuh"

namespace dsv4::cuda::radix_topk {

// The CTAs sharing one row. sm_90 code runs clusters (a launch without a cluster is a cluster of
// one); the compute_80 PTX has none, so it is always one CTA there.
struct RowCluster {
  __device__ static unsigned rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return cooperative_groups::this_cluster().block_rank();
#else
    return 0;
#endif
  }
  __device__ static unsigned size() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return cooperative_groups::this_cluster().num_blocks();
#else
    return 1;
#endif
  }
  // A barrier of every thread of every CTA of the cluster; orders their shared memory accesses.
  __device__ static void sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cooperative_groups::this_cluster().sync();
#else
    __syncthreads();
#endif
  }
  // The same shared variable in CTA `rank` of the cluster.
  template <class T>
  __device__ static T* remote(T* local, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return cooperative_groups::this_cluster().map_shared_rank(local, rank);
#else
    (void)rank;
    return local;
#endif
  }
};

inline constexpr int kRadixBits = 8;
inline constexpr int kBins = 1 << kRadixBits;
// Lane i counts into copy i % kHistogramCopies of the histogram: scores cluster in few bins (a
// binade per bin in the first pass), and lanes adding to one shared word serialize. The copies are
// kBins + 1 words apart, so the same bin of two copies lies in different banks.
inline constexpr int kHistogramCopies = 4;

// The picks of a row: every key != 0 with (key & mask) > prefix, and of the keys with
// (key & mask) == prefix (the ties at the threshold) the first `ties` in row order.
struct Selection {
  uint32_t prefix = 0;
  uint32_t mask = 0;
  int ties = 0;
  int taken = 0;  // picks in all: min(k, eligible keys)
};

template <int kThreads>
struct SelectShared {
  static_assert(kThreads % kWarpSize == 0 && kThreads >= kBins && kThreads / kWarpSize <= kWarpSize);
  static constexpr int kWarps = kThreads / kWarpSize;
  using Scan = cub::BlockScan<int, kThreads>;

  typename Scan::TempStorage scan;
  // This CTA's counts per bin (copy 0 once folded); passes alternate, since another CTA may still
  // read the previous pass's counts while this one counts.
  unsigned histogram[2][kHistogramCopies][kBins + 1];
  int bucket, above, bucket_count;  // the pass's threshold bin, keys in the bins above it, keys in it
  // write_picks: per warp, its keys above the threshold, its ties, and where its ties and picks start.
  int warp_above[kWarps], warp_ties[kWarps], warp_tie_rank[kWarps], warp_pick_rank[kWarps];
  int cta_above, cta_ties;  // this CTA's, read by the later CTAs of the cluster
};

__device__ __forceinline__ int warp_exclusive_sum(int v) {
  const int lane = threadIdx.x % kWarpSize;
  int inclusive = v;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  return inclusive - v;
}

// The threshold of the k best keys of the row (key 0, -inf, is never counted): most significant
// byte first, each pass keeps the bin holding the remaining-th best key among the keys that match
// the prefix so far. Stops early when every key of that bin is picked. Every CTA of the cluster
// computes the same result from the combined counts.
template <int kThreads>
__device__ Selection select_picks(const uint32_t* keys, int count, int64_t k, SelectShared<kThreads>& s) {
  using Scan = typename SelectShared<kThreads>::Scan;
  const unsigned cluster_size = RowCluster::size();
  uint32_t prefix = 0u, mask = 0u;
  int remaining = static_cast<int>(k < INT32_MAX ? k : INT32_MAX);  // picks left among the keys matching prefix
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  int eligible = 0;
  for (int shift = 32 - kRadixBits, pass = 0; shift >= 0; shift -= kRadixBits, ++pass) {
    auto& copies = s.histogram[pass & 1];
    for (int b = threadIdx.x; b < kHistogramCopies * (kBins + 1); b += kThreads) (&copies[0][0])[b] = 0u;
    __syncthreads();
    unsigned* copy = copies[threadIdx.x % kHistogramCopies];
    for (int warp_base = static_cast<int>(threadIdx.x) - lane; warp_base < count; warp_base += kThreads) {
      const int i = warp_base + lane;
      const uint32_t key = i < count ? keys[i] : 0u;
      const bool counted = key != 0u && (key & mask) == prefix;
      const unsigned bin = (key >> shift) & (kBins - 1), voters = __ballot_sync(kFullMask, counted);
      // A warp whose counted keys share one bin (a run of equal scores) adds them in one atomic.
      const unsigned first_bin = __shfl_sync(kFullMask, bin, voters ? __ffs(voters) - 1 : 0);
      if (__all_sync(kFullMask, !counted || bin == first_bin)) {
        if (lane == 0 && voters) atomicAdd(&copy[first_bin], static_cast<unsigned>(__popc(voters)));
      } else if (counted) {
        atomicAdd(&copy[bin], 1u);
      }
    }
    __syncthreads();
    unsigned* histogram = copies[0];
    if (threadIdx.x < kBins)
      for (int c = 1; c < kHistogramCopies; ++c) histogram[threadIdx.x] += copies[c][threadIdx.x];
    RowCluster::sync();  // every CTA's counts of this pass are complete
    // Thread i holds bin kBins - 1 - i, so that an inclusive scan counts the keys in and above a bin.
    int bin_count = 0;
    if (threadIdx.x < kBins)
      for (unsigned r = 0; r < cluster_size; ++r)
        bin_count += static_cast<int>(RowCluster::remote(histogram, r)[kBins - 1 - threadIdx.x]);
    int in_and_above = 0, matching = 0;
    Scan(s.scan).InclusiveSum(bin_count, in_and_above, matching);
    if (pass == 0) eligible = matching;
    // Fewer eligible keys than k (only possible in the first pass): all of them are picked.
    if (matching < remaining) return {prefix, mask, matching, matching};
    if (threadIdx.x < kBins && in_and_above >= remaining && in_and_above - bin_count < remaining) {
      s.bucket = kBins - 1 - static_cast<int>(threadIdx.x);
      s.above = in_and_above - bin_count;
      s.bucket_count = bin_count;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s.bucket) << shift;
    mask |= static_cast<uint32_t>(kBins - 1) << shift;
    remaining -= s.above;
    // s and the scan storage are written again only after the next pass's cluster barrier.
    if (s.bucket_count == remaining) break;
  }
  return {prefix, mask, remaining, static_cast<int>(k < eligible ? k : eligible)};
}

// Writes the picks of this CTA's keys (row positions first + i) into picks[0, k) of the row: the
// chunks lie in row order and each warp walks a contiguous run of tiles of 32 keys, so ranks in
// row order come from counts per CTA and per warp and ballots per tile. The CTAs share the -1
// padding. Ends with a cluster barrier, after which the CTA may exit.
template <int kThreads>
__device__ void write_picks(const uint32_t* keys, int count, int64_t first, const Selection& selection,
                            int32_t* picks, int64_t k, SelectShared<kThreads>& s) {
  constexpr int kWarps = SelectShared<kThreads>::kWarps;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const unsigned lanes_before = (1u << lane) - 1u;
  const int tiles = (count + kWarpSize - 1) / kWarpSize;
  const int tiles_per_warp = (tiles + kWarps - 1) / kWarps;
  const int begin = min(count, warp * tiles_per_warp * kWarpSize), end = min(count, begin + tiles_per_warp * kWarpSize);
  const auto classify = [&](int i, unsigned& above, unsigned& tie) {
    const uint32_t key = i < end ? keys[i] : 0u;
    above = __ballot_sync(kFullMask, key != 0u && (key & selection.mask) > selection.prefix);
    tie = __ballot_sync(kFullMask, key != 0u && (key & selection.mask) == selection.prefix);
  };

  int above_count = 0, tie_count = 0;
  for (int base = begin; base < end; base += kWarpSize) {
    unsigned above, tie;
    classify(base + lane, above, tie);
    above_count += __popc(above);
    tie_count += __popc(tie);
  }
  if (lane == 0) {
    s.warp_above[warp] = above_count;
    s.warp_ties[warp] = tie_count;
  }
  __syncthreads();
  if (warp == 0) {
    const int ties = lane < kWarps ? s.warp_ties[lane] : 0, above = lane < kWarps ? s.warp_above[lane] : 0;
    const int ties_before = warp_exclusive_sum(ties), above_before = warp_exclusive_sum(above);
    if (lane < kWarps) s.warp_tie_rank[lane] = ties_before;
    if (lane == kWarpSize - 1) {
      s.cta_ties = ties_before + ties;
      s.cta_above = above_before + above;
    }
  }
  RowCluster::sync();  // every CTA's totals are published
  if (warp == 0) {
    // The ties and picks of the CTAs before this one, in row order.
    int tie_rank = 0, pick_rank = 0;
    for (unsigned r = 0; r < RowCluster::rank(); ++r) {
      const int cta_ties = *RowCluster::remote(&s.cta_ties, r);
      pick_rank += *RowCluster::remote(&s.cta_above, r) + max(0, min(cta_ties, selection.ties - tie_rank));
      tie_rank += cta_ties;
    }
    const int ties = lane < kWarps ? s.warp_ties[lane] : 0;
    const int warp_tie_rank = tie_rank + (lane < kWarps ? s.warp_tie_rank[lane] : 0);
    const int picked = (lane < kWarps ? s.warp_above[lane] : 0) + max(0, min(ties, selection.ties - warp_tie_rank));
    const int picks_before = warp_exclusive_sum(picked);
    if (lane < kWarps) {
      s.warp_tie_rank[lane] = warp_tie_rank;
      s.warp_pick_rank[lane] = pick_rank + picks_before;
    }
  }
  __syncthreads();
  int tie_rank = s.warp_tie_rank[warp], pick_rank = s.warp_pick_rank[warp];
  for (int base = begin; base < end; base += kWarpSize) {
    unsigned above, tie;
    classify(base + lane, above, tie);
    const bool tie_picked = ((tie >> lane) & 1u) && tie_rank + __popc(tie & lanes_before) < selection.ties;
    const unsigned picked = above | __ballot_sync(kFullMask, tie_picked);
    if ((picked >> lane) & 1u) picks[pick_rank + __popc(picked & lanes_before)] = static_cast<int32_t>(first + base + lane);
    tie_rank += __popc(tie);
    pick_rank += __popc(picked);
  }
  const int64_t stride = int64_t{RowCluster::size()} * kThreads;
  for (int64_t i = selection.taken + int64_t{RowCluster::rank()} * kThreads + threadIdx.x; i < k; i += stride)
    picks[i] = -1;
  RowCluster::sync();  // the later CTAs have read this CTA's totals
}

}  // namespace dsv4::cuda::radix_topk
