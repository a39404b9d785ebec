// Index-score kernel (see include/dsv4/cuda/indexer.h). Block = (token, 128 entries), one thread
// per entry: the thread runs every index head against its key row, reading the token's queries
// from shared memory as broadcasts, staged a group of heads at a time (kStagedQueryFloats).
// kDim > 0: the thread decodes its whole key row into registers once; kDim = 0 (any index_dim
// that is a multiple of 32): it decodes 32 channels at a time, again for every head.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/visible_entries.cuh"

namespace dsv4::cuda {

struct IndexScoresSimtLaunch : IndexScoresLaunch {
  int staged_heads = 0;  // heads whose queries shared memory holds at a time
};

inline constexpr int kIndexEntriesPerBlock = 128;
inline constexpr int kIndexKeyChunk = 32;  // channels decoded at a time without a register row
// Query floats in shared memory at a time: 128 heads of 128 channels (64 KiB, 3 blocks per SM).
inline constexpr int64_t kStagedQueryFloats = 128 * 128;

inline int index_scores_staged_heads(int heads, int dim) {
  return static_cast<int>(std::min<int64_t>(heads, std::max<int64_t>(1, kStagedQueryFloats / dim)));
}

inline size_t index_scores_shared_bytes(int staged_heads, int dim) {
  return static_cast<size_t>(staged_heads) * (dim + 1) * sizeof(float);
}

// Channels c0 … c0 + kN − 1 of a key row.
template <int kN>
__device__ __forceinline__ void decode_key_channels(const DeviceRows& keys, const RowRef& row, int c0, float* out) {
  visit_format(keys.format, [&](auto format) {
#pragma unroll
    for (int d = 0; d < kN; ++d) out[d] = decode_channel<decltype(format)::value>(keys, row, c0 + d);
  });
}

// fp32 scores: a head's dot in 4-channel steps (contracted to FMAs), score += w · relu(dot).
struct Fp32Scores {
  struct Dot {
    float sum = 0.0f;
    // Channels c … c + kN − 1 (q float4-aligned in shared memory).
    template <int kN>
    __device__ __forceinline__ void add(const float* q, const float* key) {
      const float4* q4 = reinterpret_cast<const float4*>(q);
#pragma unroll
      for (int d = 0; d < kN / 4; ++d) {
        const float4 qv = q4[d];
        sum += qv.x * key[4 * d] + qv.y * key[4 * d + 1] + qv.z * key[4 * d + 2] + qv.w * key[4 * d + 3];
      }
    }
    __device__ __forceinline__ float value() const { return sum; }
  };
  __device__ __forceinline__ static float add_head(float score, float dot, float weight) {
    const float relu = dot < 0.0f ? 0.0f : dot;  // keeps NaN, as the reference's max(dot, 0)
    return score + weight * relu;
  }
  __device__ __forceinline__ static float finish(float score, bool) { return score; }
};

// The reference's bf16 scores (reference::index_scores with bf16), bit for bit: its dot — eight
// running double sums over the channels d ≡ k (mod 8), added pairwise, rounded once to fp32 —
// rounded to bf16, relu, the weighted term rounded to bf16, the fp32 sum over heads in head order
// rounded to bf16 unless partial. A product of two floats is exact in double, so the fused
// multiply-add rounds as the reference's multiply then add.
struct Bf16RoundedScores {
  struct Dot {
    double sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    // Channels c … c + kN − 1, c a multiple of 8.
    template <int kN>
    __device__ __forceinline__ void add(const float* q, const float* key) {
      static_assert(kN % 8 == 0);
#pragma unroll
      for (int d = 0; d < kN; ++d)
        sum[d % 8] = __fma_rn(static_cast<double>(q[d]), static_cast<double>(key[d]), sum[d % 8]);
    }
    __device__ __forceinline__ float value() const {
      const double low = __dadd_rn(__dadd_rn(sum[0], sum[1]), __dadd_rn(sum[2], sum[3]));
      const double high = __dadd_rn(__dadd_rn(sum[4], sum[5]), __dadd_rn(sum[6], sum[7]));
      return __double2float_rn(__dadd_rn(low, high));
    }
  };
  __device__ __forceinline__ static float add_head(float score, float dot, float weight) {
    const float rounded = round_to_bf16(dot);
    const float relu = rounded < 0.0f ? 0.0f : rounded;  // keeps NaN, as std::max(dot, 0.0f)
    return __fadd_rn(score, round_to_bf16(__fmul_rn(relu, weight)));
  }
  __device__ __forceinline__ static float finish(float score, bool partial) {
    return partial ? score : round_to_bf16(score);
  }
};

template <int kDim, class Scores>
__global__ void __launch_bounds__(kIndexEntriesPerBlock) index_scores_kernel(IndexScoresSimtLaunch a) {
  static_assert(kDim % kIndexKeyChunk == 0);
  const int dim = kDim > 0 ? kDim : a.dim;
  extern __shared__ float4 shared4[];
  float* q_shared = reinterpret_cast<float*>(shared4);  // [staged_heads][dim]
  float* w_shared = q_shared + a.staged_heads * dim;    // [staged_heads]
  const int64_t t = blockIdx.x;
  const int64_t first = int64_t{blockIdx.y} * kIndexEntriesPerBlock;
  const int64_t j = first + threadIdx.x;
  const int64_t position = a.token_position[t];
  const int64_t n_visible = position >= 0 ? (position + 1) / a.compress_ratio : 0;
  float* out = a.scores + t * a.entries;
  if (first >= n_visible) {  // the whole block is in the future: uniform early exit
    if (j < a.entries) out[j] = -INFINITY;
    return;
  }

  RowRef row;  // stays invalid for j >= entries: such threads only help stage the queries
  if (j < a.entries && j < n_visible &&
      (!a.candidates || contains_block(a.candidates + t * a.num_candidates, a.num_candidates, j / a.candidate_block_size)))
    row = row_of_sequence(a.keys, a.token_sequence ? a.token_sequence[t] : 0, j);
  float key[kDim > 0 ? kDim : 1];
  if constexpr (kDim > 0)
    if (row.valid()) decode_key_channels<kDim>(a.keys, row, 0, key);

  float score = 0.0f;
  for (int h0 = 0; h0 < a.heads; h0 += a.staged_heads) {
    const int staged = min(a.staged_heads, a.heads - h0);
    if (h0 > 0) __syncthreads();  // every thread is done with the previous heads' queries
    const int64_t q_first = (t * a.heads + h0) * dim;
    for (int i = threadIdx.x; i < staged * dim; i += blockDim.x)
      q_shared[i] = a.q_f32 ? a.q_f32[q_first + i] : bf16_bits_to_float(a.q[q_first + i]);
    for (int i = threadIdx.x; i < staged; i += blockDim.x) w_shared[i] = a.weights[t * a.heads + h0 + i];
    __syncthreads();
    if (!row.valid()) continue;
    for (int h = 0; h < staged; ++h) {
      const float* qh = q_shared + h * dim;
      typename Scores::Dot dot;
      if constexpr (kDim > 0) {
        dot.template add<kDim>(qh, key);
      } else {
        for (int c = 0; c < dim; c += kIndexKeyChunk) {
          float chunk[kIndexKeyChunk];
          decode_key_channels<kIndexKeyChunk>(a.keys, row, c, chunk);
          dot.template add<kIndexKeyChunk>(qh + c, chunk);
        }
      }
      score = Scores::add_head(score, dot.value(), w_shared[h]);
    }
  }
  if (j < a.entries) out[j] = row.valid() ? Scores::finish(score, a.partial) : -INFINITY;
}

template <class Kernel>
void launch_index_scores_kernel(Kernel kernel, const IndexScoresSimtLaunch& a, cudaStream_t stream) {
  const size_t shared = index_scores_shared_bytes(a.staged_heads, a.dim);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.entries + kIndexEntriesPerBlock - 1) / kIndexEntriesPerBlock));
  kernel<<<grid, kIndexEntriesPerBlock, shared, stream>>>(a);
}

// kDim: a.dim, or 0 for any a.dim.
template <int kDim>
void launch_index_scores(const IndexScoresSimtLaunch& a, cudaStream_t stream) {
  if (a.bf16_rounding) launch_index_scores_kernel(index_scores_kernel<kDim, Bf16RoundedScores>, a, stream);
  else launch_index_scores_kernel(index_scores_kernel<kDim, Fp32Scores>, a, stream);
}

}  // namespace dsv4::cuda
