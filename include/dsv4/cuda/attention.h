// Sparse MQA attention with a per-head sink over the sliding window plus the picked compressed
// entries (SPEC §5): decode (one token per sequence) and prefill chunks (many tokens of a sequence)
// are the same call, tokens of any number of sequences mixed.
//
// For the token at position p of sequence s, the attended rows are
//   * window rows f ... l of s in `window` (its own layer's cache): l = p, or window_last[t] when
//     given (a DSpark draft block sees the committed rows up to the position before the block,
//     SPEC §13.1); f = max(0, l - W + 1), or window_first[t] when given (image spans, SPEC §14.3);
//     and
//   * compressed entries picks[t][i] >= 0 of s in `compressed` (the kv source's cache), the first
//     pick_count[t] of the list when given; with compress_ratio > 0 entries >= (p + 1) /
//     compress_ratio are skipped (not yet closed).
// A cache without a block table is flat (runtime.h): picks are then slots, FlashMLA's indices.
// Each row is key and value at once (K = V, RoPE dims included), decoded exactly from any cache
// format. Rows that are not addressable (page outside the table or the pool) are skipped.
//   out[t, h] = Σ_i e_i · row_i / (Σ_i e_i + exp(sink[h] - m)),  e_i = exp(scale · q[t, h]·row_i - m)
// in fp32 with an online softmax over tiles of rows (m: a running max over rows, which the
// tensor-core kernels raise only where a tile's max exceeds it by more than 8 log2 units, so e_i
// <= 2^8 and their accumulators are rarely rescaled; every m gives the same result); a token with
// no attended row gets zeros. With bf16_rounding (reference precision, SPEC §5.2) each e_i is
// rounded to bf16 before it multiplies its row, while the denominator sums the unrounded e_i, as
// reference::sparse_attention(bf16 = true) does; e_i is relative to the running max, so the
// rounding may differ from the reference's (relative to the final max) by one bf16 ulp of e_i.
// Optionally lse[t, h] = m + log Σ_i e_i (natural log, sink excluded, FlashMLA's definition):
// what merging this attention with another over disjoint rows needs.
#pragma once

#include <cstddef>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

struct SparseAttentionParams {
  TensorView q;                // [tokens, heads, head_dim] bf16 | f32 (after RoPE); head_dim 512
  TensorView token_sequence;   // [tokens] i32: the token's sequence = row of the block tables
                               // (optional when no cache has a block table)
  TensorView token_position;   // [tokens] i32: the token's absolute position p (>= 0)
                               // (optional with window_size 0 and compress_ratio 0)
  TensorView window_last;      // [tokens] i32, optional: the last window row the token attends
                               // (absent: its own position p); < 0 attends no window row
  TensorView window_first;     // [tokens] i32, optional (with window_last): the first window row
                               // (absent: window_last - W + 1); none when last < first
  int64_t max_window_rows = 0; // with window_first: >= every window_last[t] - window_first[t] + 1
                               // (the rows the kernels plan for; a longer window is cut there)
  PagedCache window;           // reader; rows = positions, head_dim channels (optional with window_size 0)
  int64_t window_size = 128;   // W >= 0 (0: the picks alone)
  PagedCache compressed;       // reader, optional (pages absent: window only); rows = entries
  TensorView picks;            // [tokens, k] i32 entry indices, -1 = none; required with `compressed`
  TensorView pick_count;       // [tokens] i32, optional: picks of token t beyond pick_count[t] are ignored
  int compress_ratio = 0;      // >= 0; 0: picks are not bounded by the position
  TensorView sink;             // [heads] f32 logits (attn_sink), optional: absent = no sink
  float scale = 0.0f;          // softmax scale, head_dim^-0.5
  TensorView out;              // [tokens, heads, head_dim] bf16 | f32
  TensorView lse;              // [tokens, heads] f32, optional: log-sum-exp of the scaled logits
                               // without the sink; -inf for a token with no attended row
  bool bf16_rounding = false;  // round e_i to bf16 before P·V (reference precision)
};

void validate_sparse_attention(const SparseAttentionParams& p);
// The name of the implementation run_sparse_attention picks for this call on the current device
// (for bf16_rounding with bf16 q, tensor cores: on sm_90 "wgmma" over the V4.1 native caches or
// fp8_ds_mla rows, "decode_mma" over other caches exact in bf16, elsewhere "mma_bf16"; "simt": the
// portable fp32 kernel, the one for f32 q and f32 caches); for tests and dsv4 bench.
const char* sparse_attention_implementation(const SparseAttentionParams& p);
// Small steps (few tokens × head groups, e.g. decode at batch 1) leave most of the GPU idle with
// one block per (token, head group); given a workspace, each token's rows are split over several
// blocks (whole tiles of rows) whose partial softmax sums are merged in a fixed order: by a second
// kernel through this workspace, or ("wgmma") within the blocks' thread-block cluster, which uses
// none of its bytes (it asks for a token 256 where it may split: passing the workspace lets it).
// 0 when the step is large enough not to split. A split rounds e_i relative to its own max
// (bf16_rounding), so the split changes the last bits; how many splits a step gets depends on its
// token count and (wgmma) on the device's cluster capacity, unsplit results do not depend on the
// other tokens.
size_t sparse_attention_workspace_bytes(const SparseAttentionParams& p);
// The largest workspace any step of at most max_tokens tokens of `heads` heads needs, each token
// attending at most max_rows rows (window_size + picks per token): what a caller that sizes its
// workspace ahead (the engine, a CUDA graph) allocates. Both sizes cover every implementation, so
// they do not depend on the device.
size_t sparse_attention_max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t max_rows);
void run_sparse_attention(const SparseAttentionParams& p, void* workspace, cudaStream_t stream);
// The same without a workspace: rows are never split.
void run_sparse_attention(const SparseAttentionParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
