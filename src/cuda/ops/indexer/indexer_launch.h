// The raw form of a validated index-scores or top-k call, built once here and given to every
// implementation's kernels, each of which extends it with its own geometry.
#pragma once

#include <cstdint>

#include "cuda/common/paged_rows.h"
#include "dsv4/cuda/indexer.h"

namespace dsv4::cuda {

struct IndexScoresLaunch {
  const uint16_t* q = nullptr;        // [tokens, heads, dim] bf16, or null when q_f32 holds q
  const float* q_f32 = nullptr;       // [tokens, heads, dim] f32 (Precision::fp32)
  const float* weights = nullptr;     // [tokens, heads]
  DeviceRows keys;
  const int32_t* token_sequence = nullptr;  // null: flat keys
  const int32_t* token_position = nullptr;  // [tokens]
  int compress_ratio = 1;
  const int32_t* candidates = nullptr;  // [tokens, num_candidates] or null
  int64_t num_candidates = 0;
  int64_t candidate_block_size = 1;
  float* scores = nullptr;            // [tokens, entries]
  int64_t entries = 0;
  int64_t tokens = 0;
  int heads = 0;
  int dim = 0;                        // index_dim
  bool bf16_rounding = false;         // IndexScoresParams::bf16_rounding
  bool partial = false;               // IndexScoresParams::partial
};

IndexScoresLaunch index_scores_launch(const IndexScoresParams& p);

struct TopkLaunch {
  const float* scores = nullptr;            // [tokens, n]
  int64_t n = 0;
  const int32_t* token_position = nullptr;  // null: the whole row is eligible
  int compress_ratio = 0;
  int64_t group_size = 1;
  int32_t* picks = nullptr;                 // [tokens, k]
  int64_t k = 0;
};

TopkLaunch topk_launch(const TopkParams& p);

}  // namespace dsv4::cuda
