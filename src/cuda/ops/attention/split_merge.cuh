// The normalization of one (token, head)'s split partials: the rule the split-KV combine kernel and
// the wgmma kernel's cluster merge share. Each split z brings its unnormalized P·V, its running max
// m_z in log2 units (scores times log2 e, as the tensor-core kernels keep them) and its sum l_z of
// 2^(score − m_z).
#pragma once

#include <cuda_runtime.h>

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
    n.rows_sum += split.y * n.weight(split.x);
  }
  n.inverse = n.any() ? 1.0f / (n.rows_sum + exp2f(sink_log2 - n.most)) : 0.0f;
  return n;
}

}  // namespace dsv4::cuda
