// The per-tile math the tensor-core attention kernels share (wgmma, mma_bf16, decode_mma): the online
// softmax of a warp's 16 heads over a tile of scores held as mma.sync C fragments, and the final
// write of the warp's output (or of its split's partial). Softmax state per lane: its two heads
// (rows g and g + 8 of the warp's 16, g = lane / 4), in log2 units.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/ops/attention/mma/mma_fragments.cuh"
#include "cuda/ops/attention/sparse_attention_launch.cuh"
#include "cuda/ops/attention/split_merge.cuh"

namespace dsv4::cuda::mma {

struct SoftmaxState {
  float running_max[2] = {-INFINITY, -INFINITY};
  float running_sum[2] = {0.0f, 0.0f};
  // The heads' sinks (-inf: none), read at the start so that the final normalization does not
  // wait for them.
  float sink[2] = {-INFINITY, -INFINITY};
  // The lane's heads are head_base + lane / 4 + 8r, those below head_end the block's.
  __device__ SoftmaxState(const SparseAttentionLaunch& a, int head_base, int head_end, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = head_base + lane / 4 + 8 * r;
      if (a.sink && head < head_end) sink[r] = a.sink[head];
    }
  }
};

// A warp's scores over the lower half of the channels plus its partner's over the upper half (or
// the reverse): s goes to `mine`, and after pair_barrier() (both warps have stored) the partner's
// partial is added from `theirs`. Addition commutes: both warps get the same bits.
template <int kScoreTiles, class PairBarrier>
__device__ __forceinline__ void add_partner_scores(float (&s)[kScoreTiles][4], float* mine, const float* theirs, int lane,
                                                   PairBarrier&& pair_barrier) {
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * kWarpSize + lane] = s[j][e];
  pair_barrier();
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] += theirs[(j * 4 + e) * kWarpSize + lane];
}

// 2^x as the MUFU computes it (exp2f's accuracy), results below 2^-126 flushed to zero: such an
// exp-score or rescale factor changes no sum of a tile (its largest exp-score is 1), and exp2f's
// rescaling of subnormal results costs about ten instructions per score.
__device__ __forceinline__ float exp2_flushed(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The two steps of the online softmax of a tile of raw scores s (16 heads x 8·kScoreTiles rows: the
// lane holds columns 8j + 2c and 8j + 2c + 1, c = lane % 4), split so that a kernel whose warps hold
// parts of a tile's rows can merge their maxima in between (wgmma). First: s scaled to log2 units
// (invalid rows -inf) and the maxima of the lane's two heads over it.
template <int kScoreTiles>
__device__ __forceinline__ void scaled_tile_max(float (&s)[kScoreTiles][4], uint64_t valid_rows, float scale_log2,
                                                int lane, float (&tile_max)[2]) {
  tile_max[0] = tile_max[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int column = 8 * j + 2 * (lane & 3) + (e & 1);
      s[j][e] = (valid_rows >> column) & 1 ? s[j][e] * scale_log2 : -INFINITY;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], s[j][e]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 2));
  }
}

// How far (log2 units) a tile's max may exceed the running max before the running max is raised.
// Until then the tile's exp-scores are relative to the old max, at most 2^8, which fp32 sums and
// bf16 exp-scores carry as well as values up to 1 (a bf16 keeps its relative precision), and the
// accumulators need no rescale: 128 multiplies per lane that would otherwise run on nearly every
// tile, since some head of a warp's 16 usually reaches a new max.
inline constexpr float kMaxSlack = 8.0f;

// Whether a tile whose max (of a head, both halves of a split tile merged) is tile_max raises the
// running max: there was none, or the tile's exceeds it by more than kMaxSlack.
__device__ __forceinline__ bool raises_max(float running_max, float tile_max) {
  return running_max == -INFINITY || tile_max > running_max + kMaxSlack;
}

// Then: s as exp-scores relative to the new running max (the state's, raised to tile_max where that
// exceeds it by more than kMaxSlack or where there was none; none at all: every exp-score 0), their
// unrounded sum added to the state, and in `correction` the factor the accumulators must be
// rescaled by (1 where the max stays, or where nothing was accumulated yet).
template <int kScoreTiles>
__device__ __forceinline__ void exp_scores(float (&s)[kScoreTiles][4], const float (&tile_max)[2], SoftmaxState& state,
                                           float (&correction)[2]) {
  float new_max[2], tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float old_max = state.running_max[r];
    const bool raise = raises_max(old_max, tile_max[r]);
    new_max[r] = raise ? tile_max[r] : old_max;
    // No valid row before this tile: the accumulators hold zeros (every earlier exp-score was 0).
    correction[r] = raise && old_max != -INFINITY ? exp2_flushed(old_max - new_max[r]) : 1.0f;
  }
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      s[j][e] = new_max[r] == -INFINITY ? 0.0f : exp2_flushed(s[j][e] - new_max[r]);
      tile_sum[r] += s[j][e];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_sum[r] += __shfl_xor_sync(kFullMask, tile_sum[r], 1);
    tile_sum[r] += __shfl_xor_sync(kFullMask, tile_sum[r], 2);
    state.running_sum[r] = state.running_sum[r] * correction[r] + tile_sum[r];
    state.running_max[r] = new_max[r];
  }
}

// exp_scores where the running max stays (no head of the lane's raises it): the same exp-scores,
// relative to the running max, and in tile_sum the sums exp_scores adds to the state (adding them
// gives the same bits), with s and the state left as they were: a kernel that speculates on the
// max needs both again where the max does rise. The exp-scores go out as bf16 pairs, as
// for_each_a_fragment emits them: emit(k, e, pair) for element e of the A fragment of k step k.
template <int kScoreTiles, class Emit>
__device__ __forceinline__ void exp_scores_at_running_max(const float (&s)[kScoreTiles][4], const SoftmaxState& state,
                                                          float (&tile_sum)[2], Emit&& emit) {
  tile_sum[0] = tile_sum[1] = 0.0f;
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
    for (int x = 0; x < 4; x += 2) {
      const int r = x / 2;
      const float e0 = exp2_flushed(s[j][x] - state.running_max[r]), e1 = exp2_flushed(s[j][x + 1] - state.running_max[r]);
      tile_sum[r] += e0;
      tile_sum[r] += e1;
      emit(j / 2, 2 * (j % 2) + r, pack_bf16(e0, e1));
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_sum[r] += __shfl_xor_sync(kFullMask, tile_sum[r], 1);
    tile_sum[r] += __shfl_xor_sync(kFullMask, tile_sum[r], 2);
  }
}

// Both steps, for a warp that holds the whole tile.
template <int kScoreTiles>
__device__ __forceinline__ void online_softmax(float (&s)[kScoreTiles][4], uint64_t valid_rows, float scale_log2,
                                               int lane, SoftmaxState& state, float (&correction)[2]) {
  float tile_max[2];
  scaled_tile_max(s, valid_rows, scale_log2, lane, tile_max);
  exp_scores(s, tile_max, state, correction);
}

template <int kOutTiles>
__device__ __forceinline__ void rescale(float (&acc)[kOutTiles][4], const float (&correction)[2]) {
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) {
    acc[j][0] *= correction[0], acc[j][1] *= correction[0];
    acc[j][2] *= correction[1], acc[j][3] *= correction[1];
  }
}

// The results of the warp's 16 heads from head_base (those below head_end) x kOutTiles·8 channels:
// out = acc / (sum + exp(sink - max)), and lse (written by the lanes with stats_writer); or with
// a.splits > 1 the unnormalized acc, and (max, sum) of split blockIdx.z for the combine. The lane's
// values go to emit(head, j, x, y): channels 8j + 2c and 8j + 2c + 1 of the head's kOutTiles·8
// (c = lane % 4), for its heads head_base + lane / 4 + 8r. acc holds the values divided by
// value_scale (a power of two: scaling it back in the inverse rounds to the same bits).
template <int kOutTiles, class Emit>
__device__ __forceinline__ void finish_output(const SparseAttentionLaunch& a, int64_t t, int head_base, int head_end,
                                              bool stats_writer, int lane, const float (&acc)[kOutTiles][4],
                                              const SoftmaxState& state, Emit&& emit, float value_scale = 1.0f) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = head_base + lane / 4 + 8 * r;
    if (head >= head_end) continue;
    const int64_t index = (int64_t{blockIdx.z} * a.tokens + t) * a.heads + head;
    const bool stats_lane = stats_writer && (lane & 3) == 0;
    const float running_max = state.running_max[r], running_sum = state.running_sum[r];
    if (a.splits > 1) {
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) emit(head, j, acc[j][2 * r] * value_scale, acc[j][2 * r + 1] * value_scale);
      if (stats_lane) a.partials.stats[index] = make_float2(running_max, running_sum);  // log2 units
      continue;
    }
    const bool any = running_max != -INFINITY;
    const float inverse = any ? value_scale / (running_sum + exp2f(state.sink[r] * kLog2e - running_max)) : 0.0f;
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) emit(head, j, acc[j][2 * r] * inverse, acc[j][2 * r + 1] * inverse);
    if (stats_lane && a.lse) a.lse[t * a.heads + head] = any ? (running_max + log2f(running_sum)) * kLn2 : -INFINITY;
  }
}

// Where the results of head `head` start: its split's partial row (a.splits > 1) or its output row.
template <int kHeadDim>
__device__ __forceinline__ float* partial_row(const SparseAttentionLaunch& a, int64_t t, int head) {
  return a.partials.out + ((int64_t{blockIdx.z} * a.tokens + t) * a.heads + head) * kHeadDim;
}
template <class Out, int kHeadDim>
__device__ __forceinline__ Out* output_row(const SparseAttentionLaunch& a, int64_t t, int head) {
  return static_cast<Out*>(a.out) + (t * a.heads + head) * kHeadDim;
}

// Two adjacent output values as Out (bf16 bits or f32).
template <class Out>
__device__ __forceinline__ void store_pair(Out* dst, float x, float y) {
  if constexpr (sizeof(Out) == 2) *reinterpret_cast<uint32_t*>(dst) = pack_bf16(x, y);
  else *reinterpret_cast<float2*>(dst) = make_float2(x, y);
}

// finish_output straight to global memory, channels from channel0.
template <class Out, int kOutTiles, int kHeadDim>
__device__ __forceinline__ void write_output(const SparseAttentionLaunch& a, int64_t t, int head_base, int channel0,
                                             bool stats_writer, int lane, const float (&acc)[kOutTiles][4],
                                             const SoftmaxState& state) {
  const int column0 = channel0 + 2 * (lane & 3);
  finish_output(a, t, head_base, a.heads, stats_writer, lane, acc, state, [&](int head, int j, float x, float y) {
    if (a.splits > 1) store_pair(partial_row<kHeadDim>(a, t, head) + column0 + 8 * j, x, y);
    else store_pair(output_row<Out, kHeadDim>(a, t, head) + column0 + 8 * j, x, y);
  });
}

}  // namespace dsv4::cuda::mma
