// The lightning indexer on the GPU (SPEC §4): scores of every visible compressed entry, the
// two-level candidate filter and the top-k picks.
//
// A step's index source runs: run_index_scores -> run_topk (picks). The candidate source also runs
// run_candidate_block_scores -> run_topk over the block scores (with group_size = block size) and
// publishes the kept blocks; later index sources pass them to run_index_scores as `candidates`.
#pragma once

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

// score[t, j] = Σ_h weights[t, h] · relu(q[t, h] · key_j) in fp32 for entries j < n_vis(p) =
// (p + 1) / compress_ratio whose key row is addressable (and, with candidates, whose block
// j / candidate_block_size is listed); every other j < entries gets -inf. relu keeps NaN.
// bf16_rounding: the reference's bf16 scores (reference::index_scores with bf16, SPEC §4.3), bit
// for bit: each dot rounded to bf16, each weighted term rounded to bf16, the fp32 sum over the
// heads in head order rounded to bf16 (not with partial).
struct IndexScoresParams {
  TensorView q;                    // [tokens, index_heads, index_dim] bf16 | f32 (RoPE'd, fake-quantized)
  TensorView weights;              // [tokens, index_heads] f32 (weights_proj output times its scale)
  PagedCache keys;                 // reader: index_mxfp4 | index_fp8 | bf16 | f32 rows of index_dim channels; row = entry
  TensorView token_sequence;       // [tokens] i32 (optional when keys has no block table: flat slots)
  TensorView token_position;       // [tokens] i32
  int compress_ratio = 1;          // >= 1
  TensorView candidates;           // optional: [tokens, candidate_blocks] i32 kept blocks, ascending, -1 padded
  int64_t candidate_block_size = 0;// entries per candidate block (> 0 with candidates)
  TensorView scores;               // [tokens, entries] f32
  bool bf16_rounding = false;      // Precision::reference: the reference's bf16 rounding sequence
  bool partial = false;            // with bf16_rounding: the heads are a tensor-parallel rank's share;
                                   // the sum stays fp32, rounded once the ranks' sums are added
  bool fp4_queries = false;        // q holds FP4 values (SPEC §4.2 QAT: e2m1 times a power of two per
                                   // 32 channels of a head), so an implementation may read q as e2m1
                                   // codes (wgmma, mma_f16); a head with a block that is not gets NaN dots
};

void validate_index_scores(const IndexScoresParams& p);
// The name of the implementation run_index_scores picks for this call on the current device
// ("wgmma", "mma_f16": tensor cores, "simt": the portable kernel); for tests and dsv4 bench.
const char* index_scores_implementation(const IndexScoresParams& p);
void run_index_scores(const IndexScoresParams& p, cudaStream_t stream);

// Candidate block scores (SPEC §4.5): block b of token t scores the max over its visible,
// non-NaN entries (-inf if none); the block holding the newest visible entry n_vis(p) - 1 scores
// +inf (it may be partly filled).
struct CandidateBlockScoresParams {
  TensorView scores;               // [tokens, entries] f32 (index scores, causally masked)
  TensorView token_position;       // [tokens] i32
  int compress_ratio = 1;          // >= 1
  int64_t block_size = 8;          // entries per block (candidate_block_size)
  TensorView block_scores;         // [tokens, ceil(entries / block_size)] f32
};

void validate_candidate_block_scores(const CandidateBlockScoresParams& p);
void run_candidate_block_scores(const CandidateBlockScoresParams& p, cudaStream_t stream);

// Top-k (SPEC §4.6): among the eligible elements of a row — index < the row's eligible length and
// score != -inf — the k best (NaN ranks below every number, ties: lower index first), written in
// ascending index order and padded with -1. Never writes an index outside the row.
// Eligible length: the whole row, or with token_position and compress_ratio > 0
// ceil(n_vis(p) / group_size) (group_size 1 for entries, the block size for candidate blocks).
struct TopkParams {
  TensorView scores;               // [tokens, n] f32
  TensorView token_position;       // optional: [tokens] i32
  int compress_ratio = 0;          // >= 0; used with token_position
  int64_t group_size = 1;          // >= 1
  TensorView picks;                // [tokens, k] i32
};

void validate_topk(const TopkParams& p);
const char* topk_implementation(const TopkParams& p);  // as index_scores_implementation
void run_topk(const TopkParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
