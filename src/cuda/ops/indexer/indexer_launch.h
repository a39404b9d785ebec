// The raw form of a validated index-scores or top-k call, built once here and given to every
// implementation's kernels, each of which extends it with its own geometry.
#pragma once

#include <cstdint>

#include "cuda/common/dispatch.h"
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

// The tensor-core implementations' geometry: a CTA scores a run of tokens (consecutive tokens of
// one sequence share its key loads) against a range of keys.
struct IndexScoresRangeLaunch : IndexScoresLaunch {
  int tokens_per_cta = 1;
  int64_t keys_per_cta = 0;  // a multiple of the implementation's stage rows
};

// Tokens per CTA for `tokens` tokens: one per 64 tokens of the call (a decode batch of 64: one;
// tokens of different sequences run one after the other in a CTA), at most max_tokens and as many
// as fit shared_budget (shared_bytes(n): a CTA's bytes for n tokens).
template <class SharedBytes>
int index_tokens_per_cta(int64_t tokens, int max_tokens, size_t shared_budget, SharedBytes shared_bytes) {
  int64_t n = tokens / 64;
  n = n < 1 ? 1 : n > max_tokens ? max_tokens : n;
  while (n > 1 && shared_bytes(static_cast<int>(n)) > shared_budget) --n;
  return static_cast<int>(n);
}
// Keys per CTA: splits of the entries such that the token_groups x splits CTAs, `resident` an SM
// (at most max_resident, as the CTA's shared bytes allow), fill the last of their at most `waves`
// waves (the fewest splits that fill it to 95 %, else the fullest), each of at least min_keys keys;
// a multiple of granule.
int64_t index_keys_per_cta(int64_t entries, int64_t token_groups, size_t shared_bytes, int max_resident, int64_t granule,
                           int64_t min_keys, int waves, const DeviceInfo& device);

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
