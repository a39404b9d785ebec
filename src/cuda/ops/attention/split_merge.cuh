// The normalization of one (token, head)'s split partials: the rule the split-KV combine kernel and
// the wgmma kernel's cluster merge share. Each split z brings its unnormalized P·V, its running max
// m_z in log2 units (scores times log2 e, as the tensor-core kernels keep them) and its sum l_z of
// 2^(score − m_z).
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/device_math.cuh"

namespace dsv4::cuda {

inline constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// M = max_z m_z; split z's weight 2^(m_z − M), 0 for every split where none attended a row; the
// denominator Σ_z l_z·2^(m_z − M) + 2^(sink − M), the sink only there; lse = (M + log2 Σ_z
// l_z·2^(m_z − M))·ln 2, −inf where no split attended a row. out = Σ_z acc_z·weight_z·inverse.
struct SplitNormalization {
  float most = -INFINITY;
  float rows_sum = 0.0f;  // the denominator without the sink
  float inverse = 0.0f;   // 1 / the denominator, 0 where no split attended a row

  __device__ bool any() const { return most != -INFINITY; }
  __device__ float weight(float split_max) const { return any() ? exp2f(split_max - most) : 0.0f; }
  __device__ float lse() const { return any() ? (most + log2f(rows_sum)) * kLn2 : -INFINITY; }
  // Split z's term of the denominator, added in split order z = 0, 1, … (one rounding per term).
  __device__ void add_rows(float split_sum, float split_weight) { rows_sum = fmaf(split_sum, split_weight, rows_sum); }
  __device__ void finish(float sink_log2) {
    inverse = any() ? 1.0f / (rows_sum + exp2f(sink_log2 - most)) : 0.0f;
  }
};

// stats(z): split z's (m_z, l_z); sink_log2: the head's sink times log2 e (−inf: none). The loops
// stay rolled: the wgmma kernel calls this at its register bound.
template <class Stats>
__device__ __forceinline__ SplitNormalization normalize_splits(int splits, Stats stats, float sink_log2) {
  SplitNormalization n;
#pragma unroll 1
  for (int z = 0; z < splits; ++z) n.most = fmaxf(n.most, stats(z).x);
#pragma unroll 1
  for (int z = 0; z < splits; ++z) {
    const float2 split = stats(z);
    n.add_rows(split.y, n.weight(split.x));
  }
  n.finish(sink_log2);
  return n;
}

// The same normalization with the splits spread over aligned groups of kLanes lanes of a warp (the
// whole warp calls it): lane z of a group brings split z's (m_z, l_z), (−inf, 0) at z >= splits
// (splits <= kLanes, the same in the whole warp). Every lane of a group gets the bits
// normalize_splits gives: the max is exact in any order, and each lane adds the terms in split order.
// `weight` is the lane's own split's weight.
template <int kLanes>
__device__ __forceinline__ SplitNormalization normalize_splits_across_lanes(int splits, float2 split, float sink_log2,
                                                                            float& weight) {
  static_assert(kLanes > 0 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);
  SplitNormalization n;
  n.most = split.x;
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) n.most = fmaxf(n.most, __shfl_xor_sync(kFullMask, n.most, offset));
  weight = n.weight(split.x);
#pragma unroll
  for (int z = 0; z < kLanes; ++z)
    if (z < splits)
      n.add_rows(__shfl_sync(kFullMask, split.y, z, kLanes), __shfl_sync(kFullMask, weight, z, kLanes));
  n.finish(sink_log2);
  return n;
}

}  // namespace dsv4::cuda
