// The implementations of run_sparse_attention and their chooser (the dispatch seam, dispatch.h).
// Adding an implementation: a folder next to simt/ that defines a SparseAttentionImplementation,
// declared below and listed in sparse_attention.cpp ahead of the ones it should win over.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "cuda/common/dispatch.h"
#include "cuda/ops/attention/split_kv.h"
#include "dsv4/cuda/attention.h"

namespace dsv4::cuda {

// How an implementation blocks a step, which decides its row split (split_kv.h): a block per
// (token, heads_per_block heads, split), the rows in tiles of tile_rows; one block per SM (the
// tensor-core kernels: split to fill one wave) or several. Where the split blocks of a token merge
// in their thread-block cluster (merges_in_cluster), the kernel plans its split at launch from the
// device's cluster capacity (plan_split_kv_clusters) and uses no workspace; it splits only when
// given one all the same, so that a call without a workspace stays the batch-independent one, and
// a step it may split asks for kClusterSplitWorkspaceBytes (workspace_bytes).
inline constexpr size_t kClusterSplitWorkspaceBytes = 256;
struct AttentionBlocking {
  int64_t heads_per_block = 1;
  int64_t tile_rows = 1;
  int64_t head_dim = 512;
  bool one_block_per_sm = false;
  bool merges_in_cluster = false;
};

struct SparseAttentionImplementation {
  const char* name;
  // "" when the implementation runs this (validated) call on `device`, else why not.
  std::string (*supports)(const SparseAttentionParams& p, const DeviceInfo& device);
  AttentionBlocking blocking;
  // workspace: null (then nothing may be split) or at least workspace_bytes(p) bytes, 256-aligned
  // (any non-null pointer where that is 0).
  void (*run)(const SparseAttentionParams& p, void* workspace, cudaStream_t stream);

  // The row split of a call of `tokens` tokens of `heads` heads attending at most max_rows rows each
  // (for merges_in_cluster, which plans at launch, only whether the call may split).
  SplitKvPlan plan(int64_t tokens, int64_t heads, int64_t max_rows, bool split_allowed) const;
  // The split of a validated call (split_allowed: a workspace is given).
  SplitKvPlan plan(const SparseAttentionParams& p, bool split_allowed) const;
  // Workspace the call may use (0: none); callable for any validated call, no device needed.
  size_t workspace_bytes(const SparseAttentionParams& p) const;
  // The largest workspace_bytes of any call of at most max_tokens tokens of `heads` heads
  // attending at most max_rows rows per token.
  size_t max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t max_rows) const;
};

// Hopper warpgroup MMAs (wgmma, sm_90a) with the row gathers and decodes on their own warpgroup, for
// bf16_rounding calls with bf16 q over the V4.1 native caches (v41_fp8 window, v41_fp4 compressed),
// fp8_ds_mla rows or bf16 rows (wgmma/): the H100 / H200 in reference precision, decode steps and
// prefill chunks.
extern const SparseAttentionImplementation kSparseAttentionWgmma;
// Tensor cores with the row gathers and decodes on their own warps (mma.sync bf16, sm_90 only: its
// machine code, setmaxnreg), for bf16_rounding calls with bf16 q over caches exact in bf16 (mma/): on
// the H100 / H200 the calls wgmma does not take (other format pairs, such as bf16 window rows with
// v41_fp4 picks).
extern const SparseAttentionImplementation kSparseAttentionDecodeMma;
// Tensor cores (mma.sync bf16, sm_80+ with 227 KB of shared memory per block: A100 has less), for
// bf16_rounding calls with bf16 q over caches whose rows are exact in bf16 (mma/).
extern const SparseAttentionImplementation kSparseAttentionMmaBf16;
// The portable fallback: fp32 SIMT, every device, every cache format, bf16 | f32 q (simt/).
extern const SparseAttentionImplementation kSparseAttentionSimt;

// For the implementations that copy raw rows `alignment` (8 or 16) bytes at a time (cp.async) and
// decode them: "" when the call's window and compressed caches (those present) have one of
// `formats` and row data and scales aligned to it, else why not (`unsupported` says why the other
// formats are not taken).
std::string gathered_caches_supported(const SparseAttentionParams& p, std::span<const KvRowFormat> formats,
                                      const char* unsupported, int alignment);

// The most rows a token of a validated call attends (window, widened by image spans, plus picks):
// what the implementations plan their row splits for.
int64_t max_attended_rows(const SparseAttentionParams& p);

// In order of preference; the chooser takes the first that supports the call.
std::span<const SparseAttentionImplementation* const> sparse_attention_implementations();
const SparseAttentionImplementation& choose_sparse_attention(const SparseAttentionParams& p, const DeviceInfo& device);

}  // namespace dsv4::cuda
