// What every top-k kernel selects by (indexer.h, SPEC §4.6): the eligible length of a row and an
// order-preserving key per score.
#pragma once

#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/ops/indexer/visible_entries.cuh"

namespace dsv4::cuda {

// Elements of row t that may be picked: the whole row, or with token_position (non-null) and
// compress_ratio > 0 the groups of group_size entries holding a visible entry.
__device__ __forceinline__ int64_t topk_eligible_length(int64_t n, const int32_t* token_position, int compress_ratio,
                                                        int64_t group_size, int64_t t) {
  if (!token_position || compress_ratio <= 0) return n;
  const int64_t visible = visible_entries(token_position[t], compress_ratio);
  return min(n, (visible + group_size - 1) / group_size);
}

// Key of a score for "larger is better": 0 for -inf (not eligible), 1 for NaN (eligible, below
// every number), and for numbers an unsigned code >= 2 ordered like the floats (-0 and +0 equal;
// the most negative finite number maps to 0x00800000).
// Selects, not branches: the radix kernels key every score they read, and as early returns ptxas
// gave each key its own branch region.
__device__ __forceinline__ uint32_t topk_key(float score) {
  const uint32_t bits = float_bits(score);
  // Negative numbers flip every bit, the others only the sign bit.
  const uint32_t ordered = bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
  const uint32_t number = score == 0.0f ? 0x80000000u : ordered;  // -0 as +0
  const uint32_t eligible = score == -INFINITY ? 0u : number;
  return score != score ? 1u : eligible;
}

}  // namespace dsv4::cuda
