// What every sparse attention kernel receives (built from a validated SparseAttentionParams), and
// the rows a token attends: window rows first, then its picks, as one index i over [0, rows).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/attention/split_kv.h"
#include "dsv4/cuda/attention.h"

namespace dsv4::cuda {

struct SparseAttentionLaunch {
  const uint16_t* q = nullptr;  // [tokens, heads, head_dim] bf16, or null when q_f32 holds q
  const float* q_f32 = nullptr; // [tokens, heads, head_dim] f32 (Precision::fp32; the SIMT kernel only)
  const int32_t* token_sequence = nullptr;  // optional (flat caches): sequence 0
  const int32_t* token_position = nullptr;  // optional: no window, no causal bound
  const int32_t* window_last = nullptr;     // optional: the token's own position
  const int32_t* window_first = nullptr;    // optional, with window_last: window_last - W + 1
  int64_t max_window_rows = 0;              // with window_first
  DeviceRows window;
  int64_t window_size = 0;
  DeviceRows compressed;
  const int32_t* picks = nullptr;  // [tokens, num_picks]; null: window only
  int64_t num_picks = 0;
  int compress_ratio = 0;
  const int32_t* pick_count = nullptr;  // [tokens], optional: token t's picks beyond pick_count[t] are ignored
  const float* sink = nullptr;          // [heads], optional: absent = no sink
  float scale = 0.0f;
  bool bf16_rounding = false;  // e_i rounded to bf16 before P·V (the sums keep it unrounded)
  void* out = nullptr;
  float* lse = nullptr;  // [tokens, heads], optional; written by the combine when split
  int64_t tokens = 0;
  int heads = 0;
  // Split-KV (split_kv.h): block z of a token covers tiles [z·tiles_per_split, (z+1)·tiles_per_split)
  // of its rows (tiles of the implementation's size). With splits > 1 each block writes its
  // unnormalized P·V and (max, sum) to the partials and run_split_kv_combine produces out (or, where
  // the implementation merges in a cluster, the blocks merge them; partials then stay empty).
  int splits = 1;
  int64_t tiles_per_split = 0;
  SplitKvPartials partials;
};

// The launch of a validated call with the given split (partials carved from `workspace`).
inline SparseAttentionLaunch make_sparse_attention_launch(const SparseAttentionParams& p, const SplitKvPlan& split,
                                                          void* workspace, int64_t head_dim) {
  SparseAttentionLaunch a;
  a.tokens = p.q.shape[0];
  a.heads = static_cast<int>(p.q.shape[1]);
  if (p.q.dtype == DType::f32) a.q_f32 = p.q.ptr<const float>();
  else a.q = p.q.ptr<const uint16_t>();
  if (is_present(p.token_sequence)) a.token_sequence = p.token_sequence.ptr<const int32_t>();
  if (is_present(p.token_position)) a.token_position = p.token_position.ptr<const int32_t>();
  if (is_present(p.window_last)) a.window_last = p.window_last.ptr<const int32_t>();
  a.window = device_rows(p.window);
  a.window_size = p.window_size;
  if (is_present(p.window_first)) {
    a.window_first = p.window_first.ptr<const int32_t>();
    a.max_window_rows = p.max_window_rows;
  }
  if (is_present(p.compressed.pages)) {
    a.compressed = device_rows(p.compressed);
    a.picks = p.picks.ptr<const int32_t>();
    a.num_picks = p.picks.shape[1];
    a.compress_ratio = p.compress_ratio;
  }
  if (is_present(p.pick_count)) a.pick_count = p.pick_count.ptr<const int32_t>();
  if (is_present(p.sink)) a.sink = p.sink.ptr<const float>();
  a.scale = p.scale;
  a.bf16_rounding = p.bf16_rounding;
  a.out = p.out.data;
  a.lse = is_present(p.lse) ? p.lse.ptr<float>() : nullptr;
  a.splits = split.splits;
  a.tiles_per_split = split.tiles_per_split;
  a.partials = split_kv_partials(workspace, a.tokens, a.heads, head_dim, a.splits);
  return a;
}

// Merges the partials of a launch with splits > 1 into its out and lse.
inline void combine_sparse_attention_splits(const SparseAttentionLaunch& a, DType out_dtype, int64_t head_dim,
                                            cudaStream_t stream) {
  run_split_kv_combine({.partials = a.partials, .splits = a.splits, .tokens = a.tokens, .heads = a.heads,
                        .head_dim = head_dim, .sink = a.sink, .out = a.out, .out_dtype = out_dtype, .lse = a.lse},
                       stream);
}

// Whether token t is the only one of its sequence among its neighbours in the launch (a decode step
// of one token per sequence), so that no token near it in time reads its rows again; a prefill
// chunk's tokens share their rows. Without token_sequence (flat caches) every token is sequence 0.
__device__ inline bool reads_rows_alone(const SparseAttentionLaunch& a, int64_t t) {
  if (!a.token_sequence) return a.tokens == 1;
  const int32_t own = a.token_sequence[t];
  return (t == 0 || a.token_sequence[t - 1] != own) && (t + 1 == a.tokens || a.token_sequence[t + 1] != own);
}

// The L2 policy of token t's cache-row and Q copies: a decode step reads each once, so they leave
// the L2 first and what the next lookups and launches read again (block tables, picks, token
// metadata) stays there (b128 -1.9 us, b64 -0.9 on an H100). A prefill chunk's tokens read the same
// rows again: evict-first cost it 8 %, on Q alone ~1 % (bench/RESULTS.md, twenty-fifth and
// twenty-sixth sessions).
__device__ inline uint64_t row_copy_policy(const SparseAttentionLaunch& a, int64_t t) {
  return reads_rows_alone(a, t) ? l2_evict_first_policy() : l2_evict_normal_policy();
}

// Token t's attended rows: i < n_window is window position window_first + i, the rest pick
// i - n_window; rows that are -1, not yet visible or not addressable are invalid refs. The window
// ends at the token's window_last (default: its own position) and starts at its window_first
// (default: W rows before; image spans give both); compressed entries stay bounded by the position.
struct TokenRows {
  int64_t sequence = 0;
  int64_t window_first = 0;
  int64_t n_window = 0;
  int64_t n_rows = 0;
  int64_t n_visible = 0;

  __device__ TokenRows(const SparseAttentionLaunch& a, int64_t t) {
    sequence = a.token_sequence ? a.token_sequence[t] : 0;
    const int64_t position = a.token_position ? a.token_position[t] : -1;
    const int64_t last = a.window_last ? a.window_last[t] : position;
    if (a.window_first) {
      window_first = a.window_first[t];
      n_window = min(max(last - window_first + 1, int64_t{0}), a.max_window_rows);
    } else {
      window_first = last - a.window_size + 1 > 0 ? last - a.window_size + 1 : 0;
      n_window = last >= 0 ? last - window_first + 1 : 0;
    }
    const int64_t n_picks = !a.picks       ? 0
                            : a.pick_count ? min(max(int64_t{a.pick_count[t]}, int64_t{0}), a.num_picks)
                                           : a.num_picks;
    n_rows = n_window + n_picks;
    n_visible = a.compress_ratio > 0 ? (position + 1) / a.compress_ratio : INT64_MAX;
  }

  // Row i < end (the end of the block's rows) of token t; invalid beyond it.
  __device__ RowRef row(const SparseAttentionLaunch& a, int64_t t, int64_t i, int64_t end) const {
    return row_of_number(a, i, row_number(a, t, i, end));
  }
  // The same in two steps, for a kernel that keeps the dependent loads apart (the pick, then the
  // block table): row i's number in its cache (window position or entry), -1 when the row is
  // invalid; then its bytes.
  __device__ int64_t row_number(const SparseAttentionLaunch& a, int64_t t, int64_t i, int64_t end) const {
    if (i >= end) return -1;
    if (i < n_window) return window_first + i;
    const int64_t entry = a.picks[t * a.num_picks + (i - n_window)];
    return entry >= 0 && entry < n_visible ? entry : -1;
  }
  __device__ RowRef row_of_number(const SparseAttentionLaunch& a, int64_t i, int64_t number) const {
    if (number < 0) return {};
    return row_of_sequence(i < n_window ? a.window : a.compressed, sequence, number);
  }

  // The rows [first, end) block blockIdx.z of a split covers, n_tiles tiles of tile_rows.
  struct BlockRows {
    int64_t first = 0, end = 0;
    int n_tiles = 0;
  };
  __device__ BlockRows block_rows(const SparseAttentionLaunch& a, int tile_rows) const {
    BlockRows b;
    b.first = int64_t{blockIdx.z} * a.tiles_per_split * tile_rows;
    b.end = min(n_rows, b.first + a.tiles_per_split * tile_rows);
    b.n_tiles = b.end > b.first ? static_cast<int>((b.end - b.first + tile_rows - 1) / tile_rows) : 0;
    return b;
  }

  // How many of the tile's rows [base, base + tile_rows) are window rows.
  __device__ int window_rows_in_tile(int64_t base, int tile_rows) const {
    const int64_t n = n_window - base;
    return static_cast<int>(n < 0 ? 0 : (n > tile_rows ? tile_rows : n));
  }
};

}  // namespace dsv4::cuda
