// Split-KV, shared by the attention implementations: a step with few tokens × head groups leaves
// most of the GPU idle, so each token's rows are split over several blocks. Each block writes its
// unnormalized P·V and its softmax (max, sum) to the workspace; the combine kernel merges the
// splits of every (token, head) with the sink and writes the output.
//
// The planner depends on the step's shape only, never on the device, so that a caller can size
// its workspace ahead (sparse_attention_max_workspace_bytes).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

// Blocks a step should have before splitting rows pays off (two per SM of an H100 / H200).
inline constexpr int64_t kSplitKvTargetBlocks = 264;

struct SplitKvPlan {
  int splits = 1;                 // blocks per token and head group
  int64_t tiles_per_split = 0;    // split z covers row tiles [z·tiles_per_split, (z+1)·tiles_per_split)
};

// blocks: the step's blocks without splitting (tokens × head groups); tiles: the row tiles of the
// token with the most rows. Without `split_allowed` (no workspace) the plan has one split. More
// tiles never mean fewer splits, and a step of kSplitKvTargetBlocks blocks or more never splits.
SplitKvPlan plan_split_kv(int64_t blocks, int64_t tiles, bool split_allowed);

// Blocks of one wave of an H100 / H200 (132 SMs) for kernels that run one block per SM.
inline constexpr int64_t kOneWaveBlocks = 132;

// The plan of a kernel that runs one block per SM: a step of fewer blocks than one wave splits
// each token's rows so that the blocks make about one wave, never more (a second, partial wave
// would cost a whole block's time).
SplitKvPlan plan_split_kv_one_wave(int64_t blocks, int64_t tiles, bool split_allowed);

// The plan of a kernel whose split blocks of a token form one thread-block cluster and merge in it
// (no workspace): capacity[s] is how many clusters of s blocks the device runs at once (0: none;
// capacity[1]: blocks). Of the split counts 1 … capacity.size() - 1 (at most `tiles`) whose clusters
// run in one wave (or 1), the one with the fewest tiles per block times waves; on a tie the fewest
// splits (the least to merge).
SplitKvPlan plan_split_kv_clusters(int64_t blocks, int64_t tiles, std::span<const int> capacity);

// The same for a kernel whose blocks take up to max_heads_per_block heads of a token (its MMAs'
// rows) and may take fewer, the rest of the rows padding: where a step is small, narrower head
// groups make more blocks and shrink what each merges. The merge moves every split's partial of
// the block's heads through distributed shared memory, about 25 GB/s per SM on an H200: for 64
// heads of 512 fp32 channels about kMergeTilesPer64Heads times the time of a 64-row tile. Of the
// groups of max_heads_per_block, half, a quarter … down to 16 heads, the one with the least tile
// time per block plus merge time; on a tie the widest.
inline constexpr double kMergeTilesPer64Heads = 1.6;
struct ClusterSplitPlan {
  SplitKvPlan split;
  int heads_per_block = 0;
};
ClusterSplitPlan plan_split_kv_clusters(int64_t tokens, int64_t heads, int max_heads_per_block, int64_t tiles,
                                        std::span<const int> capacity);

// The partial results in the workspace, [splits, tokens, heads, head_dim] f32 then
// [splits, tokens, heads] (running max in log2 units, running sum).
struct SplitKvPartials {
  float* out = nullptr;
  float2* stats = nullptr;
};

// Workspace of a plan (0 with one split) and its carving.
size_t split_kv_workspace_bytes(int64_t tokens, int64_t heads, int64_t head_dim, int splits);
SplitKvPartials split_kv_partials(void* workspace, int64_t tokens, int64_t heads, int64_t head_dim, int splits);

// The largest split_kv_workspace_bytes of any step of 1 ... max_tokens tokens, whose plan is
// splits_of(tokens) (the implementation's plan for its most rows per token).
template <class SplitsOf>
size_t split_kv_max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t head_dim, SplitsOf splits_of) {
  size_t most = 0;
  for (int64_t tokens = 1; tokens <= std::min(max_tokens, kSplitKvTargetBlocks); ++tokens)
    most = std::max(most, split_kv_workspace_bytes(tokens, heads, head_dim, splits_of(tokens)));
  return most;
}

// out[t, h] and lse[t, h] of the splits' partials by normalize_splits (split_merge.cuh): the
// weighted sum of the partials in split order, normalized with the sink in the denominator; zeros
// and −inf where no split attended a row.
struct SplitKvCombine {
  SplitKvPartials partials;
  int splits = 1;
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;       // a multiple of 4, at most 4096
  const float* sink = nullptr;  // [heads] f32, optional
  void* out = nullptr;          // [tokens, heads, head_dim]
  DType out_dtype = DType::f32; // bf16 | f32
  float* lse = nullptr;         // [tokens, heads] f32, optional
};

void run_split_kv_combine(const SplitKvCombine& c, cudaStream_t stream);

}  // namespace dsv4::cuda
