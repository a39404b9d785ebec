// Index-score kernel (see include/dsv4/cuda/indexer.h). Block = (token, 128 entries), one thread
// per entry: the thread decodes its key row into registers (index_dim values) and runs every
// index head against it, reading the token's queries from shared memory as broadcasts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"

namespace dsv4::cuda {

struct IndexScoresLaunch {
  const uint16_t* q = nullptr;        // [tokens, heads, kDim] bf16
  const float* weights = nullptr;     // [tokens, heads]
  DeviceRows keys;
  const int32_t* token_sequence = nullptr;
  const int32_t* token_position = nullptr;
  int compress_ratio = 1;
  const int32_t* candidates = nullptr;  // [tokens, num_candidates] or null
  int64_t num_candidates = 0;
  int64_t candidate_block_size = 1;
  float* scores = nullptr;            // [tokens, entries]
  int64_t entries = 0;
  int64_t tokens = 0;
  int heads = 0;
};

inline constexpr int kIndexEntriesPerBlock = 128;

template <int kDim>
size_t index_scores_shared_bytes(int heads) {
  return static_cast<size_t>(heads) * (kDim + 1) * sizeof(float);
}

// Whether `block` is in the ascending, -1-padded list (the padding sorts as +inf).
__device__ __forceinline__ bool contains_block(const int32_t* list, int64_t n, int64_t block) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t v = list[mid];
    if (v >= 0 && v < block) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && list[lo] == block;
}

template <int kDim>
__global__ void __launch_bounds__(kIndexEntriesPerBlock) index_scores_kernel(IndexScoresLaunch a) {
  static_assert(kDim % 4 == 0);
  extern __shared__ float4 shared4[];
  float* q_shared = reinterpret_cast<float*>(shared4);  // [heads][kDim]
  float* w_shared = q_shared + a.heads * kDim;          // [heads]
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
  for (int i = threadIdx.x; i < a.heads * kDim; i += blockDim.x)
    q_shared[i] = bf16_bits_to_float(a.q[t * a.heads * kDim + i]);
  for (int i = threadIdx.x; i < a.heads; i += blockDim.x) w_shared[i] = a.weights[t * a.heads + i];
  __syncthreads();
  if (j >= a.entries) return;

  RowRef row;
  if (j < n_visible &&
      (!a.candidates || contains_block(a.candidates + t * a.num_candidates, a.num_candidates, j / a.candidate_block_size)))
    row = row_of_sequence(a.keys, a.token_sequence[t], j);
  if (!row.valid()) {
    out[j] = -INFINITY;
    return;
  }
  float key[kDim];
  visit_format(a.keys.format, [&](auto format) {
#pragma unroll
    for (int d = 0; d < kDim; ++d) key[d] = decode_channel<decltype(format)::value>(a.keys, row, d);
  });
  float score = 0.0f;
  for (int h = 0; h < a.heads; ++h) {
    const float4* qh = reinterpret_cast<const float4*>(q_shared + h * kDim);
    float dot = 0.0f;
#pragma unroll
    for (int d = 0; d < kDim / 4; ++d) {
      const float4 qv = qh[d];
      dot += qv.x * key[4 * d] + qv.y * key[4 * d + 1] + qv.z * key[4 * d + 2] + qv.w * key[4 * d + 3];
    }
    const float relu = dot < 0.0f ? 0.0f : dot;  // keeps NaN, as the reference's max(dot, 0)
    score += w_shared[h] * relu;
  }
  out[j] = score;
}

template <int kDim>
void launch_index_scores(const IndexScoresLaunch& a, cudaStream_t stream) {
  const size_t shared = index_scores_shared_bytes<kDim>(a.heads);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(index_scores_kernel<kDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.entries + kIndexEntriesPerBlock - 1) / kIndexEntriesPerBlock));
  index_scores_kernel<kDim><<<grid, kIndexEntriesPerBlock, shared, stream>>>(a);
}

}  // namespace dsv4::cuda
