// The selection core of the radix top-k: the keys of one row (topk_rules.cuh) are spread over the
// CTAs of a thread-block cluster, each CTA holding a contiguous chunk in row order. The k-th best
// key is found by up to three radix passes (11, 11 and 10 bits, most significant first); each pass
// counts per CTA the keys that match the bins chosen so far, and the CTAs combine the counts
// through distributed shared memory. The first pass, over every key, is counted while the keys are
// read (count_first_pass); the later passes count only the few keys of the threshold bin.
// write_picks then writes every pick at its rank in the row's ascending pick list. Nothing goes
// through global memory but the picks, and the result is a pure function of the keys (histogram
// counts do not depend on the order of the atomics).
//
// Keys are handled in tiles of kTileKeys: lane l of a warp holds keys 4l .. 4l + 3 of a tile (one
// 16-byte access) and each warp walks a contiguous run of tiles (warp_tiles). After the first
// pass the later passes and write_picks read a CTA's keys again from a key source, in the CTA's
// row order: its chunk in shared memory (the resident kernel), the keys it gathered there at or
// above the first pass's threshold bin (the streamed kernel), or its scores in global memory (the
// streamed kernel when its chunk has more keys at or above that bin than it gathers: CTAs of one
// row may read different sources). A kernel calls: clear_counts, then for each of its warp's
// tiles count_first_pass, then first_pass, refine and write_picks.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/phase_stamps.cuh"

namespace dsv4::cuda::radix_topk {

// The most CTAs sharing a row: the portable cluster size.
inline constexpr int kMaxCluster = 8;

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
  // sync() in two halves: arrive() once this thread reads no other CTA's shared memory any more,
  // wait() before the CTA exits, so that its shared memory outlives the other CTAs' reads. Work
  // between the two overlaps the barrier. With one CTA there is nothing to wait for.
  __device__ static void arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cooperative_groups::this_cluster().barrier_arrive();
#endif
  }
  __device__ static void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cooperative_groups::this_cluster().barrier_wait();
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
  // The sum of a shared counter over the CTAs; the reads are issued together, not one round trip
  // after the other.
  __device__ static int sum(const unsigned* local) {
    const unsigned ctas = size();
    unsigned count[kMaxCluster];
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) count[r] = static_cast<unsigned>(r) < ctas ? *remote(local, r) : 0u;
    int total = 0;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) total += static_cast<int>(count[r]);
    return total;
  }
};

// Phase stamps of a diagnostic build (phase_stamps.cuh; bench/probes/topk_phase_stamps.cu prints
// them): per CTA, from its first warpgroup's leading thread.
enum TopkStamp {
  kTopkStampStart = 0,      // the kernel's start
  kTopkStampLoaded = 1,     // the thread's keys loaded, stored and counted
  kTopkStampCounted = 2,    // + pass: the pass's counts complete in every CTA (after its cluster barrier)
  kTopkStampThreshold = 5,  // + pass: the pass's threshold bin known (after warp 0's search)
  kTopkStampTotals = 8,     // write_picks: every CTA's totals published (after its cluster barrier)
  kTopkStampWritten = 9,    // write_picks: this thread's picks written
  kTopkStampEnd = 10,       // the CTA's last cluster wait passed
  kTopkStampGathered = 11,  // streamed: the CTA's kept keys gathered into shared memory
};

inline constexpr int kKeysPerLane = 4;
inline constexpr int kTileKeys = kWarpSize * kKeysPerLane;

// A pass counts the keys matching the bins chosen so far in kBins bins of the next kBinBits bits
// (the last pass takes the 10 that are left: its bins share their top bit with the prefix).
inline constexpr int kBinBits = 11;
inline constexpr int kBins = 1 << kBinBits;
__device__ constexpr int pass_shift(int pass) {
  return 32 - kBinBits * (pass + 1) > 0 ? 32 - kBinBits * (pass + 1) : 0;
}
// Bins are also summed in groups of kGroupBins, so that a single warp finds the threshold bin:
// first its group from every CTA's group sums (two groups per lane), then the bin among the group's
// bins (one per lane) of every CTA. Two rounds of a few distributed shared memory reads, instead of
// every CTA reading every bin of every CTA.
inline constexpr int kGroupBins = kWarpSize;
inline constexpr int kGroups = kBins / kGroupBins;
static_assert(kGroups == 2 * kWarpSize);

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
  static_assert(kThreads % kWarpSize == 0 && kThreads / kWarpSize <= kWarpSize);
  static constexpr int kWarps = kThreads / kWarpSize;

  // This CTA's counts per bin of a pass, counts[pass & 1]: passes alternate, since another CTA may
  // still read the previous pass's counts while this one counts. The first pass, the one over
  // every key, counts odd lanes into counts[1] and folds them into counts[0]: scores pile up in few
  // bins, and lanes adding to one shared word serialize. The + 1 puts the same bin of the two in
  // different banks.
  unsigned counts[2][kBins + 1];
  unsigned group_counts[2][kGroups];     // the sums of counts[pass & 1] per group of kGroupBins bins
  int bucket, above, bucket_count;       // the pass's threshold bin, keys in the bins above it, keys in it
  int matching;                          // keys the pass counted (all eligible keys in the first)
  int cta_kept;                          // this CTA's keys the selection still reads (cta_kept_keys)
  // write_picks: per warp, its keys above the threshold and its ties (then: those of the warps
  // before it in the CTA); this CTA's totals (read by the later CTAs of the cluster); the totals of
  // the CTAs before this one.
  int warp_above[kWarps], warp_ties[kWarps];
  int cta_above, cta_ties;
  int above_before, ties_before;
};

// The first `count` keys in tiles: this warp's contiguous run [begin, end).
struct TileRange {
  int begin, end;
};

template <int kThreads>
__device__ __forceinline__ TileRange warp_tiles(int count) {
  constexpr int kWarps = SelectShared<kThreads>::kWarps;
  const int tiles = (count + kTileKeys - 1) / kTileKeys;
  const int per_warp = (tiles + kWarps - 1) / kWarps;
  const int begin = min(tiles, static_cast<int>(threadIdx.x) / kWarpSize * per_warp);
  return {begin, min(tiles, begin + per_warp)};
}

__device__ __forceinline__ void load_tile(const uint32_t* keys, int tile, uint32_t (&key)[kKeysPerLane]) {
  const uint4 q = reinterpret_cast<const uint4*>(keys)[tile * kWarpSize + static_cast<int>(threadIdx.x) % kWarpSize];
  key[0] = q.x;
  key[1] = q.y;
  key[2] = q.z;
  key[3] = q.w;
}

// A key source (see the top): load(tile, key) gives this lane's keys of a tile, position(i) the
// row position of the CTA's i-th key. This one: keys[i] is the key of row position first + i.
struct ChunkKeys {
  const uint32_t* keys;  // [tiles * kTileKeys] in shared memory
  int64_t first;
  __device__ void load(int tile, uint32_t (&key)[kKeysPerLane]) const { load_tile(keys, tile, key); }
  __device__ int64_t position(int i) const { return first + i; }
};

// Keys a CTA gathered in row order, with their row positions.
struct GatheredKeys {
  const uint32_t* keys;      // [tiles * kTileKeys] in shared memory, 0 past the gathered ones
  const int32_t* positions;  // [gathered]
  __device__ void load(int tile, uint32_t (&key)[kKeysPerLane]) const { load_tile(keys, tile, key); }
  __device__ int64_t position(int i) const { return positions[i]; }
};

__device__ __forceinline__ void store_tile(uint32_t* keys, int tile, const uint32_t (&key)[kKeysPerLane]) {
  reinterpret_cast<uint4*>(keys)[tile * kWarpSize + static_cast<int>(threadIdx.x) % kWarpSize] =
      make_uint4(key[0], key[1], key[2], key[3]);
}

__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int other = __shfl_up_sync(kFullMask, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

// Adds this lane's keys of a tile that are != 0 and match prefix under mask to their bins
// (key >> shift) & (kBins - 1) of counts. Warp-wide: a tile without such keys costs a vote, and a
// tile whose counted keys share one bin (a run of equal scores) one atomic.
__device__ __forceinline__ void count_keys(unsigned* counts, const uint32_t (&key)[kKeysPerLane], uint32_t mask,
                                           uint32_t prefix, int shift) {
  bool counted[kKeysPerLane];
  unsigned bin[kKeysPerLane], lane_count = 0u, first_bin = 0u;
#pragma unroll
  for (int j = kKeysPerLane - 1; j >= 0; --j) {
    counted[j] = key[j] != 0u && (key[j] & mask) == prefix;
    bin[j] = (key[j] >> shift) & (kBins - 1);
    lane_count += counted[j] ? 1u : 0u;
    if (counted[j]) first_bin = bin[j];
  }
  const unsigned lanes = __ballot_sync(kFullMask, lane_count != 0u);
  if (lanes == 0u) return;
  const unsigned tile_bin = __shfl_sync(kFullMask, first_bin, __ffs(lanes) - 1);
  bool in_tile_bin = true;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) in_tile_bin = in_tile_bin && (!counted[j] || bin[j] == tile_bin);
  const uint32_t counts_address = shared_address(counts);  // the adds below: add_shared_u32
  if (__all_sync(kFullMask, in_tile_bin)) {
    const unsigned tile_count = __reduce_add_sync(kFullMask, lane_count);
    if (threadIdx.x % kWarpSize == 0) add_shared_u32(counts_address + 4 * tile_bin, tile_count);
  } else {
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j)
      if (counted[j]) add_shared_u32(counts_address + 4 * bin[j], 1u);
  }
}

// Zeroes the first pass's counts; ends with a barrier of the CTA, after which it may count.
template <int kThreads>
__device__ void clear_counts(SelectShared<kThreads>& s) {
  for (int i = static_cast<int>(threadIdx.x); i < 2 * (kBins + 1); i += kThreads) (&s.counts[0][0])[i] = 0u;
  if (threadIdx.x == 0) s.cta_kept = 0;
  __syncthreads();
}

// Counts this lane's keys of a tile (as stored) for the first pass: every key but -inf.
template <int kThreads>
__device__ __forceinline__ void count_first_pass(const uint32_t (&key)[kKeysPerLane], SelectShared<kThreads>& s) {
  count_keys(s.counts[threadIdx.x % 2], key, 0u, 0u, pass_shift(0));
}

struct Threshold {
  int bucket = 0, above = 0, bucket_count = 0, matching = 0;
};

// The bin of a pass holding the remaining-th best key among the keys every CTA of the cluster
// counted (valid when matching >= remaining), the keys in the bins above it and in it, and the
// number counted. Begins with a barrier of the CTA (its counts are complete) and ends with one;
// zeroes the next pass's counts. Every CTA finds the same.
template <int kThreads>
__device__ Threshold find_threshold(int pass, int remaining, SelectShared<kThreads>& s) {
  constexpr int kWarps = SelectShared<kThreads>::kWarps;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  unsigned* counts = s.counts[pass & 1];
  unsigned* groups = s.group_counts[pass & 1];
  __syncthreads();
  for (int g = warp; g < kGroups; g += kWarps) {
    const int bin = g * kGroupBins + lane;
    unsigned count = counts[bin];
    if (pass == 0) {
      count += s.counts[1][bin];
      counts[bin] = count;
    }
    const unsigned group_count = __reduce_add_sync(kFullMask, count);
    if (lane == 0) groups[g] = group_count;
  }
  RowCluster::sync();  // every CTA's counts of this pass are complete
  DSV4_PHASE_STAMP(kTopkStampCounted + pass);
  // Zero the next pass's counts: the other CTAs are done with the previous pass's, which they read
  // before counting this one (after the first pass: this CTA's second copy, folded above).
  if (pass_shift(pass) > 0)
    for (int i = static_cast<int>(threadIdx.x); i < kBins + 1; i += kThreads) s.counts[(pass + 1) & 1][i] = 0u;
  if (warp == 0) {
    // Lane l holds groups kGroups - 1 - 2l (high) and kGroups - 2 - 2l (low), so that an inclusive
    // scan counts the keys in and above a lane's groups.
    const int high_group = kGroups - 1 - 2 * lane, low_group = high_group - 1;
    const int high = RowCluster::sum(&groups[high_group]), low = RowCluster::sum(&groups[low_group]);
    const int through = warp_inclusive_sum(high + low);
    const int matching = __shfl_sync(kFullMask, through, kWarpSize - 1);
    if (lane == 0) s.matching = matching;
    if (matching >= remaining) {
      const int group_lane = __ffs(__ballot_sync(kFullMask, through >= remaining)) - 1;
      const int lane_above = through - high - low;
      const bool in_high = lane_above + high >= remaining;
      const int group = __shfl_sync(kFullMask, in_high ? high_group : low_group, group_lane);
      const int group_above = __shfl_sync(kFullMask, in_high ? lane_above : lane_above + high, group_lane);
      // Lane l holds bin kGroupBins - 1 - l of the group (descending again).
      const int bin = group * kGroupBins + kGroupBins - 1 - lane;
      const int count = RowCluster::sum(&counts[bin]);
      const int bin_through = group_above + warp_inclusive_sum(count);
      if (lane == __ffs(__ballot_sync(kFullMask, bin_through >= remaining)) - 1) {
        s.bucket = bin;
        s.above = bin_through - count;
        s.bucket_count = count;
      }
    }
  }
  __syncthreads();
  DSV4_PHASE_STAMP(kTopkStampThreshold + pass);
  // s is written again only after the next pass's cluster barrier.
  return {s.bucket, s.above, s.bucket_count, s.matching};
}

// The selection after a pass: the picks are the keys with (key & mask) > prefix and `remaining`
// of those with (key & mask) == prefix; done when that takes the whole bin (or no bits are left).
struct SelectionState {
  uint32_t prefix = 0, mask = 0;
  int remaining = 0, eligible = 0;
  bool done = false;
  __device__ Selection selection(int64_t k) const {
    return {prefix, mask, remaining, static_cast<int>(k < eligible ? k : eligible)};
  }
};

// The first pass's threshold (its counts complete in each CTA: count_first_pass) for the k best
// keys of the row (key 0, -inf, is never counted). With fewer eligible keys than k, every one is
// picked, as a tie of the empty prefix.
template <int kThreads>
__device__ SelectionState first_pass(int64_t k, SelectShared<kThreads>& s) {
  const int wanted = static_cast<int>(k < INT32_MAX ? k : INT32_MAX);
  const Threshold threshold = find_threshold(0, wanted, s);
  SelectionState state;
  state.eligible = threshold.matching;
  if (state.eligible < wanted) {
    state.remaining = state.eligible;
    state.done = true;
    return state;
  }
  const int shift = pass_shift(0);
  state.prefix = static_cast<uint32_t>(threshold.bucket) << shift;
  state.mask = static_cast<uint32_t>(kBins - 1) << shift;
  state.remaining = wanted - threshold.above;
  state.done = threshold.bucket_count == state.remaining;
  return state;
}

// This CTA's keys the selection reads after the first pass (its own counts of that pass in the
// threshold bin and above; every eligible key when all are picked). The same in every thread.
template <int kThreads>
__device__ int cta_kept_keys(const SelectionState& state, SelectShared<kThreads>& s) {
  const int first_bin = static_cast<int>((state.prefix & state.mask) >> pass_shift(0));
  int kept = 0;
  for (int bin = first_bin + static_cast<int>(threadIdx.x); bin < kBins; bin += kThreads) kept += static_cast<int>(s.counts[0][bin]);
  kept = __reduce_add_sync(kFullMask, kept);
  if (threadIdx.x % kWarpSize == 0 && kept != 0) atomicAdd(&s.cta_kept, kept);
  __syncthreads();
  return s.cta_kept;
}

// The later passes over `count` keys of this CTA from `keys` (a key source): each keeps the bin
// holding the remaining-th best key among the keys matching the prefix so far, and stops early
// when every key of that bin is picked.
template <int kThreads, class Keys>
__device__ Selection refine(const Keys& keys, int count, SelectionState state, int64_t k, SelectShared<kThreads>& s) {
  const TileRange tiles = warp_tiles<kThreads>(count);
  for (int pass = 1; !state.done; ++pass) {
    const int shift = pass_shift(pass);
    for (int tile = tiles.begin; tile < tiles.end; ++tile) {
      uint32_t key[kKeysPerLane];
      keys.load(tile, key);
      count_keys(s.counts[pass & 1], key, state.mask, state.prefix, shift);
    }
    const Threshold threshold = find_threshold(pass, state.remaining, s);
    state.prefix |= static_cast<uint32_t>(threshold.bucket) << shift;
    state.mask |= static_cast<uint32_t>(kBins - 1) << shift;
    state.remaining -= threshold.above;
    state.done = threshold.bucket_count == state.remaining || shift == 0;
  }
  return state.selection(k);
}

// Writes the picks among this CTA's `count` keys from `keys` (a key source) into picks[0, k) of
// the row. A pick's rank is the number of keys above the threshold before it in the row plus the
// number of picked ties before it, min(ties before it, selection.ties); both counts come from
// counts per CTA and per warp (the chunks lie in row order, each warp walks a contiguous run of
// tiles) and a scan per tile. The CTAs share the -1 padding. Ends with a cluster barrier, after
// which the CTA may exit.
template <int kThreads, class Keys>
__device__ void write_picks(const Keys& keys, int count, const Selection& selection, int32_t* picks, int64_t k,
                            SelectShared<kThreads>& s) {
  constexpr int kWarps = SelectShared<kThreads>::kWarps;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const TileRange tiles = warp_tiles<kThreads>(count);
  const auto classify = [&](int tile, bool (&above)[kKeysPerLane], bool (&tie)[kKeysPerLane]) {
    uint32_t key[kKeysPerLane];
    keys.load(tile, key);
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      above[j] = (key[j] & selection.mask) > selection.prefix;
      tie[j] = key[j] != 0u && (key[j] & selection.mask) == selection.prefix;
    }
  };

  int above_count = 0, tie_count = 0;
  for (int tile = tiles.begin; tile < tiles.end; ++tile) {
    bool above[kKeysPerLane], tie[kKeysPerLane];
    classify(tile, above, tie);
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      above_count += above[j] ? 1 : 0;
      tie_count += tie[j] ? 1 : 0;
    }
  }
  above_count = __reduce_add_sync(kFullMask, above_count);
  tie_count = __reduce_add_sync(kFullMask, tie_count);
  if (lane == 0) {
    s.warp_above[warp] = above_count;
    s.warp_ties[warp] = tie_count;
  }
  __syncthreads();
  if (warp == 0) {
    const int above = lane < kWarps ? s.warp_above[lane] : 0, ties = lane < kWarps ? s.warp_ties[lane] : 0;
    const int above_through = warp_inclusive_sum(above), ties_through = warp_inclusive_sum(ties);
    if (lane < kWarps) {
      s.warp_above[lane] = above_through - above;
      s.warp_ties[lane] = ties_through - ties;
    }
    if (lane == kWarpSize - 1) {
      s.cta_above = above_through;
      s.cta_ties = ties_through;
    }
  }
  RowCluster::sync();  // every CTA's totals are published
  DSV4_PHASE_STAMP(kTopkStampTotals);
  if (warp == 0) {
    // Lane r < this CTA's rank reads CTA r's totals.
    const bool before = static_cast<unsigned>(lane) < RowCluster::rank();
    const int above = __reduce_add_sync(kFullMask, before ? *RowCluster::remote(&s.cta_above, lane) : 0);
    const int ties = __reduce_add_sync(kFullMask, before ? *RowCluster::remote(&s.cta_ties, lane) : 0);
    if (lane == 0) {
      s.above_before = above;
      s.ties_before = ties;
    }
  }
  __syncthreads();
  RowCluster::arrive();
  // The row's keys above the threshold and ties before this warp's next tile.
  int above_before = s.above_before + s.warp_above[warp], ties_before = s.ties_before + s.warp_ties[warp];
  for (int tile = tiles.begin; tile < tiles.end; ++tile) {
    bool above[kKeysPerLane], tie[kKeysPerLane];
    classify(tile, above, tie);
    int lane_above = 0, lane_ties = 0;
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      lane_above += above[j] ? 1 : 0;
      lane_ties += tie[j] ? 1 : 0;
    }
    if (!__any_sync(kFullMask, lane_above + lane_ties != 0)) continue;
    // Both counts of the lanes up to this one in one scan (each at most kTileKeys per tile).
    const int packed = (lane_above << 16) | lane_ties;
    const int through = warp_inclusive_sum(packed);
    int above_here = above_before + ((through - packed) >> 16), ties_here = ties_before + ((through - packed) & 0xffff);
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      if (above[j] || (tie[j] && ties_here < selection.ties))
        picks[above_here + min(ties_here, selection.ties)] =
            static_cast<int32_t>(keys.position(tile * kTileKeys + lane * kKeysPerLane + j));
      above_here += above[j] ? 1 : 0;
      ties_here += tie[j] ? 1 : 0;
    }
    const int tile_total = __shfl_sync(kFullMask, through, kWarpSize - 1);
    above_before += tile_total >> 16;
    ties_before += tile_total & 0xffff;
  }
  const int64_t stride = int64_t{RowCluster::size()} * kThreads;
  for (int64_t i = selection.taken + int64_t{RowCluster::rank()} * kThreads + threadIdx.x; i < k; i += stride)
    picks[i] = -1;
  DSV4_PHASE_STAMP(kTopkStampWritten);
  RowCluster::wait();  // the later CTAs have read this CTA's totals
  DSV4_PHASE_STAMP(kTopkStampEnd);
}

}  // namespace dsv4::cuda::radix_topk
