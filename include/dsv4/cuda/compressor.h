// The compressor of a kv-source layer (SPEC §3, §12): pools the projected rows of each closed group
// into one normalized latent, keeping the rows of still-open groups on the device between steps.
//
// A kv-source step on the GPU:
//   1. run_linear(x, [wkv; wgate] fused to [row_width, hidden]) -> rows [tokens, row_width] f32
//      (ratio 1: wkv only);
//   2. run_compressor_pool -> latent [tokens, dim] for every token that closes a group;
//   3. V4.1 index keys: run_linear(latent, wk) then run_cache_insert(norm k_norm, position_offset
//      1 - ratio, RowQuantizer::fp4_ue8m0_32) into the index-key cache;
//   4. compressed entries: run_cache_insert(latent, position_offset 1 - ratio, RowQuantizer::fp4_e4m3_16
//      (V4.1) or none / fp8_e4m3_nope_64 (V4.0)) into the compressed cache at the entries' slots.
#pragma once

#include <cstdint>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

// Entry w closes at position w·ratio + ratio − 1 and pools, per channel c,
//   pooled[c] = Σ_s softmax_s(score_s[c] + bias_s[c]) · kv_s[c]
// over its slots: the `ratio` tokens w·ratio … w·ratio + ratio − 1 (kv / score: the last `dim`
// columns of each half of the row), and with overlap (V4.0 CSA) also the tokens of window w − 1
// (the first `dim` columns of each half; absent for w = 0). Ungated (V4.1 ratio 1): pooled = kv
// of the token itself. latent = RMSNorm(pooled) with norm_weight; with bf16 latents, pooled is
// rounded to bf16 first and the latent is rounded, as the reference does.
//
// Rows of earlier steps come from `state`, a ring per sequence of ring_rows >= span rows holding
// the projected row of position p at [state_slot][p % ring_rows] (span = ratio, or 2·ratio with
// overlap; rows beyond the span let a sequence roll back speculative tokens). A step's tokens of
// one sequence must be consecutive in the step with consecutive positions. After pooling, the
// last ring_rows rows of every sequence's chunk are stored in its ring. Latent rows of tokens that
// close no group are not written; a token whose state_slot is outside `state` gets a NaN latent.
struct CompressorPoolParams {
  TensorView rows;            // [tokens, row_width] f32, row = [kv (coff·dim) | score (coff·dim)], coff = 1 + overlap
  TensorView token_position;  // [tokens] i32
  TensorView state_slot;      // [tokens] i32: the sequence's ring (KvCacheManager::sequence_slot)
  TensorView state;           // [slots, ring_rows >= span, row_width] f32
  TensorView position_bias;   // optional: [ratio, coff·dim] f32 (V4.0 ape)
  TensorView norm_weight;     // [dim] bf16 | f32
  float eps = 1e-6f;
  int ratio = 2;              // >= 1
  bool overlap = false;       // V4.0 CSA
  bool gated = true;          // false: V4.1 ratio 1 (ratio must be 1, no score columns)
  TensorView latent;          // [tokens, dim] bf16 | f32
};

void validate_compressor_pool(const CompressorPoolParams& p);
void run_compressor_pool(const CompressorPoolParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
